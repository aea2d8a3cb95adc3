"""The ``loki`` command line.

Each subcommand lives next to the code it drives and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this module only wires them up.  Only the module of the command that runs is imported, and
the command modules import torch, transformers and the kernels inside ``run``: ``loki --help``, ``loki --version``
and ``loki COMMAND --help`` import none of them (tests/test_cli_startup.py).

A user error is one line ``error: ...`` on stderr and exit status 2: argparse's own errors, a
:class:`~loki.evaluation.commands.UsageError` raised by a command's checks (every argument, file and schema is
checked before a model loads), and a model or text wheel that is not installed
(:class:`~loki.embedded.EmbeddedModelError`, which says how to install it).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("loki.evaluation.check", "the main job: calibrate (or reuse) a basis on the embedded default model, "
              "run the accuracy suite, write a report and fail when a gate fails"),
    "calibrate": ("loki.evaluation.commands.calibrate", "fit PCA bases of a model's keys on a calibration corpus"),
    "analyze": ("loki.evaluation.commands.analyze", "Rank@v of keys per layer and head, with plots"),
    "ppl": ("loki.evaluation.commands.ppl", "perplexity of a model under a sparse-attention method"),
    "compare": ("loki.evaluation.commands.compare", "the field's sparse-attention methods at matched bytes per step"),
    "fidelity": ("loki.evaluation.fidelity", "the fidelity study: score-aware bases, budget splits and GQA modes "
                 "against the paper-faithful Loki at equal bytes"),
    "generate": ("loki.evaluation.commands.generate", "generate text with Loki attention (a demo)"),
    "eval": ("loki.evaluation.commands.eval", "run lm-eval tasks (local, offline) through the Loki model"),
    "bench": ("loki.bench.harness", "benchmark the decode kernels against torch SDPA, or with --e2e "
              "whole-model decoding (dense and Loki, eager and compiled; needs a CUDA GPU)"),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loki",
        description="Loki: low-rank-key sparse attention. Calibrate PCA bases of attention keys, evaluate "
        "sparse attention methods on real models, and benchmark the decode kernels.",
    )
    from loki._version import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == load:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if isinstance(getattr(args, "device", None), str):
        from loki.evaluation.models import resolve_device

        try:
            resolve_device(args.device)
        except ValueError as exc:
            print(f"error: --device: {exc}", file=sys.stderr)
            return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    from loki.embedded import EmbeddedModelError
    from loki.evaluation.commands import UsageError

    try:
        return int(module.run(args) or 0)
    except (UsageError, EmbeddedModelError) as exc:
        # a user error (or a model or text wheel that is not installed): one line, exit status 2, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
