from __future__ import annotations

from django.apps import AppConfig
from django.conf import settings
from django.utils.module_loading import autodiscover_modules


class ReliableMessagingConfig(AppConfig):
    name = "reliable_messaging"
    verbose_name = "Reliable messaging"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .broker.codec import install as install_amqp_codec

        install_amqp_codec()  # before any broker connection: see broker/codec.py
        from .broker.pika_logs import install as install_pika_logs

        install_pika_logs()  # our probes' expected 404s stay out of the user's log

        # Like admin.py: every installed app's contracts.py declares the payloads it publishes
        # (reliable_messaging.contracts.publishes), and its consumers.py registers its handlers.
        autodiscover_modules("contracts")
        autodiscover_modules("consumers")
        if getattr(settings, "TASKS", None):
            # And the consumers of the task queues of a django.tasks backend of ours.
            from .contrib.task_backend import register_task_consumers

            register_task_consumers()

        from django.db.models.signals import post_migrate

        from .dead_letters.permissions import create_consumer_permissions

        # After Django's own permissions: one per registered consumer, to edit and replay its
        # dead letters (created at each migrate, so a consumer added later gets it then).
        post_migrate.connect(create_consumer_permissions, sender=self)
