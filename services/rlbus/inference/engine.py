"""What every inference engine is: token ids in, token ids and per-token logprobs out.

The interface alone, so that the engines (:mod:`rlbus.inference.engines` for hf and
synthetic, :mod:`rlbus.inference.vllm_engine`) and the factory that picks one import it
without importing each other.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rlbus.errors import WeightsMismatchError
from rlbus.messages import FinishReason, LoraAdapter, Sampling


@dataclass(frozen=True)
class Completion:
    """One completion."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version_spans: list[tuple[int, int]] | None = None
    """The weight version of each token, run-length (``(version, count)``); None: every
    token by the version the engine held when the batch began (no in-flight update)."""


class Engine(ABC):
    """A batch generator with a policy version."""

    version: int = 0
    reads_weight_files: bool = True
    """False for an engine that loads nothing from a version's uri (synthetic): its uris
    are not checked against the weight store."""
    inflight_updates: bool = False
    """True for an engine whose ``load`` may run inside :meth:`step_boundary` while a batch
    is generating: the new weights apply from the next decode step, and each completion
    says which version produced which token (``Completion.version_spans``)."""

    @contextlib.asynccontextmanager
    async def step_boundary(self) -> AsyncIterator[None]:
        """Hold any running generation between two decode steps while the body runs (a
        ``load``). Engines without in-flight updates never load during a batch: nothing
        to hold."""
        yield

    @abstractmethod
    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        """Complete every prompt with the same sampling parameters."""

    @abstractmethod
    async def load(self, uri: str, checksum: str, version: int) -> None:
        """Replace the weights (between batches)."""

    async def load_adapter(self, uri: str, checksum: str, version: int,
                           adapter: LoraAdapter) -> None:
        """Serve the base model plus the LoRA adapter folder ``uri`` (between batches),
        replacing the adapter served before; one that does not fit the base model is a
        :class:`~rlbus.errors.WeightsMismatchError` and changes nothing. This engine serves
        no adapters: every one is refused."""
        raise WeightsMismatchError(
            f"v{version} is a LoRA adapter; this engine ({type(self).__name__}) serves none")

    async def close(self) -> None:
        return None
