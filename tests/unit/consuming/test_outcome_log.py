"""The log stage formats a delivery's line only when the log keeps it: with INFO off (most
deployments), a processed delivery costs no formatting at all, and a dead letter still logs."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest

from reliable_messaging.consuming.outcome_log import log_outcome, logger
from reliable_messaging.consuming.stage import DeliveryOutcome, Job
from reliable_messaging.core.outcomes import Acknowledge, OutcomeLabel

PROCESSED = DeliveryOutcome(
    Acknowledge(OutcomeLabel.PROCESSED), OutcomeLabel.PROCESSED, 0.002, processed=True
)


class Untouchable:
    """A job whose message fails any read: formatting its line would raise."""

    @property
    def message(self) -> Any:
        raise AssertionError("the line was formatted")

    name = "tests.alpha"


class Plain:
    class message:  # stands for a decoded Message
        message_id = "m-1"
        attempt = 2

    name = "tests.alpha"


@pytest.fixture
def level() -> Any:
    before = logger.level

    def set_level(value: int) -> None:
        logger.setLevel(value)

    yield set_level
    logger.setLevel(before)


def test_a_processed_delivery_is_not_formatted_when_info_is_off(level: Any) -> None:
    level(logging.WARNING)
    log_outcome(cast(Job, Untouchable()), PROCESSED)  # no AssertionError: nothing was read


def test_a_processed_delivery_is_logged_when_info_is_on(
    level: Any, caplog: pytest.LogCaptureFixture
) -> None:
    level(logging.INFO)
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_outcome(cast(Job, Plain()), PROCESSED)
    assert "processed message_id=m-1 consumer=tests.alpha attempt=2" in caplog.text


def test_a_dead_letter_is_logged_with_info_off(
    level: Any, caplog: pytest.LogCaptureFixture
) -> None:
    level(logging.WARNING)
    dead = DeliveryOutcome(
        Acknowledge(OutcomeLabel.DEAD_LETTERED, "permanent_error"),
        OutcomeLabel.DEAD_LETTERED,
        detail="refused",
    )
    with caplog.at_level(logging.WARNING, logger=logger.name):
        log_outcome(cast(Job, Plain()), dead)
    assert "dead-lettering message_id=m-1" in caplog.text
    assert "reason=permanent_error" in caplog.text
