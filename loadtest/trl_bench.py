"""``python -m loadtest.trl_bench``: TRL's GRPOTrainer generating by itself vs through rlbus.

    python -m loadtest.trl_bench                  # long_tail, 12 steps per arm, about 5 minutes
    python -m loadtest.trl_bench --steps 40 --max-staleness 2
    python -m loadtest.trl_bench --smoke --out DIR   # the smoke scenario, 4 steps: no timing

Side by side in one run: the same tiny chat model (:func:`rlbus.learner.chat_model.
build_chat_model`, built here, no download; both arms start from its saved weights), the
same task and environment latency (a scenario's synthetic environment: ``long_tail`` is
lognormal steps, median 60 ms, p99 33x the median, 2-10 turns), the same ``GRPOConfig``
(``groups_per_step x group_size`` episodes per optimizer step, ``max_completion_length`` the
scenario's ``max_new_tokens`` per turn), the same reward function (:func:`rlbus_reward`):

- **trl alone**: GRPOTrainer generating with its own model. TRL has no multi-turn loop for
  an rlbus task, so :class:`LockstepRollouts` is its ``rollout_func``: it plays the
  generation batch's episodes in the trainer's process, all at once, turn by turn (one
  ``generate`` over every episode still running, then each episode's environment step),
  and returns when the slowest episode ends. The episodes are played by rlbus's own agent
  (:class:`~rlbus.agent.MultiTurnAgent`) and tokenizer class, the tokens sampled by rlbus's
  hf engine code wrapped round the trainer's model, the rows made by the adapter's own
  functions: the two arms differ only in where and when episodes run.
- **trl + rlbus**: GRPOTrainer with :class:`~rlbus.integrations.trl.RlbusRollouts`,
  decoupled: rollout, inference (hf engine, the same model) and reward as processes over
  Kafka, groups in flight while TRL trains, weights published after every optimizer step,
  trained up to ``max_staleness`` versions old (the scenario's, or ``--max-staleness``).

Both arms play the same episodes: group ``i``'s spec is drawn from seed ``0/i`` as the
adapter draws it, and the synthetic environment's plan (turns, step latencies) follows from
the spec and the episode's place in its group.

Counted: samples that trained, i.e. rows of the batch TRL computes its loss on with at least
one token in the loss mask (``completion_mask x env_mask``); masked rows (failed, stale) are
counted apart. Rates are over a steady window: from the end of the warm-up steps (the
scenario's ``warmup_steps``: rlbus's pipeline filling up) to the last step. No drain is left
out: the adapter keeps submitting up to the credit window until TRL stops calling.

Starts a local Kafka broker unless ``RLBUS_KAFKA_BOOTSTRAP`` names one, and stops it and
every process on the way out, also on failure or SIGTERM. Prints one table; writes
``results.json`` (every figure, per-step rows, the machine) and ``trained_over_time.png``
into ``--out`` (default ``runs/trl-bench-<time>``), and the services' logs under it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.fleet import Fleet, FleetError, rollout_env
from loadtest.scenario import Scenario, load
from rlbus import api
from rlbus.agent import MultiTurnAgent
from rlbus.messages import Sampling, ScoredTrajectory, Trajectory
from rlbus.settings import settings_env
from rlbus.synthetic import SyntheticTask, episode_plan

ARMS = ("trl", "rlbus")
LABELS = {"trl": "trl alone", "rlbus": "trl + rlbus"}
TASK = "synthetic"
"""The scenario's environment is rlbus's synthetic task: its turns and step latencies
follow a plan drawn from the spec, not from what the random model says, so both arms do
the same work; its observations are plain words ("ok ok ok ok"), which the chat model's
byte-level tokenizer encodes like any text."""


def say(text: str) -> None:
    print(f"[trl-bench] {text}", flush=True)


@dataclass(frozen=True)
class Bench:
    """Everything both arms share."""

    scenario: Scenario
    steps: int
    max_staleness: int
    model: Path
    out: Path

    @property
    def episodes_per_step(self) -> int:
        return self.scenario.batch

    def spec(self, group: int) -> api.TaskSpec:
        """Group ``group``'s spec, drawn as :class:`RlbusRollouts` draws it (its seed 0)."""
        return {**SyntheticTask().sample(random.Random(f"0/{group}")), **self.scenario.env}


# -- what a trainer did, step by step


@dataclass
class Meter:
    """One arm's trainer, step by step: filled by :class:`Metered`, :func:`counting_trainer`
    and :class:`StepClock`."""

    t0: float = 0.0
    trained: int = 0
    """Rows that entered the loss (at least one token in its mask), so far."""
    masked: int = 0
    """Rows that reached TRL and did not (every token masked), so far."""
    advantaged: int = 0
    """Of the trained rows, those with a non-zero advantage (a zero one moves nothing)."""
    wait_s: float = 0.0
    """Seconds inside ``rollout_func`` during the current step."""
    staleness: list[int] = field(default_factory=list)
    """Staleness of each trained row of the current step (trainer step - sampling version)."""
    rows: list[dict[str, Any]] = field(default_factory=list)

    def step_done(self, step: int) -> None:
        self.rows.append({
            "step": step, "time": round(time.monotonic() - self.t0, 3),
            "episodes_trained": self.trained, "episodes_masked": self.masked,
            "episodes_advantaged": self.advantaged, "rollout_wait_s": round(self.wait_s, 3),
            "staleness": self.staleness,
        })
        self.wait_s, self.staleness = 0.0, []


class Metered:
    """A ``rollout_func`` timed, and the staleness of the rows it hands TRL noted."""

    def __init__(self, rollout_func: Callable[[list[Any], Any], dict[str, list[Any]]],
                 meter: Meter) -> None:
        self.rollout_func, self.meter = rollout_func, meter

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        started = time.monotonic()
        out = self.rollout_func(prompts, trainer)
        self.meter.wait_s += time.monotonic() - started
        step = trainer.state.global_step
        self.meter.staleness += [step - v for v, cause in zip(
            out["rlbus_policy_version"], out["rlbus_masked"], strict=True) if cause is None]
        return out


def counting_trainer(meter: Meter) -> type:
    """GRPOTrainer counting, in each batch its loss is computed on, the rows that train."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    class Counting(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out: dict[str, Any] = super()._generate_and_score_completions(inputs)
            mask = out["completion_mask"]  # (B, T)
            if "tool_mask" in out:  # the rows' env_mask
                mask = mask * out["tool_mask"]
            trains = mask.sum(dim=1) > 0  # (B,)
            meter.trained += int(trains.sum())
            meter.masked += int((~trains).sum())
            meter.advantaged += int((trains & (out["advantages"] != 0)).sum())
            return out

    return Counting


def step_clock(meter: Meter, check: Callable[[], None] = lambda: None) -> Any:
    """A callback: the clock starts at train begin, a row at each optimizer step's end
    (after ``check``, which raises to stop a run whose services died)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            meter.t0 = time.monotonic()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            check()
            meter.step_done(state.global_step)

    return StepClock()


# -- the shared trainer


def grpo_config(b: Bench, out_dir: Path) -> Any:
    """One generation batch (the scenario's groups) per optimizer step, on the CPU.
    ``mask_truncated_completions`` stays False: a multi-turn episode often ends on a turn
    that stopped at ``max_new_tokens`` (examples/trl/README.md)."""
    from trl.trainer.grpo_config import GRPOConfig

    s = b.scenario
    return GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=s.batch, num_generations=s.group_size,
        gradient_accumulation_steps=1, max_completion_length=s.max_new_tokens,
        mask_truncated_completions=False, max_steps=b.steps, learning_rate=1e-4,
        logging_steps=max(1, b.steps // 4), report_to="none", save_strategy="no",
        dataloader_num_workers=0, eval_strategy="no", seed=0, disable_tqdm=True)


def make_trainer(b: Bench, config: Any, rollout_func: Any, meter: Meter,
                 callbacks: Sequence[Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbus.integrations.trl import placeholder_dataset, rlbus_reward

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    return counting_trainer(meter)(
        model=AutoModelForCausalLM.from_pretrained(b.model, dtype=torch.float32),
        args=config, processing_class=AutoTokenizer.from_pretrained(b.model),
        reward_funcs=[rlbus_reward], train_dataset=placeholder_dataset(config),
        rollout_func=Metered(rollout_func, meter), callbacks=list(callbacks))


def torch_threads(n: int) -> int:
    import torch

    torch.set_num_threads(n)
    return n


# -- arm (a): TRL alone, lockstep, in process


class Lockstep:
    """The :class:`rlbus.api.Policy` of one generation batch's episodes: a turn's
    ``generate`` runs once every episode still running has asked for it, on all of them at
    once. TRL's own tool loop (``GRPOTrainer._tool_call_loop``) keeps turns in step too, and
    calls each sample's tools one sample after another; here a turn's environment steps run
    at once, which is kinder to this arm."""

    def __init__(self, engine: Any, live: int, version: int) -> None:
        self.engine, self.live, self.version = engine, live, version
        self.waiting: list[tuple[list[int], asyncio.Future[Any]]] = []
        self.calls = 0

    async def generate(self, input_ids: list[int], sampling: Sampling) -> api.Generation:
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting.append((input_ids, answer))
        self._maybe_generate(sampling)
        c = await answer
        return api.Generation(c.completion_ids, c.logprobs, self.version, c.finish_reason)

    def leave(self, sampling: Sampling) -> None:
        """An episode has ended: the others need not wait for it any more."""
        self.live -= 1
        self._maybe_generate(sampling)

    def _maybe_generate(self, sampling: Sampling) -> None:
        if self.waiting and len(self.waiting) == self.live:
            batch, self.waiting = self.waiting, []
            self.calls += 1
            asyncio.get_running_loop().create_task(self._generate(batch, sampling))

    async def _generate(self, batch: list[tuple[list[int], asyncio.Future[Any]]],
                        sampling: Sampling) -> None:
        try:
            completions = await self.engine.generate([ids for ids, _ in batch], sampling)
        except Exception as exc:  # every episode of the turn fails, and is masked
            for _, answer in batch:
                answer.set_exception(exc)
            return
        for (_, answer), completion in zip(batch, completions, strict=True):
            answer.set_result(completion)


class LockstepRollouts:
    """TRL's ``rollout_func`` for arm (a): each call plays one generation batch of the
    task's episodes with the trainer's current model and answers with the adapter's rows
    (:func:`~rlbus.integrations.trl.episode_row`), so TRL sees the same layout as from
    rlbus. A failed episode is masked, as rlbus masks it."""

    def __init__(self, b: Bench) -> None:
        from rlbus.rollout.service import Tokenizer
        from rlbus.rollout.settings import RolloutSettings

        self.b = b
        self.task = SyntheticTask()
        self.tokenizer = Tokenizer(b.model)  # the rollout tier's class
        self.limits = RolloutSettings.model_construct()  # the rollout tier's defaults
        self.engine: Any = None
        self.groups = 0
        self.generate_calls = 0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        from rlbus.integrations.trl import shape_of, trl_batch

        shape = shape_of(trainer.args)
        model = trainer.accelerator.unwrap_model(trainer.model)
        engine = self._engine(model)
        sampling = Sampling(temperature=trainer.args.temperature, top_p=trainer.args.top_p,
                            max_new_tokens=trainer.args.max_completion_length)
        version = trainer.state.global_step
        first, self.groups = self.groups, self.groups + shape.groups
        specs = {f"trl/{i}": self.b.spec(i) for i in range(first, self.groups)}
        rows = asyncio.run(self._play(engine, specs, shape.group_size, sampling, version,
                                      model.get_input_embeddings().num_embeddings))
        return trl_batch(rows)

    def _engine(self, model: Any) -> Any:
        """rlbus's hf engine (its sampling, logprobs and stop handling) round ``model``."""
        if self.engine is None:
            from rlbus.inference.engines import HFEngine
            from rlbus.inference.settings import InferenceSettings

            self.engine = HFEngine(InferenceSettings.model_construct(
                engine="hf", model_path=self.b.model, torch_threads=None))
        if self.engine.model is not model:
            self.engine.model = model
            model.generation_config = self.engine._base  # as HFEngine sets its own model's
        return self.engine

    async def _play(self, engine: Any, specs: dict[str, api.TaskSpec], size: int,
                    sampling: Sampling, version: int, vocab: int) -> list[Any]:
        from rlbus.client import Episode
        from rlbus.integrations.trl import episode_row, mask_cause

        policy = Lockstep(engine, len(specs) * size, version)
        played = await asyncio.gather(*(
            self._episode(policy, spec, group_id, k, size, sampling)
            for group_id, spec in specs.items() for k in range(size)))
        self.generate_calls += policy.calls
        pad_id = engine.pad_id
        rows = []
        for scored in played:
            e = Episode.of(scored, {})
            cause = mask_cause(e, version=version, max_staleness=0, vocab_size=vocab)
            rows.append(episode_row(e, pad_id=pad_id, cause=cause, vocab_size=vocab))
        return rows

    async def _episode(self, policy: Lockstep, spec: api.TaskSpec, group_id: str,
                       index: int, size: int, sampling: Sampling) -> ScoredTrajectory:
        """One episode by the rollout tier's agent, scored by the task, as rlbus records it."""
        episode = api.Episode(task=self.task, spec=spec, env=self.task.make_env(),
                              policy=policy, tokenizer=self.tokenizer, sampling=sampling,
                              max_context_tokens=self.b.scenario.rollout.max_context_tokens,
                              timeout_s=self.limits.env_timeout_s)
        error = None
        try:
            await MultiTurnAgent().run(episode)
        except Exception as exc:  # one episode's failure is a masked row, as in rlbus
            error = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            policy.leave(sampling)
        t = Trajectory(episode_id=f"{group_id}/{index}", group_id=group_id, index=index,
                       group_size=size, task=TASK, spec=spec, turns=episode.turns,
                       status="failed" if error else "ok", error=error)
        actions = [turn.action for turn in episode.turns]
        return ScoredTrajectory(trajectory=t, reward=self.task.score(spec, actions),
                                valid=error is None)


def run_trl(b: Bench) -> dict[str, Any]:
    """Arm (a): every core to the one process, which generates and trains in turn."""
    meter = Meter()
    threads = torch_threads(os.cpu_count() or 1)
    rollouts = LockstepRollouts(b)
    config = grpo_config(b, b.out / "trl")
    trainer = make_trainer(b, config, rollouts, meter, [step_clock(meter)])
    trainer.train()
    return {"rows": meter.rows, "torch_threads": threads,
            "generate_calls": rollouts.generate_calls}


# -- arm (b): TRL + rlbus, decoupled, over Kafka


def tier_envs(b: Bench) -> dict[str, dict[str, str]]:
    """Inference (hf engine), reward and rollout serving the bench's model."""
    s = b.scenario
    quiet = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    served = settings_env(model_path=b.model)
    return {
        "inference": {**quiet, **served, **settings_env(
            engine="hf", max_batch_size=s.inference.max_batch_size,
            batch_wait_ms=s.inference.batch_wait_ms, served_report_s=1.0)},
        "reward": quiet,
        "rollout": {**quiet, **rollout_env(s), **served, **settings_env(tokenizer="hf")},
    }


def wait_ready(fleet: Fleet, timeout_s: float = 120.0) -> None:
    """Until every service has logged that it is ready (inference: its model loaded)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(fleet.procs)
    while waiting:
        fleet.check_alive()
        if time.monotonic() > deadline:
            raise FleetError(f"not ready after {timeout_s:.0f}s: "
                             f"{', '.join(p.label for p in waiting)}")
        waiting = [p for p in waiting
                   if f"{p.label} ready" not in p.log.read_text(errors="replace")]
        time.sleep(0.2)


def run_rlbus(b: Bench, bootstrap: str) -> dict[str, Any]:
    """Arm (b): the trainer gets half the cores (as examples/trl does), the services the
    rest; inference's engine runs one torch thread (its default)."""
    from rlbus.client import ClientSettings, SyncRolloutClient
    from rlbus.integrations.trl import RlbusRollouts, groups_per_step
    from rlbus.settings import KafkaSettings

    s, meter = b.scenario, Meter()
    threads = torch_threads(max(1, (os.cpu_count() or 2) // 2))
    config = grpo_config(b, b.out / "rlbus" / "trl")
    with Fleet(b.out / "rlbus", bootstrap) as fleet:
        for tier, env in tier_envs(b).items():
            fleet.spawn(tier, 0, env)
        wait_ready(fleet)
        settings = ClientSettings(
            kafka=KafkaSettings(bootstrap=bootstrap), topics=fleet.topics, model_path=b.model,
            weights_dir=b.out / "rlbus" / "weights", run_name=fleet.prefix,
            groups_per_step=groups_per_step(config), max_staleness=b.max_staleness,
            straggler_wait_s=s.straggler_wait_s)
        with SyncRolloutClient(settings) as client:
            rollouts = RlbusRollouts(client, TASK, spec=s.env, receive_timeout_s=s.timeout_s)
            trainer = make_trainer(b, config, rollouts, meter,
                                   [rollouts.callback, step_clock(meter, fleet.check_alive)])
            trainer.train()
            counters = dict(rollouts.counters)
    return {"rows": meter.rows, "torch_threads": threads, "adapter": counters,
            "max_staleness": b.max_staleness, "prefix": fleet.prefix}


# -- figures


def env_seconds(b: Bench) -> dict[str, float]:
    """The environment's own latency per optimizer step over the episodes trl alone plays
    (their plans, no model): lockstep, as it plays them (each turn waits for its slowest
    step), and free-running (each episode at its own pace; the batch waits for its slowest
    episode), what an in-process baseline could at best gain by not keeping turns in step."""
    s, lockstep, free = b.scenario, [], []
    for step in range(b.steps):
        groups = range(step * s.groups_per_step, (step + 1) * s.groups_per_step)
        plans = [episode_plan(b.spec(i), k) for i in groups for k in range(s.group_size)]
        lockstep.append(sum(max(p[t] for p in plans if len(p) > t)
                            for t in range(max(map(len, plans)))))
        free.append(max(map(sum, plans)))
    return {"lockstep_s_per_step": sum(lockstep) / len(lockstep),
            "free_running_s_per_step": sum(free) / len(free)}


def summary(run: dict[str, Any], warmup: int) -> dict[str, Any]:
    """The steady window's rates: from the end of step ``warmup`` to the last step."""
    rows = run["rows"]
    start = min(warmup, len(rows) - 1)
    origin = rows[start - 1] if start else {"time": 0.0, "episodes_trained": 0,
                                            "episodes_masked": 0, "episodes_advantaged": 0}
    window, last = rows[start:], rows[-1]
    seconds = last["time"] - origin["time"]
    stale = [x for r in window for x in r["staleness"]]

    def rate(key: str) -> float:
        return (last[key] - origin[key]) / seconds if seconds > 0 else 0.0

    return {
        "steps": len(rows), "window_steps": len(window), "window_s": seconds,
        "trained": last["episodes_trained"], "masked": last["episodes_masked"],
        "steps_per_s": len(window) / seconds if seconds > 0 else 0.0,
        "trained_per_s": rate("episodes_trained"),
        "masked_per_s": rate("episodes_masked"),
        "advantaged_per_s": rate("episodes_advantaged"),
        "rollout_wait_share": sum(r["rollout_wait_s"] for r in window) / seconds
        if seconds > 0 else 0.0,
        "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
        "staleness_max": max(stale, default=0),
        "wall_s": last["time"],
    }


def ratio(results: dict[str, Any], key: str) -> float | None:
    a, b = results["trl"]["summary"][key], results["rlbus"]["summary"][key]
    return b / a if a else None


def render(results: dict[str, Any]) -> str:
    rows = []
    for arm in ARMS:
        x = results[arm]["summary"]
        rows.append([LABELS[arm], str(x["steps"]), str(x["trained"]), str(x["masked"]),
                     f"{x['steps_per_s']:.3f}", f"{x['trained_per_s']:.2f}",
                     f"{100 * x['rollout_wait_share']:.0f}%", f"{x['staleness_mean']:.2f}",
                     f"{x['wall_s']:.1f}"])
    b, e = results["bench"], results["env_seconds"]
    trained, steps = ratio(results, "trained_per_s"), ratio(results, "steps_per_s")
    return "\n".join([
        f"TRL GRPOTrainer on scenario {b['scenario']!r}: {b['episodes_per_step']} episodes "
        f"per optimizer step, {b['steps']} steps per arm; rates over steps "
        f"{b['warmup_steps'] + 1}-{b['steps']} (trained = entered the loss)",
        report.table(["arm", "steps", "trained", "masked", "steps/s", "trained/s",
                      "in rollout_func", "staleness mean", "train s"], rows),
        f"ratio trl + rlbus / trl alone: trained samples/s {trained or 0:.2f}x, "
        f"optimizer steps/s {steps or 0:.2f}x (max_staleness {b['max_staleness']})",
        f"environment latency alone, per step of trl alone: {e['lockstep_s_per_step']:.1f} s "
        f"lockstep (as played); {e['free_running_s_per_step']:.1f} s were each episode "
        "free-running",
    ])


def plot(results: dict[str, Any], path: Path) -> Path:
    """Cumulative trained samples against seconds since train begin, both arms."""
    plt = report._pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for arm in ARMS:
        rows = [{"time": 0.0, "episodes_trained": 0}, *results[arm]["rows"]]
        rate = results[arm]["summary"]["trained_per_s"]
        ax.step([r["time"] for r in rows], [r["episodes_trained"] for r in rows],
                where="post", label=f"{LABELS[arm]} ({rate:.1f}/s steady)")
    ax.set(xlabel="seconds since train begin", ylabel="samples trained",
           title=f"TRL GRPOTrainer — {results['bench']['scenario']} "
                 f"(x{ratio(results, 'trained_per_s') or 0:.1f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the run


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.trl_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--scenario", default="long_tail", help="scenario name or YAML file")
    p.add_argument("--steps", type=int, help="optimizer steps per arm (default 12; smoke 4)")
    p.add_argument("--max-staleness", type=int,
                   help="trl + rlbus's bound (default: the scenario's)")
    p.add_argument("--out", type=Path, help="output folder (default runs/trl-bench-<time>)")
    p.add_argument("--smoke", action="store_true",
                   help="the smoke scenario, 4 steps: checks the harness, not timings")
    args = p.parse_args(argv)
    if args.smoke:
        args.scenario, args.steps = "smoke", args.steps or 4
    args.steps = args.steps or 12
    try:
        args.scenario = load(args.scenario)
    except (OSError, ValueError) as e:
        p.error(f"--scenario: {e}")
    if args.steps < args.scenario.warmup_steps + 2:
        p.error(f"--steps: at least {args.scenario.warmup_steps + 2} (the warm-up and a "
                "steady window of two steps)")
    if args.max_staleness is not None and args.max_staleness < 0:
        p.error("--max-staleness: at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = report.output_folder(args.out, "trl-bench")
    from rlbus.learner.chat_model import build_chat_model
    from rlbus.ops.broker import bootstrap_or_start

    s: Scenario = args.scenario
    bench = Bench(s, args.steps, s.max_staleness if args.max_staleness is None
                  else args.max_staleness, build_chat_model(out / "model"), out)
    results: dict[str, Any] = {"machine": report.machine(), "argv": sys.argv[1:], "bench": {
        "scenario": s.name, "steps": bench.steps, "warmup_steps": s.warmup_steps,
        "episodes_per_step": bench.episodes_per_step, "group_size": s.group_size,
        "max_new_tokens": s.max_new_tokens, "max_staleness": bench.max_staleness,
        "env": s.env, "model": str(bench.model)}}
    say("starting Kafka (or using RLBUS_KAFKA_BOOTSTRAP)")
    bootstrap, cluster = bootstrap_or_start()
    try:
        say(f"trl alone: {bench.steps} steps of {bench.episodes_per_step} episodes")
        results["trl"] = run_trl(bench)
        say(f"trl + rlbus: {bench.steps} steps, max_staleness {bench.max_staleness}")
        results["rlbus"] = run_rlbus(bench, bootstrap)
    finally:
        if cluster is not None:
            cluster.stop()
    for arm in ARMS:
        results[arm]["summary"] = summary(results[arm], s.warmup_steps)
    results["ratio_trained_per_s"] = ratio(results, "trained_per_s")
    results["ratio_steps_per_s"] = ratio(results, "steps_per_s")
    results["env_seconds"] = env_seconds(bench)
    results["plot"] = str(plot(results, out / "trained_over_time.png"))
    print(render(results), flush=True)
    say(f"wrote {report.write_json(out, results)} and {results['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
