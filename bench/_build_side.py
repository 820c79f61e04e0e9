"""What bench/whole_process.py does inside a build that brings its own database: run with
that build's source tree first on ``PYTHONPATH`` and ``DATABASE_URL`` naming its database, so
that its own models, migrations and ``publish()`` do the work (an older build's schema is not
this checkout's). Prints one JSON line.

    python bench/_build_side.py migrate
    python bench/_build_side.py info
    python bench/_build_side.py fill-outbox ROWS EXCHANGE
    python bench/_build_side.py empty-inbox
    python bench/_build_side.py declare-alpha
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any


def migrate() -> dict[str, Any]:
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return {"migrated": True}


def info() -> dict[str, Any]:
    """Where this build keeps things: the names the parent needs to watch its processes."""
    from django.conf import settings

    from reliable_messaging.models import OutboxMessage
    from reliable_messaging.testing import find_consumer

    try:
        from reliable_messaging.storage.partitions import INBOX_TABLE
    except ImportError:  # the build before the storage package
        from reliable_messaging.partitions import INBOX_TABLE  # type: ignore[no-redef]
    return {
        "exchange": settings.RELIABLE_MESSAGING["EXCHANGE"],
        "alpha_queue": find_consumer("tests.alpha").queue,
        "outbox_table": OutboxMessage._meta.db_table,
        "inbox_table": INBOX_TABLE,
    }


def fill_outbox(rows: int | str, exchange: str) -> dict[str, Any]:
    """An emptied outbox with ``rows`` rows from this build's ``publish()``, 1,000 per
    transaction, vacuumed (this server runs without autovacuum)."""
    from django.db import connection, transaction

    from reliable_messaging import publish
    from reliable_messaging.models import OutboxMessage

    count = int(rows)
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {OutboxMessage._meta.db_table}")
    for start in range(0, count, 1000):
        with transaction.atomic():
            for i in range(start, min(count, start + 1000)):
                publish(
                    "bench.order",
                    {"order_id": i, "amount": "19.99", "customer": f"c{i % 97}"},
                    exchange=exchange,
                )
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {OutboxMessage._meta.db_table}")
    return {"rows": count}


def empty_inbox() -> dict[str, Any]:
    """An empty inbox and effect table, analyzed, as bench/whole_process.py's prepare_consume."""
    from django.db import connection

    table = info()["inbox_table"]
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {table}, testapp_effect")
        cursor.execute(f"VACUUM ANALYZE {table}")
    return {"emptied": table}


def declare_alpha() -> dict[str, Any]:
    """tests.alpha's queue deleted and declared again by this build's own topology (another
    build may declare it with other arguments)."""
    import pika
    from django.conf import settings

    from reliable_messaging.broker.topology import declare_topology
    from reliable_messaging.testing import find_consumer

    alpha = find_consumer("tests.alpha")
    url = str(settings.RELIABLE_MESSAGING["BROKER_URL"])
    connection = pika.BlockingConnection(pika.URLParameters(url))
    connection.channel().queue_delete(alpha.queue)
    declare_topology(connection.channel(), [alpha])
    connection.close()
    return {"declared": alpha.queue}


ACTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "migrate": migrate,
    "info": info,
    "fill-outbox": fill_outbox,
    "empty-inbox": empty_inbox,
    "declare-alpha": declare_alpha,
}


def main() -> None:
    import django

    django.setup()
    action, *args = sys.argv[1:]
    print(json.dumps(ACTIONS[action](*args)))


if __name__ == "__main__":
    main()
