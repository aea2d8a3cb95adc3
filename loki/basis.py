"""The PCA basis of the keys of a model: :class:`PCABasis`.

Shape letters: L = decoder layers, HKV = key/value heads, D = head dim.

``components[l, h]`` is an orthogonal ``[D, D]`` matrix whose columns are the principal components of the keys
of layer ``l``, KV head ``h``, sorted by decreasing eigenvalue, so that ``k_hat = k @ components[l, h]`` and the
first ``d`` coordinates of ``k_hat`` are the rank-``d`` projection used by Loki.

Centring: the basis is fit on the centred covariance of the keys, but keys are **not** centred at inference.
For orthogonal ``P``, ``(q P)(K P)^T = q K^T`` exactly (Loki, Lemma 1), so centring is not needed for
correctness; the paper's code loads the means and never uses them.  ``means`` are stored for analysis only.

Three kinds of basis (``kind``):

- ``"pca"`` (the paper's): ``components`` is orthogonal and both queries and keys are rotated by it.
- ``"channels"`` (Double Sparsity's label channels, :func:`loki.calibration.channels.channel_basis`): ``components``
  are permutation matrices putting the channels of largest calibrated ``|q_j k_j|`` first (``eigenvalues`` hold
  those contributions), so Loki with ``d = r`` scores with the ``r`` label channels.
- ``"score"`` (score-aware, :func:`loki.calibration.score_aware.score_aware_basis`): an invertible pair chosen so
  that the first ``d`` coordinates give the best rank-``d`` approximation of the scores ``q . k`` over the
  calibration queries and keys (not of the keys alone).  Keys use ``components`` (``k_hat = k @ P_k``), queries
  use ``query_components`` (``q_hat = q @ P_q``) with ``P_q P_k^T = I``, so ``q_hat . k_hat = q . k`` exactly and
  Lemma 1 still holds: the kernels and the cache are the same, only the query transform differs.

Files are safetensors with tensors ``components`` (float32), ``eigenvalues`` and ``means`` (float64), for score
bases also ``query_components`` (float32), and the metadata as string metadata: a JSON blob under
``loki.basis`` plus a few plain keys for quick inspection.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from loki._basis_checks import _FORMAT, _META_KEY, BasisError, constant_heads, is_basis_file
from loki._hf import (
    config_fields,
    config_fingerprint,
    config_head_dim,
    config_identity,
    config_kv_heads,
    config_model_name,
    expected_shape,
)
from loki._io import atomic_path
from loki._version import __version__
from loki.spectrum import explained_variance_ratio, pca_from_statistics, rank_at

__all__ = [
    "KIND_CHOICES",
    "ROTARY_CHOICES",
    "BasisError",
    "PCABasis",
    "constant_heads",
    "is_basis_file",
    "config_fields",
    "config_fingerprint",
    "config_head_dim",
    "config_kv_heads",
    "config_model_name",
    "expected_shape",
]

ROTARY_CHOICES = ("pre", "post")
KIND_CHOICES = ("pca", "score", "channels")
_OPT_STR = ((str, type(None)), "a string or null")
#: The metadata fields of a basis and the JSON types a file may give them.
_METADATA_TYPES = {
    "model_name": _OPT_STR,
    "config_hash": _OPT_STR,
    "config_fields": ((dict, type(None)), "a JSON object or null"),
    "corpus": _OPT_STR,
    "num_tokens": ((int,), "an integer"),
    "seq_len": ((int, type(None)), "an integer or null"),
    "rotary": ((str,), "a string"),
    "model_dtype": _OPT_STR,
    "loki_version": ((str,), "a string"),
    "centered": ((bool,), "true or false"),
    "kind": ((str,), "a string"),
    "extra": ((dict,), "a JSON object"),
}


def _shape(t: torch.Tensor | tuple) -> list[int]:
    return [int(s) for s in t]


@dataclass
class PCABasis:
    """Per-(layer, KV head) PCA basis of a model's keys.

    Tensors:
        components: ``[L, HKV, D, D]`` float32, orthogonal, principal components as columns sorted by decreasing
            eigenvalue (``k_hat = k @ components[l, h]``).
        eigenvalues: ``[L, HKV, D]`` float64, decreasing, variance of the keys along each component.
        means: ``[L, HKV, D]`` float64, mean key; for analysis only (keys are not centred at inference, see the
            module docstring).

        query_components: ``[L, HKV, D, D]`` float32 for ``kind="score"`` bases (``q_hat = q @ P_q``,
            ``P_q P_k^T = I``); ``None`` for PCA bases, whose queries use ``components``.
        For a score basis ``eigenvalues`` holds the singular values of the score operator (decreasing).

    Metadata: ``kind`` ("pca", "score" or "channels"), ``model_name``,
    ``config_hash`` (:func:`config_fingerprint`), ``config_fields`` (the hashed fields,
    for readable mismatch messages), ``corpus``, ``num_tokens``, ``seq_len`` (tokens per calibration sequence),
    ``max_positions`` (the basis was fitted on keys at positions ``[0, max_positions)``; ``None`` for files
    written before it was recorded: then ``seq_len`` bounds them), ``rotary`` ("pre": keys before the
    rotary embedding, "post": keys as the KV cache stores them), ``model_dtype`` (dtype of the model during
    calibration), ``loki_version`` and ``centered`` (whether the covariance was centred before the PCA).
    """

    components: torch.Tensor
    eigenvalues: torch.Tensor
    means: torch.Tensor
    model_name: str | None = None
    config_hash: str | None = None
    config_fields: dict[str, Any] | None = None
    corpus: str | None = None
    num_tokens: int = 0
    seq_len: int | None = None
    max_positions: int | None = None
    rotary: str = "post"
    model_dtype: str | None = None
    loki_version: str = __version__
    centered: bool = True
    kind: str = "pca"
    query_components: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ shapes and views
    @property
    def num_layers(self) -> int:
        return int(self.components.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.components.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.components.shape[-1])

    def layer(self, layer: int) -> torch.Tensor:
        """Components of one layer: ``[HKV, D, D]``."""
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return self.components[layer]

    def query_layer(self, layer: int) -> torch.Tensor:
        """The query transform of one layer, ``[HKV, D, D]``: ``query_components`` for a score basis, else the
        (orthogonal) components themselves."""
        if self.query_components is None:
            return self.layer(layer)
        self.layer(layer)  # range check
        return self.query_components[layer]

    @property
    def queries(self) -> torch.Tensor:
        """``[L, HKV, D, D]`` query transform (``components`` for PCA bases)."""
        return self.components if self.query_components is None else self.query_components

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> PCABasis:
        """A copy on ``device`` with ``components`` and ``means`` cast to ``dtype`` (eigenvalues keep float64)."""
        qc = self.query_components
        return replace(
            self,
            query_components=None if qc is None else qc.to(device=device, dtype=dtype),
            components=self.components.to(device=device, dtype=dtype),
            means=self.means.to(device=device, dtype=dtype),
            eigenvalues=self.eigenvalues.to(device=device),
            extra=dict(self.extra),
        )

    def rank_at(self, v: float) -> torch.Tensor:
        """Rank@v per layer and head, ``[L, HKV]`` int64 (see :func:`loki.spectrum.rank_at`)."""
        return rank_at(self.eigenvalues, v)

    def explained_variance(self) -> torch.Tensor:
        """Cumulative explained-variance ratio ``[L, HKV, D]`` (last entry 1)."""
        return explained_variance_ratio(self.eigenvalues)

    def __repr__(self) -> str:
        return (
            f"PCABasis(L={self.num_layers}, HKV={self.num_kv_heads}, D={self.head_dim}, rotary={self.rotary!r}, "
            f"model={self.model_name!r}, corpus={self.corpus!r}, tokens={self.num_tokens}, seq_len={self.seq_len}, "
            f"max_positions={self.max_positions})"
        )

    @property
    def covered_positions(self) -> int | None:
        """Keys at positions below this were in the calibration (``max_positions``, else ``seq_len``)."""
        return self.max_positions if self.max_positions is not None else self.seq_len

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_statistics(
        cls,
        stats,
        *,
        rotary: str = "post",
        config=None,
        model_name: str | None = None,
        corpus: str | None = None,
        seq_len: int | None = None,
        max_positions: int | None = None,
        model_dtype: torch.dtype | str | None = None,
        centered: bool = True,
    ) -> PCABasis:
        """Fit the basis from :class:`~loki.calibration.stats.KeyStatistics` (PCA in float64).

        ``config`` (a transformers config) fills ``config_hash``/``config_fields`` and, if ``model_name`` is not
        given, the model name.  A head whose keys have no variance (constant keys, or a single token) gets the
        identity basis with zero eigenvalues and a warning naming it; statistics holding NaN or inf, or without
        variance in any head, raise :class:`BasisError` naming the layer and KV head (:func:`constant_heads`).
        """
        if centered:
            constant = constant_heads(stats, "keys")
        else:  # the uncentred second moment of constant keys still has their direction
            constant = constant_heads(stats, "keys", rel_tol=-1.0)
        components, eigenvalues, means = pca_from_statistics(stats, centered=centered)
        if bool(constant.any()):
            D = components.shape[-1]
            components[constant] = torch.eye(D, dtype=components.dtype)
            eigenvalues[constant] = 0.0
        return cls(
            components=components.to(torch.float32).cpu().contiguous(),
            eigenvalues=eigenvalues.cpu().contiguous(),
            means=means.cpu(),
            **config_identity(config, model_name),
            corpus=corpus,
            num_tokens=stats.num_tokens,
            seq_len=seq_len,
            max_positions=max_positions,
            rotary=rotary,
            model_dtype=_dtype_name(model_dtype),
            centered=centered,
        )

    @classmethod
    def identity(cls, num_layers: int, num_kv_heads: int, head_dim: int, **metadata: Any) -> PCABasis:
        """Identity components (keys used in their own coordinates), unit eigenvalues, zero means."""
        L, HKV, D = num_layers, num_kv_heads, head_dim
        eye = torch.eye(D, dtype=torch.float32).expand(L, HKV, D, D).clone()
        return cls(
            components=eye,
            eigenvalues=torch.ones(L, HKV, D, dtype=torch.float64),
            means=torch.zeros(L, HKV, D, dtype=torch.float64),
            **metadata,
        )

    @classmethod
    def random(cls, num_layers: int, num_kv_heads: int, head_dim: int, seed: int = 0, **metadata: Any) -> PCABasis:
        """Random orthogonal components (QR of a Gaussian, Haar-distributed) and random decreasing eigenvalues,
        drawn from ``seed`` on the CPU; for tests."""
        L, HKV, D = num_layers, num_kv_heads, head_dim
        gen = torch.Generator().manual_seed(seed)
        q, r = torch.linalg.qr(torch.randn(L, HKV, D, D, generator=gen, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
        eig = torch.rand(L, HKV, D, generator=gen, dtype=torch.float64).sort(dim=-1, descending=True).values
        return cls(
            components=q.to(torch.float32),
            eigenvalues=eig,
            means=torch.zeros(L, HKV, D, dtype=torch.float64),
            **metadata,
        )

    # ------------------------------------------------------------------ validation
    def validate(self, config=None, model_name: str | None = None, atol: float = 1e-3) -> PCABasis:
        """Check dtypes (components float32 or float64: a bfloat16 or float16 basis is refused, naming its dtype),
        shapes, finiteness, orthonormality (``P^T P ~ I`` within ``atol``) and decreasing eigenvalues, and, with
        ``config``, that the basis was calibrated for this architecture.  Returns ``self``.

        Raises:
            BasisError: naming the problem; a basis calibrated for another model (config fingerprint mismatch)
                names both models and the fields that differ.
        """
        self._check_field_types()
        comp, eig, means = self.components, self.eigenvalues, self.means
        if comp.ndim != 4 or comp.shape[-1] != comp.shape[-2]:
            raise BasisError(f"basis components must have shape [L, HKV, D, D], got {_shape(comp.shape)}")
        L, HKV, D = (int(s) for s in comp.shape[:3])
        for name, t in (("eigenvalues", eig), ("means", means)):
            if _shape(t.shape) != [L, HKV, D]:
                raise BasisError(f"basis {name} have shape {_shape(t.shape)} but components imply [{L}, {HKV}, {D}]")
        if self.rotary not in ROTARY_CHOICES:
            raise BasisError(f"basis rotary must be one of {ROTARY_CHOICES}, got {self.rotary!r}")
        if self.kind not in KIND_CHOICES:
            raise BasisError(f"basis kind must be one of {KIND_CHOICES}, got {self.kind!r}")
        qc = self.query_components
        if (qc is not None) != (self.kind == "score"):
            need = "needs" if self.kind == "score" else "must not have"
            raise BasisError(f"a {self.kind!r} basis {need} query_components")
        if qc is not None and _shape(qc.shape) != _shape(comp.shape):
            raise BasisError(f"basis query_components have shape {_shape(qc.shape)}, components {_shape(comp.shape)}")

        if config is not None:
            want = expected_shape(config)
            if (L, HKV, D) != want:
                names = ("num_hidden_layers", "num_key_value_heads", "head_dim")
                diff = ", ".join(f"{n}={w}" for n, g, w in zip(names, (L, HKV, D), want) if g != w)
                raise BasisError(
                    f"basis components have shape {_shape(comp.shape)} but config expects "
                    f"{[*want, want[-1]]} ({diff}); the basis was calibrated for {self.model_name!r}, "
                    f"the model is {config_model_name(config)!r}"
                )

        named = [("components", comp), ("eigenvalues", eig), ("means", means)]
        if qc is not None:
            named.append(("query_components", qc))
        for name, t in named:
            if not torch.isfinite(t).all():
                bad = ~torch.isfinite(t)
                per_head = bad.flatten(2).any(dim=-1) if bad.ndim > 2 else bad  # [L, HKV]
                l, h = (int(i) for i in per_head.nonzero()[0])
                heads = int(per_head.sum())
                more = f" and {heads - 1} more head(s)" if heads > 1 else ""
                raise BasisError(f"basis {name} contain {int(bad.sum())} non-finite values (NaN or inf): layer {l}, "
                                 f"KV head {h}{more}")

        p = comp.to(torch.float64)
        if qc is None:
            gram, what = p.transpose(-1, -2) @ p, "not orthonormal: max |P^T P - I|"
        else:  # q_hat . k_hat = q P_q P_k^T k^T must equal q . k
            gram, what = qc.to(torch.float64) @ p.transpose(-1, -2), "not a dual pair: max |P_q P_k^T - I|"
        err = (gram - torch.eye(D, dtype=torch.float64, device=p.device)).abs().amax(dim=(-1, -2))  # [L, HKV]
        worst = float(err.max()) if err.numel() else 0.0
        if worst > atol:
            l, h = divmod(int(err.argmax()), HKV)
            raise BasisError(f"basis components are {what} = {worst:.3g} > atol={atol:g} (layer {l}, KV head {h})")

        if D > 1:
            rises = eig[..., 1:] - eig[..., :-1]
            tol = 1e-6 * eig.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
            if (rises > tol).any():
                l, h = divmod(int((rises > tol).any(dim=-1).flatten().nonzero()[0]), HKV)
                raise BasisError(f"basis eigenvalues of layer {l}, KV head {h} are not in decreasing order")

        if config is not None and self.config_hash is not None:
            theirs = config_fingerprint(config)
            if theirs != self.config_hash:
                raise BasisError(self._mismatch_message(config, theirs))
        if model_name is not None and self.model_name is not None and model_name != self.model_name:
            warnings.warn(
                f"basis was calibrated on {self.model_name!r} but is used with {model_name!r} "
                "(same architecture, possibly different weights)",
                stacklevel=2,
            )
        return self

    def _check_field_types(self) -> None:
        """Every field has the type the file format promises (metadata read from a file may not)."""
        for name in ("components", "eigenvalues", "means", "query_components"):
            t = getattr(self, name)
            if t is None and name == "query_components":
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise BasisError(f"basis {name} must be a floating torch.Tensor, got {type(t).__name__}")
            if name in ("components", "query_components") and t.dtype not in (torch.float32, torch.float64):
                raise BasisError(
                    f"basis {name} are {_dtype_name(t.dtype)}; a basis must be float32 or float64: "
                    f"{_dtype_name(t.dtype)} rounding alone moves P^T P off the identity by about "
                    f"{torch.finfo(t.dtype).eps:.0e}, and the scores are computed in float32 whatever the model's "
                    "dtype, so nothing is gained; keep the float32 basis (PCABasis.load and calibrate give one; "
                    "casting a rounded basis back does not restore it)")
        for name, (types, what) in _METADATA_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, bool) and bool not in types or not isinstance(value, types):
                raise BasisError(f"basis metadata {name!r} must be {what}, got {type(value).__name__} {value!r}")
        if self.num_tokens < 0:
            raise BasisError(f"basis metadata 'num_tokens' must be >= 0, got {self.num_tokens}")
        if self.seq_len is not None and self.seq_len < 1:
            raise BasisError(f"basis metadata 'seq_len' must be >= 1 or null, got {self.seq_len}")

    def _mismatch_message(self, config, theirs: str) -> str:
        ours_fields = self.config_fields or {}
        their_fields = config_fields(config)
        diffs = [
            f"{k}: basis {ours_fields.get(k)!r} vs model {their_fields.get(k)!r}"
            for k in sorted(set(ours_fields) | set(their_fields))
            if ours_fields.get(k) != their_fields.get(k)
        ]
        detail = f"; differing fields: {'; '.join(diffs)}" if diffs and ours_fields else ""
        return (
            f"basis was calibrated for another model: {self.model_name!r} (config sha256 {self.config_hash[:12]}) "
            f"but the model is {config_model_name(config)!r} (config sha256 {theirs[:12]}){detail}"
        )

    # ------------------------------------------------------------------ I/O
    def metadata(self) -> dict[str, Any]:
        """All metadata fields as a JSON-able dict."""
        skip = {"components", "eigenvalues", "means", "query_components"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    def save(self, path: str | os.PathLike) -> None:
        """Write the basis to a safetensors file at ``path`` (tensors contiguous on CPU, metadata as JSON).

        The basis is :meth:`validate` d first (an invalid basis raises :class:`BasisError` and nothing is written,
        so a good file at ``path`` is never replaced by one that cannot be loaded), and the file is written under
        a temporary name in the same folder, then renamed over ``path``: an interrupted save leaves the previous
        file intact.  Raises ``IsADirectoryError`` when ``path`` is a folder and ``FileNotFoundError`` when its
        folder does not exist.
        """
        from safetensors.torch import save_file

        self.validate()
        path = os.fspath(path)
        if os.path.isdir(path):
            raise IsADirectoryError(f"cannot save the PCA basis to {path}: it is a directory, not a file path")
        meta = self.metadata()
        str_meta = {
            "format": "pt",
            "loki.format": _FORMAT,
            _META_KEY: json.dumps(meta, sort_keys=True),
        }
        for key in ("model_name", "config_hash", "corpus", "rotary", "kind", "num_tokens", "seq_len", "max_positions",
                    "loki_version"):
            if meta.get(key) is not None:
                str_meta[key] = str(meta[key])
        tensors = {
            "components": self.components.detach().to("cpu", torch.float32).contiguous(),
            "eigenvalues": self.eigenvalues.detach().to("cpu").contiguous(),
            "means": self.means.detach().to("cpu").contiguous(),
        }
        if self.query_components is not None:
            tensors["query_components"] = self.query_components.detach().to("cpu", torch.float32).contiguous()
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"cannot save the PCA basis to {path}: folder {folder} does not exist")
        with atomic_path(path) as tmp:
            save_file(tensors, tmp, metadata=str_meta)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        config=None,
        model_name: str | None = None,
        device: torch.device | str = "cpu",
        atol: float = 1e-3,
    ) -> PCABasis:
        """Read a basis written by :meth:`save` and :meth:`validate` it (against ``config`` when given).

        Raises:
            FileNotFoundError: no file at ``path``.
            BasisError: the file is corrupt or truncated, lacks tensors or metadata, or fails validation; the
                message names ``path``.
        """
        from safetensors import safe_open

        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no PCA basis file at {path}")
        if os.path.isdir(path):
            raise BasisError(f"{path} is a directory, not a PCA basis file")
        try:
            with safe_open(path, framework="pt", device=str(device)) as f:
                str_meta = f.metadata() or {}
                names = set(f.keys())
                missing = [n for n in ("components", "eigenvalues", "means") if n not in names]
                if missing:
                    raise BasisError(f"basis file {path} lacks tensor(s) {', '.join(missing)}")
                tensors = {n: f.get_tensor(n) for n in ("components", "eigenvalues", "means", "query_components")
                           if n in names}
        except BasisError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError, OSError, RuntimeError, ...
            raise BasisError(f"cannot read PCA basis file {path} (corrupt or truncated?): {exc}") from exc
        if _META_KEY not in str_meta:
            raise BasisError(f"basis file {path} has no '{_META_KEY}' metadata (not written by PCABasis.save?)")
        try:
            meta = json.loads(str_meta[_META_KEY])
        except json.JSONDecodeError as exc:
            raise BasisError(f"basis file {path} has unreadable '{_META_KEY}' metadata: {exc}") from exc
        if not isinstance(meta, dict):
            raise BasisError(f"basis file {path}: '{_META_KEY}' metadata must be a JSON object, got "
                             f"{type(meta).__name__}")
        if not isinstance(meta.get("extra", {}), dict):
            raise BasisError(f"basis file {path}: basis metadata 'extra' must be a JSON object, got "
                             f"{type(meta['extra']).__name__}")
        known = {f.name for f in fields(cls)} - {"components", "eigenvalues", "means", "query_components"}
        extra = {k: v for k, v in meta.items() if k not in known}
        meta = {k: v for k, v in meta.items() if k in known}
        meta.setdefault("extra", {}).update(extra)
        basis = cls(**tensors, **meta)
        try:
            basis.validate(config=config, model_name=model_name, atol=atol)
        except BasisError as exc:
            raise BasisError(f"{path}: {exc}") from None
        return basis


def _dtype_name(dtype: torch.dtype | str | None) -> str | None:
    if dtype is None:
        return None
    return str(dtype).replace("torch.", "")
