"""Settings of the processes the whole-process benchmarks start: the test suite's, with the
persistent database connections docs/deploy.md tells users to give ``consume`` and ``relay``."""

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES["default"]["CONN_MAX_AGE"] = 60
