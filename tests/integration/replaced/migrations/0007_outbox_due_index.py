"""The relay's claim walks only due rows: an index on (next_attempt_at, id) of pending rows
replaces the one on id, and next_attempt_at may be NULL (a row parked behind an earlier unsent
message of its key).

On PostgreSQL the index is built and the old one dropped CONCURRENTLY, so publishing goes on
while it runs (a scan of the table: about a minute per ten million rows on a small machine);
the migration is therefore not atomic. Reversible.
"""

import django.utils.timezone
from django.db import migrations, models

from reliable_messaging.migration_ops import AddIndexOnline, RemoveIndexOnline


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("reliable_messaging", "0006_outbox_unrouted"),
    ]

    operations = [
        migrations.AlterField(
            model_name="outboxmessage",
            name="next_attempt_at",
            field=models.DateTimeField(blank=True, default=django.utils.timezone.now, null=True),
        ),
        AddIndexOnline(
            model_name="outboxmessage",
            index=models.Index(
                condition=models.Q(("status", "pending")),
                fields=["next_attempt_at", "id"],
                name="rm_outbox_due_idx",
            ),
        ),
        RemoveIndexOnline(
            model_name="outboxmessage",
            name="rm_outbox_pending_idx",
        ),
    ]
