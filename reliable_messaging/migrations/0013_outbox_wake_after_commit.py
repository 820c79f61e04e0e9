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

from django.db import migrations

NOTIFY_CHANNEL = "reliable_messaging_outbox"

CREATE_TRIGGER = f"""
CREATE OR REPLACE FUNCTION reliable_messaging_outbox_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{NOTIFY_CHANNEL}', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER reliable_messaging_outbox_notify
    AFTER INSERT ON reliable_messaging_outboxmessage
    FOR EACH STATEMENT EXECUTE FUNCTION reliable_messaging_outbox_notify();
"""
DROP_TRIGGER = """
DROP TRIGGER IF EXISTS reliable_messaging_outbox_notify ON reliable_messaging_outboxmessage;
DROP FUNCTION IF EXISTS reliable_messaging_outbox_notify();
"""


def drop_notify_trigger(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_TRIGGER)


def create_notify_trigger(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE_TRIGGER)


class Migration(migrations.Migration):
    dependencies = [
        ("reliable_messaging", "0012_dead_letter_operations"),
    ]

    operations = [migrations.RunPython(drop_notify_trigger, create_notify_trigger)]
