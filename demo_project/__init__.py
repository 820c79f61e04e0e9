"""The demo shop for reliable_messaging: ``make demo`` runs it end to end."""

# The Celery app is created with Django, so that shared tasks (the shop's, relay_outbox) are
# sent through it, with its broker and queue, from any process of the demo.
from .celery import app as celery_app

__all__ = ["celery_app"]
