"""reliable_messaging: exactly-once effects for Django services that talk over RabbitMQ.

Public API::

    from reliable_messaging import consumer, publish, Message, PermanentError
    from reliable_messaging import idempotent_task  # needs Celery
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core.envelope import Message
from .core.registry import consumer
from .exceptions import PermanentError

if TYPE_CHECKING:
    from .contrib.celery import idempotent_task
    from .publishing.publish import publish

__all__ = ["Message", "PermanentError", "consumer", "idempotent_task", "publish"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # publish() touches models; importing it lazily keeps `import reliable_messaging` safe before
    # Django's app registry is ready (settings files, consumers.py modules).
    if name == "publish":
        from .publishing.publish import publish

        return publish
    if name == "idempotent_task":
        # Celery is optional (the "celery" extra): only this name needs it.
        from .contrib.celery import idempotent_task

        return idempotent_task
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
