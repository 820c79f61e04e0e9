"""TCP keepalives for the database connections of ``consume`` and ``relay``: a dead database
host is given up on in about a minute, not TCP's 15. The server's side: see docs/cluster.md."""

from __future__ import annotations

from typing import Any

from django.db import connections

# libpq connection parameters: probe after 30 s idle, every 10 s, give up after 3 unanswered
# (about a minute in all); tcp_user_timeout bounds data sent and never acknowledged (ms).
KEEPALIVE_OPTIONS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}


def keep_database_alive() -> list[str]:
    """Add :data:`KEEPALIVE_OPTIONS` to every PostgreSQL database's ``OPTIONS`` (a value there
    wins) and close this thread's connection to it; returns the aliases changed."""
    changed = []
    for alias in connections:
        settings_dict = connections.settings[alias]
        if "postgresql" not in str(settings_dict.get("ENGINE", "")):
            continue
        options = settings_dict.setdefault("OPTIONS", {})
        if options.get("pool"):
            continue  # a pool's connections take their own kwargs: the project sets them there
        for key, value in KEEPALIVE_OPTIONS.items():
            options.setdefault(key, value)
        # A connection the system checks opened has not got them: the next one will.
        connections[alias].close()
        changed.append(alias)
    return changed
