"""Settings for mypy's django-stubs plugin: the test settings plus the demo shop's app, so one
type-check run sees every model. Not used to run anything."""

from tests.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "demo_project.shop"]  # noqa: F405
