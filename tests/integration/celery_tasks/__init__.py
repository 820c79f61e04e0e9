"""The Celery integration with real workers."""
