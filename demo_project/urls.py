"""The demo shop has only the admin, where dead letters are reviewed."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
