"""The settings are declared once, in ``reliable_messaging/conf.py``: the reference page, the
defaults, the typed attributes and the system checks all derive from those declarations, and
this module fails when one of them drifts from it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from django.test import override_settings

from reliable_messaging import checks
from reliable_messaging.conf import (
    DEFAULTS,
    SETTINGS,
    CheckedBy,
    MessagingSettings,
    Rule,
    Setting,
    messaging_settings,
)

ROOT = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    path = ROOT / "scripts" / "settings_reference.py"
    spec = importlib.util.spec_from_file_location("settings_reference", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_what_the_declarations_give() -> None:
    script = load_script()
    page = script.PAGE.read_text(encoding="utf-8")
    assert script.rendered(page) == page, (
        "docs/reference/settings.md is out of date: run python scripts/settings_reference.py"
    )
    assert script.reference_table(SETTINGS) in page


def test_every_declaration_has_a_row_in_the_reference() -> None:
    page = (ROOT / "docs" / "reference" / "settings.md").read_text(encoding="utf-8")
    for setting in SETTINGS:
        assert f"| `{setting.key}` |" in page


def test_defaults_derive_from_the_declarations() -> None:
    assert list(DEFAULTS) == [setting.key for setting in SETTINGS]
    assert len(set(DEFAULTS)) == len(SETTINGS)  # no key declared twice
    for setting in SETTINGS:
        assert DEFAULTS[setting.key] == setting.default


def test_each_attribute_is_named_after_its_key() -> None:
    names = {
        name: value.key
        for name, value in vars(MessagingSettings).items()
        if isinstance(value, Setting)
    }
    # BROKER_URL reads as a list (broker_url is the ";"-joined string): the one exception.
    assert names.pop("broker_urls") == "BROKER_URL"
    assert all(name == key.lower() for name, key in names.items()), names


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda setting: setting.key)
def test_every_default_passes_its_own_rule(setting: Setting[Any]) -> None:
    rule = setting.rule
    if isinstance(rule, Rule):
        assert rule.problem(setting.default) is None
    elif isinstance(rule, CheckedBy):
        # The broker's default names localhost; only its shape is judged here.
        assert checks.CHECKED_HERE[rule.function](setting.default) == []
    assert setting.doc.strip() and "\n" not in setting.doc


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda setting: setting.key)
def test_every_default_converts(setting: Setting[Any]) -> None:
    with override_settings(RELIABLE_MESSAGING={}):
        getattr(messaging_settings, _attribute(setting))


def _attribute(setting: Setting[Any]) -> str:
    (name,) = [n for n, v in vars(MessagingSettings).items() if v is setting]
    return name


def test_functions_named_by_declarations_exist_in_the_checks() -> None:
    named = {s.rule.function for s in SETTINGS if isinstance(s.rule, CheckedBy)}
    assert named == set(checks.CHECKED_HERE)


def test_every_setting_is_checked() -> None:
    assert [s.key for s in SETTINGS if s.rule is None] == []


def test_the_settings_object_is_read_only() -> None:
    settings = MessagingSettings()
    with pytest.raises(AttributeError):
        settings.prefetch = 5
    assert isinstance(MessagingSettings.prefetch, Setting)


def test_a_pipe_in_a_doc_does_not_break_the_table() -> None:
    odd = Setting("a|b", str, "either a | b", key="ODD")
    row = load_script().reference_table([odd]).splitlines()[-1]
    assert row.count("|") - row.count("\\|") == 4
