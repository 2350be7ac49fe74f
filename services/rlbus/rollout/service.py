"""Rollout: turns each Prompt into ``group_size`` multi-turn episodes, one Trajectory each.

Delivery contract: at-least-once. A prompt's offset is committed only after every one of its
trajectories is acknowledged by the broker; a killed instance's unfinished prompts are rolled
out again by another member (same deterministic episode ids, so the learner keeps one copy).
Every model call is a StepRequest answered on this instance's own partition of
steps.results; an unanswered request is re-sent with the same ``request_id`` and duplicate
answers are dropped. Token ids pass through unchanged: the context sent to inference is the
exact concatenation of prompt, completion and observation ids recorded in the trajectory.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import OrderedDict
from typing import Any, Literal

from rlbus import plugins, telemetry
from rlbus.api import (
    Agent,
    ChatAgent,
    ChatSession,
    Env,
    Episode,
    Generation,
    StepOutcome,
    Task,
    TaskSpec,
)
from rlbus.errors import PluginError, Refusal, RefusalReason, RefusedError
from rlbus.limits import check_prompt
from rlbus.messages import Prompt, Sampling, StepRequest, StepResult, Trajectory, Turn
from rlbus.rollout.gateway import Bounds, Gateway
from rlbus.rollout.settings import RolloutSettings
from rlbus.service import Service
from rlbus.transport import Bus, Consumer, Delivery, MessageTooLargeError, Producer

log = logging.getLogger(__name__)


FINISHED_KEPT = 100_000
"""Ids of finished requests remembered to tell a late duplicate answer from one to a
request never sent."""


class EpisodeFailed(RefusedError, RuntimeError):
    """The episode cannot go on (no answer, engine error, environment error): it is
    published as failed, its group goes on."""


def _load_task(name: str) -> Task | Refusal:
    """The task a prompt names, or why it has none (not installed, does not load)."""
    try:
        return plugins.task(name)
    except PluginError as exc:
        return exc.refusal


class Tokenizer:
    """The policy tokenizer, used only to turn environment text into ids and back."""

    def __init__(self, model_path: Any) -> None:
        from transformers import AutoTokenizer

        if model_path is None:
            raise ValueError("rollout needs RLBUS_MODEL_PATH (the policy's tokenizer folder)")
        self.tok = AutoTokenizer.from_pretrained(model_path)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tok.encode(text, add_special_tokens=False)
        return ids

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


class SyntheticTokenizer:
    """Words to stable ids and ids to numbers: enough for synthetic environments."""

    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(w.encode()) % 50_000 for w in text.split()] or [0]

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


class TracedEnv(Env):
    """An episode's environment with ``env.reset``/``env.step`` spans of this member."""

    def __init__(self, env: Env, member: str) -> None:
        self.env, self.member = env, member
        self.tools = env.tools
        self.turn = 0

    async def reset(self, spec: TaskSpec) -> str:
        with telemetry.span("env.reset", self.member):
            return await self.env.reset(spec)

    async def step(self, action: str) -> StepOutcome:
        with telemetry.span("env.step", self.member, attributes={"rlbus.turn": self.turn}):
            self.turn += 1
            return await self.env.step(action)


class KafkaPolicy:
    """The :class:`rlbus.api.Policy` of one episode: each generate is a StepRequest."""

    def __init__(self, rollout: Rollout, prompt: Prompt, episode_id: str) -> None:
        self.rollout, self.prompt, self.episode_id = rollout, prompt, episode_id
        self.turn = 0

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        result = await self.rollout._ask(self.episode_id, self.turn, input_ids, self.prompt,
                                         sampling)
        self.turn += 1
        return Generation(result.completion_ids, result.logprobs, result.policy_version,
                          result.finish_reason, result.version_spans)


def default_reply_partition(instance: str, partitions: int) -> int:
    number = int(instance) if instance.isdigit() else zlib.crc32(instance.encode())
    return number % partitions


class Rollout(Service[RolloutSettings]):
    name = "rollout"

    def __init__(
        self, settings: RolloutSettings, bus: Bus | None = None, tokenizer: Any = None
    ) -> None:
        super().__init__(settings, bus)
        self.tokenizer = tokenizer
        self.reply_partition = (
            settings.reply_partition
            if settings.reply_partition is not None
            else default_reply_partition(settings.instance, settings.topics.result_partitions)
        )
        self._pending: dict[str, asyncio.Future[StepResult]] = {}
        # ids of requests answered or given up lately: a later answer is a duplicate; one
        # to an id neither pending nor here was never asked for by this instance
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._groups: set[asyncio.Task[None]] = set()
        self._episode_slots = asyncio.Semaphore(settings.max_concurrent_episodes)
        self.gateway: Gateway | None = None  # started in setup for a ChatAgent

    async def setup(self) -> None:
        # a broken plugin is a startup error naming its entry point
        log.info("tasks: %s", ", ".join(plugins.check_all("task")))
        self.agent: Agent | ChatAgent = plugins.agent(self.settings.agent)
        if self.tokenizer is None and self.settings.tokenizer == "synthetic":
            self.tokenizer = SyntheticTokenizer()
        elif self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(Tokenizer, self.settings.model_path)
        self.producer: Producer = await self.bus.producer()
        self.replies: Consumer[StepResult] = await self.bus.consumer(
            [self.topics.results],
            StepResult,
            assign=[(self.topics.results, self.reply_partition)],
            from_end=True,  # answers to an earlier incarnation's requests are of no use
        )
        self.prompts: Consumer[Prompt] = await self.bus.consumer(
            [self.topics.prompts], Prompt, group_id=self.group
        )
        if isinstance(self.agent, ChatAgent):
            if not isinstance(self.tokenizer, Tokenizer):
                raise ValueError(f"agent {self.settings.agent!r} talks to the OpenAI gateway, "
                                 "which needs the policy's own tokenizer (RLBUS_TOKENIZER=hf)")
            st = self.settings
            self.gateway = Gateway(st.served_model_name, st.gateway_host, st.gateway_port,
                                   Bounds(st.gateway_max_sessions, st.gateway_max_body_bytes,
                                          st.gateway_max_session_tokens,
                                          st.gateway_idle_timeout_s))
            await self.gateway.start()
        self.spawn("replies", self._read_replies())
        log.info("%s reads replies on partition %d", self.member, self.reply_partition)

    # -- prompts

    async def main(self) -> None:
        while not self.stopping:
            room = self.settings.max_groups_in_flight - len(self._groups)
            if room <= 0:
                self.bump("group_bound_waits")  # saturated: no prompt is taken meanwhile
                await asyncio.wait(self._groups, timeout=1.0, return_when="FIRST_COMPLETED")
            else:
                for d in await self.prompts.poll(0.5, room):
                    self._start_group(d)
            await self.prompts.commit()

    def _start_group(self, d: Delivery[Prompt]) -> None:
        task = asyncio.create_task(self._run_group(d), name=f"group:{d.message.group_id}")
        self._groups.add(task)
        task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task[None]) -> None:
        self._groups.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        log.error("group task ended with an error", exc_info=task.exception())
        # its prompt is unacked and would hold back every later commit: stop, and let the
        # next owner of the partition roll it out (only while draining, or with no broker)
        self.request_stop(f"group task {task.get_name()} failed: {task.exception()!r}")

    async def _run_group(self, d: Delivery[Prompt]) -> None:
        # an error the group's own retries do not take: its prompt is a dead letter
        async with self.prompts.handling(d, hand_back=lambda: self.stopping):
            with d.processing() as prompt_span:
                await self._handle_prompt(d, prompt_span)
        self.prompts.ack(d)  # only now: every trajectory of the group is on the broker
        self.count_input()

    async def _handle_prompt(self, d: Delivery[Prompt], prompt_span: Any) -> None:
        # over a limit or naming no loadable task: a dead letter, before any allocation
        task = check_prompt(d.message, self.settings.limits) or _load_task(d.message.task)
        if isinstance(task, Refusal):
            await self._dead_letter(d, task)
        else:
            await self._roll_out(d, task, prompt_span)

    async def _roll_out(self, d: Delivery[Prompt], task: Task, prompt_span: Any) -> None:
        """Every episode of the group, published. A group that crashes (a broker call that
        timed out, a bug) is tried again from the start, ``group_attempts`` times in all
        (episode ids are deterministic: the learner keeps one copy of each), then
        dead-lettered: its prompt is never left unacked, so commits keep advancing, and
        every episode of it is published as failed, so the group completes (masked) at the
        learner instead of holding there the members published before the crash."""
        prompt = d.message
        for attempt in range(1, self.settings.group_attempts + 1):
            try:
                await asyncio.gather(*(self._traced_episode(task, prompt, i, prompt_span)
                                       for i in range(prompt.group_size)))
                return
            except Exception as exc:
                self.bump("group_crashes")
                error = f"group failed on attempt {attempt}: {type(exc).__name__}: {exc}"
                log.error("prompt %s: %s", prompt.group_id, error, exc_info=exc)
                if self.stopping:
                    raise  # unacked: the next owner of the partition rolls it out
        await self._publish_failed_group(prompt, error[:500])
        await self._dead_letter(d, Refusal(RefusalReason.GROUP_GIVEN_UP, error[:500]))

    async def _publish_failed_group(self, prompt: Prompt, error: str) -> None:
        """Every episode of a group given up, as failed and empty: the learner keeps the
        first copy of each, so one published before the crash still counts."""
        for i in range(prompt.group_size):
            t = Trajectory(episode_id=f"{prompt.group_id}/{i}", group_id=prompt.group_id,
                           index=i, group_size=prompt.group_size, task=prompt.task, spec={},
                           turns=[], status="failed", error=error, purpose=prompt.purpose,
                           eval_round=prompt.eval_round)
            await self.producer.send(self.topics.trajectories, t, key=prompt.group_id)

    async def _traced_episode(self, task: Task, prompt: Prompt, index: int, parent: Any) -> None:
        """One episode = one trace: its root span covers every step request, environment
        step and the trajectory's publication; the prompt is linked, not a parent."""
        attrs = {"rlbus.episode_id": f"{prompt.group_id}/{index}", "rlbus.task": prompt.task}
        with telemetry.span(
            "episode", self.member, root=True, links=[parent], attributes=attrs
        ) as span:
            t = await self._episode(task, prompt, index)
            span.set_attribute("rlbus.status", t.status)
            t = await self._publish(t)
        self.bump("episodes")
        self.bump("failed_episodes", t.status == "failed")
        telemetry.EPISODES.add(1, {"rlbus.task": t.task, "rlbus.status": t.status})

    async def _publish(self, t: Trajectory) -> Trajectory:
        """Publish; an episode too large for the topic is published as a failed stub, so
        its group still completes (and the learner masks it)."""
        try:
            await self.producer.send(self.topics.trajectories, t, key=t.group_id)
            return t
        except MessageTooLargeError as exc:
            log.warning("episode %s not publishable: %s", t.episode_id, exc)
            stub = t.model_copy(update={"turns": [], "status": "failed", "error": str(exc)})
            await self.producer.send(self.topics.trajectories, stub, key=t.group_id)
            return stub

    async def _dead_letter(self, d: Delivery[Prompt], refusal: Refusal) -> None:
        log.warning("prompt %s dead-lettered: %s", d.message.group_id, refusal)
        self.bump("dead_letters")
        await self.prompts.reject(d, refusal)

    # -- episodes

    async def _episode(self, task: Task, prompt: Prompt, index: int) -> Trajectory:
        episode_id = f"{prompt.group_id}/{index}"
        started = time.time()
        turns: list[Turn] = []
        status: Literal["ok", "failed"] = "ok"
        error: str | None = None
        async with self._episode_slots:
            try:
                await self._play(task, prompt, episode_id, turns)
            except (EpisodeFailed, TimeoutError, Exception) as exc:  # one bad env ≠ dead service
                status, error = "failed", f"{type(exc).__name__}: {exc}"[:500]
                log.warning("episode %s failed: %s", episode_id, error)
        return Trajectory(
            episode_id=episode_id,
            group_id=prompt.group_id,
            index=index,
            group_size=prompt.group_size,
            task=prompt.task,
            spec=prompt.spec,
            turns=turns,
            status=status,
            error=error,
            purpose=prompt.purpose,
            eval_round=prompt.eval_round,
            started_at=started,
        )

    async def _play(self, task: Task, prompt: Prompt, episode_id: str, turns: list[Turn]) -> None:
        """One episode by the configured agent; ``turns`` keeps what it recorded."""
        assert self.tokenizer is not None
        policy = KafkaPolicy(self, prompt, episode_id)
        env = TracedEnv(task.make_env(), self.member)
        if isinstance(self.agent, ChatAgent):
            await self._play_chat(self.agent, task, prompt, env, policy, turns)
            return
        await self.agent.run(Episode(
            task=task, spec=prompt.spec, env=env, policy=policy, tokenizer=self.tokenizer,
            sampling=prompt.sampling, max_context_tokens=self.settings.max_context_tokens,
            timeout_s=self.settings.env_timeout_s, turns=turns,
        ))

    async def _play_chat(self, agent: ChatAgent, task: Task, prompt: Prompt, env: Env,
                         policy: KafkaPolicy, turns: list[Turn]) -> None:
        """Agent code with an OpenAI client: a gateway session is the episode."""
        assert self.gateway is not None and self.tokenizer is not None
        async with self.gateway.session(
            policy=policy, tokenizer=self.tokenizer.tok, sampling=prompt.sampling,
            max_context_tokens=self.settings.max_context_tokens, turns=turns,
            history=self.settings.history_of(prompt.task),
        ) as session:
            chat = ChatSession(base_url=self.gateway.base_url(session.id), api_key=session.id,
                               model=self.gateway.model, task=task, spec=prompt.spec, env=env)
            await asyncio.wait_for(self.gateway.run(session, agent.run(chat)),
                                   self.settings.agent_timeout_s)
            if session.failed:  # the agent may have caught the error: the episode has not
                raise EpisodeFailed(session.failed)

    async def _ask(self, episode_id: str, turn: int, context: list[int], p: Prompt,
                   sampling: Sampling) -> StepResult:
        request = StepRequest(
            request_id=f"{episode_id}/t{turn}",
            episode_id=episode_id,
            turn=turn,
            input_ids=context,
            sampling=sampling,
            reply_partition=self.reply_partition,
            min_version=p.min_version,
        )
        result = await self._request(request)
        if result.finish_reason == "error":
            raise EpisodeFailed(f"inference error on {request.request_id}: {result.error}")
        return result

    async def _request(self, request: StepRequest) -> StepResult:
        """Send, and re-send the same request until answered or out of retries."""
        future: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = future
        sent = time.perf_counter()
        try:
            for attempt in range(self.settings.step_retries + 1):
                if attempt:
                    self.bump("resends")
                await self.producer.send(self.topics.steps, request, key=request.episode_id)
                try:
                    result = await asyncio.wait_for(
                        asyncio.shield(future), self.settings.step_timeout_s
                    )
                    telemetry.STEP_LATENCY.record(time.perf_counter() - sent)
                    return result
                except TimeoutError:
                    log.info("no answer to %s; re-sending", request.request_id)
            raise EpisodeFailed(
                f"no answer to {request.request_id} after {self.settings.step_retries + 1} sends"
            )
        finally:
            self._pending.pop(request.request_id, None)
            self._finished[request.request_id] = None
            if len(self._finished) > FINISHED_KEPT:
                self._finished.popitem(last=False)

    async def _read_replies(self) -> None:
        # on through the drain: the episodes it lets finish still wait for their answers
        while not self.stopping or self._groups:
            for d in await self.replies.poll(0.5):
                future = self._pending.get(d.message.request_id)
                if future is not None and not future.done():
                    future.set_result(d.message)
                elif future is not None or d.message.request_id in self._finished:
                    self.bump("duplicate_replies")  # a re-sent request answered twice
                else:
                    self._unsolicited(d)

    def _unsolicited(self, d: Delivery[StepResult]) -> None:
        """An answer to a request this instance never sent (a forged one, or a member with
        the same reply partition): dropped, counted, and logged now and then."""
        self.bump("unsolicited_replies")
        n = self.counters["unsolicited_replies"]
        if n == 1 or n % 1000 == 0:
            log.warning("dropped %d answer(s) to requests this instance never sent, e.g. "
                        "%r at %s[%d]@%d", n, d.message.request_id[:200], d.topic, d.partition,
                        d.offset)

    async def drain(self) -> None:
        """Finish what can finish in time; the rest is redelivered to another member."""
        if self._groups:
            await asyncio.wait(self._groups, timeout=self.settings.drain_timeout_s * 0.8)
        for task in list(self._groups):
            task.cancel()
        await self.prompts.commit()

    async def close(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
