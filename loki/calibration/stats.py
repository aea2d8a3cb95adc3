"""Streamed per-(layer, KV head) key statistics in float64.

Shape letters: L = decoder layers, HKV = key/value heads, D = head dim, N = key vectors (tokens) in one update.

The statistics are sufficient for PCA: a count, the sum of keys and the sum of outer products per layer and head,
so a basis can be fit on any number of tokens without keeping the keys themselves (nothing is written to disk).
"""

from __future__ import annotations

import torch


class KeyStatistics:
    """Running count, sum and sum of outer products of keys, per (layer, KV head), in float64.

    Attributes:
        count: ``[L, HKV]`` int64, key vectors seen.
        sum: ``[L, HKV, D]`` float64, sum of keys.
        outer: ``[L, HKV, D, D]`` float64, sum of ``k k^T``.

    The reductions of one update run on the keys' device in float64; only the small ``[HKV, D, D]`` result is
    moved to the statistics' device (``device``, CPU by default).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.count = torch.zeros(num_layers, num_kv_heads, dtype=torch.int64, device=device)
        self.sum = torch.zeros(num_layers, num_kv_heads, head_dim, dtype=torch.float64, device=device)
        self.outer = torch.zeros(num_layers, num_kv_heads, head_dim, head_dim, dtype=torch.float64, device=device)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(L, HKV, D)``."""
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def num_tokens(self) -> int:
        """Tokens seen by layer 0 (every layer sees the same tokens in a calibration run)."""
        return int(self.count[0, 0])

    def update(self, layer: int, keys: torch.Tensor) -> None:
        """Add ``keys: [N, HKV, D]`` (any float dtype) to the statistics of ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        if keys.ndim != 3 or tuple(keys.shape[1:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"keys must have shape [N, {self.num_kv_heads}, {self.head_dim}] (N, HKV, D), got {list(keys.shape)}"
            )
        if keys.shape[0] == 0:
            return
        k = keys.detach().to(torch.float64)
        dev = self.sum.device
        self.count[layer] += k.shape[0]
        self.sum[layer] += k.sum(dim=0).to(dev)
        self.outer[layer] += torch.einsum("nhd,nhe->hde", k, k).to(dev)

    def merge(self, other: KeyStatistics) -> KeyStatistics:
        """Add ``other``'s statistics into this object (in place) and return it."""
        if not isinstance(other, KeyStatistics):
            raise TypeError(f"other must be a KeyStatistics, got {type(other).__name__}")
        if other.shape != self.shape:
            raise ValueError(f"cannot merge statistics of shape {list(other.shape)} into {list(self.shape)}")
        dev = self.sum.device
        self.count += other.count.to(dev)
        self.sum += other.sum.to(dev)
        self.outer += other.outer.to(dev)
        return self

    def __iadd__(self, other: KeyStatistics) -> KeyStatistics:
        return self.merge(other)

    def _check_nonempty(self) -> None:
        empty = (self.count == 0).nonzero()
        if len(empty):
            layer, head = (int(i) for i in empty[0])
            raise ValueError(f"no keys were recorded for layer {layer}, KV head {head}")

    @property
    def mean(self) -> torch.Tensor:
        """``[L, HKV, D]`` float64 mean key."""
        self._check_nonempty()
        return self.sum / self.count[..., None].to(torch.float64)

    def second_moment(self) -> torch.Tensor:
        """``[L, HKV, D, D]`` float64 ``E[k k^T]`` (uncentred)."""
        self._check_nonempty()
        return self.outer / self.count[..., None, None].to(torch.float64)

    def covariance(self, centered: bool = True) -> torch.Tensor:
        """``[L, HKV, D, D]`` float64 covariance ``E[k k^T] - mu mu^T`` (population, divided by N).

        With ``centered=False`` this is the second moment ``E[k k^T]``.  The result is symmetrised exactly.
        """
        cov = self.second_moment()
        if centered:
            mu = self.mean
            cov = cov - mu[..., :, None] * mu[..., None, :]
        return 0.5 * (cov + cov.transpose(-1, -2))

    def check_finite(self, what: str = "keys") -> None:
        """Raise ``ValueError`` naming the first layer and KV head whose statistics hold NaN or inf (the model
        produced non-finite ``what``, e.g. an overflow in float16), so that no NaN basis is ever fitted."""
        bad = ~(torch.isfinite(self.sum).all(dim=-1) & torch.isfinite(self.outer).flatten(2).all(dim=-1))
        if bool(bad.any()):
            layer, head = (int(i) for i in bad.nonzero()[0])
            more = f" (and {int(bad.sum()) - 1} more head(s))" if int(bad.sum()) > 1 else ""
            raise ValueError(f"the calibration {what} of layer {layer}, KV head {head}{more} contain NaN or inf: "
                             "the model produced non-finite values on the calibration text (try --dtype float32)")

    def constant_heads(self, rel_tol: float = 1e-10) -> torch.Tensor:
        """``[L, HKV]`` bool: heads whose vectors have no variance, i.e. are constant (one token, or the same
        vector every time): the largest eigenvalue of the centred covariance is at most ``rel_tol`` times that
        of the uncentred second moment (float64 round-off of ``E[k k^T] - mu mu^T`` stays far below that)."""
        cov = torch.linalg.eigvalsh(self.covariance(centered=True)).amax(dim=-1)
        scale = torch.linalg.eigvalsh(self.covariance(centered=False)).amax(dim=-1)
        return cov <= rel_tol * scale

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"count": self.count, "sum": self.sum, "outer": self.outer}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> KeyStatistics:
        L, HKV, D = state["sum"].shape
        stats = cls(L, HKV, D, device=state["sum"].device)
        stats.count.copy_(state["count"])
        stats.sum.copy_(state["sum"])
        stats.outer.copy_(state["outer"])
        return stats

    def __repr__(self) -> str:
        return (
            f"KeyStatistics(L={self.num_layers}, HKV={self.num_kv_heads}, D={self.head_dim}, tokens={self.num_tokens})"
        )
