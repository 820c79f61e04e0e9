"""Who may edit a dead letter's message and replay the edited copy: ``edit_replay_deadletter``
for every consumer, or a registered consumer's own permission (made after each ``migrate``),
with the dead letters' view and replay permissions."""

from __future__ import annotations

import hashlib
from typing import Any

from django.apps import apps as global_apps
from django.db import DEFAULT_DB_ALIAS, router

from ..core.registry import registry

APP_LABEL = "reliable_messaging"
GLOBAL_CODENAME = "edit_replay_deadletter"
# Django's limits on a Permission's codename and name.
_CODENAME_MAX, _NAME_MAX = 100, 255


def consumer_codename(consumer: str) -> str:
    """The codename of the permission to edit and replay ``consumer``'s dead letters (a hash of
    its name, so any name fits)."""
    digest = hashlib.sha256(consumer.encode("utf-8", errors="surrogatepass")).hexdigest()
    return f"{GLOBAL_CODENAME}__{digest[:12]}"[:_CODENAME_MAX]


def can_edit(user: Any, consumer: str) -> bool:
    """Whether ``user`` may edit and replay ``consumer``'s dead letters."""
    needed = (f"{APP_LABEL}.view_deadletter", f"{APP_LABEL}.replay_deadletter")
    either = (GLOBAL_CODENAME, consumer_codename(consumer))
    return bool(
        user.has_perms(needed) and any(user.has_perm(f"{APP_LABEL}.{code}") for code in either)
    )


def create_consumer_permissions(
    app_config: Any = None,
    verbosity: int = 1,
    using: str = DEFAULT_DB_ALIAS,
    apps: Any = global_apps,
    **kwargs: Any,
) -> int:
    """``post_migrate``: one permission per registered consumer, on the dead letters' content
    type (existing ones left alone); returns how many were created."""
    try:
        permission_model = apps.get_model("auth", "Permission")
        content_type_model = apps.get_model("contenttypes", "ContentType")
        dead_letter_model = apps.get_model(APP_LABEL, "DeadLetter")
    except LookupError:  # auth or contenttypes not installed, or not migrated yet
        return 0
    if not router.allow_migrate_model(using, permission_model):
        return 0
    content_type, _ = content_type_model.objects.db_manager(using).get_or_create(
        app_label=APP_LABEL, model=dead_letter_model._meta.model_name
    )
    wanted = {
        consumer_codename(spec.name): f"Can edit and replay dead letters of {spec.name}"[:_NAME_MAX]
        for spec in registry
    }
    existing = set(
        permission_model.objects.using(using)
        .filter(content_type=content_type, codename__in=list(wanted))
        .values_list("codename", flat=True)
    )
    missing = [
        permission_model(codename=codename, name=name, content_type=content_type)
        for codename, name in sorted(wanted.items())
        if codename not in existing
    ]
    permission_model.objects.using(using).bulk_create(missing)
    if verbosity >= 2:
        for permission in missing:
            print(f"Adding permission '{permission.name}'")  # as Django says of its own
    return len(missing)
