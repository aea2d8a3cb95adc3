"""Calibration over several processes (``loki calibrate`` under ``torchrun``, or any caller with an initialised
``torch.distributed`` group): every rank builds the same list of calibration batches, runs the forward passes of
its share (batch ``i`` on rank ``i % W``), and the float64 statistics are summed across ranks so that every rank
ends with the statistics, and so the basis, of a single-process run, bit for bit.

Bit-for-bit equality fixes the order of the additions: a single process adds the statistics of batch ``i`` to
the running sum of batches ``0 .. i-1``.  A plain all-reduce would add them in another order (per-rank partial
sums), which differs in the last bits.  :class:`ChainReduction` keeps the single-process order: the rank owning
batch ``i`` receives the running sum from the owner of batch ``i - 1``, adds its batch (computed into zeroed
statistics, so the sum of that batch is the same number) and passes it on; the owner of the last batch
broadcasts the total.  The forward passes, the cost of calibration, run in parallel; one copy of the
statistics (``[L, HKV, D, D]`` float64 per kind) travels per batch.

The ranks must be handed the same data: the plan (every batch's tokens and budget) is compared across ranks
before any forward pass, and a mismatch raises ``ValueError`` on every rank.
"""

from __future__ import annotations

import hashlib

import torch

from loki._distributed import collective_device, gather_objects, world

from .stats import KeyStatistics

__all__ = ["ChainReduction", "plan_digest"]


def plan_digest(plan: list) -> str:
    """A digest of the batches ``[(input_ids, attention_mask, take), ...]``: equal on ranks given equal data."""
    h = hashlib.sha256()
    for ids, mask, take in plan:
        for t in (ids, mask):
            c = t.detach().to("cpu", torch.int64).contiguous()
            h.update(str(tuple(c.shape)).encode())
            h.update(c.numpy().tobytes())
        h.update(str(int(take)).encode())
    return h.hexdigest()


def _tensors(stats: dict[str, KeyStatistics]) -> list[torch.Tensor]:
    return [t for kind in sorted(stats) for t in (stats[kind].count, stats[kind].sum, stats[kind].outer)]


class ChainReduction:
    """Batch ``i`` of ``num_batches`` is computed on rank ``i % size``; :meth:`add` folds it into the running sum
    in batch order, :meth:`finish` hands the total to every rank."""

    def __init__(self, plan: list):
        self.rank, self.size = world()
        self.num_batches = len(plan)
        digests = gather_objects(plan_digest(plan))
        if len(set(digests)) != 1:
            raise ValueError(
                "distributed calibration: the ranks were given different calibration data (batch digests differ "
                "between ranks); every rank must be handed the same texts or batches, each rank computes its share"
            )
        self.device = collective_device()

    def owns(self, index: int) -> bool:
        return index % self.size == self.rank

    def _send(self, stats: dict[str, KeyStatistics], dst: int) -> None:
        import torch.distributed as dist

        for t in _tensors(stats):
            dist.send(t.to(self.device), dst)

    def _recv(self, stats: dict[str, KeyStatistics], src: int) -> None:
        import torch.distributed as dist

        for t in _tensors(stats):
            buf = torch.empty_like(t, device=self.device)
            dist.recv(buf, src)
            t.copy_(buf)

    def add(self, total: dict[str, KeyStatistics], batch: dict[str, KeyStatistics], index: int) -> None:
        """``total`` becomes the sum of batches ``0 .. index`` (this rank owns batch ``index``)."""
        if index > 0:
            self._recv(total, (index - 1) % self.size)
        for kind, s in total.items():
            s.merge(batch[kind])
        if index + 1 < self.num_batches and self.size > 1:
            self._send(total, (index + 1) % self.size)

    def finish(self, total: dict[str, KeyStatistics]) -> None:
        """Every rank's ``total`` becomes the sum over all batches (held by the owner of the last one)."""
        import torch.distributed as dist

        if self.size == 1 or self.num_batches == 0:
            return
        src = (self.num_batches - 1) % self.size
        for t in _tensors(total):
            buf = t.to(self.device)
            dist.broadcast(buf, src)
            if buf is not t:
                t.copy_(buf)
