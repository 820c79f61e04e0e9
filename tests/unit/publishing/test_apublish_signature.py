"""``apublish()`` spells out ``publish()``'s arguments (for type checkers and readers) and passes
each one on: a test keeps the two signatures one."""

from __future__ import annotations

import inspect

from reliable_messaging import apublish, publish


def test_apublish_takes_exactly_publishs_arguments() -> None:
    ours = inspect.signature(apublish).parameters
    theirs = inspect.signature(publish).parameters
    assert list(ours.values()) == list(theirs.values())
    # ... and hands every one of them on to publish().
    body = inspect.getsource(apublish)
    assert all(f"{name}={name}" in body for name in list(theirs)[2:]), body
