"""rlbus.integrations.trl without TRL's trainer or a broker: episodes as TRL's rows, and the
rollout function over a client on the in-memory bus, with the test playing rollout and
reward (it answers each prompt with scored episodes) and TRL (it calls the function as
``GRPOTrainer._generate`` does: a trainer with ``args``, ``state``, ``model``,
``processing_class`` and ``callback_handler``)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbus import plugins
from rlbus.client import (
    ClientSettings,
    Episode,
    PluginError,
    Position,
    SyncRolloutClient,
    WeightsMismatchError,
)
from rlbus.codec import decode
from rlbus.integrations.trl import (
    PLACEHOLDER,
    POSITION_FILE,
    RlbusRollouts,
    episode_row,
    groups_per_step,
    load_position,
    lockstep_prompt,
    mask_cause,
    rlbus_reward,
    shape_of,
)
from rlbus.messages import Prompt, ScoredTrajectory, Trajectory, Turn
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBroker, MemoryBus

TOPICS = TopicSettings(prefix="trl", partitions=2, result_partitions=1)
T = Topics(TOPICS)
PAD, VOCAB = 0, 100


def multi_turn(group_id: str = "run/0", index: int = 0, version: int = 0,
               status: str = "ok", size: int = 2) -> Trajectory:
    """Two turns: prompt [10 11 12], completion [20 21], observation [30], completion [22 2]."""
    turns = [Turn(input_ids=[10, 11, 12], completion_ids=[20, 21], logprobs=[-0.1, -0.2],
                  policy_version=version, action="7", observation="higher"),
             Turn(input_ids=[30], completion_ids=[22 + index, 2], logprobs=[-0.3, -0.4],
                  policy_version=version, action="9")]
    return Trajectory(episode_id=f"{group_id}/{index}", group_id=group_id, index=index,
                      group_size=size, task="guess_number", spec={"target": 9}, turns=turns,
                      status=status)  # type: ignore[arg-type]


def episode(t: Trajectory, reward: float = 1.0, valid: bool = True) -> Episode:
    return Episode.of(ScoredTrajectory(trajectory=t, reward=reward, valid=valid), {})


# -- episodes as rows


def test_a_multi_turn_episode_is_one_row_split_after_its_first_input() -> None:
    row = episode_row(episode(multi_turn(), reward=0.5), pad_id=PAD)
    assert row.prompt_ids == [10, 11, 12]
    assert row.completion_ids == [20, 21, 30, 22, 2]  # completions and observation, as sampled
    assert row.env_mask == [1, 1, 0, 1, 1]  # the observation is the environment's
    assert row.logprobs == [-0.1, -0.2, 0.0, -0.3, -0.4]
    assert (row.reward, row.masked, row.episode_id, row.spec) == (0.5, None, "run/0/0",
                                                                  {"target": 9})


@pytest.mark.parametrize(("trajectory", "valid", "version", "cause"), [
    (multi_turn(status="failed"), False, 0, "failed"),
    (multi_turn(), False, 0, "invalid"),  # the verifier failed
    (multi_turn(version=0), True, 2, "stale"),  # max_staleness 1
    (multi_turn(), True, 1, None),
])
def test_what_rlbus_would_not_train_is_masked_and_unscored(
        trajectory: Trajectory, valid: bool, version: int, cause: str | None) -> None:
    e = episode(trajectory, valid=valid)
    assert mask_cause(e, version=version, max_staleness=1, vocab_size=VOCAB) == cause
    row = episode_row(e, pad_id=PAD, cause=cause)
    if cause is None:
        assert sum(row.env_mask) == 4 and row.reward == 1.0
    else:
        assert set(row.env_mask) == {0} and row.reward is None and row.masked == cause
        assert row.completion_ids == [20, 21, 30, 22, 2]  # kept: TRL's tensors stay aligned


def test_a_token_past_the_vocabulary_is_masked_and_replaced_by_the_pad_id() -> None:
    e = episode(multi_turn(index=VOCAB))  # its last completion holds id 22 + 100
    cause = mask_cause(e, version=0, max_staleness=0, vocab_size=VOCAB)
    row = episode_row(e, pad_id=PAD, cause=cause, vocab_size=VOCAB)
    assert cause == "out_of_vocabulary" and row.completion_ids == [20, 21, 30, PAD, 2]
    assert set(row.env_mask) == {0}


def test_a_failed_episode_with_no_turn_still_gives_tensors_to_train_nothing_on() -> None:
    t = multi_turn().failed_stand_in("dead-lettered")
    e = Episode.of(ScoredTrajectory.failed_stand_in(t, "x"), {})
    row = episode_row(e, pad_id=PAD, cause=mask_cause(e, version=0, max_staleness=0))
    assert (row.prompt_ids, row.completion_ids, row.env_mask, row.logprobs) == (
        [PAD], [PAD], [0], [0.0])
    assert row.masked == "failed"


def segmented(t: Trajectory) -> Trajectory:
    """``t`` with its second turn's context trimmed to its own input: two segments."""
    first, second = t.turns
    return t.model_copy(update={"turns": [first, second.model_copy(
        update={"input_ids": [10, 30], "fresh_context": True})]})


def test_an_episode_of_several_segments_is_masked_never_concatenated() -> None:
    e = episode(segmented(multi_turn()))
    assert mask_cause(e, version=0, max_staleness=0, vocab_size=VOCAB) == "segmented"
    assert mask_cause(episode(segmented(multi_turn(status="failed")), valid=False),
                      version=0, max_staleness=0) == "failed"  # the first cause wins
    for cause in ("segmented", None):  # masked even by a caller that says it trains
        row = episode_row(e, pad_id=PAD, cause=cause, vocab_size=VOCAB)
        assert (row.prompt_ids, row.completion_ids) == ([10, 11, 12], [20, 21])  # 1st segment
        assert set(row.env_mask) == {0} and row.reward is None and row.masked == "segmented"


def test_rlbus_reward_passes_the_reward_tiers_rewards_through() -> None:
    assert rlbus_reward([], [], [], rlbus_reward=[1.0, None]) == [1.0, None]
    with pytest.raises(ValueError, match="RlbusRollouts"):
        rlbus_reward(["p"], ["c"], [[1]])


# -- TRL's config


def config(**overrides: Any) -> SimpleNamespace:
    """The GRPOConfig fields the adapter reads (a real one is checked below)."""
    base = dict(world_size=1, num_generations=2, generation_batch_size=4,
                steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1,
                temperature=1.0, top_p=1.0, max_completion_length=8)
    return SimpleNamespace(**{**base, **overrides})


def test_the_shape_of_trls_calls_and_the_pace_it_asks_of_the_client() -> None:
    assert groups_per_step(config()) == 2
    # 2 accumulation steps per generation, each batch used twice: 4 optimizer steps of 2
    c = config(generation_batch_size=16, steps_per_generation=4, num_iterations=2,
               gradient_accumulation_steps=2)
    assert (shape_of(c).groups, shape_of(c).steps, groups_per_step(c)) == (8, 4, 2)
    with pytest.raises(ValueError, match="multiple of gradient_accumulation_steps"):
        shape_of(config(steps_per_generation=1, gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="one process"):
        shape_of(config(world_size=2))


def test_a_real_grpo_config_has_what_the_adapter_reads(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl", reason="the trl extra: pip install 'rlbus[trl]'")
    c = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                       num_generations=2, report_to="none")
    assert groups_per_step(c) == 2 and shape_of(c).group_size == 2


# -- the rollout function over the in-memory bus


@pytest.fixture
def broker() -> MemoryBroker:
    return memory_broker(TOPICS)


@pytest.fixture
def client(broker: MemoryBroker, tmp_path: Path) -> Iterator[SyncRolloutClient]:
    settings = ClientSettings(topics=TOPICS, groups_per_step=2, max_staleness=1,
                              straggler_wait_s=0, weights_dir=tmp_path / "weights")
    with SyncRolloutClient(settings, MemoryBus(broker, dlq_topic=T.dlq)) as c:
        yield c


class FakeTrainer:
    """What TRL's GRPOTrainer shows a rollout_func, after its optimizer steps."""

    def __init__(self, rollouts: RlbusRollouts, **overrides: Any) -> None:
        self.args = config(**overrides)
        self.state = SimpleNamespace(global_step=0)
        embeddings = SimpleNamespace(num_embeddings=VOCAB)
        self.model = SimpleNamespace(training=True, get_input_embeddings=lambda: embeddings)
        self.processing_class = SimpleNamespace(pad_token_id=PAD)
        self.callback_handler = SimpleNamespace(callbacks=[rollouts.callback])

    def step(self, rollouts: RlbusRollouts, weights: dict[str, torch.Tensor]) -> None:
        self.state.global_step += 1
        rollouts.callback.on_step_end(self.args, self.state, None, model=weights)

    def call(self, rollouts: RlbusRollouts, rows: int = 4) -> dict[str, list[Any]]:
        return rollouts([PLACEHOLDER] * rows, self)


def prompts(broker: MemoryBroker) -> list[Prompt]:
    """The prompts sent, in the order sent (group ids end in the client's count)."""
    sent = [decode(r.value, Prompt) for part in broker.logs.get(T.prompts, []) for r in part]
    return sorted(sent, key=lambda p: int(p.group_id.rsplit("/", 1)[1]))


def answer(client: SyncRolloutClient, broker: MemoryBroker, group_ids: list[str],
           version: int = 0, reversed_members: bool = True,
           split: frozenset[str] = frozenset()) -> None:
    """Play rollout and reward: score every member of each group (members out of order);
    the episodes named in ``split`` have two segments."""
    async def send() -> None:
        producer = await MemoryBus(broker).producer()
        for p in (p for p in prompts(broker) if p.group_id in group_ids):
            members = range(p.group_size)
            for i in reversed(members) if reversed_members else members:
                t = multi_turn(p.group_id, i, version=version, size=p.group_size)
                t = t.model_copy(update={"spec": p.spec, "task": p.task})
                t = segmented(t) if t.episode_id in split else t
                scored = ScoredTrajectory(trajectory=t, reward=float(i))
                await producer.send(T.scored, scored, key=p.group_id)

    client.run(send())


def test_decoupled_rows_are_whole_groups_in_trls_order_from_the_task(
        client: SyncRolloutClient, broker: MemoryBroker) -> None:
    rollouts = RlbusRollouts(client, "guess_number", spec={"max_turns": 2}, seed=7)
    trainer = FakeTrainer(rollouts)
    rollouts.begin(trainer.args, 0)
    sent = prompts(broker)
    # the credit window, filled at train begin: (max_staleness 1 + 0 + 1) x 2 groups
    assert [p.group_id for p in sent] == ["run/0", "run/1", "run/2", "run/3"]
    assert {p.spec["max_turns"] for p in sent} == {2} and sent[0].sampling.max_new_tokens == 8
    task = plugins.task("guess_number")  # the n-th spec from seed <seed>/<n>, as the learner's
    assert [p.spec for p in sent] == [{**task.sample(random.Random(f"7/{i}")), "max_turns": 2}
                                      for i in range(4)]
    answer(client, broker, ["run/1", "run/0"])

    out = trainer.call(rollouts)
    assert out["rlbus_episode_id"] == ["run/0/0", "run/0/1", "run/1/0", "run/1/1"]
    assert out["rlbus_group_id"][::2] == out["rlbus_group_id"][1::2]  # members contiguous
    assert out["prompt_ids"] == [[10, 11, 12]] * 4
    assert out["env_mask"][0] == [1, 1, 0, 1, 1]
    assert out["rlbus_reward"] == [0.0, 1.0, 0.0, 1.0]  # by member index, as scored
    assert out["rlbus_spec"][0] == sent[0].spec and out["rlbus_task"][0] == "guess_number"
    assert {"prompt_ids", "completion_ids", "logprobs"} <= out.keys()


def test_a_segmented_episode_is_a_masked_row_counted_and_logged(
        client: SyncRolloutClient, broker: MemoryBroker,
        caplog: pytest.LogCaptureFixture) -> None:
    rollouts = RlbusRollouts(client, "guess_number")
    trainer = FakeTrainer(rollouts)
    rollouts.begin(trainer.args, 0)
    answer(client, broker, ["run/0", "run/1"], split=frozenset({"run/1/0"}))
    out = trainer.call(rollouts)
    assert out["rlbus_masked"] == [None, None, "segmented", None]
    assert out["rlbus_reward"][2] is None and set(out["env_mask"][2]) == {0}
    assert rollouts.counters["masked_segmented"] == 1 and rollouts.counters["trained_rows"] == 3
    assert "masked 1 of 4 episodes with several token sequences" in caplog.text
    assert "run/1/0" in caplog.text


def test_a_trainer_that_stops_calling_gets_nothing_submitted_past_the_credit_window(
        client: SyncRolloutClient, broker: MemoryBroker) -> None:
    rollouts = RlbusRollouts(client, "guess_number")
    trainer = FakeTrainer(rollouts)
    rollouts.begin(trainer.args, 0)
    answer(client, broker, [f"run/{i}" for i in range(4)])
    trainer.call(rollouts)
    for _ in range(3):  # more calls, no optimizer step: no version, no credit
        assert rollouts.top_up() == 0
    assert len(prompts(broker)) == 4
    trainer.step(rollouts, {"w": torch.zeros(2)})  # a version: two more groups admitted
    assert [p.group_id for p in prompts(broker)][4:] == ["run/4", "run/5"]
    assert client.client.version == 1 and prompts(broker)[-1].min_version == 1


def test_weights_of_another_shape_fail_the_step_that_made_them(
        client: SyncRolloutClient, broker: MemoryBroker) -> None:
    rollouts = RlbusRollouts(client, "guess_number")
    trainer = FakeTrainer(rollouts)
    rollouts.begin(trainer.args, 0)
    trainer.step(rollouts, {"w": torch.zeros(2)})
    with pytest.raises(WeightsMismatchError, match=r"w: shape \[3\]") as caught:
        trainer.step(rollouts, {"w": torch.zeros(3)})
    assert "TRL's model after optimizer step 2" in "\n".join(caught.value.__notes__)
    assert client.client.version == 1  # nothing published


def test_an_unknown_task_is_refused_before_training_starts(client: SyncRolloutClient) -> None:
    with pytest.raises(PluginError, match="no_such_task"):
        RlbusRollouts(client, "no_such_task")
    with pytest.raises(PluginError, match="no_such_task"):
        lockstep_prompt("no_such_task", {})


def test_a_client_paced_for_another_config_or_no_callback_is_refused(
        client: SyncRolloutClient) -> None:
    rollouts = RlbusRollouts(client, "guess_number")
    with pytest.raises(ValueError, match="groups_per_step is 2; this GRPOConfig trains 4"):
        rollouts.begin(config(generation_batch_size=8), 0)
    trainer = FakeTrainer(rollouts)
    trainer.callback_handler.callbacks = []
    with pytest.raises(ValueError, match=r"callbacks=\[rollouts\.callback\]"):
        trainer.call(rollouts)


def test_lockstep_rolls_out_trls_own_prompts_in_its_order(
        client: SyncRolloutClient, broker: MemoryBroker) -> None:
    rollouts = RlbusRollouts(client)
    trainer = FakeTrainer(rollouts)
    asked = [lockstep_prompt("guess_number", {"target": t}) for t in (5, 3)]

    def play_rollout() -> None:  # answers once the call has submitted both groups
        deadline = time.monotonic() + 10
        while len(prompts(broker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        answer(client, broker, ["run/1", "run/0"])

    player = threading.Thread(target=play_rollout)
    player.start()
    out = rollouts([asked[0], asked[0], asked[1], asked[1]], trainer)
    player.join()
    assert [p.spec for p in prompts(broker)] == [{"target": 5}, {"target": 3}]
    assert out["rlbus_group_id"] == ["run/0", "run/0", "run/1", "run/1"]
    assert out["rlbus_spec"] == [{"target": 5}] * 2 + [{"target": 3}] * 2
    with pytest.raises(ValueError, match="lockstep_prompt"):
        rollouts(["what is 2 + 2?"] * 4, trainer)


def test_a_checkpoint_holds_the_position_of_the_groups_trained_by_its_step(
        client: SyncRolloutClient, broker: MemoryBroker, tmp_path: Path) -> None:
    rollouts = RlbusRollouts(client, "guess_number")
    trainer = FakeTrainer(rollouts)
    rollouts.begin(trainer.args, 0)
    answer(client, broker, [f"run/{i}" for i in range(4)])
    trainer.call(rollouts)  # takes run/0 and run/1, trained by step 1
    folder = tmp_path / "checkpoint-0"
    assert rollouts.save_position(folder, 0).taken == []  # not trained yet at step 0
    trainer.step(rollouts, {"w": torch.zeros(2)})
    rollouts.callback.on_save(SimpleNamespace(output_dir=str(tmp_path)), trainer.state, None)
    saved = load_position(tmp_path / "checkpoint-1")
    assert saved is not None and saved.taken == ["run/0", "run/1"]
    assert (saved.submitted, saved.steps, saved.version) == (6, 1, 1)
    assert json.loads((tmp_path / "checkpoint-1" / POSITION_FILE).read_text())["steps"] == 1
    assert load_position(tmp_path / "nowhere") is None and load_position(None) is None
    assert isinstance(saved, Position)
