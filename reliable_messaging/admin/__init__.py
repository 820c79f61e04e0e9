"""The Django admin: dead letters and their console, the outbox, the inbox and the tasks."""

from __future__ import annotations

# Imported here because a framework discovers this package by name (Django's admin
# autodiscovery imports <app>.admin): importing the package must register everything.
from . import dead_letters, inbox, operations, outbox, task_runs  # noqa: F401
