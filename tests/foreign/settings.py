"""The suite's settings plus the ``tests.foreign`` app, whose consumer records the headers a
handler receives (type and repr of each), for ``manage.py consume`` subprocesses."""

from tests.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.foreign"]  # noqa: F405
