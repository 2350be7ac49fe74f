"""docker-compose.yml, checked by reading it (CI has no Docker engine).

The point is the environment blocks: every RLBUS_* key must be a setting of the class that
the container's command reads, and every value must validate. A key that matches no setting
is silently ignored by pydantic-settings' environment source (extra="forbid" only rejects
unknown *nested* keys such as RLBUS_KAFKA__BOOTSTRAPP), so the keys are also matched
against the settings fields here; test_a_misspelt_key_is_caught proves both halves bite.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from rlbus.runner import settings_class, tier_names
from rlbus.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
OTHER_ENV_PREFIXES = ("OTEL_", "HF_", "PYTHON", "TRANSFORMERS")
PREFIX = "RLBUS_"


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return data


def services() -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose()["services"]
    return result


def is_rlbus(service: dict[str, Any]) -> bool:
    """Runs the rlbus image (the rest are kafka and jaeger, with their own variables)."""
    return str(service.get("image", "")).startswith("rlbus:")


_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any) -> str:
    """What compose makes of a value when no variable is set on the host (as in CI)."""
    assert not isinstance(value, bool), f"{value!r}: compose rejects unquoted booleans"
    text = str(value).replace("$$", "\0")

    def default(m: re.Match[str]) -> str:
        assert m.group(2) is not None, f"{value!r}: ${{{m.group(1)}}} needs a default"
        return m.group(2)

    return _VARIABLE.sub(default, text).replace("\0", "$")


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment (anchors already merged by the YAML loader), mapping or list."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = [item.split("=", 1) for item in env]
        assert all(len(p) == 2 for p in pairs), f"bare (host pass-through) keys in {env}"
        env = dict(pairs)
    return {str(k): interpolate(v) for k, v in env.items()}


def settings_for(service: dict[str, Any]) -> type[ServiceSettings] | None:
    """The settings class the container's command reads, if it reads one."""
    command = service.get("command") or []
    if command[:1] == ["run"]:
        return settings_class(command[1])
    if command[:1] == ["topics"]:
        from rlbus.ops.admin import AdminSettings

        return AdminSettings
    return None


def unknown_keys(cls: type[BaseModel], env: dict[str, str]) -> list[str]:
    """RLBUS_* keys that name no field of ``cls`` (walking nested sections on ``__``)."""
    unknown = []
    for key in env:
        if not key.startswith(PREFIX):
            continue
        model: Any = cls
        for part in key[len(PREFIX) :].lower().split("__"):
            fields = (
                model.model_fields
                if isinstance(model, type) and issubclass(model, BaseModel)
                else {}
            )
            if part not in fields:
                unknown.append(key)
                break
            model = fields[part].annotation
    return unknown


def load_settings(
    cls: type[ServiceSettings], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> ServiceSettings:
    """Build ``cls`` from exactly the RLBUS_* keys of ``env``, as the container would."""
    for key in list(os.environ):
        if key.startswith(PREFIX):
            monkeypatch.delenv(key)  # nothing from the developer's shell leaks in
    unknown = unknown_keys(cls, env)
    assert not unknown, f"{cls.__name__} has no setting for {unknown}"
    for key, value in env.items():
        if key.startswith(PREFIX):
            monkeypatch.setenv(key, value)
    return cls()


def volume_mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Container path -> (volume or host path, read-only), short or long syntax."""
    mounts = {}
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            mounts[v["target"]] = (v["source"], bool(v.get("read_only", False)))
        else:
            source, target, *mode = v.split(":")
            mounts[target] = (source, "ro" in "".join(mode).split(","))
    return mounts


def volume_at(service: dict[str, Any], path: str) -> tuple[str, str, bool] | None:
    """(volume, its mount point, read-only) of the mount that holds ``path``, if any."""
    for target, (source, ro) in volume_mounts(service).items():
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return source, target, ro
    return None


# -- the tests ------------------------------------------------------------------------------

RLBUS_SERVICE_NAMES = sorted(name for name, s in services().items() if is_rlbus(s))
SETTINGS_SERVICE_NAMES = sorted(
    name for name, s in services().items() if is_rlbus(s) and settings_for(s) is not None
)


def test_the_four_services_and_the_setup_services_exist():
    names = set(services())
    assert set(tier_names()) <= names
    assert {"kafka", "topics", "jaeger", "model-init"} <= names


@pytest.mark.parametrize("name", SETTINGS_SERVICE_NAMES)
def test_environment_is_valid_settings(name, monkeypatch):
    service = services()[name]
    cls = settings_for(service)
    assert cls is not None
    settings = load_settings(cls, environment(service), monkeypatch)
    assert settings.kafka.bootstrap == "kafka:9092"


@pytest.mark.parametrize(
    "bogus", ["RLBUS_NOT_A_SETTING", "RLBUS_KAFKA__NOT_A_SETTING", "RLBUS_MAX_STEPS"]
)
def test_a_misspelt_key_is_caught(bogus, monkeypatch):
    """RLBUS_MAX_STEPS is a learner setting, so in the rollout's block it is a mistake."""
    env = {**environment(services()["rollout"]), bogus: "1"}
    with pytest.raises((AssertionError, ValidationError)):
        load_settings(settings_class("rollout"), env, monkeypatch)


def test_a_bad_value_is_caught(monkeypatch):
    env = {**environment(services()["inference"]), "RLBUS_ENGINE": "vlm"}
    with pytest.raises(ValidationError):
        load_settings(settings_class("inference"), env, monkeypatch)


@pytest.mark.parametrize("name", RLBUS_SERVICE_NAMES)
def test_other_variables_are_runtime_ones(name):
    service = services()[name]
    env = environment(service)
    others = [k for k in env if not k.startswith(PREFIX)]
    assert all(k.startswith(OTHER_ENV_PREFIXES) for k in others), others
    if settings_for(service) is None:  # model-init: no rlbus settings at all
        assert not [k for k in env if k.startswith(PREFIX)]


def test_run_commands_name_a_service():
    runs = {
        name: s["command"]
        for name, s in services().items()
        if (s.get("command") or [])[:1] == ["run"]
    }
    for name, command in runs.items():
        assert len(command) == 2 and command[1] in tier_names(), (name, command)
    for service in tier_names():  # each of the four runs under its own name
        assert runs[service] == ["run", service]


def test_otel_service_names():
    for name in tier_names():
        env = environment(services()[name])
        assert env["OTEL_SERVICE_NAME"] == f"rlbus-{name}"
        assert env["OTEL_TRACES_EXPORTER"] == "otlp"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://jaeger:")


def test_kafka_is_healthchecked_and_topics_wait_for_it():
    kafka = services()["kafka"]
    assert "kafka-broker-api-versions.sh" in " ".join(kafka["healthcheck"]["test"])
    env = {k: str(v) for k, v in kafka["environment"].items()}
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    topics = services()["topics"]
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_kafka_image_is_the_version_the_tests_run():
    from rlbus.ops.broker import KAFKA_VERSION

    assert services()["kafka"]["image"] == f"apache/kafka:{KAFKA_VERSION}"


def test_topics_service_creates_the_catalogue_once():
    topics = services()["topics"]
    assert topics["command"] == ["topics", "create"]
    assert topics["restart"] == "no"


@pytest.mark.parametrize("name", [*tier_names(), "inference-gpu"])
def test_services_wait_for_setup(name):
    depends = services()[name]["depends_on"]
    assert depends["topics"]["condition"] == "service_completed_successfully"
    if name != "reward":
        assert depends["model-init"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("name", [*tier_names(), "inference-gpu"])
def test_services_can_be_scaled(name):
    service = services()[name]
    assert "container_name" not in service
    assert "ports" not in service
    assert "hostname" not in service


def test_inference_reads_the_weights_the_learner_writes():
    learner = services()["learner"]
    weights_dir = environment(learner)["RLBUS_WEIGHTS_DIR"]
    assert weights_dir.startswith("/"), "the published URI is this path; it must be absolute"
    written = volume_at(learner, weights_dir)
    assert written is not None and not written[2], "the learner needs the store read-write"
    for name in ("inference", "inference-gpu"):
        read = volume_at(services()[name], weights_dir)
        assert read is not None and read[:2] == written[:2], name


def test_model_path_is_on_the_volume_model_init_fills():
    init = services()["model-init"]
    for name in ("rollout", "inference", "inference-gpu", "learner"):
        service = services()[name]
        model_path = environment(service)["RLBUS_MODEL_PATH"]
        mount = volume_at(service, model_path)
        assert mount is not None, name
        built = volume_at(init, model_path)
        assert built is not None and built[:2] == mount[:2] and not built[2], name
        assert model_path in " ".join(init["entrypoint"])


def test_gpu_inference_is_an_opt_in_profile():
    cpu, gpu = services()["inference"], services()["inference-gpu"]
    assert "profiles" not in cpu
    assert gpu["profiles"] == ["gpu"]
    assert environment(gpu)["RLBUS_ENGINE"] == "vllm"
    assert environment(gpu)["RLBUS_DEVICE"].startswith("cuda")
    assert environment(cpu)["RLBUS_ENGINE"] == "hf"
    assert gpu["build"]["target"] == "vllm"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"


def test_build_targets_exist_in_the_dockerfile():
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE.read_text(), re.M | re.I))
    for name, service in services().items():
        if "build" in service:
            assert service["build"].get("target") in stages, name


def test_learner_runs_the_demo_recipe():
    """`docker compose up` trains what `rlbus demo` trains, for as many steps by default."""
    from rlbus.ops.demo import DEFAULT_STEPS, RECIPE

    env = environment(services()["learner"])
    assert {k: env.get(k) for k in RECIPE} == RECIPE
    assert env["RLBUS_MAX_STEPS"] == str(DEFAULT_STEPS)


def test_kafka_advertises_the_host_port_it_publishes():
    kafka = services()["kafka"]
    (published,) = kafka["ports"]
    host, container = published.rsplit(":", 1)
    assert container == "29092"
    advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert f"EXTERNAL://localhost:{host}" in advertised, "a moved host port must be advertised"
    assert interpolate(host) == "29092"


# -- the offline override (tests/compose/offline.yml), used where Docker Hub is out of reach

OFFLINE_FILE = ROOT / "tests" / "compose" / "offline.yml"


class _ComposeLoader(yaml.SafeLoader):
    """Reads compose's `!reset` (drop this key from the merged file) as the string "!reset"."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")


def offline() -> dict[str, dict[str, Any]]:
    data: dict[str, Any] = yaml.load(OFFLINE_FILE.read_text(), Loader=_ComposeLoader)
    result: dict[str, dict[str, Any]] = data["services"]
    return result


def started_by_default() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services().items() if "profiles" not in s}


def test_offline_builds_every_rlbus_image_from_the_local_base():
    """A service the override missed would pull python:*-slim from Docker Hub in CI."""
    for name, service in started_by_default().items():
        if "build" in service:
            args = offline()[name]["build"]["args"]
            assert args["BASE_IMAGE"].startswith("rlbus-local/python:"), name
            assert args["TORCH_INDEX_URL"] == "", name  # the CPU index is out of reach


def test_offline_kafka_is_the_local_image_of_the_same_version():
    from rlbus.ops.broker import KAFKA_VERSION

    assert offline()["kafka"]["image"] == f"rlbus-local/kafka:{KAFKA_VERSION}"
    assert set(offline()["kafka"]) == {"image"}, "same environment and healthcheck as users get"


def test_offline_leaves_jaeger_out_and_nothing_waits_for_it():
    assert offline()["jaeger"]["profiles"]
    for name, service in started_by_default().items():
        if "jaeger" in (service.get("depends_on") or {}):
            assert offline()[name]["depends_on"]["jaeger"] == "!reset", name
        if environment(service).get("OTEL_TRACES_EXPORTER") == "otlp":
            assert offline()[name]["environment"]["OTEL_TRACES_EXPORTER"] == "none", name


def test_dockerfile_builds_with_the_classic_builder():
    """The offline path builds with Docker's classic builder (BuildKit would fetch its
    Dockerfile frontend from Docker Hub for the `# syntax=` line)."""
    text = DOCKERFILE.read_text()
    instructions = [line for line in text.splitlines() if not line.startswith("#")]
    assert not [line for line in instructions if "<<" in line], "heredocs need BuildKit"
    assert not [line for line in instructions if "--mount" in line], "so does RUN --mount"
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base$", text, re.M)
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M | re.I)
    # the classic builder builds every stage before --target: cpu must not follow vllm
    assert stages.index("cpu") < stages.index("vllm")
    assert stages[-1] == "default" and re.search(r"^FROM cpu AS default$", text, re.M)


def test_dockerignore_admits_only_what_the_image_needs():
    """An exclusion list once let .venv-vllm (6 GB after `make test`) into the image."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert patterns[0] == "*", "admit by name, exclude everything else"
    admitted = {p.removeprefix("!") for p in patterns if p.startswith("!")}
    assert admitted == {"pyproject.toml", "README.md", "shared", "services"}
