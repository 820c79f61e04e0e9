"""Markers that read the test settings, for test modules only: ``tests.support`` is also imported
by scripts that run without Django's settings (``bench/soak.py``, the fault harness)."""

from __future__ import annotations

import os

import pytest
from django.conf import settings

# For tests of what exists on PostgreSQL only (partitions, catalogs, plans, NOTIFY): skipped
# when the suite runs against another database (DATABASE_URL=sqlite://...).
ON_POSTGRESQL = "postgresql" in settings.DATABASES["default"]["ENGINE"]
postgresql_only = pytest.mark.skipif(not ON_POSTGRESQL, reason="PostgreSQL only")

# The run through a transaction-pooling PgBouncer (RM_TEST_PGBOUNCER, tests/conftest.py): a test
# of which backend did what (its pid) means nothing there, since a pooler shares server sessions.
THROUGH_PGBOUNCER = bool(os.environ.get("RM_TEST_PGBOUNCER"))
direct_only = pytest.mark.skipif(
    THROUGH_PGBOUNCER, reason="about PostgreSQL's backends: a pooler shares them"
)
