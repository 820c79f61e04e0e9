"""The outbox's NOTIFY trigger goes: ``publish()`` wakes the relay after the commit instead.

The trigger (migration 0002) ran ``pg_notify`` inside every publishing transaction, and
PostgreSQL holds one instance-wide lock from a notifying transaction's pre-commit until its
commit record is flushed: publishing transactions committed one after the other. Now
``publish()`` sends its wake-up after the commit, from a connection of its own
(``publishing/wake_after_commit.py``).

Safe on a live system, in either direction: dropping a trigger takes a short lock on the
outbox, and a relay that misses a wake-up during the switch (old code on new schema or the
reverse) finds the row on its next poll, every ``RELAY_POLL_INTERVAL``. Between this migration
and the deploy of the new code, processes still running the old code publish without any
wake-up, so their rows wait up to a poll interval; nothing is lost. Reversing recreates the
trigger and its function exactly as 0002 did. Elsewhere than PostgreSQL nothing happens.
"""

import importlib

from django.db import migrations

# Reversing puts back exactly what 0002 made: its SQL and its functions, run the other way.
_0002 = importlib.import_module("tests.integration.replaced.migrations.0002_outbox")
CREATE_TRIGGER = _0002.CREATE_TRIGGER
DROP_TRIGGER = _0002.DROP_TRIGGER


class Migration(migrations.Migration):
    dependencies = [
        ("reliable_messaging", "0012_dead_letter_operations"),
    ]

    operations = [migrations.RunPython(_0002.drop_notify_trigger, _0002.create_notify_trigger)]
