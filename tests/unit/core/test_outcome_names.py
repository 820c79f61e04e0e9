"""Outcome labels and failure reasons are named once (``reliable_messaging.core.outcomes``); the
metrics, the retry decisions and the dead-letter model's choices use those names."""

from __future__ import annotations

from reliable_messaging import metrics
from reliable_messaging.choices import DeadLetterReason
from reliable_messaging.consuming.retries import GiveUp, decide
from reliable_messaging.core.outcomes import (
    Acknowledge,
    FailureReason,
    OutcomeLabel,
    Release,
    ScheduleRetry,
    label_of,
)


def test_the_metrics_count_exactly_the_outcome_labels() -> None:
    assert set(OutcomeLabel) == metrics.CONSUMER_OUTCOMES
    # The label a time series carries is the plain word.
    assert {str(label) for label in OutcomeLabel} == {
        "processed",
        "duplicate",
        "retried",
        "dead_lettered",
        "released",
        "parked",
        "deferred",
        "expired",
    }


def test_every_failure_reason_has_a_dead_letter_choice_and_no_other_exists() -> None:
    assert set(DeadLetterReason.values) == {str(reason) for reason in FailureReason}


def test_labels_of_outcomes() -> None:
    assert label_of(Acknowledge(OutcomeLabel.DUPLICATE)) == "duplicate"
    assert label_of(ScheduleRetry(1.0, 2)) is OutcomeLabel.RETRIED
    assert label_of(ScheduleRetry(1.0, 2, deferred=True)) is OutcomeLabel.DEFERRED
    assert label_of(Release("stopping")) is OutcomeLabel.RELEASED


def test_the_retry_decision_and_the_decoder_give_members_of_the_one_list() -> None:
    decision = decide(ValueError("x"), attempt=3, max_attempts=3, delays=(1,))
    assert isinstance(decision, GiveUp) and decision.reason is FailureReason.RETRIES_EXHAUSTED
    assert DeadLetterReason(decision.reason) == DeadLetterReason.RETRIES_EXHAUSTED
