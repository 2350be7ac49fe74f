"""The Helm chart, offline: `helm lint` and `helm template` over several values files, and
what the rendered objects must say: the group and topic names the code uses (one source of
truth: `rlbus k8s names`), the partition count as the ceiling of every ScaledObject, only
RLBUS_* variables some service reads, the GPU resource by name, probes on the service's own
health endpoint, grace periods that cover each tier's drain. The objects are validated
against the Kubernetes and KEDA schemas by a real API server in test_cluster.py."""

from __future__ import annotations

from typing import Any

import pytest

from rlbus.ops.k8s import SCALABLE, names
from rlbus.settings import TopicSettings, tiers, unknown_env_keys
from tests.k8s.conftest import CHART, VALUES, Render, run_helm

pytestmark = pytest.mark.k8s

VALUE_FILES = sorted(p.name for p in VALUES.glob("*.yaml"))
ALL_VALUES = [(), *((f,) for f in VALUE_FILES)]


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]
    return spec["template"]["spec"] if "template" in spec else spec


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tier name -> its Deployment or StatefulSet."""
    out = {}
    for d in docs:
        component = d["metadata"]["labels"].get("app.kubernetes.io/component")
        if d["kind"] in ("Deployment", "StatefulSet") and component in TIERS:
            out[component] = d
    return out


TIERS = tuple(tiers())


@pytest.mark.parametrize("values", ALL_VALUES, ids=["defaults", *VALUE_FILES])
def test_helm_lint_passes(helm: str, values: tuple[str, ...]):
    args = ["lint", "--strict", str(CHART)]
    for v in values:
        args += ["-f", str(VALUES / v)]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("values", ALL_VALUES, ids=["defaults", *VALUE_FILES])
def test_scaled_objects_watch_the_groups_and_topics_the_services_use(render: Render, values):
    docs = render(*values)
    env = env_of(pod_spec(workloads(docs)["rollout"])["containers"][0])
    prefix, partitions = env["RLBUS_TOPICS__PREFIX"], int(env["RLBUS_TOPICS__PARTITIONS"])
    code = names(TopicSettings(prefix=prefix, partitions=partitions))["tiers"]
    for tier, w in workloads(docs).items():
        env = env_of(pod_spec(w)["containers"][0])
        assert env["RLBUS_GROUP"] == code[tier]["group"], tier
    scaled = objects(docs, "ScaledObject")
    if not scaled:
        return  # keda.enabled=false
    assert {so["spec"]["scaleTargetRef"]["name"].rsplit("-", 1)[1] for so in scaled.values()} \
        == set(SCALABLE)
    for so in scaled.values():
        tier = so["spec"]["scaleTargetRef"]["name"].rsplit("-", 1)[1]
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "kafka"
        assert trigger["metadata"]["consumerGroup"] == code[tier]["group"]
        assert trigger["metadata"]["topic"] == code[tier]["topic"]
        # the real ceiling: a member beyond the topic's partitions gets none
        assert so["spec"]["maxReplicaCount"] <= code[tier]["partitions"]
        assert so["spec"]["scaleTargetRef"]["name"] in objects(docs, "Deployment")


def test_a_prefix_and_partitions_set_on_the_command_line_reach_names_and_env(render: Render):
    docs = render("--set", "topics.prefix=run42", "--set", "topics.partitions=4",
                  "--set", "rollout.autoscaling.maxReplicas=4",
                  "--set", "inference.autoscaling.maxReplicas=4",
                  "--set", "reward.autoscaling.maxReplicas=4")
    triggers = {so["metadata"]["name"]: so["spec"]["triggers"][0]["metadata"]
                for so in objects(docs, "ScaledObject").values()}
    assert triggers["demo-rlbus-inference"] == {
        **triggers["demo-rlbus-inference"], "consumerGroup": "run42.inference",
        "topic": "run42.steps"}
    assert triggers["demo-rlbus-reward"]["topic"] == "run42.trajectories"


def test_max_replicas_above_the_partition_count_is_refused(helm: str):
    proc = run_helm(helm, "template", "x", str(CHART), "--set", "topics.partitions=4")
    assert proc.returncode != 0
    assert "exceeds topics.partitions=4" in proc.stderr, proc.stderr


@pytest.mark.parametrize("values", ALL_VALUES, ids=["defaults", *VALUE_FILES])
def test_every_rlbus_variable_is_one_the_tier_reads(render: Render, values):
    """A misspelt RLBUS_ key fails the pod at start; here it fails before any install."""
    settings = {tier: cls for tier, cls in tiers().items()}
    for tier, w in workloads(render(*values)).items():
        spec = pod_spec(w)
        env = {k: "x" for k in env_of(spec["containers"][0])}
        assert unknown_env_keys(settings[tier], env) == [], tier
        for init in spec.get("initContainers", []):
            assert init["name"] in ("model-init", "topics")


@pytest.mark.parametrize("values", ALL_VALUES, ids=["defaults", *VALUE_FILES])
def test_grace_periods_cover_each_tiers_drain(render: Render, values):
    for tier, w in workloads(render(*values)).items():
        spec = pod_spec(w)
        drain = float(env_of(spec["containers"][0])["RLBUS_DRAIN_TIMEOUT_S"])
        assert spec["terminationGracePeriodSeconds"] > drain, tier


def test_gpus_are_requested_by_the_resource_name_the_values_give(render: Render):
    default = workloads(render())
    assert "limits" not in default["inference"]["spec"]["template"]["spec"]["containers"][0][
        "resources"]  # gpus: 0
    amd = workloads(render("gpu-vllm.yaml"))
    inference = pod_spec(amd["inference"])["containers"][0]["resources"]
    assert inference["limits"] == {"amd.com/gpu": 1, "memory": "48Gi"}
    learner = pod_spec(amd["learner"])["containers"][0]
    assert learner["resources"]["limits"] == {"amd.com/gpu": 4}
    assert learner["command"][:4] == ["torchrun", "--standalone", "--nproc_per_node", "4"]
    nvidia = workloads(render("--set", "inference.gpus=2"))
    assert pod_spec(nvidia["inference"])["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": 2}
    none = workloads(render("--set", "inference.gpus=2", "--set", "gpu.resourceName="))
    assert "limits" not in pod_spec(none["inference"])["containers"][0]["resources"]


def test_probes_ask_the_service_itself(render: Render, helm: str):
    http = pod_spec(workloads(render())["reward"])["containers"][0]
    assert http["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "health"}
    assert http["livenessProbe"]["httpGet"]["path"] == "/live"
    assert env_of(http)["RLBUS_HEALTH_PORT"] == str(http["ports"][0]["containerPort"])
    local = pod_spec(workloads(render("local-cluster.yaml"))["reward"])
    (container,) = local["containers"]
    assert local["hostNetwork"] is True
    assert container["readinessProbe"]["exec"]["command"] == [
        "python", "-m", "rlbus.health", "ready"]
    assert "RLBUS_HEALTH_SOCKET" in env_of(container)
    proc = run_helm(helm, "template", "x", str(CHART), "--set", "hostNetwork=true")
    assert proc.returncode != 0 and "probes.mode=exec" in proc.stderr


def test_every_member_is_named_by_its_pod(render: Render):
    """On the host network every pod's HOSTNAME is the node's: reward's transactional id
    and rollout's reply partition must come from the pod's own name."""
    for w in workloads(render("local-cluster.yaml")).values():
        env = env_of(pod_spec(w)["containers"][0])
        assert env["RLBUS_INSTANCE"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_secrets_reach_each_tier_as_variables_and_files(render: Render):
    docs = render("secure-kafka.yaml")
    for tier, w in workloads(docs).items():
        spec = pod_spec(w)
        container = spec["containers"][0]
        assert [s["secretRef"]["name"] for s in container["envFrom"]] == [
            "rlbus-kafka-common", f"rlbus-{tier}-kafka"]
        env = env_of(container)
        assert env["RLBUS_KAFKA__SECURITY_PROTOCOL"] == "SASL_SSL"
        assert env["RLBUS_KAFKA__SASL_MECHANISM"] == "SCRAM-SHA-512"
        assert env["RLBUS_KAFKA__SSL_CAFILE"] == "/etc/rlbus/kafka-tls/ca.crt"
        assert any(v.get("secret", {}).get("secretName") == "rlbus-kafka-ca"
                   for v in spec["volumes"])
    for so in objects(docs, "ScaledObject").values():
        assert so["spec"]["triggers"][0]["authenticationRef"] == {"name": "rlbus-keda-kafka"}
    (job,) = objects(docs, "Job").values()
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["topics", "create"]


def test_the_bundled_broker_replaces_the_hook_job_with_init_containers(render: Render):
    docs = render("bundled-kafka.yaml")
    assert "demo-rlbus-kafka" in objects(docs, "StatefulSet")
    assert not objects(docs, "Job") and not objects(docs, "ScaledObject")
    for tier, w in workloads(docs).items():
        spec = pod_spec(w)
        assert env_of(spec["containers"][0])["RLBUS_KAFKA__BOOTSTRAP"] == \
            "demo-rlbus-kafka.ml.svc:9092"
        assert [c["name"] for c in spec["initContainers"]] == ["topics"], tier
    assert workloads(docs)["rollout"]["spec"]["replicas"] == 2
    assert "PersistentVolumeClaim" not in {d["kind"] for d in docs}  # existing claims


def test_the_learner_is_one_stateful_member_with_its_checkpoint_volume(render: Render):
    docs = render()
    learner = workloads(docs)["learner"]
    assert learner["kind"] == "StatefulSet" and learner["spec"]["replicas"] == 1
    (claim,) = learner["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in pod_spec(learner)["containers"][0][
        "volumeMounts"]}
    env = env_of(pod_spec(learner)["containers"][0])
    assert env["RLBUS_CHECKPOINT_DIR"].startswith(mounts[claim["metadata"]["name"]])
    assert env["RLBUS_WEIGHTS_DIR"] == mounts["weights"]
    weights = objects(docs, "PersistentVolumeClaim")["demo-rlbus-weights"]
    assert weights["spec"]["accessModes"] == ["ReadWriteMany"]
    inference = pod_spec(workloads(docs)["inference"])["containers"][0]
    assert {"name": "weights", "mountPath": "/data/weights", "readOnly": True} in \
        inference["volumeMounts"]
