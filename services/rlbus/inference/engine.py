"""What every inference engine is: token ids in, token ids and per-token logprobs out.

The interface alone, so that the engines (:mod:`rlbus.inference.engines` for hf and
synthetic, :mod:`rlbus.inference.vllm_engine`) and the factory that picks one import it
without importing each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from rlbus.messages import FinishReason, Sampling


@dataclass(frozen=True)
class Completion:
    """One completion."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class Engine(ABC):
    """A batch generator with a policy version."""

    version: int = 0
    reads_weight_files: bool = True
    """False for an engine that loads nothing from a version's uri (synthetic): its uris
    are not checked against the weight store."""

    @abstractmethod
    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        """Complete every prompt with the same sampling parameters."""

    @abstractmethod
    async def load(self, uri: str, checksum: str, version: int) -> None:
        """Replace the weights (between batches)."""

    async def close(self) -> None:
        return None
