"""The tiers against a broker secured as production ones are (rlbus.ops.broker.secure): only
SASL_SSL with SCRAM-SHA-512, a principal per role, ACLs enforced (StandardAuthorizer,
``allow.everyone.if.no.acl.found=false``, admin the only super user).

One broker for the module (never ``$RLBUS_KAFKA_BOOTSTRAP``: an external broker is not known
to be secured, and the tests need its users). Each test gets topics of its own prefix, with
the ACLs ``rlbus acl apply`` would create for them. Every refusal runs under a hard bound, so
a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from rlbus.acl import Role, acls, apply_acls
from rlbus.errors import AccessDeniedError, BrokerConnectError
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.messages import Prompt, ScoredTrajectory, StepResult, WeightVersion
from rlbus.ops.broker.secure import SecureCluster, make_certificates
from rlbus.ops.status import status_command
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus
from tests import factories
from tests.pipeline import run_pipeline, settings
from tests.polling import poll_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# A client that waits instead of failing shows up as a call that lasts this long. A refusal
# takes well under a second; the margin is for a loaded machine (5 s was short there).
REQUEST_TIMEOUT_S = 20.0
# Hard bound on any failing call: above the request timeout, far below pytest's.
HANG_BOUND_S = 3 * REQUEST_TIMEOUT_S


@pytest.fixture(scope="module")
def secure() -> Iterator[SecureCluster]:
    cluster = SecureCluster().start(timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop(timeout=10)


def kafka_as(secure: SecureCluster, role: Role | str = Role.ADMIN, **changes: Any
             ) -> KafkaSettings:
    return secure.kafka(role, request_timeout_s=REQUEST_TIMEOUT_S, **changes)


async def make_topics(secure: SecureCluster, prefix: str, *, with_acls: bool = True,
                      **shape: int) -> TopicSettings:
    topics = TopicSettings(prefix=prefix, **{"partitions": 1, "result_partitions": 1, **shape})
    admin = kafka_as(secure)
    assert await ensure_topics(admin, topics)  # created over SASL_SSL, as admin
    if with_acls:
        assert await apply_acls(admin, acls(topics))
    return topics


@pytest.fixture
async def topics(secure: SecureCluster, unique_name: Callable[..., str]) -> TopicSettings:
    """Topics of this test's own, for a test that writes and reads."""
    return await make_topics(secure, unique_name("sec"))


@pytest.fixture(scope="module")
def shared_topics(secure: SecureCluster) -> TopicSettings:
    """Topics for the tests that are refused: nothing is written, so they can share them."""
    return asyncio.run(make_topics(secure, f"refused-{uuid.uuid4().hex[:8]}"))


def bus_of(secure: SecureCluster, role: Role | str, topics: TopicSettings, **changes: Any
           ) -> KafkaBus:
    return KafkaBus(kafka_as(secure, role, **changes), dlq_topic=Topics(topics).dlq,
                    service=str(role))


Attempt = Callable[[], Awaitable[Any]]


async def refused(attempt: Attempt, error: type[Exception] = AccessDeniedError) -> Exception:
    """The error ``attempt`` fails with: the broker's answer, in one line, not a timeout."""
    started = time.monotonic()
    with pytest.raises(error) as caught:
        async with asyncio.timeout(HANG_BOUND_S):
            await attempt()
    elapsed = time.monotonic() - started
    assert elapsed < REQUEST_TIMEOUT_S, f"refused only after {elapsed:.1f}s"
    assert "\n" not in str(caught.value)
    return caught.value


# ------------------------------------------------------------------------------ works when right


async def test_produce_and_consume_through_tls_and_scram(
    secure: SecureCluster, topics: TopicSettings
) -> None:
    names = Topics(topics)
    bus = bus_of(secure, Role.ADMIN, topics)
    try:
        producer = await bus.producer()
        sent = factories.prompt()
        await producer.send(names.prompts, sent, key="k")
        consumer = await bus.consumer([names.prompts], Prompt, group_id=f"{names.prompts}.g")
        [delivery] = await poll_until(consumer, 1)
        assert delivery.message == sent
    finally:
        await bus.close()


async def test_reward_scores_exactly_once_as_its_own_principal(
    secure: SecureCluster, topics: TopicSettings
) -> None:
    # its group join, transactional id, offsets in the transaction: all under its ACLs
    names = Topics(topics)
    rollout, learner = bus_of(secure, Role.ROLLOUT, topics), bus_of(secure, Role.LEARNER, topics)
    try:
        sent = factories.trajectory()
        await (await rollout.producer()).send(names.trajectories, sent, key=sent.group_id)
        reward = RewardSettings(kafka=kafka_as(secure, Role.REWARD), topics=topics,
                                max_messages=1, until_idle_s=30)
        summary = await asyncio.wait_for(Reward(reward).run(), 60)
        assert summary["handled"] == 1
        scored = await learner.consumer([names.scored], ScoredTrajectory, read_committed=True,
                                        group_id=f"{topics.prefix}.learner")
        [delivery] = await poll_until(scored, 1)
        assert delivery.message.trajectory == sent
    finally:
        await rollout.close()
        await learner.close()


# ------------------------------------------------ each role refused outside its role


async def _produce(bus: KafkaBus, topic: str, message: Any, txn: str | None = None) -> None:
    producer = await bus.producer(transactional_id=txn)
    if txn is None:
        await producer.send(topic, message, key="k")
        return
    async with producer.transaction():
        await producer.send(topic, message, key="k")


async def _consume(bus: KafkaBus, topic: str, group: str) -> None:
    consumer = await bus.consumer([topic], Prompt, group_id=group)
    await consumer.poll(1.0)
    await consumer.commit({(topic, 0): 0})


OUT_OF_ROLE = {
    # role, what it tries (topic attribute or group), the refusal it must get
    "rollout writes scored": (Role.ROLLOUT, "write", "scored", "WRITE on topic '{scored}'"),
    "rollout writes weights": (Role.ROLLOUT, "write", "weights", "WRITE on topic '{weights}'"),
    "rollout writes prompts": (Role.ROLLOUT, "write", "prompts", "WRITE on topic '{prompts}'"),
    "rollout answers steps": (Role.ROLLOUT, "write", "results", "WRITE on topic '{results}'"),
    "reward writes weights": (Role.REWARD, "write", "weights", "WRITE on topic '{weights}'"),
    "inference writes trajectories": (Role.INFERENCE, "write", "trajectories",
                                      "WRITE on topic '{trajectories}'"),
    "rollout joins learner's group": (Role.ROLLOUT, "join", "learner",
                                      "READ on group '{prefix}.learner'"),
    "learner joins reward's group": (Role.LEARNER, "join", "reward",
                                     "READ on group '{prefix}.reward'"),
    "rollout uses reward's transactional id": (Role.ROLLOUT, "txn", "reward-0",
                                               "WRITE on transactional id '{prefix}.reward-0'"),
    "rollout reads scored": (Role.ROLLOUT, "read", "scored", "READ on topic '{scored}'"),
}


@pytest.mark.parametrize("case", OUT_OF_ROLE, ids=list(OUT_OF_ROLE))
async def test_a_role_is_refused_outside_its_role_promptly_and_in_one_line(
    secure: SecureCluster, shared_topics: TopicSettings, case: str
) -> None:
    role, action, target, line = OUT_OF_ROLE[case]
    names = Topics(shared_topics)
    fill = {"prefix": shared_topics.prefix, **{k: getattr(names, k) for k in (
        "scored", "weights", "prompts", "results", "trajectories")}}
    bus = bus_of(secure, role, shared_topics)
    try:
        if action == "write":
            attempt = _produce(bus, getattr(names, target), factories.prompt())
        elif action == "txn":  # into its own topic, under another role's transactional id
            attempt = _produce(bus, names.trajectories, factories.prompt(),
                               txn=f"{shared_topics.prefix}.{target}")
        elif action == "join":  # a topic its role reads, under another role's group
            topic = names.prompts if role == Role.ROLLOUT else names.scored
            attempt = _consume(bus, topic, f"{shared_topics.prefix}.{target}")
        else:
            attempt = _consume(bus, getattr(names, target), f"{shared_topics.prefix}.{role}")
        error = await refused(lambda: attempt)
    finally:
        await bus.close()
    assert f"does not allow user '{role}' {line.format(**fill)}" in str(error)


async def test_a_service_with_a_missing_acl_does_not_start(
    secure: SecureCluster, unique_name: Callable[..., str]
) -> None:
    """Reward writes scored only once it has scored something: without that right it must
    stop at start, before it takes any work, not at its first transaction."""
    topics = await make_topics(secure, unique_name("miss"), with_acls=False)
    scored = Topics(topics).scored
    await apply_acls(kafka_as(secure), [r for r in acls(topics) if r.name != scored])
    reward = Reward(RewardSettings(kafka=kafka_as(secure, Role.REWARD), topics=topics))
    error = await refused(reward.run)
    assert f"does not allow user 'reward' WRITE on topic '{scored}'" in str(error)
    assert not reward.ready.is_set()


def test_the_command_says_what_to_fix_in_one_line(
    secure: SecureCluster, shared_topics: TopicSettings, tmp_path: Path
) -> None:
    """``rlbus run`` with another role's credentials: exit at start, one line naming it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_")}
    fields = secure.credentials.fields(secure.bootstrap, Role.ROLLOUT)
    env |= {f"RLBUS_KAFKA__{k.upper()}": str(v) for k, v in fields.items()}
    env |= {"RLBUS_TOPICS__PREFIX": shared_topics.prefix, "RLBUS_TOPICS__PARTITIONS": "1",
            "RLBUS_TOPICS__RESULT_PARTITIONS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "run", "reward"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlbus reward: the broker does not allow user 'rollout' READ on "
                           f"topic '{shared_topics.prefix}.trajectories'"), proc.stderr[-2000:]


# ------------------------------------------------------------------- refused at the door


async def test_wrong_password_is_refused_promptly_naming_the_user(
    secure: SecureCluster, shared_topics: TopicSettings, caplog: pytest.LogCaptureFixture
) -> None:
    bus = bus_of(secure, Role.REWARD, shared_topics, sasl_password="not-the-password")
    try:
        error = await refused(bus.producer, BrokerConnectError)
    finally:
        await bus.close()
    assert "authentication failed for user 'reward'" in str(error)
    # aiokafka raises only "Unable to bootstrap from [...]"; the real cause is in its log
    assert "SaslAuthenticationFailed" in caplog.text


@pytest.mark.parametrize(
    "changes",
    [
        {"security_protocol": "PLAINTEXT"},
        {"security_protocol": "SSL"},  # TLS but no SASL login
        {"security_protocol": "SASL_PLAINTEXT"},  # SASL login but no TLS
        {"ssl_cafile": None},  # the system CAs do not trust our broker
        {"ssl_cafile": "other-ca"},  # a CA that did not sign the broker's certificate
        {"sasl_mechanism": "SCRAM-SHA-256"},  # a mechanism the broker does not enable
    ],
    ids=["plaintext", "tls-only", "sasl-only", "untrusted-ca", "other-ca", "sha-256"],
)
async def test_other_client_security_is_refused_promptly(
    secure: SecureCluster, shared_topics: TopicSettings, changes: dict[str, Any], tmp_path: Path
) -> None:
    if changes.get("ssl_cafile") == "other-ca":
        changes = {"ssl_cafile": make_certificates(tmp_path, ca_name="another CA").ca}
    kafka = kafka_as(secure, Role.REWARD, **changes)
    reward = Reward(RewardSettings(kafka=kafka, topics=shared_topics))
    await refused(reward.run, BrokerConnectError)


# ------------------------------------------------- training with every role's own principal


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


async def _forge(secure: SecureCluster, topics: TopicSettings) -> None:
    """What a compromised tier would send outside its role: every send is refused."""
    names = Topics(topics)
    forged_score = factories.scored("forged/0", reward=100.0)
    forged_weights = WeightVersion(model="policy", version=99, uri="/tmp/evil", checksum="0",
                                   step=99)
    forged_answer = StepResult(**{**factories.step_result().model_dump(),
                                  "request_id": "forged/0/0/t0"})
    tries: list[tuple[Role, str, Any]] = [
        (Role.ROLLOUT, names.scored, forged_score),  # agent code scoring itself
        (Role.INFERENCE, names.scored, forged_score),
        (Role.ROLLOUT, names.weights, forged_weights),
        (Role.REWARD, names.weights, forged_weights),
        (Role.REWARD, names.results, forged_answer),  # answering another's model call
        (Role.ROLLOUT, names.results, forged_answer),
    ]
    for role, topic, message in tries:
        bus = bus_of(secure, role, topics)
        try:
            await refused(lambda bus=bus, topic=topic, message=message: _produce(
                bus, topic, message))
        finally:
            await bus.close()


async def test_training_runs_with_every_role_as_its_own_principal_and_forgeries_go_nowhere(
    secure: SecureCluster, unique_name: Callable[..., str], tiny_model: Path, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pipeline trains under ACLs; what a compromised tier sends outside its role is
    refused and never trained on; no password is in any log, the broker's and `rlbus
    status`'s included."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="aiokafka.conn")  # where the SASL login happens
    topics = await make_topics(secure, unique_name("run"), partitions=2, result_partitions=2)
    await _forge(secure, topics)

    s = settings(tiny_model, tmp_path, {"topics": topics}, max_staleness=0, max_steps=2)
    for role, service in s.items():
        service.kafka = kafka_as(secure, role)  # the bus, and its start-up check, use it
    out = await run_pipeline(s, lambda role: KafkaBus(
        kafka_as(secure, role), dlq_topic=Topics(topics).dlq, service=role))
    learner, (inference, reward, rollout) = out["learner"], out["others"]

    assert learner.step == 2
    assert sorted(learner.assembler.trained_ids()) == ["run/0", "run/1", "run/2", "run/3"]
    ledger = [episode for step in learner.ledger for episode in step]
    assert len(ledger) == 16 and not [e for e in ledger if e.startswith("forged")]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["episodes"] for r in rows] == [8, 8] and [r["masked"] for r in rows] == [0, 0]
    assert 1 <= inference.engine.version <= 2  # the learner's weights, never version 99
    assert reward.handled == 16
    assert rollout.counters.get("unsolicited_replies", 0) == 0

    status = Console(file=io.StringIO(), width=120)
    assert await status_command(kafka_as(secure), Topics(topics), True, 1.0, status) == 0
    shown = status.file.getvalue()
    assert "trajectories.scored" in shown

    logs = shown + caplog.text + "".join(
        p.read_text(errors="replace") for p in secure.cluster.log_path(0).parent.iterdir())
    assert "Authenticated as inference via SCRAM-SHA-512" in logs  # the logs were captured
    leaked = [role for role, password in secure.passwords.items() if password in logs]
    assert not leaked, f"the password of {leaked} is in a log"
