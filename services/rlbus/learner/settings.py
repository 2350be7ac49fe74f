"""Settings of the learner (env prefix ``RLBUS_``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from rlbus.prompt_data import DatasetSettings
from rlbus.settings import ServiceSettings
from rlbus.tracking.base import TrackingSink
from rlbus.weights import ChecksumAlgorithm

OffPolicyMode = Literal["none", "decoupled", "tis", "token_mask", "seq_mask"]


def _name_list(value: object) -> object:
    """A comma list as people write it, or JSON as :func:`rlbus.settings.settings_env`
    renders a list; each name once, in order (anything else is left to pydantic)."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else text.split(",")
    if isinstance(value, list | tuple):
        return list(dict.fromkeys(str(v).strip() for v in value if str(v).strip()))
    return value


class OffPolicySettings(BaseModel):
    """How the loss corrects for the gap between the behaviour policy mu (the logprobs the
    engine reported while sampling) and pi_old (the weights the learner trains from), both
    stale versions and engine-vs-trainer numerics (``RLBUS_OFF_POLICY__*``; docs/off-policy.md).
    """

    model_config = ConfigDict(extra="forbid")

    mode: OffPolicyMode = "none"
    """none: one ratio pi_theta/mu, PPO-clipped (the loss as it always was). decoupled:
    decoupled PPO (AReaL), the ratio pi_theta/pi_old clipped, each token weighted by
    w = pi_old/mu. tis: decoupled with w truncated at ``tis_cap``. token_mask: decoupled,
    tokens whose w is outside [token_low, token_high] get no gradient (IcePop).
    seq_mask: decoupled, a sequence whose geometric-mean w is outside [seq_low, seq_high]
    gets no gradient."""
    tis_cap: float = Field(default=2.0, gt=0)
    """mode=tis: the most a token's weight pi_old/mu counts (verl, slime, SkyRL: 2)."""
    token_low: float = Field(default=0.5, ge=0)
    """mode=token_mask: tokens with pi_old/mu below this are masked (NeMo-RL IcePop: 0.5)."""
    token_high: float = Field(default=5.0, gt=0)
    """mode=token_mask: tokens with pi_old/mu above this are masked (NeMo-RL IcePop: 5)."""
    seq_low: float = Field(default=0.999, ge=0)
    """mode=seq_mask: sequences whose exp(mean log(pi_old/mu)) is below this are masked
    (verl's geometric rejection: 0.999)."""
    seq_high: float = Field(default=1.001, gt=0)
    """mode=seq_mask: sequences whose geometric-mean weight is above this are masked
    (verl: 1.001)."""

    @model_validator(mode="after")
    def _bands(self) -> OffPolicySettings:
        for low, high in (("token_low", "token_high"), ("seq_low", "seq_high")):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(f"off_policy.{low} must be below off_policy.{high}")
        return self


class LoraSettings(BaseModel):
    """Train a LoRA adapter instead of the whole model (``RLBUS_LORA__*``; docs/lora.md).
    The base weights stay frozen; each publish sends only the adapter."""

    model_config = ConfigDict(extra="forbid")

    rank: int | None = Field(default=None, ge=0)
    """The adapter's rank r; 0 or None: LoRA off, the whole model trains."""
    alpha: float | None = Field(default=None, gt=0)
    """LoRA's alpha (the update is scaled by alpha / rank); None: 2 x rank, so the scale
    stays 2 whatever the rank and a rank change does not need a new learning rate."""
    target_modules: Annotated[list[str], NoDecode] = ["all-linear"]
    """Module names the adapter wraps (a comma list, e.g. q_proj,v_proj); ``all-linear``
    (PEFT's): every linear layer but the output head."""
    lr: float | None = Field(default=None, gt=0)
    """The adapter's AdamW learning rate; None: the learner's ``lr``. The LoRA papers and
    some RL peers raise it about 10x for a pretrained model at a full fine-tuning rate of
    1e-5 to 1e-6; on the demo's model (``lr`` 1e-3) 10x made the adapter diverge even in
    supervised training, and 1x learned (docs/lora.md, "Learning rate")."""

    @property
    def enabled(self) -> bool:
        return bool(self.rank)

    @field_validator("target_modules", mode="before")
    @classmethod
    def _module_list(cls, value: object) -> object:
        return _name_list(value)


class LearnerSettings(ServiceSettings):
    """The learner: GRPO on scored trajectories, weight publication and the prompt feeder."""

    service: ClassVar[str] = "rlbus.learner.service:Learner"

    model_path: Path | None = None
    """Folder of the initial policy (a Hugging Face causal LM)."""
    model_name: str = "policy"
    """Key of the WeightVersion events this learner publishes."""
    weights_dir: Path = Path("runs/weights")
    """Weight store: one safetensors folder per published version."""
    keep_weights: int = Field(default=3, ge=1)
    """Published versions kept in the weight store (older ones are deleted)."""
    weights_checksum: ChecksumAlgorithm = "sha256"
    """The published files' checksum: sha256, or xxh3_128 (as safe against torn and
    corrupted files, several times faster; not against a forger who can write the store)."""
    checkpoint_dir: Path = Path("runs/checkpoint")
    """Where the checkpoint (model, optimizer, version, offsets, feeder) is written."""
    checkpoint_every: int = Field(default=5, ge=1)
    """Optimizer steps between checkpoints."""
    ledger_steps: int = Field(default=1000, ge=1)
    """Steps whose episode ids the checkpoint's ledger keeps (the audit trail of what was
    trained, bounded so a long run's checkpoint does not grow without end)."""
    metrics_file: Path | None = None
    """JSON lines, one per optimizer step (what ``rlbus demo`` plots)."""
    tracking: Annotated[list[TrackingSink], NoDecode] = []
    """Experiment trackers that get every metrics row too, a comma list of tensorboard,
    wandb, mlflow (empty: metrics_file only). Each needs its extra: ``rlbus[tensorboard]``."""
    tracking_dir: Path | None = None
    """Where the trackers write (``tensorboard/``, ``wandb/``, ``mlruns/`` below it); None:
    the folder of metrics_file, or runs/tracking without one."""
    tracking_project: str = "rlbus"
    """W&B project and MLflow experiment of the run."""
    tracking_run: str | None = None
    """The run's name in the trackers; None: run_name."""
    tracking_wandb_mode: Literal["offline", "online", "disabled"] | None = None
    """W&B mode; None: WANDB_MODE if set, else online where WANDB_API_KEY is set, else
    offline (local run files, uploaded later with ``wandb sync``)."""
    tracking_mlflow_uri: str | None = None
    """MLflow tracking URI (a server, a database); None: a file store, ``mlruns/`` under
    tracking_dir."""
    throughput_every_s: float = Field(default=10.0, gt=0)
    """How often the per-tier throughput in the metrics rows is measured (end offsets of
    the tiers' topics: one short broker call each time)."""
    device: str = "cpu"
    """torch device, e.g. cpu or cuda:0."""
    torch_threads: int | None = 1
    """torch intra-op threads on CPU."""
    seed: int = 0
    """Seed of torch and of the feeder's task sampling."""
    max_steps: int = Field(default=100, ge=1)
    """Optimizer steps, after which the learner stops."""
    group_size: int = Field(default=8, ge=2)
    """Episodes per prompt (GRPO group)."""
    groups_per_step: int = Field(default=4, ge=1)
    """Complete groups per optimizer step."""
    max_staleness: int = Field(default=2, ge=0)
    """Most versions a sample's oldest token may lag the learner when it trains. The
    feeder's credit window admits groups at most this far ahead, and the learner waits for
    a straggling group whose last chance within the bound is its next step (up to
    ``straggler_wait_s``); a sample older than this is masked, never trained."""
    staleness_from: Literal["oldest", "newest"] = "oldest"
    """Which of an episode's tokens its staleness counts from, for the mask above: the
    oldest (every token within the bound) or the newest (a partial rollout whose turns or
    tokens came from several versions trains while its latest part is within the bound;
    its older part is off-policy by more, which the importance ratio against the behaviour
    logprobs still corrects). Staleness statistics count the same way."""
    straggler_wait_s: float = Field(default=60.0, ge=0)
    """Longest the learner holds a step back for a group that would otherwise go stale
    (its other members are back, one is still running); past it the step goes on and the
    group is masked as stale when it arrives. 0: never wait (mask)."""
    lr: float = Field(default=1e-3, gt=0)
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping."""
    clip_low: float = Field(default=0.2, ge=0)
    """Lower clip of the importance ratio: 1 - clip_low."""
    clip_high: float = Field(default=0.28, ge=0)
    """Upper clip: 1 + clip_high (clip-higher when above clip_low, DAPO)."""
    loss_norm: Literal["token", "sequence", "dr_grpo"] = "token"
    """How token losses are averaged: token (DAPO), sequence (GRPO), dr_grpo (constant).
    An episode of several segments counts as one episode in each (grpo.py)."""
    dr_grpo_max_tokens: int = Field(default=1024, ge=1)
    """loss_norm=dr_grpo: the constant every sequence's token-loss sum is divided by (with
    the number of episodes), the same for every batch whatever its padded width; set it to
    the completion-token budget of an episode (Dr. GRPO's generation budget)."""
    updates_per_step: int = Field(default=1, ge=1)
    """Optimizer steps on each batch (GRPO's mu, TRL's num_iterations, verl's ppo_epochs):
    later passes reuse the same samples with the importance ratio against the behaviour
    logprobs, clipped as usual. More learning per episode for more learner compute."""
    off_policy: OffPolicySettings = OffPolicySettings()
    """The off-policy correction of the loss (``RLBUS_OFF_POLICY__MODE`` etc.; default
    none: the one ratio against the behaviour logprobs)."""
    lora: LoraSettings = LoraSettings()
    """Train a LoRA adapter (``RLBUS_LORA__RANK`` etc.; default off: the whole model)."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus: the loss minus this times the token-mean policy entropy on completion
    tokens (0: off, and the entropy over the vocabulary is not computed at all)."""
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    """Gradient accumulation: the step's sequences go through the model in micro-batches of
    at most this many (padded) tokens each, sorted by length; the update equals the
    one-batch update. None: the whole batch at once. A sequence longer than this is a
    micro-batch of its own."""
    logits_chunk_tokens: int = Field(default=1024, ge=1)
    """Positions whose logits are materialised at once when scoring tokens (see
    ``grpo.score_tokens``): the fp32 logits peak is this times the vocabulary size."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the forward and backward pass: bfloat16 autocast (on a device that
    supports it; weights, gradients and optimizer state stay fp32) or plain fp32."""
    gradient_checkpointing: bool = False
    """Recompute the decoder layers' activations in the backward pass instead of keeping
    them: less memory, about a third more compute."""
    scale_by_std: bool = True
    """Divide advantages by the group std (False: Dr. GRPO's no-std)."""
    feed: bool = True
    """Host the prompt feeder (False when prompts come from ``rlbus feed``)."""
    task: str = "guess_number"
    """The task the feeder samples: an ``rlbus.tasks`` entry point or an import string
    ``package.module:attr``; prompts carry this reference as their task."""
    task_spec: dict[str, Any] = {}
    """Keys merged over every sampled task spec (e.g. a synthetic scenario's latencies)."""
    eval_every: int = Field(default=0, ge=0)
    """Every this many steps, roll out a fixed evaluation set greedily (0: never). Eval
    episodes are measured, never trained on, and do not count against the credit window."""
    eval_episodes: int = Field(default=64, ge=1)
    """Size of the evaluation set (the same task specs every time); with ``eval_dataset``,
    its first this many valid rows."""
    dataset: DatasetSettings | None = None
    """Training prompts from a dataset (``RLBUS_DATASET__PATH`` etc., see
    :mod:`rlbus.prompt_data`) instead of the task's ``sample``; its position is
    checkpointed. The run ends at ``max_steps`` or when its epochs are done."""
    eval_dataset: DatasetSettings | None = None
    """The held-out evaluation set (``RLBUS_EVAL_DATASET__*``), in file order, never
    trained on; None: specs the task samples from fixed seeds."""
    eval_pass_k: int = Field(default=0, ge=0)
    """pass@k of every evaluation round, besides greedy success: ``eval_pass_n`` samples
    per problem at the training temperature, scored with the unbiased estimator
    1 - C(n-c, k)/C(n, k) (any-of-k when n = k). 0: greedy only."""
    eval_pass_n: int | None = Field(default=None, ge=1)
    """Samples per problem for pass@k (at least ``eval_pass_k``); None: ``eval_pass_k``."""
    run_name: str = "run"
    """Prefix of group ids; deterministic ids make re-sent prompts recognisable."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature sent with each training prompt, and the temperature the trainer
    scores tokens at (logits / T), as the engines report their logprobs; prompts published
    by ``rlbus feed`` must use the same one. Not 0: the members of a greedy group would act
    alike and give no signal (evaluation rounds are greedy regardless)."""
    max_new_tokens: int = Field(default=4, ge=1)
    """Most tokens per completion (per turn)."""
    trainer: Literal["grpo", "synthetic"] = "grpo"
    """grpo: the real optimizer step; synthetic: no model, each step just takes
    ``synthetic_step_s`` (load tests of the pipeline without a model)."""
    synthetic_step_s: float = Field(default=0.5, ge=0)
    """Wall time of one synthetic optimizer step."""

    @field_validator("tracking", mode="before")
    @classmethod
    def _sink_list(cls, value: object) -> object:
        return _name_list(value)
