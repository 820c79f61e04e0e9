"""WSGI entry point of the demo shop."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")

application = get_wsgi_application()
