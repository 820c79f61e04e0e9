"""reliable_messaging: exactly-once effects for Django services that talk over RabbitMQ.

Public API::

    from reliable_messaging import consumer, publish, cancel_scheduled, Message, PermanentError
    from reliable_messaging import apublish  # publish() for async views and handlers
    from reliable_messaging import Breaker  # @consumer(breaker=Breaker(...))
    from reliable_messaging import idempotent_task  # needs Celery
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core.breaker import Breaker
from .core.envelope import Message
from .core.registry import consumer
from .exceptions import PermanentError

if TYPE_CHECKING:
    from .contrib.celery import idempotent_task
    from .publishing.publish import apublish, cancel_scheduled, publish

__all__ = [
    "Breaker",
    "Message",
    "PermanentError",
    "apublish",
    "cancel_scheduled",
    "consumer",
    "idempotent_task",
    "publish",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # publish() touches models; importing it lazily keeps `import reliable_messaging` safe before
    # Django's app registry is ready (settings files, consumers.py modules).
    if name in ("publish", "apublish", "cancel_scheduled"):
        from .publishing import publish

        return getattr(publish, name)
    if name == "idempotent_task":
        # Celery is optional (the "celery" extra): only this name needs it.
        from .contrib.celery import idempotent_task

        return idempotent_task
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
