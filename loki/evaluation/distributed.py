"""Evaluation over several processes: work split into numbered chunks (perplexity windows, a batch of them per
chunk), chunk ``j`` computed on rank ``j % W`` of an initialised ``torch.distributed`` group, the results gathered
on every rank in chunk order.  A chunk holds the same windows as in a single-process run, so the gathered
results are those of a single process (bit for bit where the device computes a batch the same way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loki._distributed import gather_objects, world

__all__ = ["map_chunks"]


def map_chunks(fn: Callable[[int], Any], num_chunks: int) -> list:
    """``[fn(0), ..., fn(num_chunks - 1)]`` on every rank, each ``fn(j)`` run on rank ``j % W`` only (results
    travel pickled: keep them on the CPU).  In one process: the plain list."""
    rank, size = world()
    if size == 1:
        return [fn(j) for j in range(num_chunks)]
    mine = {j: fn(j) for j in range(rank, num_chunks, size)}
    done: dict[int, Any] = {}
    for part in gather_objects(mine):
        done.update(part)
    return [done[j] for j in range(num_chunks)]
