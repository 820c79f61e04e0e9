"""Integrations with optional extras: Celery (idempotent tasks), django-health-check."""
