"""``OPS_VIEWS_PUBLIC`` opens ``metrics/`` and ``healthz/`` to anonymous requests for the boolean
``True`` only. E047 names any other value, but a WSGI server runs no system checks: the views
themselves must stay closed for ``"False"`` read from an environment variable, ``"True"``, 1."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from reliable_messaging.ops import views

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("name", ["metrics", "healthz"])
@pytest.mark.parametrize("value", ["False", "True", "0", 1, [False]], ids=repr)
def test_only_the_boolean_true_opens_the_ops_views(name: str, value: Any, settings: Any) -> None:
    url = reverse(f"reliable_messaging:{name}")
    views.RECENT_BROKER_CHECK.forget()
    settings.RELIABLE_MESSAGING = {
        **settings.RELIABLE_MESSAGING,
        "OPS_VIEWS_TOKEN": None,
        "OPS_VIEWS_PUBLIC": value,
    }
    refused = Client().get(url)
    assert refused.status_code == 403
    assert b"reliable_messaging_" not in refused.content and b"checks" not in refused.content

    settings.RELIABLE_MESSAGING = {**settings.RELIABLE_MESSAGING, "OPS_VIEWS_PUBLIC": True}
    assert Client().get(url).status_code == 200
