"""Data parallel learner under ``torchrun``: rank 0 is the service, the other ranks follow.

``torchrun --nproc_per_node N -m rlbus.learner`` starts N processes. Rank 0 is the
learner service as usual: it alone reads Kafka, assembles groups, computes advantages,
writes checkpoints and offsets and publishes weights. Every optimizer step it broadcasts
the step's packed samples; each rank (rank 0 too) trains on its share of them inside
``DistributedDataParallel``, whose gradient all-reduce makes the update that of the whole
batch, so all ranks hold the same parameters. The followers (rank > 0) run no service and
touch no broker: they loop on the broadcasts until rank 0 sends "stop".

Backend: NCCL when the learner's device is CUDA (each rank on ``cuda:LOCAL_RANK``), gloo on
the CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

IDLE_LIMIT = timedelta(days=7)


def rank_from_env() -> int:
    """This process's rank as torchrun sets it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class World:
    """The process group this learner trains in (size 1: no group at all)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str) -> World:
        """Join torchrun's process group (``WORLD_SIZE`` > 1), else a world of one."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return cls()
        world = cls(rank_from_env(), size, int(os.environ.get("LOCAL_RANK", "0")))
        cuda = torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.set_device(world.local_rank)
        if not dist.is_initialized():
            # Followers wait in a broadcast for as long as rank 0 waits for data (broker
            # or rollouts down): the default 30 min would kill them. A dead rank still ends
            # the job at once (torchrun stops the others).
            dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=IDLE_LIMIT)
        log.info("learner rank %d of %d (%s)", world.rank, size, dist.get_backend())
        return world

    def device(self, configured: str) -> torch.device:
        """The device of this rank: ``cuda`` is each rank's own ``cuda:LOCAL_RANK``."""
        dev = torch.device(configured)
        if dev.type == "cuda" and self.size > 1:
            return torch.device("cuda", self.local_rank)
        return dev

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; for the step's samples, not tensors of
        model size)."""
        if self.size == 1:
            return obj
        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the ranks (a small tensor of figures)."""
        if self.size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def all_max(self, value: float) -> float:
        """The largest of the ranks' ``value`` (a figure such as a step's largest weight)."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return float(box.item())

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def shard(items: list[int], world: World) -> list[int]:
    """This rank's share of `items` (already in a balanced order): every size-th one."""
    return items[world.rank :: world.size]
