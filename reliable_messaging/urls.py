"""``include("reliable_messaging.urls")``: ``metrics/`` and ``healthz/`` (see
:mod:`reliable_messaging.ops.views`)."""

from django.urls import path

from .ops import views

app_name = "reliable_messaging"

urlpatterns = [
    path("metrics/", views.metrics, name="metrics"),
    path("healthz/", views.healthz, name="healthz"),
]
