"""The extension API: discovery by entry point and import string, the default agent's tools,
and verifiers in killable worker processes."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from rlbus import plugins
from rlbus.agent import MultiTurnAgent, parse_tool_call
from rlbus.api import Env, Episode, Generation, StepOutcome, Task, TaskSpec, Tool, Verdict, Verifier
from rlbus.messages import DeadLetter, Prompt, Sampling, Trajectory
from rlbus.reward.pool import VerifierFailed, VerifierPool
from rlbus.rollout.service import Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBus
from tests import factories
from tests.polling import wait_until

TOPICS = TopicSettings(prefix="ext", partitions=1, result_partitions=1)
T = Topics(TOPICS)


@pytest.fixture(autouse=True)
def _fresh_plugins():
    plugins.load.cache_clear()
    yield
    plugins.load.cache_clear()


# ------------------------------------------------------------------------------- discovery


def test_builtins_come_through_entry_points():
    assert {"guess_number", "addition", "python_tests", "synthetic"} <= set(
        plugins.installed("task"))
    assert "multi_turn" in plugins.installed("agent")
    assert {"exact_match", "numeric", "python_tests"} <= set(plugins.installed("verifier"))
    assert plugins.task("guess_number") is plugins.task("guess_number")  # cached, one instance
    assert plugins.task("rlbus.tasks:addition") is plugins.task("addition")


def test_unknown_and_malformed_references_say_what_exists():
    with pytest.raises(plugins.PluginError, match=r"no task named 'nope'.*guess_number"):
        plugins.task("nope")
    with pytest.raises(plugins.PluginError, match="not an import string"):
        plugins.task("rlbus.tasks:")
    with pytest.raises(plugins.PluginError, match="has no attribute"):
        plugins.task("rlbus.tasks:missing")
    with pytest.raises(plugins.PluginError, match="not a Task"):
        plugins.task("rlbus.tasks:exact_match")  # a function, not a task


def _broken_distribution(root: Path) -> None:
    """An installed package whose task entry point raises at import, line 2."""
    (root / "broken_plugin.py").write_text("import os\nraise RuntimeError('no GPU here')\n")
    info = root / "broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlbus.tasks]\nbroken = broken_plugin:Task\n")


def test_a_plugin_that_fails_to_import_names_its_entry_point_and_line(tmp_path, monkeypatch):
    _broken_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(plugins.PluginError) as err:
        plugins.check_all("task")
    text = str(err.value)
    assert "task 'broken'" in text and "broken_plugin:Task" in text and "rlbus.tasks" in text
    assert "RuntimeError: no GPU here" in text and "broken_plugin.py:2" in text


async def test_rollout_refuses_to_start_with_a_broken_plugin(tmp_path, monkeypatch):
    _broken_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rollout = Rollout(RolloutSettings(topics=TOPICS, tokenizer="synthetic"),
                      MemoryBus(memory_broker(TOPICS)))
    with pytest.raises(plugins.PluginError, match="entry point 'broken_plugin:Task'"):
        await rollout.run()


async def test_prompts_naming_unknown_or_broken_tasks_are_dead_lettered(tmp_path, monkeypatch):
    (tmp_path / "half_written.py").write_text("def task(:\n")  # a syntax error
    monkeypatch.syspath_prepend(str(tmp_path))
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    spec = plugins.task("guess_number").sample(random.Random(0))
    for group, task in (("a", "no_such_task"), ("b", "half_written:task"),
                        ("c", "guess_number")):
        await producer.send(T.prompts, Prompt(group_id=group, task=task, spec=spec,
                                              group_size=1))
    from rlbus.inference.service import Inference
    from rlbus.inference.settings import InferenceSettings

    rollout = Rollout(RolloutSettings(topics=TOPICS, tokenizer="synthetic"),
                      MemoryBus(broker, dlq_topic=T.dlq))
    inference = Inference(InferenceSettings(topics=TOPICS, engine="synthetic"),
                          MemoryBus(broker))
    runs = [asyncio.create_task(s.run()) for s in (rollout, inference)]
    try:
        async with asyncio.timeout(20):
            while len(broker.logs.get(T.trajectories, [[]])[0]) < 1:  # noqa: ASYNC110 - polls a log
                await asyncio.sleep(0.05)
    finally:
        for s in (rollout, inference):
            s.request_stop("test over")
        await asyncio.gather(*runs)
    from rlbus.codec import decode

    letters = [decode(r.value, DeadLetter) for r in broker.logs[T.dlq][0]]
    assert len(letters) == 2
    assert "no task named 'no_such_task'" in letters[0].error
    assert {letter.reason for letter in letters} == {"unknown_plugin"}
    assert "importing 'half_written'" in letters[1].error
    assert "SyntaxError" in letters[1].error
    assert broker.groups["ext.rollout"].committed[(T.prompts, 0)] == 3  # nothing left behind


# ----------------------------------------------------------------------------------- tools


async def _slow_tool() -> str:
    await asyncio.sleep(60)
    return "never"


def _add(a: int, b: int) -> int:
    return a + b


def _broken() -> str:
    raise KeyError("calculator offline")


class ToolEnv(Env):
    tools = (
        Tool("add", "a + b", _add, {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}}),
        Tool("slow", "hangs", _slow_tool),
        Tool("broken", "raises", _broken),
    )

    async def reset(self, spec: TaskSpec) -> str:
        return "use the tools"

    async def step(self, action: str) -> StepOutcome:
        return StepOutcome("done", 1.0, True)


class ToolTask(Task):
    name = "tool_task"
    max_turns = 8

    def sample(self, rng: random.Random) -> TaskSpec:
        return {}

    def make_env(self) -> Env:
        return ToolEnv()

    def score(self, spec: TaskSpec, actions: Sequence[str]) -> float:
        return 1.0


class ScriptedPolicy:
    """Answers with the next scripted action, tokenised as the synthetic tokenizer would
    not round-trip them: ids are indices into the script."""

    def __init__(self, actions: list[str]) -> None:
        self.actions = actions
        self.contexts: list[list[int]] = []

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        self.contexts.append(list(input_ids))
        return Generation([len(self.contexts) - 1], [-0.5], policy_version=3)


class ScriptTokenizer:
    def __init__(self, policy: ScriptedPolicy) -> None:
        self.policy = policy
        self.seen: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.seen.append(text)
        return [1000 + len(self.seen)]

    def decode(self, ids: list[int]) -> str:
        return self.policy.actions[ids[0]]


async def test_default_agent_runs_tools_and_records_every_call():
    actions = [
        'let me add <tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>',
        '<tool_call>{"name": "slow", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "broken"}</tool_call>',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
        "<tool_call>{not json}</tool_call>",
        "the answer is 42",
    ]
    policy = ScriptedPolicy(actions)
    tokenizer = ScriptTokenizer(policy)
    task = ToolTask()
    episode = Episode(task=task, spec={}, env=task.make_env(), policy=policy,
                      tokenizer=tokenizer, sampling=Sampling(max_new_tokens=4),
                      max_context_tokens=1000, timeout_s=0.3)
    # a safety net far below the hanging tool's 60 s; "timed out after 0.3s" below says the
    # tool was cut off at its own timeout
    async with asyncio.timeout(30):
        await MultiTurnAgent().run(episode)
    turns = episode.turns
    assert len(turns) == 7
    assert "# tools" in tokenizer.seen[0] and '"name": "add"' in tokenizer.seen[0]
    calls = [t.tool_call for t in turns]
    assert calls[0] is not None and calls[0].result == "42" and calls[0].error is None
    assert turns[0].observation == "42" and calls[0].arguments == {"a": 2, "b": 40}
    assert "timed out after 0.3s" in (calls[1].error or "")
    assert "KeyError" in (calls[2].error or "") and "calculator offline" in calls[2].error
    assert "unknown tool 'nope'" in (calls[3].error or "")
    assert "TypeError" in (calls[4].error or "")  # a missing argument
    assert "not valid JSON" in (calls[5].error or "")
    assert all(t.observation.startswith("error: ") for t in turns[1:6])
    assert calls[6] is None and turns[6].observation == "done" and turns[6].env_reward == 1.0
    # the context the policy saw is exactly the recorded ids, in order
    last = policy.contexts[-1]
    expected: list[int] = []
    for t in turns[:-1]:
        expected += t.input_ids + t.completion_ids
    assert last == expected + turns[-1].input_ids
    assert {t.policy_version for t in turns} == {3}


def test_tool_calls_are_only_parsed_from_the_tag():
    assert parse_tool_call("no call here") is None
    assert parse_tool_call('<tool_call>{"name": "x", "arguments": {"k": 1}}</tool_call>') == (
        "x", {"k": 1})
    assert "object" in str(parse_tool_call('<tool_call>{"name": "x", "arguments": 3}'
                                           "</tool_call>"))


async def test_a_trajectory_with_tool_calls_round_trips_the_codec():
    from rlbus.codec import decode, encode
    from rlbus.messages import ToolCall, Turn

    turn = Turn(input_ids=[1], completion_ids=[2], logprobs=[-0.1], policy_version=0,
                tool_call=ToolCall(name="add", arguments={"a": 1}, result="2", seconds=0.01))
    t = factories.trajectory("g").model_copy(update={"turns": [turn]})
    assert decode(encode(t), Trajectory).turns[0].tool_call == turn.tool_call


# ------------------------------------------------------------------------------- verifiers


class SlowVerifier(Verifier):
    async def verify(self, trajectory: Trajectory) -> Verdict:
        if trajectory.spec.get("slow"):
            # a child process too: the kill must take it along
            proc = await asyncio.create_subprocess_exec("sleep", "60")
            await asyncio.to_thread(Path(trajectory.spec["pidfile"]).write_text,
                                    f"{os.getpid()} {proc.pid}")
            await proc.wait()
        return Verdict(0.5, info={"checked": True})


SLOW = SlowVerifier()


async def test_a_hung_verifier_is_killed_with_its_children_and_blocks_nobody(tmp_path):
    pool = VerifierPool(workers=2, timeout_s=1.0)
    pool.start()
    try:
        pidfile = tmp_path / "pids"
        slow = factories.trajectory("slow").model_copy(update={"spec": {
            "verifier": f"{__name__}:SLOW", "slow": True, "pidfile": str(pidfile)}})
        fast = [factories.trajectory(f"fast{i}").model_copy(
            update={"spec": {"verifier": f"{__name__}:SLOW"}}) for i in range(5)]
        # both workers up and the verifier imported: the 1 s deadline below then covers the
        # five fast calls only, not two interpreters starting on a loaded machine
        await asyncio.gather(*(pool.verify(t) for t in fast[:2]))
        hung = asyncio.create_task(pool.verify(slow))
        results = await asyncio.gather(*(pool.verify(t) for t in fast))
        assert not hung.done()  # scored while the slow one was still running
        assert [r[1:] for r in results] == [(0.5, True, {"checked": True})] * 5
        with pytest.raises(VerifierFailed, match="TimeoutError"):
            await hung
        worker, child = (int(x) for x in pidfile.read_text().split())
        await wait_until(lambda: not any(_alive(pid) for pid in (worker, child)),
                         "the verifier and its child are killed")
        assert pool.killed == 1
        # the pool is whole again
        assert (await pool.verify(fast[0]))[1] == 0.5
    finally:
        pool.close()


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: killed, not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return False
    return "zombie" not in state


def test_a_service_naming_a_missing_plugin_exits_with_one_clear_line():
    import subprocess
    import sys

    from rlbus.processes import child_env

    done = subprocess.run(
        [sys.executable, "-m", "rlbus.ops.cli", "run", "learner"],
        env=child_env({"RLBUS_TASK": "nope", "RLBUS_TRAINER": "synthetic"}),
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "rlbus learner: no task named 'nope': installed tasks are [" in done.stderr
    assert "Traceback" not in done.stderr


def test_verifier_workers_never_rerun_the_callers_main_module(tmp_path):
    """multiprocessing's start methods import the caller's __main__ in every worker: a
    script without a main guard that embeds the reward tier would re-run itself there (its
    verifiers hung). The workers are plain `python -m` processes instead."""
    import subprocess
    import sys

    script = tmp_path / "embed.py"
    script.write_text(
        "import asyncio\n"
        "from rlbus.reward.pool import VerifierPool\n"
        "from tests import factories\n"
        "print('main module ran', flush=True)\n"
        "async def main():\n"
        "    pool = VerifierPool(workers=1, timeout_s=20)\n"
        "    pool.start()\n"
        "    t = factories.trajectory('g').model_copy(update={'spec': {\n"
        "        'verifier': 'exact_match', 'answer': 'x'}})\n"
        "    print(await pool.verify(t), flush=True)\n"
        "    pool.close()\n"
        "asyncio.run(main())\n")  # no `if __name__ == "__main__"` guard, on purpose
    root = str(Path(__file__).resolve().parents[3])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": root},
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("main module ran") == 1, done.stdout
    assert "('exact_match', " in done.stdout
