from __future__ import annotations

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class ReliableMessagingConfig(AppConfig):
    name = "reliable_messaging"
    verbose_name = "Reliable messaging"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)

        # Like admin.py: every installed app's consumers.py registers its handlers on import.
        autodiscover_modules("consumers")
