"""One shell for every tier: a variable some rlbus service reads is accepted by all (and
logged once where unused); a variable no service reads is an error that names the closest one."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import BaseModel, SecretStr, TypeAdapter, ValidationError

from rlbus import settings
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.settings import LearnerSettings
from rlbus.ops.admin import AdminSettings
from rlbus.processes import child_env
from rlbus.reward.settings import RewardSettings
from rlbus.settings import KafkaSettings, TopicSettings, UnknownSettingError


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


# --------------------------------------------------------------- settings -> env -> settings

STRINGS = ["x", "a b=c,d", "ünïcode", "h1:9093,h2:9094", '{"looks": "json"}', "123", "null"]
PATHS = [Path("/tmp/rlbus run/ß"), Path("relative/dir")]
DICTS = [{"a": 1}, {"question": "q", "answer": "a b"},  # the second: a dict[str, str] too
         {"nested": {"b": [1.5, "x", None]}, "flag": True, "s": "true"}]


def _draw(annotation: Any, default: Any, rng: random.Random) -> Any:
    """A value of ``annotation`` other than ``default`` (maybe outside the field's bounds)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return rng.choice([a for a in args if a != default])
    if origin is list and get_origin(args[0]) is Literal:  # a list of names: some of them
        names = get_args(args[0])
        return rng.sample(names, rng.randint(1, len(names)))
    if origin is list and args[0] is str:  # free names (LoRA's target modules)
        return rng.sample(STRINGS, rng.randint(1, 3))
    if origin is dict and get_origin(args[1]) is Literal:  # names, each with a choice
        return {rng.choice(STRINGS): rng.choice(get_args(args[1]))
                for _ in range(rng.randint(1, 3))}
    if origin in (UnionType, Union):  # X | None: None is the default or not expressible
        return _draw(next(a for a in args if a is not type(None)), default, rng)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _section(annotation, rng, every=True)
    base = default if isinstance(default, int | float) else 0
    draws: dict[Any, list[Any]] = {
        bool: [not default],
        int: [base + 1, base + 7, 2 * base + 1, 1 << 20],
        float: [base + 0.25, base * 1.5 + 0.1, 0.1 + 0.2, 1e-5, 12345.678],
        str: STRINGS, Path: PATHS, SecretStr: [SecretStr('p@ss w=rd "q"')],
    }
    return rng.choice(draws.get(annotation) or draws.get(origin) or DICTS)


def _fields(cls: type[BaseModel], rng: random.Random, every: bool) -> dict[str, Any]:
    """Each field (or, unless ``every``, about half of them) set to a valid non-default value."""
    values = {}
    for name, field in cls.model_fields.items():
        if not every and rng.random() < 0.5:
            continue
        default = field.get_default(call_default_factory=True)
        bounded = Annotated[(field.annotation, *field.metadata)] if field.metadata else None
        adapter = TypeAdapter(bounded or field.annotation)
        for _ in range(100):
            value = _draw(field.annotation, default, rng)
            with contextlib.suppress(ValidationError):
                if adapter.validate_python(value) != default:
                    values[name] = value
                    break
        else:
            raise AssertionError(f"no valid non-default value drawn for {cls.__name__}.{name}")
    return values


def _section(cls: type[BaseModel], rng: random.Random, every: bool) -> BaseModel:
    """A valid ``cls`` with non-default fields (redrawn while a cross-field check refuses)."""
    for _ in range(100):
        with contextlib.suppress(ValidationError):
            return cls(**_fields(cls, rng, every))
    raise AssertionError(f"no valid {cls.__name__} drawn")


CLASSES = [settings.ServiceSettings, *settings.settings_classes()]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_settings_survive_the_trip_through_a_childs_environment(env, cls, seed):
    """settings -> settings_env -> the same class built from that environment: equal."""
    original = _section(cls, random.Random(f"{cls.__name__}/{seed}"), every=seed == 0)
    env(**settings.settings_env(original))
    assert cls() == original


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_of_every_section_can_be_passed_on(cls):
    names = settings.variable_names(cls)
    leaves = {n for n in names if not any(m.startswith(n + "__") for m in names)}
    assert set(settings.settings_env(_section(cls, random.Random(0), every=True))) == leaves


def test_defaults_are_left_to_the_child():
    assert settings.settings_env(InferenceSettings()) == {}
    assert settings.settings_env(kafka=KafkaSettings(), topics=TopicSettings(partitions=2)) == {
        "RLBUS_TOPICS__PARTITIONS": "2"}


def test_named_settings_are_written_as_the_child_reads_them(env):
    passed = settings.settings_env(
        kafka=KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
                            sasl_username="u", sasl_password=SecretStr("s3cret")),
        instance=3, feed=False, task_spec={"max_ms": 5}, weights_dir=Path("/w"))
    assert passed["RLBUS_KAFKA__SASL_PASSWORD"] == "s3cret"
    env(**passed)
    learner = LearnerSettings()
    assert (learner.instance, learner.feed, learner.task_spec) == ("3", False, {"max_ms": 5})
    assert learner.kafka.sasl_password == SecretStr("s3cret")


def test_a_name_no_service_has_fails_in_the_parent():
    with pytest.raises(UnknownSettingError, match=r"RLBUS_MAX_STEP \(did you mean RLBUS_MAX_STEPS"):
        settings.settings_env(max_step=3)


def test_none_over_a_default_that_is_not_none_fails_loudly():
    """pydantic-settings reads no string as None, so the child would not get it."""
    with pytest.raises(ValueError, match="RLBUS_TORCH_THREADS: None cannot be set"):
        settings.settings_env(InferenceSettings(torch_threads=None))


def test_a_section_of_another_class_is_refused():
    """A look-alike with other defaults: its fields at their defaults would be lost."""

    class LoadTestEngine(BaseModel):
        base_ms: float = 2.0  # the tier's is 5.0

    with pytest.raises(TypeError, match="synthetic: a LoadTestEngine is not the synthetic"):
        settings.settings_env(synthetic=LoadTestEngine())


# -- secrets: read from a file, never shown


SECRET = "hunter2-correct-horse"


def _sasl(**changes: Any) -> dict[str, Any]:
    return {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "rollout", **changes}


def test_the_password_comes_from_its_file(tmp_path):
    (tmp_path / "pw").write_text(SECRET + "\n")
    kafka = KafkaSettings(**_sasl(sasl_password_file=tmp_path / "pw"))
    assert kafka.password() == SECRET
    from rlbus.transport import client_options

    assert client_options(kafka)["sasl_plain_password"] == SECRET


@pytest.mark.parametrize(("content", "error"), [(None, "cannot read"), ("\n", "is empty")])
def test_an_unreadable_or_empty_password_file_fails_at_start(tmp_path, content, error):
    if content is not None:
        (tmp_path / "pw").write_text(content)
    with pytest.raises(ValidationError, match=error):
        KafkaSettings(**_sasl(sasl_password_file=tmp_path / "pw"))


def test_sasl_without_a_password_names_both_ways_to_give_one():
    with pytest.raises(ValidationError, match="sasl_password or sasl_password_file"):
        KafkaSettings(**_sasl())


def test_a_secret_is_in_no_repr_and_no_validation_error(env):
    kafka = KafkaSettings(**_sasl(sasl_password=SECRET))
    settings_ = RewardSettings(kafka=kafka)
    shown = [repr(kafka), str(kafka), repr(settings_), str(settings_),
             settings_.model_dump_json(), str(settings_.model_dump(mode="json"))]
    assert not [s for s in shown if SECRET in s]
    # a rejected section is not quoted back: pydantic would show the whole input
    bad = [{**_sasl(sasl_password=SECRET), "request_timeout_s": "soon"},
           {**_sasl(sasl_password=SECRET), "sasl_pasword": SECRET}]
    for section in bad:
        with pytest.raises(ValidationError) as caught:
            RewardSettings(kafka=section)
        assert SECRET not in str(caught.value)
    env(RLBUS_KAFKA__SECURITY_PROTOCOL="SASL_SSL", RLBUS_KAFKA__SASL_USERNAME="u",
        RLBUS_KAFKA__SASL_PASSWORD=SECRET)  # no mechanism: refused
    with pytest.raises(ValidationError) as caught:
        RewardSettings()
    assert SECRET not in str(caught.value)
