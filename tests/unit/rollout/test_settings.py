"""The rollout tier's settings: the gateway's history mode, per task."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from rlbus.rollout.settings import RolloutSettings


@pytest.fixture
def env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("RLBUS_"):
            monkeypatch.delenv(key)
    return monkeypatch.setenv


def test_a_task_named_in_the_json_map_gets_its_own_gateway_history(env):
    env("RLBUS_GATEWAY_HISTORY_BY_TASK", '{"swe_agent": "strict"}')
    s = RolloutSettings()
    assert s.history_of("swe_agent") == "strict"
    assert s.history_of("guess_number") == s.gateway_history == "segments"
    env("RLBUS_GATEWAY_HISTORY", "strict")
    env("RLBUS_GATEWAY_HISTORY_BY_TASK", '{"chat": "segments"}')
    s = RolloutSettings()
    assert (s.history_of("chat"), s.history_of("other")) == ("segments", "strict")


def test_a_mode_that_does_not_exist_is_a_settings_error(env):
    env("RLBUS_GATEWAY_HISTORY_BY_TASK", '{"swe_agent": "lenient"}')
    with pytest.raises(ValidationError, match="segments"):
        RolloutSettings()
