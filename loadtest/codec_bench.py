"""Packed arrays vs msgpack lists for a 4k-token trajectory, measured side by side.

    python -m loadtest.codec_bench

Prints encode/decode time per message and wire size for both encodings, and their ratio.
"""

from __future__ import annotations

import random
import timeit

from pydantic import BaseModel

from rlbus.codec import decode, encode
from rlbus.messages import Trajectory, Turn


def make_trajectory(tokens: int = 4096, turns: int = 8) -> Trajectory:
    rng = random.Random(0)
    per = tokens // (2 * turns)
    return Trajectory(
        episode_id="g/0", group_id="g", index=0, group_size=8, task="t", spec={},
        turns=[
            Turn(
                input_ids=[rng.randrange(150_000) for _ in range(per)],
                completion_ids=[rng.randrange(150_000) for _ in range(per)],
                logprobs=[-rng.random() * 5 for _ in range(per)],
                policy_version=3,
            )
            for _ in range(turns)
        ],
    )


def measure(packed: bool, message: BaseModel, number: int = 50) -> tuple[float, float, int]:
    """Best-of-5 encode and decode ms per message, and its size in bytes."""
    data = encode(message, packed=packed)
    cls = type(message)
    enc = min(timeit.repeat(lambda: encode(message, packed=packed), number=number, repeat=5))
    dec = min(timeit.repeat(lambda: decode(data, cls), number=number, repeat=5))
    return enc / number * 1e3, dec / number * 1e3, len(data)


def main() -> None:
    traj = make_trajectory()
    rows = {name: measure(packed, traj) for name, packed in (("list", False), ("packed", True))}
    print(f"{'encoding':<8} {'encode ms':>10} {'decode ms':>10} {'bytes':>8}")
    for name, (enc, dec, size) in rows.items():
        print(f"{name:<8} {enc:>10.3f} {dec:>10.3f} {size:>8}")
    (le, ld, ls), (pe, pd, ps) = rows["list"], rows["packed"]
    print(f"list/packed ratio: encode {le / pe:.1f}x, decode {ld / pd:.1f}x, size {ls / ps:.1f}x")


if __name__ == "__main__":
    main()
