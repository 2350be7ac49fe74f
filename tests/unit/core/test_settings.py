"""One shell for every tier: a variable some rlbus service reads is accepted by all (and
logged once where unused); a variable no service reads is an error that names the closest one."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from rlbus import settings
from rlbus.inference.settings import InferenceSettings
from rlbus.ops.admin import AdminSettings
from rlbus.processes import child_env
from rlbus.reward.settings import RewardSettings
from rlbus.settings import UnknownSettingError


@pytest.fixture
def env(monkeypatch):
    """A clean RLBUS_* environment and a fresh record of what was logged."""
    for key in list(os.environ):
        if key.startswith("RLBUS_"):
            monkeypatch.delenv(key)
    monkeypatch.setattr(settings, "_REPORTED", set())

    def set_env(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


def unused_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rlbus.settings"]


def test_another_tiers_variable_is_accepted_and_logged_once(env, caplog):
    env(RLBUS_MODEL_PATH="/models/policy", RLBUS_SYNTHETIC__BASE_MS="3", RLBUS_BATCH_SIZE="2")
    caplog.set_level(logging.INFO, logger="rlbus.settings")
    reward = RewardSettings()
    RewardSettings()
    assert reward.batch_size == 2
    lines = unused_lines(caplog)
    assert len(lines) == 2  # once per variable, however often the class is built
    assert any(
        "RLBUS_MODEL_PATH is not a setting of RewardSettings" in line
        and "InferenceSettings" in line
        and "LearnerSettings" in line
        for line in lines
    )
    assert any("RLBUS_SYNTHETIC__BASE_MS" in line for line in lines)
    assert InferenceSettings().synthetic.base_ms == 3.0  # still read by its own tier


def test_operator_commands_take_every_tiers_variables_silently(env, caplog):
    env(RLBUS_MODEL_PATH="/m", RLBUS_MAX_STEPS="5", RLBUS_TOPICS__PREFIX="p")
    caplog.set_level(logging.INFO, logger="rlbus.settings")
    assert AdminSettings().topics.prefix == "p"
    assert unused_lines(caplog) == []


def test_launcher_variables_are_accepted_everywhere(env, caplog):
    env(RLBUS_KAFKA_BOOTSTRAP="h:1", RLBUS_HOME="/tmp/x", RLBUS_KAFKA_CACHE="/tmp/y",
        RLBUS_KAFKA_PORT="29093", RLBUS_SKIP_DOCKER="1")
    caplog.set_level(logging.INFO, logger="rlbus.settings")
    RewardSettings()
    assert unused_lines(caplog) == []


@pytest.mark.parametrize(
    ("variable", "suggestion"),
    [
        ("RLBUS_MODEL_PTH", "RLBUS_MODEL_PATH"),
        ("RLBUS_KAFKA__BOOTSTRAPP", "RLBUS_KAFKA__BOOTSTRAP"),
        ("RLBUS_TOPICS__PARTITION", "RLBUS_TOPICS__PARTITIONS"),
        ("RLBUS_MAXSTEPS", "RLBUS_MAX_STEPS"),
    ],
)
def test_a_variable_no_service_reads_fails_with_the_closest_name(env, variable, suggestion):
    env(**{variable: "1"})
    with pytest.raises(UnknownSettingError, match=f"{variable} \\(did you mean {suggestion}\\?\\)"):
        RewardSettings()


def test_a_variable_like_nothing_known_fails_without_a_guess(env):
    env(RLBUS_NOT_A_SETTING="1", RLBUS_MODEL_PATH="/m")
    with pytest.raises(UnknownSettingError) as info:
        AdminSettings()
    assert "RLBUS_NOT_A_SETTING" in str(info.value)
    assert "did you mean" not in str(info.value)
    assert "RLBUS_MODEL_PATH" not in str(info.value)  # a known one is not blamed


def test_variable_names_walk_nested_sections():
    names = settings.variable_names(InferenceSettings)
    assert {"RLBUS_KAFKA", "RLBUS_KAFKA__BOOTSTRAP", "RLBUS_SYNTHETIC__VOCAB_SIZE"} <= set(names)


def test_rlbus_run_reward_starts_with_a_variable_meant_for_another_tier():
    """The reported case: one shell exports RLBUS_MODEL_PATH for every service."""
    env = child_env({
        "RLBUS_MODEL_PATH": "/models/my-policy",
        "RLBUS_KAFKA__BOOTSTRAP": "127.0.0.1:1",  # nothing listens: it stops right after settings
        "RLBUS_KAFKA__REQUEST_TIMEOUT_S": "3",
    })  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "rlbus.ops.cli", "run", "reward"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "invalid settings" not in out.stderr
    assert "RLBUS_MODEL_PATH is not a setting of RewardSettings" in out.stderr
    assert "cannot reach Kafka" in out.stderr  # i.e. it got past its settings
