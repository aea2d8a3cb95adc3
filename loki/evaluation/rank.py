"""Rank@v analysis of calibrated key bases, with plots (PNG, matplotlib's Agg canvas; pyplot is not used).

Rank@v (Loki, Section 3): the fewest principal components whose eigenvalues hold ``v`` percent of the keys'
variance.  Shape letters: L = layers, HKV = key/value heads, D = head dim.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from loki.basis import PCABasis

__all__ = [
    "rank_summary",
    "plot_rank_per_layer",
    "plot_rank_heatmap",
    "plot_explained_variance",
    "write_rank_plots",
]


def rank_summary(bases: dict[str, PCABasis], vs: tuple[float, ...] = (90.0,)) -> dict:
    """Rank@v per basis: ``{name: {"v90": {"per_layer": [L] mean over heads, "per_head": [[HKV]] * L,
    "mean": float, "mean_fraction": mean / D}, "D": D, "rotary": ..., "corpus": ...}}`` (JSON-able)."""
    out: dict = {}
    for name, basis in bases.items():
        entry: dict = {"D": basis.head_dim, "rotary": basis.rotary, "corpus": basis.corpus,
                       "num_tokens": basis.num_tokens}
        for v in vs:
            r = basis.rank_at(v)  # [L, HKV]
            mean = float(r.double().mean())
            entry[f"v{v:g}"] = {
                "per_layer": [round(float(x), 3) for x in r.double().mean(dim=1)],
                "per_head": r.tolist(),
                "mean": round(mean, 3),
                "mean_fraction": round(mean / basis.head_dim, 4),
            }
        out[name] = entry
    return out


def _figure(figsize):
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, dpi=110, layout="constrained")


def _save(fig, path: str | os.PathLike) -> Path:
    from loki._io import atomic_path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def plot_rank_per_layer(bases: dict[str, PCABasis], path: str | os.PathLike, v: float = 90.0) -> Path:
    """Rank@v per layer (mean over KV heads, with the min-max range shaded), one line per basis (e.g. pre vs
    post rotary)."""
    fig = _figure((7.0, 3.8))
    ax = fig.add_subplot()
    D = None
    for name, basis in bases.items():
        r = basis.rank_at(v).double()  # [L, HKV]
        x = torch.arange(r.shape[0])
        ax.plot(x, r.mean(dim=1), marker="o", ms=3, label=f"{name} (mean {float(r.mean()):.1f})")
        ax.fill_between(x, r.amin(dim=1), r.amax(dim=1), alpha=0.15)
        D = basis.head_dim
    ax.set_xlabel("layer")
    ax.set_ylabel(f"Rank@{v:g} (of D={D})")
    ax.set_title(f"Rank@{v:g} of attention keys per layer")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_rank_heatmap(bases: dict[str, PCABasis], path: str | os.PathLike, v: float = 90.0) -> Path:
    """A layer x KV-head heatmap of Rank@v, one panel per basis, on a shared colour scale."""
    n = len(bases)
    fig = _figure((3.2 * n + 1.0, 5.0))
    ranks = {name: b.rank_at(v) for name, b in bases.items()}
    vmin = min(int(r.min()) for r in ranks.values())
    vmax = max(int(r.max()) for r in ranks.values())
    axes = fig.subplots(1, n, squeeze=False)[0]
    im = None
    for ax, (name, r) in zip(axes, ranks.items()):
        im = ax.imshow(r.numpy(), aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax, origin="lower")
        ax.set_title(name)
        ax.set_xlabel("KV head")
        ax.set_xticks(range(r.shape[1]))
        ax.set_ylabel("layer")
    fig.colorbar(im, ax=list(axes), label=f"Rank@{v:g}")
    return _save(fig, path)


def plot_explained_variance(
    bases: dict[str, PCABasis], path: str | os.PathLike, layers: list[int] | None = None
) -> Path:
    """Cumulative explained variance against the number of components (mean over KV heads) for a few layers,
    one panel per basis; the dashed line marks 90%."""
    n = len(bases)
    fig = _figure((4.0 * n, 3.6))
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (name, basis) in zip(axes, bases.items()):
        ev = basis.explained_variance().mean(dim=1)  # [L, D]
        L, D = ev.shape
        chosen = layers if layers is not None else sorted({0, 1, L // 4, L // 2, (3 * L) // 4, L - 1})
        x = torch.arange(1, D + 1)
        for l in chosen:
            ax.plot(x, ev[l], label=f"layer {l}")
        ax.axhline(0.9, ls="--", color="grey", lw=0.8)
        ax.set_xlabel("principal components")
        ax.set_ylabel("explained variance")
        ax.set_title(name)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def write_rank_plots(bases: dict[str, PCABasis], out_dir: str | os.PathLike, v: float = 90.0) -> dict[str, str]:
    """Write the three plots into ``out_dir``; returns ``{plot name: file name}``."""
    out_dir = Path(out_dir)
    files = {
        "rank_per_layer": plot_rank_per_layer(bases, out_dir / f"rank{v:g}_per_layer.png", v),
        "rank_heatmap": plot_rank_heatmap(bases, out_dir / f"rank{v:g}_heatmap.png", v),
        "explained_variance": plot_explained_variance(bases, out_dir / "explained_variance.png"),
    }
    return {k: p.name for k, p in files.items()}
