"""The chart on a real one-node Kubernetes cluster with KEDA (tests/k8s/cluster.py).

1. Every object the chart renders, for every values file, passes the API server's own
   validation (`kubectl apply --dry-run=server`): the Kubernetes schemas and KEDA's CRDs.
2. `helm install` against a Kafka broker on the host, rollout scaled by hand to 2 replicas;
   mid-run one rollout container is SIGKILLed (the kubelet restarts it) and the inference pod
   deleted (it drains, the Deployment replaces it); the learner must finish with every
   episode trained exactly once, every step a full batch, and `helm test` (rlbus status in
   the cluster) must pass.
3. KEDA scales the reward tier on its own group's lag: from 0 to the partition count (never
   past it) when trajectories pile up, and back to 0 once the members have scored them all.
4. The bundled KRaft broker (kafka.bundled.enabled): a short training through it.

Needs root, Docker, and what `make k8s-test` builds (scripts/k8s_env.sh, scripts/helm.sh,
scripts/k8s_images.sh; it passes their outputs as RLBUS_K8S_BIN and RLBUS_HELM). Outside
`make k8s-test` a missing piece skips; inside it (RLBUS_K8S_REQUIRED=1) it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlbus.ops.broker import KAFKA_VERSION
from rlbus.ops.demo import RECIPE
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics
from rlbus.transport import KafkaBus, admin_client
from tests import factories
from tests.k8s.cluster import PAUSE_IMAGE, Cluster, free_port, wait_for
from tests.k8s.conftest import CHART, VALUES, run_helm
from tests.support.ledger import check_ledger, expected_episodes, load_ledger

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(3600)]

NAMESPACE = "rlbus"
IMAGE = "rlbus:k8s-test"
CACHE = Path(os.environ.get("RLBUS_CACHE", Path.home() / ".cache" / "rlbus"))
# The training run: the demo's recipe, short. Measured on 2 shared cores: see docs/kubernetes.md.
RUN_NAME, STEPS, KILL_AT = "k8s", 240, 40
TRAJECTORIES = 10_000  # for the KEDA test
GROUPS_PER_STEP, GROUP_SIZE = int(RECIPE["RLBUS_GROUPS_PER_STEP"]), int(RECIPE["RLBUS_GROUP_SIZE"])


def missing(reason: str) -> None:
    if os.environ.get("RLBUS_K8S_REQUIRED") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(helm: str) -> Iterator[Cluster]:
    bin_dir = Path(os.environ.get("RLBUS_K8S_BIN", "/nonexistent"))
    if not (bin_dir / "kube-apiserver").exists():
        missing("no Kubernetes binaries: `make k8s-test` builds them (scripts/k8s_env.sh)")
    if os.geteuid() != 0:
        missing("the test cluster runs containerd and a kubelet: it needs root")
    for image in (IMAGE, PAUSE_IMAGE):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True,
                          check=False).returncode != 0:
            missing(f"no image {image}: `make k8s-test` builds it (scripts/k8s_images.sh)")
    c = Cluster(bin_dir, containerd_root=CACHE / "k8s-containerd",
                logs_to=CACHE / "k8s-test-logs")
    # SIGTERM (a CI timeout, a Ctrl-C'd make) ends pytest without running finalizers: turn
    # it into an exception here so that the daemons, containers and mounts still go.
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        c.start()
        for image in (PAUSE_IMAGE, IMAGE):
            t0 = time.monotonic()
            imported = c.import_image(image)
            c.timings[f"import {image}"] = round(time.monotonic() - t0, 1) if imported else 0
        c.start_kubelet()
        c.kubectl("create", "namespace", NAMESPACE)
        c.start_keda(NAMESPACE)
        print("cluster up:", json.dumps(c.timings), flush=True)
        yield c
    finally:
        c.stop()
        signal.signal(signal.SIGTERM, previous)
        print("cluster phases (s):", json.dumps(c.timings), flush=True)


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"signal {signum}: stopping the test cluster")


def helm_cmd(helm: str, cluster: Cluster, *args: str, timeout: float = 900) -> str:
    proc = subprocess.run([helm, "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


# -- 1. schemas -------------------------------------------------------------------------


def test_every_rendered_object_passes_the_api_servers_validation(cluster: Cluster, helm: str):
    cluster.kubectl("create", "namespace", "validate")
    value_sets = [[], *[[str(v)] for v in sorted(VALUES.glob("*.yaml"))]]
    for values in value_sets:
        args = ["template", "v", str(CHART), "--namespace", "validate"]
        for v in values:
            args += ["-f", v]
        proc = run_helm(helm, *args)
        assert proc.returncode == 0, proc.stderr
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        out = cluster.kubectl("apply", "--dry-run=server", "-n", "validate", "-f", "-",
                              input=proc.stdout)
        assert out.count("(server dry run)") == len(docs), out
    # and the validation is real: KEDA's schema refuses a malformed ScaledObject
    bad = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
           "metadata": {"name": "bad", "namespace": "validate"},
           "spec": {"scaleTargetRef": {"name": "x"}, "maxReplicaCount": "eight",
                    "triggers": [{"type": "kafka", "metadata": {}}]}}
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(bad),
                          check=False)
    assert "maxReplicaCount" in out and "invalid" in out.lower(), out


# -- 2. training, scaled by hand, with a member killed ------------------------------------


def host_volume(cluster: Cluster, claim: str, mode: str) -> Path:
    """A hostPath PersistentVolume and its claim, bound before any pod asks for it (with no
    provisioner, a pod scheduled before its claim binds waits minutes for a retry)."""
    path = cluster.work / "volumes" / claim
    path.mkdir(parents=True)
    path.chmod(0o777)  # the image's non-root user writes there
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                        "items": [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": claim},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [mode],
                  "storageClassName": "", "hostPath": {"path": str(path)},
                  "persistentVolumeReclaimPolicy": "Retain",
                  "claimRef": {"namespace": NAMESPACE, "name": claim}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": claim, "namespace": NAMESPACE},
         "spec": {"accessModes": [mode], "storageClassName": "", "volumeName": claim,
                  "resources": {"requests": {"storage": "1Gi"}}}}]}))
    wait_for(f"claim {claim} bound", lambda: cluster.get(
        "pvc", "-n", NAMESPACE, claim)["status"].get("phase") == "Bound", 60)
    return path


def pods(cluster: Cluster, component: str, release: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component={component}"
    items: list[dict[str, Any]] = cluster.get("pods", "-n", NAMESPACE, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod["status"].get("conditions", []))


def metrics_step(path: Path) -> int:
    if not path.exists():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((int(r["step"]) for r in rows if "version" in r), default=0)


def test_training_survives_a_killed_and_a_replaced_member(
        cluster: Cluster, helm: str, kafka_bootstrap: str, tmp_path: Path):
    release, prefix = "train", f"k8s-{uuid.uuid4().hex[:6]}"
    host_volume(cluster, f"{release}-weights", "ReadWriteMany")
    # the name the StatefulSet's volumeClaimTemplate gives its claim: it adopts this one
    learner_dir = host_volume(cluster, f"checkpoint-{release}-rlbus-learner-0", "ReadWriteOnce")
    recipe = {**RECIPE, "RLBUS_MAX_STEPS": str(STEPS), "RLBUS_RUN_NAME": RUN_NAME,
              "RLBUS_CHECKPOINT_EVERY": "40", "RLBUS_EVAL_EVERY": "0"}
    sets = [f"learner.env.{k}={v}" for k, v in recipe.items()]
    t0 = time.monotonic()
    helm_cmd(helm, cluster, "install", release, str(CHART), "-n", NAMESPACE,
             "-f", str(VALUES / "local-cluster.yaml"), "--set", "keda.enabled=false",
             "--set", f"kafka.bootstrap={kafka_bootstrap}", "--set", f"topics.prefix={prefix}",
             "--set", f"weights.existingClaim={release}-weights",
             *[a for s in sets for a in ("--set-string", s)], "--wait", "--timeout", "15m")
    timings = {"install": round(time.monotonic() - t0, 1)}

    cluster.kubectl("scale", "-n", NAMESPACE, f"deployment/{release}-rlbus-rollout",
                    "--replicas=2")
    wait_for("two rollout members ready",
             lambda: len([p for p in pods(cluster, "rollout", release) if ready(p)]) == 2, 600)
    timings["scaled"] = round(time.monotonic() - t0, 1)
    metrics = learner_dir / "metrics.jsonl"
    wait_for(f"step {KILL_AT}", lambda: metrics_step(metrics) >= KILL_AT, 1200, 2)
    timings["kill_at"] = round(time.monotonic() - t0, 1)

    # A crash: SIGKILL the rollout container mid-episode; the kubelet restarts it in place.
    victim = pods(cluster, "rollout", release)[0]
    container_id = victim["status"]["containerStatuses"][0]["containerID"].split("//", 1)[1]
    cluster.ctr("tasks", "kill", "-s", "SIGKILL", container_id)
    # A replacement: the inference pod is deleted; it drains, the Deployment makes another.
    (inference,) = pods(cluster, "inference", release)
    cluster.kubectl("delete", "pod", "-n", NAMESPACE, inference["metadata"]["name"],
                    "--wait=false")
    step_at_kill = metrics_step(metrics)
    wait_for("the killed rollout container restarted", lambda: any(
        p["metadata"]["name"] == victim["metadata"]["name"]
        and p["status"]["containerStatuses"][0]["restartCount"] >= 1 and ready(p)
        for p in pods(cluster, "rollout", release)), 600, 2)
    wait_for(f"all {STEPS} steps", lambda: metrics_step(metrics) >= STEPS, 1800, 2)
    timings["trained"] = round(time.monotonic() - t0, 1)

    checkpoint = learner_dir / "checkpoint" / "checkpoint.pt"
    wait_for("the final checkpoint", lambda: checkpoint.exists()
             and len(load_ledger(checkpoint)) == STEPS, 300, 2)
    ledger = load_ledger(checkpoint)
    check = check_ledger(ledger, expected_episodes(RUN_NAME, STEPS * GROUPS_PER_STEP,
                                                   GROUP_SIZE), GROUPS_PER_STEP * GROUP_SIZE)
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "version" in r]
    masked = {c: sum(int(r.get(f"masked_{c}", 0)) for r in train)
              for c in ("stale", "failed", "invalid")}
    print(json.dumps({"steps": len(ledger), "step_at_kill": step_at_kill,
                      "episodes_trained": check.trained, "lost": len(check.lost),
                      "trained_twice": len(check.duplicated), "masked": masked,
                      "timings_s": timings}), flush=True)
    check.assert_exactly_once()
    assert masked["failed"] == masked["invalid"] == 0, masked

    status = helm_cmd(helm, cluster, "test", release, "-n", NAMESPACE, "--logs",
                      timeout=300)
    for tier in ("rollout", "inference", "reward", "learner"):
        assert f"{tier}" in status, status
    helm_cmd(helm, cluster, "uninstall", release, "-n", NAMESPACE, "--wait", timeout=300)


# -- 3. KEDA on the reward tier's lag --------------------------------------------------------


def produce(bootstrap: str, topic: str, n: int) -> None:
    async def send() -> None:
        bus = KafkaBus(KafkaSettings(bootstrap=bootstrap), dlq_topic=None, service="k8s-test")
        producer = await bus.producer()
        try:
            for start in range(0, n, 500):
                await asyncio.gather(*(
                    producer.send(topic, factories.trajectory(f"keda/{i}"), key=f"keda/{i}")
                    for i in range(start, min(n, start + 500))))
        finally:
            await bus.close()

    asyncio.run(send())


def group_lag(bootstrap: str, group: str, topic: str) -> int:
    """End offsets minus the group's committed offsets, summed over the topic's partitions."""
    from aiokafka import AIOKafkaConsumer

    async def lag() -> int:
        async with admin_client(KafkaSettings(bootstrap=bootstrap)) as admin:
            committed = await admin.list_consumer_group_offsets(group)
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
        await consumer.start()
        try:
            tps = [tp for tp in committed if tp.topic == topic]
            ends = await consumer.end_offsets(tps)
        finally:
            await consumer.stop()
        return sum(ends[tp] - committed[tp].offset for tp in tps)

    return asyncio.run(lag())


def test_keda_scales_the_reward_tier_on_its_own_lag(
        cluster: Cluster, helm: str, kafka_bootstrap: str):
    release, prefix, partitions, threshold = "scale", f"keda-{uuid.uuid4().hex[:6]}", 4, 5
    topic = Topics(TopicSettings(prefix=prefix)).trajectories
    deployment = f"{release}-rlbus-reward"
    helm_cmd(helm, cluster, "install", release, str(CHART), "-n", NAMESPACE,
             "-f", str(VALUES / "local-cluster.yaml"),
             "--set", f"kafka.bootstrap={kafka_bootstrap}", "--set", f"topics.prefix={prefix}",
             "--set", f"topics.partitions={partitions}", "--set", "model.init=none",
             "--set", "rollout.enabled=false", "--set", "inference.enabled=false",
             "--set", "learner.enabled=false", "--set", "tests.enabled=false",
             "--set", "reward.autoscaling.minReplicas=0",
             "--set", f"reward.autoscaling.maxReplicas={partitions}",
             "--set", f"reward.autoscaling.lagThreshold={threshold}", timeout=600)

    def replicas() -> int:
        spec: int = cluster.get("deployment", "-n", NAMESPACE, deployment)["spec"]["replicas"]
        return spec

    def scaled_object_ready() -> bool:
        so = cluster.get("scaledobject", "-n", NAMESPACE, deployment)
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for c in so.get("status", {}).get("conditions", []))

    t0 = time.monotonic()
    wait_for("the ScaledObject Ready", scaled_object_ready, 120, 1)
    wait_for("no lag: scaled to 0", lambda: replicas() == 0, 180, 1)
    timings = {"to_zero": round(time.monotonic() - t0, 1)}

    # Far more than partitions x threshold, and more than one member scores before the HPA's
    # first sync (one scored 400 in under 10 s here): the lag asks for the maximum.
    produce(kafka_bootstrap, topic, TRAJECTORIES)
    t1 = time.monotonic()
    seen: list[int] = []

    def at_max() -> bool:
        seen.append(replicas())
        return seen[-1] == partitions

    wait_for(f"scaled up to the {partitions} partitions", at_max, 300, 1)
    timings["to_max"] = round(time.monotonic() - t1, 1)

    def drained_and_down() -> bool:
        seen.append(replicas())
        return seen[-1] == 0

    wait_for("all scored, scaled back to 0", drained_and_down, 900, 2)
    timings["back_to_zero"] = round(time.monotonic() - t1, 1)
    print(json.dumps({"replicas_seen": sorted(set(seen)), "timings_s": timings}), flush=True)
    assert max(seen) == partitions  # the ceiling: never more members than partitions
    assert group_lag(kafka_bootstrap, f"{prefix}.reward", topic) == 0
    helm_cmd(helm, cluster, "uninstall", release, "-n", NAMESPACE, "--wait", timeout=300)


# -- 4. the bundled broker ---------------------------------------------------------------------


def test_a_short_run_on_the_bundled_broker(cluster: Cluster, helm: str):
    """kafka.bundled.enabled: the KRaft StatefulSet of the chart (here the offline stand-in
    for apache/kafka that tests/compose builds, which reads the same KAFKA_* variables),
    topics from each tier's init container, a short training through it."""
    kafka_image = f"rlbus-local/kafka:{KAFKA_VERSION}"
    if subprocess.run(["docker", "image", "inspect", kafka_image], capture_output=True,
                      check=False).returncode != 0:
        missing(f"no image {kafka_image}: scripts/compose_env.sh builds it")
    cluster.import_image(kafka_image)
    release, steps = "bundled", 20
    host_volume(cluster, f"data-{release}-rlbus-kafka-0", "ReadWriteOnce")
    host_volume(cluster, f"{release}-weights", "ReadWriteMany")
    learner_dir = host_volume(cluster, f"checkpoint-{release}-rlbus-learner-0", "ReadWriteOnce")
    recipe = {**RECIPE, "RLBUS_MAX_STEPS": str(steps), "RLBUS_RUN_NAME": RUN_NAME,
              "RLBUS_CHECKPOINT_EVERY": "10", "RLBUS_EVAL_EVERY": "0"}
    repository, tag = kafka_image.split(":")
    t0 = time.monotonic()
    helm_cmd(helm, cluster, "install", release, str(CHART), "-n", NAMESPACE,
             "-f", str(VALUES / "local-cluster.yaml"), "--set", "keda.enabled=false",
             "--set", "kafka.bundled.enabled=true",
             "--set", f"kafka.bundled.image.repository={repository}",
             "--set", f"kafka.bundled.image.tag={tag}",
             "--set", "kafka.bundled.image.pullPolicy=Never",
             "--set", f"kafka.bundled.port={free_port()}",
             "--set", f"kafka.bundled.controllerPort={free_port()}",
             "--set", f"weights.existingClaim={release}-weights",
             *[a for k, v in recipe.items() for a in ("--set-string", f"learner.env.{k}={v}")],
             "--wait", "--timeout", "15m")
    installed = round(time.monotonic() - t0, 1)
    metrics = learner_dir / "metrics.jsonl"
    wait_for(f"all {steps} steps", lambda: metrics_step(metrics) >= steps, 900, 2)
    checkpoint = learner_dir / "checkpoint" / "checkpoint.pt"
    wait_for("the final checkpoint", lambda: checkpoint.exists()
             and len(load_ledger(checkpoint)) == steps, 300, 2)
    check = check_ledger(load_ledger(checkpoint), expected_episodes(
        RUN_NAME, steps * GROUPS_PER_STEP, GROUP_SIZE), GROUPS_PER_STEP * GROUP_SIZE)
    print(json.dumps({"bundled": {"install_s": installed,
                                  "trained_s": round(time.monotonic() - t0, 1)}}), flush=True)
    check.assert_exactly_once()
    helm_cmd(helm, cluster, "uninstall", release, "-n", NAMESPACE, "--wait", timeout=300)
