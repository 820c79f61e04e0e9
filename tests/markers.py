"""Markers that read the test settings, for test modules only: ``tests.support`` is also imported
by scripts that run without Django's settings (``bench/soak.py``, the fault harness)."""

from __future__ import annotations

import pytest
from django.conf import settings

# For tests of what exists on PostgreSQL only (partitions, catalogs, plans, NOTIFY): skipped
# when the suite runs against another database (DATABASE_URL=sqlite://...).
ON_POSTGRESQL = "postgresql" in settings.DATABASES["default"]["ENGINE"]
postgresql_only = pytest.mark.skipif(not ON_POSTGRESQL, reason="PostgreSQL only")
