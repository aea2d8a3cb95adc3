"""The process group seen by the library: the rank and world size of an initialised ``torch.distributed`` group,
its start from the ``torchrun`` environment (``WORLD_SIZE`` > 1: gloo on the CPU, nccl on CUDA), the device
its collectives run on, and the object collectives the calibration, the evaluation and the integration share.

Nothing here is used in a single process: every helper answers "one process" (rank 0 of 1) when no group of
more than one process is initialised.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

__all__ = ["World", "collective_device", "gather_objects", "init_from_env", "is_main_process", "world"]


class World(NamedTuple):
    rank: int
    size: int


def world() -> World:
    """The rank and size of the default process group; ``World(0, 1)`` when none (of several processes) is
    initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return World(0, 1)
    return World(dist.get_rank(), dist.get_world_size())


def is_main_process() -> bool:
    return world().rank == 0


def init_from_env() -> World:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) and with no group initialised yet, start the
    default group: nccl with the current device set to ``LOCAL_RANK`` when CUDA is present, gloo otherwise.
    Returns :func:`world`."""
    import torch.distributed as dist

    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size > 1 and dist.is_available() and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    return world()


def collective_device() -> torch.device:
    """Where tensors handed to collectives must live: the current CUDA device under nccl, else the CPU."""
    import torch.distributed as dist

    if world().size > 1 and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_objects(obj: Any) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (``[obj]`` in one process)."""
    import torch.distributed as dist

    w = world()
    if w.size == 1:
        return [obj]
    out: list = [None] * w.size
    dist.all_gather_object(out, obj)
    return out
