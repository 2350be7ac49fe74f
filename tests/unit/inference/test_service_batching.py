"""How long inference waits for a batch to fill: batch_wait_ms counted from when the oldest
request was sent, so a loaded replica never adds it on top of the time a request queued."""

from __future__ import annotations

import time

import pytest

from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.transport import Delivery
from tests import factories


def _request(age_s: float) -> Delivery[object]:
    sent_ms = int((time.time() - age_s) * 1000)
    return Delivery("steps", 0, 0, None, factories.step_request(), {}, sent_ms)


def _inference(**kw: object) -> Inference:
    return Inference(InferenceSettings(engine="synthetic", batch_wait_ms=20, **kw))


def test_a_fresh_request_waits_for_company_up_to_batch_wait():
    assert _inference()._wait_for_company([_request(0.0)]) == pytest.approx(0.020, abs=0.005)


def test_a_request_that_queued_behind_a_running_batch_is_served_at_once():
    inference = _inference()
    assert inference._wait_for_company([_request(0.0), _request(0.05)]) == 0.0
    assert inference._wait_for_company([]) == 0.0


def test_a_full_batch_is_served_at_once():
    inference = _inference(max_batch_size=2)
    assert inference._wait_for_company([_request(0.0), _request(0.0)]) == 0.0


def test_a_sender_clock_ahead_of_ours_never_stretches_the_wait():
    # sent "in the future" by 50 ms: another host's clock, or the broker's
    assert _inference()._wait_for_company([_request(-0.05)]) == pytest.approx(0.020)
