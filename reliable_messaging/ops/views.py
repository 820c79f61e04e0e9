"""The web process's ``metrics/`` and ``healthz/`` (the messaging system's health, not this
process's: not a liveness probe); :func:`ops_access` decides who may read them."""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, connections, router, transaction
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseForbidden,
    JsonResponse,
)
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry
from prometheus_client.django import PrometheusDjangoView

from ..broker.queues import broker_connection_error
from ..conf import messaging_settings
from ..models import OutboxMessage
from .collectors import BrokerCollector, DatabaseCollector, RecentValue, outbox_lag
from .status import OUTBOX_LAG_LIMIT, CheckResult, outbox_lag_check, system_health

# Seconds healthz/ waits for the broker to accept a connection, and reuses its answer.
BROKER_TIMEOUT = 2.0
BROKER_CHECK_MAX_AGE = 5.0


def ops_access(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
    """Let through staff users, the bearer of ``OPS_VIEWS_TOKEN`` and, with
    ``OPS_VIEWS_PUBLIC``, everyone; 403 for anyone else."""

    @functools.wraps(view)
    def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if _may_read(request):
            return view(request, *args, **kwargs)
        return HttpResponseForbidden(
            "Log in to the admin as staff, or send Authorization: Bearer <OPS_VIEWS_TOKEN> "
            "(see RELIABLE_MESSAGING['OPS_VIEWS_TOKEN']).",
            content_type="text/plain",
        )

    return guarded


def _may_read(request: HttpRequest) -> bool:
    if messaging_settings.ops_views_public:
        return True
    user = getattr(request, "user", None)  # None without the auth middleware
    if user is not None and user.is_active and user.is_staff:
        return True
    token = messaging_settings.ops_views_token
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return bool(
        token
        and scheme.lower() == "bearer"
        and hmac.compare_digest(given.strip().encode(), token.encode())
    )


BROKER_COLLECTOR = BrokerCollector()
SYSTEM_REGISTRY = CollectorRegistry(auto_describe=False)
SYSTEM_REGISTRY.register(DatabaseCollector())
SYSTEM_REGISTRY.register(BROKER_COLLECTOR)


# Outside ATOMIC_REQUESTS: a failing query must not poison a transaction around the view.
metrics = transaction.non_atomic_requests(
    never_cache(ops_access(PrometheusDjangoView.as_view(registry=SYSTEM_REGISTRY)))
)


# The details name no host, user or password, nor a database error's text: a health endpoint
# may be reachable by anyone.


def check_database(using: str) -> CheckResult:
    try:
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        return CheckResult(False, f"the database cannot be queried ({type(exc).__name__})")
    return CheckResult(True, "the database answers")


def check_broker() -> CheckResult:
    """Open (and close) an AMQP connection: the broker is up and accepts our login."""
    error = broker_connection_error(timeout=BROKER_TIMEOUT)
    if error:
        return CheckResult(False, f"the broker cannot be reached: {error}")
    return CheckResult(True, "the broker accepts connections")


RECENT_BROKER_CHECK = RecentValue(check_broker, BROKER_CHECK_MAX_AGE)


def check_outbox_lag(using: str, max_lag: float) -> CheckResult:
    try:
        lag = outbox_lag(using)
    except DatabaseError as exc:
        return CheckResult(False, f"the outbox cannot be read ({type(exc).__name__})")
    return outbox_lag_check(lag, max_lag)


@transaction.non_atomic_requests
@never_cache
@require_GET
@ops_access
def healthz(request: HttpRequest, max_outbox_lag: float = OUTBOX_LAG_LIMIT) -> HttpResponse:
    using = router.db_for_write(OutboxMessage)
    checks = {"database": check_database(using), "broker": RECENT_BROKER_CHECK.get()}
    if checks["database"].ok:
        checks["outbox_lag"] = check_outbox_lag(using, max_outbox_lag)
    report = system_health(checks)
    return JsonResponse(report.as_dict(), status=report.http_status)
