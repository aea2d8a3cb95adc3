"""ASV plugin of the Loki suite (``asv.conf.json``: ``"plugins": [".ci.asv_plugin"]``, imported by ASV from the
configuration's folder before every command).

- ``asv run``: the suite runs in ASV's *existing* environment, where ASV saves results only when told which
  commit they belong to (``--set-commit-hash``); without it ASV measures everything and silently saves nothing,
  while still rewriting the benchmark list and the machine file under ``results_dir`` (the committed
  ``.asv/results``).  Such a run now says so, before and after, and writes those two files to a scratch folder
  (``<env_dir>/unsaved-results``, git-ignored): a run that saves nothing changes nothing in the repository.
- ``asv run`` says why every ``n/a`` is n/a: ASV records a skipped benchmark as ``n/a`` and drops the reason; the
  benchmarks record it (``benchmarks._common.skip``) in a file named by ``$LOKI_ASV_SKIP_LOG``, which this plugin
  sets around the run, and after it every n/a case of the results the run wrote is listed with its reason, grouped
  (:func:`na_report`).
- ``asv run`` without stored machine information: ASV asks its questions at a console and fails elsewhere ("No
  information stored about machine"); the plugin records ASV's defaults instead, as ``asv machine --yes`` does, and
  says so (name the machine with ``asv machine --machine NAME --yes`` or ``asv run --machine NAME``).
- ``asv run`` ended by SIGTERM (``timeout``, a cancelled job) stops its benchmark processes: the plugin turns the
  signal into an interrupt, so ASV's own cleanup kills the process groups it put them in.
- ``asv publish``: the pages link every point to its commit and the header to the project.  With
  ``project_url`` / ``show_commit_url`` left empty in ``asv.conf.json`` they are filled from the repository's
  address: ``$LOKI_ASV_REPO_URL``, else ``$GITHUB_SERVER_URL/$GITHUB_REPOSITORY`` (the GPU job), else git's
  remote ``origin``; without any the pages have no links and the command says so.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["SKIP_LOG_ENV", "UNSAVED", "na_report", "repository_url", "setup", "wrap_publish", "wrap_run"]

#: benchmarks._common.SKIP_LOG_ENV (the benchmarks are not importable from ASV's own process)
SKIP_LOG_ENV = "LOKI_ASV_SKIP_LOG"

UNSAVED = "unsaved-results"

_MESSAGE = ("asv run saves NO results here: this suite runs in ASV's existing environment, where ASV saves results "
            "only with --set-commit-hash=<commit> (e.g. --set-commit-hash=$(git rev-parse HEAD)); the benchmark "
            "list and machine file of this run go to {scratch}, not {results} (docs/benchmarks.md)")


def _param_value(text) -> str:
    """ASV stores parameter values as their ``repr``: the plain string (``'bf16'`` -> bf16)."""
    try:
        value = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError):
        return str(text)
    return value if isinstance(value, str) else str(value)


def na_cases(results_dir: str, since: float = 0.0) -> list[tuple[str, tuple[str, ...]]]:
    """``[(benchmark name, parameter values)]`` of every n/a (skipped: NaN) case in the results files under
    ``results_dir`` written at or after ``since`` (a time stamp)."""
    out = []
    for root, _, files in os.walk(results_dir):
        for name in sorted(files):
            path = os.path.join(root, name)
            if not name.endswith(".json") or name in ("machine.json", "benchmarks.json"):
                continue
            if os.path.getmtime(path) < since:
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
                cols = data["result_columns"]
                i_res, i_par = cols.index("result"), cols.index("params")
                rows = data["results"].items()
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            for bench, row in rows:
                row = list(row) + [None] * (len(cols) - len(row))
                params = row[i_par] or []
                values = row[i_res] if isinstance(row[i_res], list) else [row[i_res]]
                combos = list(itertools.product(*params)) if params else [()]
                for combo, value in zip(combos, values):
                    if isinstance(value, float) and math.isnan(value):
                        out.append((bench, tuple(_param_value(v) for v in combo)))
    return out


def na_report(results_dir: str | None, log_path: str | None, since: float = 0.0) -> list[str]:
    """Every n/a case of the run with its reason, grouped by reason: one line per reason with the count of cases
    and the benchmark classes.  The reasons are those the benchmarks recorded in ``log_path``
    (``benchmarks._common.skip``); n/a cases of the results files the run wrote under ``results_dir``
    (:func:`na_cases`) that recorded none get a line of their own, naming them."""
    reasons: dict[tuple[str, tuple[str, ...]], str] = {}
    if log_path and os.path.isfile(log_path):
        with open(log_path, encoding="utf-8") as f:
            for line in f:
                try:
                    e = json.loads(line)
                    reasons[(e["benchmark"], tuple(e["params"]))] = e["reason"]
                except (ValueError, KeyError, TypeError):
                    continue
    groups: dict[str, set[str]] = {}
    for (cls, params), why in reasons.items():
        groups.setdefault(why, set()).add(cls + (f"({', '.join(params)})" if params else ""))
    unexplained = []
    for bench, params in na_cases(results_dir, since) if results_dir else ():
        cls = ".".join(bench.split(".")[:2])
        if (cls, params) not in reasons and (cls, ()) not in reasons:
            unexplained.append(bench + (f"({', '.join(params)})" if params else ""))
    lines = []
    for why, cases in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        classes = sorted({c.split("(")[0] for c in cases})
        lines.append(f"n/a because {why}: {len(cases)} case(s) of {', '.join(classes)}")
    if unexplained:
        lines.append(f"n/a without a recorded reason: {len(unexplained)} case(s): {', '.join(unexplained[:5])}"
                     + (" ..." if len(unexplained) > 5 else ""))
    return lines


def _ensure_machine(kwargs, log) -> None:
    """Record ASV's default machine information (as ``asv machine --yes``) when none is stored for the machine a
    run will use and there is no console to ask at: ASV would fail with "No information stored about machine"."""
    try:
        from asv.machine import Machine, MachineCollection
        from asv.util import UserError
    except ImportError:  # pragma: no cover - an ASV without these classes asks as it always did
        return
    name = kwargs.get("machine") or Machine.get_unique_machine_name()
    try:
        MachineCollection.load(name, _path=kwargs.get("_machine_file"))
        return
    except UserError:
        pass
    if sys.stdout.isatty() and not kwargs.get("machine"):
        return  # ASV asks its questions at the console
    info = dict(Machine.get_defaults(), machine=name)
    MachineCollection.save(name, {k: info[k] for k, _ in Machine.fields}, _path=kwargs.get("_machine_file"))
    log.warning(f"asv run: no machine information was stored for {name!r}; recorded ASV's defaults (as `asv "
                f"machine --machine {name} --yes`) in ~/.asv-machine.json; results are filed under that machine name")


def _interrupt_on_sigterm():
    """Make SIGTERM (``timeout``, a job's cancel) interrupt ``asv run`` like Ctrl-C, so that ASV's own cleanup stops
    its benchmark processes: ASV puts each in a process group of its own and kills those groups on an exception,
    but a plain SIGTERM ends ASV at once and leaves them running.  Returns the previous handler to restore, or None
    (not the main thread, or a handler of someone else's is in place)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        return None

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # `timeout` signals the process group too: clean up once
        raise KeyboardInterrupt(f"asv run: signal {signum} (SIGTERM): stopping the benchmark processes")

    signal.signal(signal.SIGTERM, interrupt)
    return previous


def wrap_run(run_cls, log, ensure_machine=None) -> None:
    """Wrap ``run_cls.run`` (asv's ``Run.run`` classmethod) once: a run in an existing environment without
    ``set_commit_hash`` warns and writes under the scratch folder instead of ``results_dir``; every n/a case is
    listed with its reason after the run; ``ensure_machine(kwargs, log)`` (:func:`_ensure_machine` under ASV) runs
    first."""
    if getattr(run_cls.run, "_loki_wrapped", False):
        return
    original = run_cls.run.__func__

    def measured(cls, conf, *args, **kwargs):
        if ensure_machine is not None:
            ensure_machine(kwargs, log)
        fd, skip_log = tempfile.mkstemp(prefix="loki-asv-skips-", suffix=".jsonl")
        os.close(fd)
        previous = os.environ.get(SKIP_LOG_ENV)
        os.environ[SKIP_LOG_ENV] = skip_log
        since = time.time() - 1.0
        handler = _interrupt_on_sigterm()
        try:
            return original(cls, conf, *args, **kwargs)
        finally:
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)
            if previous is None:
                os.environ.pop(SKIP_LOG_ENV, None)
            else:
                os.environ[SKIP_LOG_ENV] = previous
            for line in na_report(conf.results_dir, skip_log, since):
                log.info(line)
            try:
                os.unlink(skip_log)
            except OSError:
                pass

    def run(cls, conf, *args, **kwargs):
        if kwargs.get("set_commit_hash") is None and getattr(conf, "environment_type", None) == "existing":
            scratch = os.path.join(conf.env_dir, UNSAVED)
            msg = _MESSAGE.format(scratch=scratch, results=conf.results_dir)
            log.warning(msg)
            conf.results_dir = scratch
            try:
                return measured(cls, conf, *args, **kwargs)
            finally:
                log.warning(msg)
        return measured(cls, conf, *args, **kwargs)

    run._loki_wrapped = True
    run_cls.run = classmethod(run)


def _web_url(remote: str) -> str | None:
    """``https://host/owner/name`` of a git remote (``git@host:owner/name.git``, ``https://host/owner/name.git``,
    ``ssh://git@host/owner/name``), or None for a local path."""
    remote = remote.strip()
    m = re.match(r"^(?:ssh://)?[\w.-]+@([\w.-]+)[:/](.+?)(?:\.git)?/?$", remote)
    if m:
        return f"https://{m.group(1)}/{m.group(2)}"
    m = re.match(r"^(https?)://(?:[^@/]+@)?([^/]+)/(.+?)(?:\.git)?/?$", remote)
    if m:
        return f"{m.group(1)}://{m.group(2)}/{m.group(3)}"
    return None


def repository_url(repo_dir: str = ".", environ=None) -> str | None:
    """The repository's web address (see the module docstring), or None."""
    env = os.environ if environ is None else environ
    if env.get("LOKI_ASV_REPO_URL"):
        return env["LOKI_ASV_REPO_URL"].rstrip("/")
    if env.get("GITHUB_SERVER_URL") and env.get("GITHUB_REPOSITORY"):
        return f"{env['GITHUB_SERVER_URL'].rstrip('/')}/{env['GITHUB_REPOSITORY']}"
    try:
        proc = subprocess.run(["git", "-C", repo_dir, "remote", "get-url", "origin"], capture_output=True,
                              text=True, check=False)
    except OSError:
        return None
    return _web_url(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None


def wrap_publish(publish_cls, log, environ=None) -> None:
    """Wrap ``publish_cls.run`` once: empty ``project_url`` / ``show_commit_url`` are filled from
    :func:`repository_url`; when there is none, the command says the pages have no links."""
    if getattr(publish_cls.run, "_loki_wrapped", False):
        return
    original = publish_cls.run.__func__

    def run(cls, conf, *args, **kwargs):
        if not conf.project_url or not conf.show_commit_url or conf.show_commit_url == "#":
            url = repository_url(getattr(conf, "repo", "."), environ)
            if url:
                conf.project_url = conf.project_url if conf.project_url not in ("", "#") else url
                conf.show_commit_url = f"{url}/commit/"
            else:
                log.warning("asv publish: no repository address (set LOKI_ASV_REPO_URL or a git remote 'origin'): "
                            "the pages link to no commit")
        return original(cls, conf, *args, **kwargs)

    run._loki_wrapped = True
    publish_cls.run = classmethod(run)


def setup() -> None:
    """Called by ASV's plugin manager on import."""
    from asv.commands.publish import Publish
    from asv.commands.run import Run
    from asv.console import log

    wrap_run(Run, log, _ensure_machine)
    wrap_publish(Publish, log)
