"""The test suite's settings with the fifteen migrations the initial one replaces, for
``test_squashed_migration.py`` only."""

from tests.settings import *  # noqa: F403

MIGRATION_MODULES = {"reliable_messaging": "tests.integration.replaced.migrations"}
