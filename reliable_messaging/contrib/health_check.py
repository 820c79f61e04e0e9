"""A django-health-check (4.x) check: RabbitMQ answers, and the outbox is not falling behind
(``docs/operations.md#messaging_status-and-django-health-check``)."""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db import DatabaseError, connections, router

try:
    from health_check.base import HealthCheck
    from health_check.exceptions import ServiceUnavailable
except ImportError as exc:  # the "health" extra is not installed
    from ..exceptions import MissingExtra

    raise MissingExtra(
        "reliable_messaging.contrib.health_check.MessagingHealthCheck",
        "health",
        "django-health-check",
    ) from exc

from ..broker.queues import broker_connection_error
from ..models import OutboxMessage
from ..ops.collectors import outbox_lag
from ..ops.status import OUTBOX_LAG_STRICT_LIMIT, outbox_lag_problem


@dataclasses.dataclass
class MessagingHealthCheck(HealthCheck):
    """The broker is reachable and the oldest pending outbox row is younger than
    ``max_outbox_lag``. ``using`` is the outbox's database alias (default: the router's)."""

    # A relay a minute behind (the limit of messaging_status --strict), declared in .status.
    max_outbox_lag: dt.timedelta = dt.timedelta(seconds=OUTBOX_LAG_STRICT_LIMIT)
    using: str | None = None
    # Not in the repr, which the health report shows; the broker URL never is.
    timeout: dt.timedelta = dataclasses.field(default=dt.timedelta(seconds=5), repr=False)

    def run(self) -> None:
        # The connect and the query each get half the budget, so a slow broker still leaves
        # time to say so before the view's own deadline.
        error = broker_connection_error(timeout=self.timeout.total_seconds() / 2)
        if error:
            raise ServiceUnavailable(f"RabbitMQ cannot be reached: {error}")
        using = self.using or router.db_for_read(OutboxMessage)
        try:
            # Checks run on the view's executor threads: open and close the connection here,
            # or each thread would keep one open for good.
            with connections[using].temporary_connection():
                lag = outbox_lag(using)
        except DatabaseError as exc:
            raise ServiceUnavailable(f"the outbox cannot be read ({type(exc).__name__})") from exc
        problem = outbox_lag_problem(lag, self.max_outbox_lag.total_seconds())
        if problem is not None:
            raise ServiceUnavailable(problem.message)
