#!/usr/bin/env python3
"""Benchmark gate: fail a commit whose ASV results miss a threshold or regress against recent commits.

``asv compare`` always exits 0, so this script is the blocking check of the GPU job.  It reads ASV's own
results files (``<results>/<machine>/<hash8>-<env>.json``, api version 2: one row per benchmark, the columns
named by ``result_columns``, parameterised values flattened over the product of the ``params`` lists) and
the benchmark metadata ASV writes beside them (``<results>/benchmarks.json``: units and parameter names).

Checks (all listed in one table, then a summary; exit status 1 when any fails):

- ``threshold``: a value outside its limit.  Speed-up limits are in ``ci/thresholds.json`` (``checks``);
  accuracy limits live in ``loki/evaluation/accuracy_thresholds.json`` (owned by the evaluation code, shipped
  with the package) and are referenced from ``ci/thresholds.json`` by a pointer, never copied.  A gated
  benchmark without a value (failed, skipped or absent from the results) fails, unless ``--allow-missing``;
  nothing else excuses it (a known miss excuses a measured value only).
- ``regression``: a value worse than the baseline by more than the regression factor, in the benchmark's own
  direction (ms and MiB: higher is worse; x, GB/s, Jaccard: lower is worse; perplexity delta: higher is worse).
  The baseline is the median of the same benchmark case over the last ``regression.window`` earlier commits
  with results on the machine (same ASV version of the benchmark), so one noisy past run neither raises nor
  masks a flag.  Cases whose plain timing is launch-bound (``regression.overrides`` with ``skip``: run-to-run
  spread up to 2.6x on identical code) are not compared; their CUDA-graph replays (device time) are.
  Directions come from the unit, overridden by name patterns in ``ci/thresholds.json``; a change smaller than
  ``min_abs_change`` never counts (noise floor for values near zero).  A benchmark that had a value at the
  nearest earlier commit and now failed is a regression too.

The earlier commits are ``--previous`` if given (that one only), else the nearest first-parent ancestors in
``git log`` with results on the machine, else (commits unknown to git) the newest results with an earlier commit
``date``.  With no earlier results the regression check is skipped and said so.

Known misses: ``known_misses`` in ``ci/thresholds.json`` lists failures that are documented, not fixed (a target
the kernels do not reach, a regression flagged on measurement noise), each with ``kind`` (threshold or
regression), ``benchmark`` (fnmatch pattern), optional ``params`` and ``commit`` (hash prefix: the entry applies
to that commit only), the ``measured`` value and the ``reason``.  A failing check an entry matches is still
printed as a failure (``KNOWN`` in the table, ``FAIL ... [known miss: reason]`` in the summary) and still fails
the gate, unless ``--allow-known-misses`` is given; then only unlisted failures fail.  An entry excuses a value
no worse than its ``measured`` value (by at most ``tolerance``, default ``known_miss_tolerance``): a miss that
gets worse fails even with ``--allow-known-misses``.  An entry that matches no failing check of the commit is
reported as stale (the target is now met: remove the entry).

A gate with no checks at all fails (e.g. a ``--bench`` that selects nothing with a value).

Usage::

    python ci/gate.py --results .asv/results --machine h100 [--commit HASH] [--previous HASH] [--bench REGEX]

Exit status: 0 pass, 1 a check failed, 2 the inputs or arguments could not be used (no results for the
commit, a ``--bench`` that matches no benchmark, ...).
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_THRESHOLDS = HERE / "thresholds.json"
DEFAULT_ACCURACY_THRESHOLDS = HERE.parent / "loki" / "evaluation" / "accuracy_thresholds.json"
SKIP_FILES = {"machine.json", "benchmarks.json"}

__all__ = ["GateError", "ResultsFile", "Check", "KnownMiss", "asv_regression_exclusions", "load_known_misses",
           "load_results", "run_gate", "main"]


class GateError(Exception):
    """Inputs that cannot be read or do not identify a commit (exit status 2)."""


# --------------------------------------------------------------------------------------------------
# Reading ASV results


def _param_value(text) -> str:
    """ASV stores parameter values as their ``repr``; compare them as plain strings (``'bf16'`` -> bf16)."""
    if not isinstance(text, str):
        return str(text)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, str) else str(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class ResultsFile:
    """One ASV results file: a commit's values on one machine and environment."""

    path: Path
    commit_hash: str
    env_name: str
    date: float | None
    machine: str
    values: dict[str, list] = field(default_factory=dict)  # name -> flattened values (None / NaN kept)
    params: dict[str, list[list[str]]] = field(default_factory=dict)  # name -> ASV params (value reprs)
    versions: dict[str, str | None] = field(default_factory=dict)  # name -> benchmark version (code hash)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ResultsFile:
        path = Path(path)
        data = read_json(path, "ASV results file")
        if data.get("version") != 2 or not isinstance(data.get("result_columns"), list):
            raise GateError(f"{path}: not an ASV results file of api version 2 (asv 0.6)")
        if not isinstance(data.get("commit_hash"), str) or not isinstance(data.get("results", {}), dict):
            raise GateError(f"{path}: an ASV results file needs 'commit_hash' (a string) and 'results' (an object)")
        columns = data["result_columns"]
        try:
            i_result, i_params = columns.index("result"), columns.index("params")
        except ValueError as exc:
            raise GateError(f"{path}: result_columns lacks 'result' or 'params'") from exc
        i_version = columns.index("version") if "version" in columns else None
        out = cls(
            path=path,
            commit_hash=data["commit_hash"],
            env_name=data.get("env_name") or "",
            date=data.get("date"),
            machine=(data.get("params") or {}).get("machine", path.parent.name),
        )
        for name, row in data.get("results", {}).items():
            if not isinstance(row, list):
                raise GateError(f"{path}: results[{name!r}] is not a row of {len(columns)} columns")
            row = list(row) + [None] * (len(columns) - len(row))  # ASV drops trailing None columns
            params = row[i_params] or []
            result = row[i_result]
            if not isinstance(params, list) or not all(isinstance(p, list) for p in params):
                raise GateError(f"{path}: results[{name!r}] has parameters that are not lists of values")
            n_cases = math.prod(len(p) for p in params) if params else 1
            if result is None:
                result = [None] * n_cases
            elif not isinstance(result, list):
                result = [result]
            out.values[name] = list(result)
            out.params[name] = params
            out.versions[name] = row[i_version] if i_version is not None else None
        return out

    def cases(self, name: str, param_names: list[str] | None) -> list[tuple[dict[str, str], object]]:
        """``[(params, value)]`` of one benchmark, params as ``{name: value}`` (``param1``... if unnamed)."""
        params = self.params.get(name) or []
        values = self.values.get(name, [])
        if not params:
            return [({}, values[0] if values else None)]
        names = list(param_names or [])
        names += [f"param{i + 1}" for i in range(len(names), len(params))]
        out = []
        for combo, value in zip(itertools.product(*params), values):
            out.append(({n: _param_value(v) for n, v in zip(names, combo)}, value))
        return out


def read_json(path: str | os.PathLike, what: str) -> dict:
    """A JSON object from ``path``; any problem (missing, unreadable, not JSON, not an object) is a one-line
    :class:`GateError` naming ``what`` and the file (exit status 2), never a traceback."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GateError(f"{what} {path} cannot be read: {exc.strerror if isinstance(exc, OSError) else exc}") \
            from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise GateError(f"{what} {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GateError(f"{what} {path} must hold a JSON object, not {type(data).__name__}")
    return data


def load_results(results_dir: str | os.PathLike, machine: str) -> list[ResultsFile]:
    """All results files of one machine (``machine.json`` and ``benchmarks.json`` are not results).  Two files
    that claim one commit in one environment are an error naming both (the gate would otherwise read whichever
    sorts first), as is a file whose name is not that of the commit it claims (ASV names every file
    ``<hash8>-<env>.json``: a renamed or relabelled file)."""
    mdir = Path(results_dir) / machine
    if not mdir.is_dir():
        raise GateError(f"no results for machine {machine!r}: {mdir} does not exist")
    files = [ResultsFile.load(p) for p in sorted(mdir.glob("*.json")) if p.name not in SKIP_FILES]
    files = [f for f in files if f.machine == machine]
    seen: dict[tuple[str, str], ResultsFile] = {}
    for f in files:
        prefix = f.path.name.split("-", 1)[0].lower()
        if not f.commit_hash.lower().startswith(prefix) or len(prefix) < 7:
            raise GateError(f"{f.path} claims commit {f.commit_hash[:12]} but its name says {prefix!r}: ASV names "
                            "a results file <hash8>-<env>.json after its commit (a renamed or relabelled file?)")
        key = (f.commit_hash.lower(), f.env_name)
        if key in seen:
            raise GateError(f"two results files claim commit {f.commit_hash[:12]} in environment {f.env_name!r}: "
                            f"{seen[key].path} and {f.path}; keep one")
        seen[key] = f
    return files


def load_benchmark_meta(results_dir: str | os.PathLike) -> dict[str, dict]:
    """``benchmarks.json`` (units, parameter names) or ``{}`` when ASV has not written it; a file that is not
    ASV's benchmark list is an error (exit status 2)."""
    path = Path(results_dir) / "benchmarks.json"
    if not path.is_file():
        return {}
    data = read_json(path, "the ASV benchmark list")
    meta = {k: v for k, v in data.items() if k != "version"}
    bad = [k for k, v in meta.items() if not isinstance(v, dict) or not isinstance(v.get("unit", ""), str)
           or not isinstance(v.get("param_names", []), list)]
    if bad:
        raise GateError(f"the ASV benchmark list {path} is malformed: entry {bad[0]!r} is not a benchmark "
                        "(an object with 'unit' and 'param_names'); regenerate it with python ci/asv_benchmark_list.py")
    return meta


# --------------------------------------------------------------------------------------------------
# Choosing the commit and its predecessor


def _git(repo: str | os.PathLike, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _match(files: list[ResultsFile], commit: str) -> list[ResultsFile]:
    commit = commit.lower()
    return [f for f in files if f.commit_hash.lower().startswith(commit)]


def _pick_env(files: list[ResultsFile], env: str | None, what: str) -> ResultsFile:
    if env is not None:
        files = [f for f in files if f.env_name == env]
        if not files:
            raise GateError(f"no results of environment {env!r} for {what}")
    hashes = {f.commit_hash for f in files}
    if len(hashes) > 1:
        raise GateError(f"{what} is ambiguous: {', '.join(sorted(hashes))}")
    envs = sorted({f.env_name for f in files})
    if len(envs) > 1:
        raise GateError(f"{what} has results in several environments ({', '.join(envs)}): pass --env")
    return files[0]


def resolve_commit(files, commit: str | None, repo, env: str | None) -> ResultsFile:
    """The results file of ``commit`` (a hash or prefix, ``HEAD`` by default, ``latest`` = newest date)."""
    if not files:
        raise GateError("no results files on this machine")
    if commit in (None, "HEAD") or (commit and not all(c in "0123456789abcdefABCDEF" for c in commit)):
        if commit == "latest":
            newest = max(files, key=lambda f: f.date or 0)
            return _pick_env([f for f in files if f.commit_hash == newest.commit_hash], env, "latest")
        full = _git(repo, "rev-parse", commit or "HEAD")
        if not full:
            raise GateError(f"cannot resolve {commit or 'HEAD'} with git in {repo}; pass --commit HASH")
        commit = full
    found = _match(files, commit)
    if not found:
        raise GateError(
            f"no results for commit {commit[:12]} on this machine; run "
            f"`asv run --python=same --set-commit-hash={commit}` first"
        )
    return _pick_env(found, env, f"commit {commit[:12]}")


def resolve_history(files, current: ResultsFile, previous: str | None, repo,
                    window: int = 1) -> tuple[list[ResultsFile], str]:
    """The earlier results to compare against, nearest first (at most ``window``), and how they were found.

    ``previous`` names one commit (only that one is used); otherwise the nearest first-parent ancestors of the
    commit in ``git log`` with results on the machine, else (commits unknown to git) the newest results with an
    earlier commit date.  Results of the current commit's environment are preferred."""
    others = [f for f in files if f.commit_hash != current.commit_hash]
    same_env = [f for f in others if f.env_name == current.env_name]
    pool = same_env or others
    if previous:
        found = _match(pool, previous)
        if not found:
            raise GateError(f"no results for previous commit {previous} on this machine (--previous)")
        return [_pick_env(found, current.env_name if same_env else None, f"previous {previous}")], "--previous"
    if not pool:
        return [], "none"
    by_hash: dict[str, ResultsFile] = {}
    for f in pool:
        by_hash.setdefault(f.commit_hash, f)
    log = _git(repo, "rev-list", "--first-parent", current.commit_hash)
    if log:
        found = [by_hash[h] for h in log.split()[1:] if h in by_hash]
        return found[: max(1, window)], ("git log" if found else "none")
    if current.date is None:
        return [], "none"
    earlier = sorted((f for f in by_hash.values() if f.date is not None and f.date < current.date),
                     key=lambda f: f.date, reverse=True)
    return earlier[: max(1, window)], ("results date" if earlier else "none")


def resolve_previous(files, current: ResultsFile, previous: str | None, repo) -> tuple[ResultsFile | None, str]:
    """The nearest earlier results (see :func:`resolve_history`), or None."""
    found, how = resolve_history(files, current, previous, repo, 1)
    return (found[0] if found else None), how


# --------------------------------------------------------------------------------------------------
# Thresholds


def _lookup(doc, pointer: str):
    """Follow ``a/b/c`` (or ``/a/b/c``, JSON pointer style) into a JSON document."""
    node = doc
    for part in [p for p in pointer.split("/") if p]:
        if isinstance(node, list):
            node = node[int(part)]
        else:
            node = node[part]
    return node


#: Units whose values lie in [0, 1] (a limit above 1 could never bind); every unit of the suite is positive.
FRACTION_UNITS = {"fraction", "jaccard"}


def check_limit(value, where: str, unit: str | None = None) -> float:
    """A threshold limit: a finite number above 0 (every quantity the suite gates is positive: a minimum of 0 or
    below passes everything, a maximum of 0 or below fails everything), at most 1 for a fraction and 100 for a
    percentage.  Anything else is a :class:`GateError` naming ``where`` (the gates fail closed)."""
    if not _is_number(value):
        raise GateError(f"{where} must be a finite number, got {value!r}")
    high = 1.0 if unit in FRACTION_UNITS else (100.0 if unit == "%" else None)
    if value <= 0 or (high is not None and value > high):
        span = f"(0, {high:g}]" if high is not None else "above 0"
        raise GateError(f"{where} = {value!r} is not a usable limit: it must be {span}"
                        + (f" (unit {unit})" if unit else ""))
    return float(value)


def _unit_of(pattern: str, meta: dict[str, dict]) -> str | None:
    """The one unit of the benchmarks ``pattern`` matches (None when none or several)."""
    units = {m.get("unit") for name, m in meta.items() if fnmatch.fnmatchcase(name, pattern)}
    return units.pop() if len(units) == 1 else None


def _version_of(pattern: str, meta: dict[str, dict]) -> str | None:
    """The ASV version of the benchmarks ``pattern`` names in ``benchmarks.json`` (one class: one version), or None."""
    versions = {str(v["version"]) for k, v in meta.items() if fnmatch.fnmatchcase(k, pattern) and "version" in v}
    return versions.pop() if len(versions) == 1 else None


def _is_str_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


def validate_thresholds(thresholds: dict, path: str) -> None:
    """The shape of ``ci/thresholds.json``: every key the gate reads has the right type and every number is finite
    and of the right sign, so that a malformed file is a one-line error (exit status 2), never a traceback and
    never a gate that silently checks less.  The limits themselves are checked by :func:`load_rules`."""
    def bad(where, want):
        raise GateError(f"{path}: {where} must be {want}")

    checks = thresholds.get("checks")
    if not isinstance(checks, list) or not checks:
        bad("'checks'", "a non-empty list of limits (benchmark, params, min/max or min_from/max_from)")
    for i, spec in enumerate(checks):
        if not isinstance(spec, dict) or not isinstance(spec.get("benchmark"), str):
            bad(f"checks[{i}]", "an object with a 'benchmark' pattern")
        if not _is_str_map(spec.get("params", {})):
            bad(f"checks[{i}].params", "an object of parameter values")
        if not any(k in spec for k in ("min", "max", "min_from", "max_from")):
            bad(f"checks[{i}] ({spec['benchmark']})", "given min, max, min_from or max_from")
        for side in ("min_from", "max_from"):
            if side in spec and not isinstance(spec[side], str):
                bad(f"checks[{i}].{side}", "a pointer into the accuracy thresholds (a/b/c)")
    reg = thresholds.get("regression", {})
    if not isinstance(reg, dict):
        bad("'regression'", "an object")
    factor = reg.get("factor", 1.25)
    if not _is_number(factor) or factor < 1:
        bad("regression.factor", f"a finite number >= 1, got {factor!r}")
    floor = reg.get("min_abs_change", 0.0)
    if not _is_number(floor) or floor < 0:
        bad("regression.min_abs_change", f"a finite number >= 0, got {floor!r}")
    window = reg.get("window", 5)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        bad("regression.window", f"an integer >= 1, got {window!r}")
    overrides = reg.get("overrides", [])
    if not isinstance(overrides, list):
        bad("regression.overrides", "a list")
    for i, o in enumerate(overrides):
        pats = o.get("benchmark") if isinstance(o, dict) else None
        if not (isinstance(pats, str) or (isinstance(pats, list) and pats and all(isinstance(x, str) for x in pats))):
            bad(f"regression.overrides[{i}]", "an object with 'benchmark' (a pattern or a list of patterns)")
        if not _is_str_map(o.get("params", {})):
            bad(f"regression.overrides[{i}].params", "an object of parameter patterns")
        if "factor" in o and (not _is_number(o["factor"]) or o["factor"] < 1):
            bad(f"regression.overrides[{i}].factor", f"a finite number >= 1, got {o['factor']!r}")
        if "min_abs_change" in o and (not _is_number(o["min_abs_change"]) or o["min_abs_change"] < 0):
            bad(f"regression.overrides[{i}].min_abs_change", f"a finite number >= 0, got {o['min_abs_change']!r}")
        if "skip" in o and (not isinstance(o["skip"], str) or not o["skip"]):
            bad(f"regression.overrides[{i}].skip", "the reason (a non-empty string)")
    directions = thresholds.get("directions", {})
    if not isinstance(directions, dict):
        bad("'directions'", "an object")
    for key in ("by_name", "by_unit"):
        table = directions.get(key, {})
        if not isinstance(table, dict):
            bad(f"directions.{key}", "an object")
        for k, v in table.items():
            if not k.startswith("_") and v not in ("lower", "higher", "none"):
                bad(f"directions.{key}[{k!r}]", f"lower, higher or none, got {v!r}")
    tol = thresholds.get("known_miss_tolerance", 0.05)
    if not _is_number(tol) or tol < 0:
        bad("known_miss_tolerance", f"a finite number >= 0, got {tol!r}")
    acc = thresholds.get("accuracy")
    if acc is not None:
        if not isinstance(acc, dict) or not isinstance(acc.get("profile"), str) \
                or not isinstance(acc.get("limits", []), list):
            bad("'accuracy'", "an object with 'profile' (a name) and 'limits' (a list)")
        for i, lim in enumerate(acc.get("limits", [])):
            if not isinstance(lim, dict) or not all(isinstance(lim.get(k), str)
                                                    for k in ("section", "bound", "benchmark", "param")):
                bad(f"accuracy.limits[{i}]", "an object with section, bound, benchmark and param (strings)")


@dataclass
class Rule:
    benchmark: str  # fnmatch pattern on the full ASV name (module.Class.track_x)
    params: dict[str, str]
    minimum: float | None
    maximum: float | None
    source: str
    # the benchmark version the limits were recorded for (accuracy limits: the version in benchmarks.json); a result
    # of another version measured something else and is reported as stale, not judged
    version: str | None = None

    def matches(self, name: str, params: dict[str, str]) -> bool:
        return fnmatch.fnmatchcase(name, self.benchmark) and all(
            params.get(k) == str(v) for k, v in self.params.items()
        )


def load_rules(thresholds: dict, accuracy: dict | None, thresholds_path: str, accuracy_path: str,
               meta: dict[str, dict] | None = None) -> list[Rule]:
    """Threshold rules.

    ``checks``: literal ``min``/``max`` (speed) or ``min_from``/``max_from`` pointers into the accuracy file.
    ``accuracy``: ``{"profile": name, "limits": [{"section", "bound", "benchmark", "param"}]}`` turns every
    entry ``profiles/<profile>/<section>/<name>/<bound>`` of the accuracy file into a rule on the benchmark
    case whose parameter ``param`` is ``name`` (the accuracy file owns the numbers; nothing is copied).
    """
    acc_name = Path(accuracy_path).name
    meta = meta or {}
    rules = []
    for i, spec in enumerate(thresholds.get("checks", [])):
        bounds = {}
        source = spec.get("why", f"{Path(thresholds_path).name}#checks/{i}")
        unit = _unit_of(spec["benchmark"], meta)
        for side in ("min", "max"):
            if side in spec:
                bounds[side] = check_limit(spec[side], f"{thresholds_path}: checks[{i}].{side} ({spec['benchmark']})",
                                           unit)
            elif f"{side}_from" in spec:
                if accuracy is None:
                    raise GateError(f"{thresholds_path}: check {i} reads {accuracy_path}, which does not exist")
                pointer = spec[f"{side}_from"]
                try:
                    value = _lookup(accuracy, pointer)
                except (KeyError, IndexError, ValueError, TypeError):
                    raise GateError(f"{accuracy_path} has no number at {pointer!r} (check {i})") from None
                bounds[side] = check_limit(value, f"{accuracy_path}: {pointer} (check {i}, {spec['benchmark']})", unit)
                source = f"{acc_name}:{pointer}"
        if "min" in bounds and "max" in bounds and bounds["min"] > bounds["max"]:
            raise GateError(f"{thresholds_path}: checks[{i}] ({spec['benchmark']}) has min {bounds['min']:g} above "
                            f"max {bounds['max']:g}: nothing could pass")
        if not bounds:
            raise GateError(f"{thresholds_path}: check {i} has neither min nor max")
        rules.append(
            Rule(
                benchmark=spec["benchmark"],
                params={k: str(v) for k, v in spec.get("params", {}).items()},
                minimum=bounds.get("min"),
                maximum=bounds.get("max"),
                source=source,
            )
        )
    acc_spec = thresholds.get("accuracy")
    if acc_spec:
        if accuracy is None:
            raise GateError(f"{thresholds_path}: the accuracy limits are read from {accuracy_path}, which does not "
                            "exist (--accuracy-thresholds)")
        profile = acc_spec["profile"]
        prof = (accuracy.get("profiles") or {}).get(profile) if isinstance(accuracy.get("profiles"), dict) else None
        if not isinstance(prof, dict) or not prof:
            raise GateError(f"{accuracy_path} has no profile {profile!r} (named by 'accuracy' in {thresholds_path})")
        for lim in acc_spec.get("limits", []):
            section, bound = lim["section"], lim["bound"]
            if bound not in ("min", "max"):
                raise GateError(f"{thresholds_path}: accuracy limit bound must be min or max, got {bound!r}")
            entries = prof.get(section)
            if not isinstance(entries, dict) or not entries:
                raise GateError(f"{accuracy_path}: profiles/{profile}/{section} has no limits (named by 'accuracy' "
                                f"in {thresholds_path}): the gate would check less")
            unit = _unit_of(lim["benchmark"], meta)
            for name, entry in entries.items():
                value = entry.get(bound) if isinstance(entry, dict) else entry
                if value is None:
                    raise GateError(f"{accuracy_path}: profiles/{profile}/{section}/{name} has no {bound!r}")
                value = check_limit(value, f"{accuracy_path}: profiles/{profile}/{section}/{name}/{bound}", unit)
                rules.append(
                    Rule(
                        benchmark=lim["benchmark"],
                        params={lim["param"]: name},
                        minimum=float(value) if bound == "min" else None,
                        maximum=float(value) if bound == "max" else None,
                        source=f"{acc_name}:profiles/{profile}/{section}/{name}/{bound}",
                        version=_version_of(lim["benchmark"], meta),
                    )
                )
    return rules


def direction(name: str, unit: str | None, thresholds: dict) -> str | None:
    """``lower`` or ``higher`` is better, or None (not checked for regressions)."""
    for pattern, d in thresholds.get("directions", {}).get("by_name", {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return d
    if unit is not None:
        return thresholds.get("directions", {}).get("by_unit", {}).get(unit)
    return None


def _patterns(spec) -> list[str]:
    return [spec] if isinstance(spec, str) else list(spec)


def _params_match(want: dict, params: dict[str, str]) -> bool:
    """Every wanted parameter is present and matches (fnmatch pattern on the value's string)."""
    return all(k in params and fnmatch.fnmatchcase(params[k], str(v)) for k, v in want.items())


@dataclass
class RegressionRule:
    factor: float
    floor: float  # min_abs_change
    skip: str | None = None  # why this case is not compared (e.g. a launch-bound plain timing)


def regression_limits(name: str, thresholds: dict, params: dict[str, str] | None = None) -> RegressionRule:
    """The regression rule of one benchmark case: the default, or the first matching override.

    An override names ``benchmark`` (fnmatch pattern or list of patterns), optional ``params`` (fnmatch patterns
    on the values) and ``factor``/``min_abs_change``, or ``skip`` (a reason: the case is not compared)."""
    reg = thresholds.get("regression", {})
    factor, floor = float(reg.get("factor", 1.25)), float(reg.get("min_abs_change", 0.0))
    for spec in reg.get("overrides", []):
        if not any(fnmatch.fnmatchcase(name, pat) for pat in _patterns(spec["benchmark"])):
            continue
        if spec.get("params") and not _params_match(spec["params"], params or {}):
            continue
        return RegressionRule(float(spec.get("factor", factor)), float(spec.get("min_abs_change", floor)),
                              spec.get("skip"))
    return RegressionRule(factor, floor)


@dataclass
class KnownMiss:
    kind: str  # threshold | regression
    benchmark: str  # fnmatch pattern
    params: dict[str, str]
    commit: str | None  # hash prefix, or None: every commit
    reason: str
    measured: float  # the value the miss was recorded with: a worse value is not excused
    tolerance: float  # relative slack on ``measured`` (measurement noise)

    def applies_to(self, commit_hash: str) -> bool:
        return self.commit is None or commit_hash.lower().startswith(self.commit.lower())

    def matches(self, check: Check) -> bool:
        """The entry names this check (kind, benchmark, parameters).  Whether it excuses the check is
        :meth:`excuses`: only a measured value no worse than the recorded one."""
        return (check.kind == self.kind and fnmatch.fnmatchcase(check.benchmark, self.benchmark)
                and all(check.params.get(k) == str(v) for k, v in self.params.items()))

    def limit(self, better: str | None) -> float | None:
        """The worst value the entry excuses in direction ``better`` (None: no direction known)."""
        slack = abs(self.measured) * self.tolerance
        if better == "higher":
            return self.measured - slack
        if better == "lower":
            return self.measured + slack
        return None

    def excuses(self, check: Check) -> tuple[bool, str]:
        """(excused, why not): a check with a value no worse than ``measured`` (within ``tolerance``)."""
        if not _is_number(check.value):
            return False, f"no value ({_fmt(check.value)}): a known miss excuses a measured value only"
        worst = self.limit(check.better)
        if worst is None:
            return False, "no direction to compare with the recorded value"
        worse = check.value < worst if check.better == "higher" else check.value > worst
        if worse:
            return False, (f"worse than the known miss recorded ({self.measured:.4g}, tolerance "
                           f"{self.tolerance:.0%}: {'>=' if check.better == 'higher' else '<='} {worst:.4g})")
        return True, ""

    @property
    def label(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.params.items())
        where = f" at {self.commit}" if self.commit else ""
        return f"{self.kind} {self.benchmark}{f'({extra})' if extra else ''}{where}"


def load_known_misses(thresholds: dict, thresholds_path: str = "thresholds.json") -> list[KnownMiss]:
    """``known_misses`` of the thresholds file: a list of entries (or ``{"entries": [...]}``); each needs the
    ``measured`` value it was recorded with.  ``known_miss_tolerance`` (default 0.05) is the relative slack of
    every entry without its own ``tolerance``."""
    spec = thresholds.get("known_misses") or []
    if isinstance(spec, dict):
        spec = spec.get("entries", [])
    default_tol = float(thresholds.get("known_miss_tolerance", 0.05))
    if not isinstance(spec, list):
        raise GateError(f"{thresholds_path}: known_misses must be a list of entries")
    out = []
    for i, e in enumerate(spec):
        if not isinstance(e, dict):
            raise GateError(f"{thresholds_path}: known_misses[{i}] must be an object")
        if e.get("kind") not in ("threshold", "regression") or not e.get("benchmark") or not e.get("reason"):
            raise GateError(f"{thresholds_path}: known_misses[{i}] needs kind (threshold|regression), "
                            "benchmark and reason")
        if not _is_number(e.get("measured")) or e["measured"] <= 0:
            raise GateError(f"{thresholds_path}: known_misses[{i}] ({e['benchmark']}) needs 'measured': the value "
                            f"the miss was recorded with, a finite number above 0 (a worse value then fails); got "
                            f"{e.get('measured')!r}")
        if not _is_str_map(e.get("params", {})) or not isinstance(e.get("commit") or "", str):
            raise GateError(f"{thresholds_path}: known_misses[{i}] params must be an object and commit a hash prefix")
        tol = e.get("tolerance", default_tol)
        if not _is_number(tol) or tol < 0:
            raise GateError(f"{thresholds_path}: known_misses[{i}] tolerance must be a number >= 0, got {tol!r}")
        out.append(KnownMiss(e["kind"], e["benchmark"], {k: str(v) for k, v in e.get("params", {}).items()},
                             e.get("commit"), e["reason"], float(e["measured"]), float(tol)))
    return out


def asv_regression_exclusions(meta: dict[str, dict], thresholds: dict) -> list[str]:
    """Benchmarks ASV's regressions page must not scan: every one whose direction is not "lower" (ASV flags
    increases only, so a higher-is-better value such as a speed-up or a Jaccard index would list its
    improvements), and the baselines that are not this project's code (direction "none")."""
    return sorted(name for name, m in meta.items() if direction(name, m.get("unit"), thresholds) != "lower")


# --------------------------------------------------------------------------------------------------
# The gate


@dataclass
class Check:
    kind: str  # threshold | regression
    benchmark: str
    params: dict[str, str]
    value: object
    limit: str
    ok: bool
    note: str = ""
    known: str = ""  # the reason of the known-miss entry that excuses this failing check ("" when none)
    better: str | None = None  # "lower" or "higher": the direction of the limit
    stale: bool = False  # a result of another benchmark version than the limits': reported, not judged

    @property
    def measured(self) -> bool:
        """The check compared a measured value with its limit (not an absent, failed or skipped result)."""
        return _is_number(self.value)

    @property
    def status(self) -> str:
        """``ok`` (a measured value within its limit), ``MISSING`` (no value, accepted by --allow-missing),
        ``KNOWN`` (a failure a known miss excuses), ``STALE`` (a result of another benchmark version than the
        limits were recorded for: not judged) or ``FAIL``."""
        if self.stale:
            return "STALE"
        if self.ok:
            return "ok" if self.measured else "MISSING"
        return "KNOWN" if self.known else "FAIL"

    @property
    def label(self) -> str:
        if not self.params:
            return self.benchmark
        return f"{self.benchmark}({', '.join(f'{k}={v}' for k, v in self.params.items())})"


def _fmt(value) -> str:
    if value is None:
        return "failed"
    if isinstance(value, float) and math.isnan(value):
        return "skipped"
    if isinstance(value, (int, float)):
        return f"{value:.4g}"
    return str(value)


def _compile_bench(bench: str | None):
    if not bench:
        return None
    try:
        return re.compile(bench)
    except re.error as exc:
        raise GateError(f"--bench {bench!r} is not a regular expression: {exc}") from None


def run_gate(
    results_dir,
    machine: str,
    *,
    commit: str | None = None,
    previous: str | None = None,
    thresholds_path=DEFAULT_THRESHOLDS,
    accuracy_path=DEFAULT_ACCURACY_THRESHOLDS,
    repo=".",
    env: str | None = None,
    allow_missing: bool = False,
    bench: str | None = None,
    allow_known_misses: bool = False,
    out=sys.stdout,
) -> tuple[bool, list[Check]]:
    """Run every check; print the table and the summary to ``out``; return (passed, checks).

    ``bench``: a regular expression; only benchmarks whose name it matches (``re.search``) are checked (a
    pattern that matches no benchmark is an error).  ``allow_missing``: gated benchmarks without a value do not
    fail.  ``allow_known_misses``: failures listed in ``known_misses`` (marked in ``Check.known``) whose value
    is no worse than recorded do not fail the gate; they are reported all the same.  No checks at all fails."""
    pattern = _compile_bench(bench)
    thresholds_path, accuracy_path = Path(thresholds_path), Path(accuracy_path)
    thresholds = read_json(thresholds_path, "the thresholds file (--thresholds)")
    validate_thresholds(thresholds, str(thresholds_path))
    accuracy = read_json(accuracy_path, "the accuracy thresholds file (--accuracy-thresholds)") \
        if accuracy_path.exists() else None
    meta = load_benchmark_meta(results_dir)
    rules = load_rules(thresholds, accuracy, str(thresholds_path), str(accuracy_path), meta)
    known_misses = load_known_misses(thresholds, str(thresholds_path))
    window = int(thresholds.get("regression", {}).get("window", 5))

    files = load_results(results_dir, machine)
    current = resolve_commit(files, commit, repo, env)
    history, how = resolve_history(files, current, previous, repo, window)
    if pattern is not None:
        names = set(current.values) | set(meta) | {r.benchmark for r in rules}
        if not any(pattern.search(n) for n in names):
            raise GateError(f"--bench {bench!r} matches no benchmark in the results, in benchmarks.json or in the "
                            "thresholds")
        rules = [r for r in rules if pattern.search(r.benchmark)]
        for f in (current, *history):
            f.values = {k: v for k, v in f.values.items() if pattern.search(k)}

    def param_names(name):
        return meta.get(name, {}).get("param_names")

    coverage = module_coverage(current, meta, pattern)

    checks: list[Check] = []

    # (a), (c): thresholds.  Every rule must match at least one case with a value.
    for rule in rules:
        hits = 0
        better = "higher" if rule.minimum is not None and rule.maximum is None else (
            "lower" if rule.maximum is not None and rule.minimum is None else None)
        for name in sorted(current.values):
            for params, value in current.cases(name, param_names(name)):
                if not rule.matches(name, params):
                    continue
                hits += 1
                v_res = current.versions.get(name)
                if rule.version is not None and v_res is not None and str(v_res) != rule.version:
                    checks.append(Check("threshold", name, params, value, "-", True,
                                        f"stale: version {v_res} of the benchmark, the limits are version "
                                        f"{rule.version}'s ({rule.source}); record it again", better=None,
                                        stale=True))
                    continue
                bound = []
                ok = _is_number(value)
                if rule.minimum is not None:
                    bound.append(f">= {rule.minimum:g}")
                    ok = ok and value >= rule.minimum
                if rule.maximum is not None:
                    bound.append(f"<= {rule.maximum:g}")
                    ok = ok and value <= rule.maximum
                note = rule.source
                if not _is_number(value):
                    note = f"no value ({_fmt(value)}); {rule.source}" + ("" if allow_missing else
                                                                          "; --allow-missing accepts it")
                    ok = ok or allow_missing
                checks.append(Check("threshold", name, params, value, " and ".join(bound), ok, note, better=better))
        if hits == 0:
            want = rule.benchmark + (f" {rule.params}" if rule.params else "")
            checks.append(
                Check("threshold", rule.benchmark, rule.params, "absent", "present", allow_missing,
                      f"no results match {want}; {rule.source}"
                      + ("" if allow_missing else "; --allow-missing accepts it"), better=better)
            )

    # (b): regressions against the median of recent commits.
    not_compared: dict[str, int] = {}
    if history:
        nearest = history[0]
        for name in sorted(current.values):
            unit = meta.get(name, {}).get("unit")
            d = direction(name, unit, thresholds)
            if d not in ("lower", "higher"):
                continue  # no direction (e.g. "none"): not checked for regressions
            v_now = current.versions.get(name)
            # earlier results of the same benchmark version (a changed version means other numbers)
            same = [f for f in history if name in f.values
                    and not (v_now and f.versions.get(name) and f.versions.get(name) != v_now)]
            if not same:
                continue
            before = [{tuple(sorted(p.items())): v for p, v in f.cases(name, param_names(name))} for f in same]
            for params, value in current.cases(name, param_names(name)):
                key = tuple(sorted(params.items()))
                rule = regression_limits(name, thresholds, params)
                if rule.skip:
                    not_compared[rule.skip] = not_compared.get(rule.skip, 0) + 1
                    continue
                olds = [b.get(key) for b in before]
                olds = [v for v in olds if _is_number(v)]
                if not olds:
                    continue
                if not _is_number(value):
                    last = before[0].get(key) if same[0] is nearest else None
                    if value is None and _is_number(last):  # failed now, measured at the nearest commit
                        checks.append(Check("regression", name, params, value, f"was {last:.4g}", False,
                                            "benchmark failed; it had a value at the previous commit", better=d))
                    continue
                old = statistics.median(olds)
                if d == "lower":
                    allowed = max(abs(old) * (rule.factor - 1.0), rule.floor)
                    ok = value - old <= allowed
                    limit = f"<= {old + allowed:.4g}"
                else:
                    allowed = max(abs(old) * (1.0 - 1.0 / rule.factor), rule.floor)
                    ok = old - value <= allowed
                    limit = f">= {old - allowed:.4g}"
                ratio = value / old if old else float("inf")
                base = f"median of {len(olds)} earlier" if len(olds) > 1 else "was"
                note = f"{base} {old:.4g} ({ratio:.3g}x, {d} is better, factor {rule.factor:g})"
                checks.append(Check("regression", name, params, value, limit, ok, note, better=d))

    applicable = [k for k in known_misses if k.applies_to(current.commit_hash)
                  and (pattern is None or pattern.search(k.benchmark))]
    applicable.sort(key=lambda k: k.commit is None)  # an entry for this commit before one for every commit
    used = set()
    for c in checks:
        if c.ok:
            continue
        for i, k in enumerate(applicable):
            if k.matches(c):
                used.add(i)
                excused, why = k.excuses(c)
                if excused:
                    c.known = k.reason
                else:
                    c.note = f"{c.note}; known miss does not excuse it: {why}"
                break
    # an entry is stale (the miss is gone: remove it) only where a measured value it names now passes; an entry
    # whose check has no value here, or that no check of this run names, says nothing about the miss
    stale, unchecked = [], []
    for i, k in enumerate(applicable):
        if i in used:
            continue
        named = [c for c in checks if k.matches(c)]
        (stale if any(c.ok and c.measured for c in named) else unchecked).append(k)
    _print_report(out, machine, current, history, how, checks, stale, allow_known_misses, not_compared, bench,
                  unchecked, coverage)
    return verdict(checks, allow_known_misses), checks


def module_coverage(current: ResultsFile, meta: dict[str, dict], pattern=None) -> tuple[list[str], list[str]]:
    """(classes with a measured value in ``current``, classes of ``benchmarks.json`` without one), as
    ``module.Class`` names, both restricted to ``pattern`` (``--bench``)."""
    def cls(name):
        return ".".join(name.split(".")[:2])

    have = sorted({cls(n) for n, vals in current.values.items() if any(_is_number(v) for v in vals)})
    known = {cls(n) for n in meta if pattern is None or pattern.search(n)}
    return have, sorted(known - set(have))


def record_command(current: ResultsFile, lacking: list[str]) -> str:
    """The command that records the classes ``lacking`` at ``current``'s commit on its machine (the GPU machine,
    with its interpreter; ``ci/run_asv_history.sh`` checks the commit out and adds to its results file)."""
    names = "|".join(c.split(".", 1)[1] for c in lacking)
    modules = sorted({c.split(".")[0] for c in lacking})
    regex = f"^{modules[0]}\\.({names})\\." if len(modules) == 1 else "^(" + "|".join(
        c.replace(".", "\\.") for c in lacking) + ")\\."
    h = current.commit_hash[:12]
    return f"ci/run_asv_history.sh --force --bench '{regex}' {h}~1..{h} -- --quick --show-stderr"


def verdict(checks: list[Check], allow_known_misses: bool = False) -> bool:
    """The gate passes when every check passed (or is a known miss, with ``allow_known_misses``) and at least one
    check compared a measured value: results accepted as missing (``--allow-missing``) are not a pass."""
    return (any(c.measured and not c.stale for c in checks)
            and all(c.ok or (allow_known_misses and c.known) for c in checks))


def _print_report(out, machine, current, history, how, checks, stale=(), allow_known_misses=False,
                  not_compared=None, bench=None, unchecked=(), coverage=None):
    p = lambda *a: print(*a, file=out)
    p(f"gate: machine {machine}, commit {current.commit_hash[:12]} ({current.env_name})")
    if coverage is not None:
        have, lacking = coverage
        p(f"gate: this commit's results hold {', '.join(have) or 'no measured benchmark'}")
        if lacking:
            p(f"gate: they lack {', '.join(lacking)} (gated results of these fail as absent; record them on the "
              f"machine: {record_command(current, lacking)})")
    if not history:
        p("gate: no previous results on this machine: regression check skipped")
    else:
        p(f"gate: previous commit {history[0].commit_hash[:12]} (found by {how})")
        if len(history) > 1:
            p(f"gate: regression baseline: per case, the median over {len(history)} earlier commits ("
              + ", ".join(f.commit_hash[:8] for f in history) + ")")
    rows = [("status", "check", "benchmark", "value", "limit", "note")]
    for c in checks:
        rows.append((c.status, c.kind, c.label, _fmt(c.value), c.limit, c.note))
    widths = [min(max(len(r[i]) for r in rows), 90) for i in range(5)]
    for r in rows:
        p("  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5])
    failed = [c for c in checks if not c.ok]
    known = [c for c in failed if c.known]
    missing = [c for c in checks if c.ok and not c.measured]
    measured = [c for c in checks if c.measured and not c.stale]
    outdated = [c for c in checks if c.stale]
    n_thr = sum(c.kind == "threshold" for c in checks)
    n_reg = sum(c.kind == "regression" for c in checks)
    p(f"gate: {len(checks)} checks ({n_thr} threshold, {n_reg} regression), {len(failed)} failed"
      + (f" ({len(known)} of them known misses listed in known_misses)" if known else "")
      + (f", {len(missing)} without a value accepted by --allow-missing (not checked)" if missing else ""))
    if outdated:
        p(f"gate: {len(outdated)} results of another benchmark version than their limits were recorded for, not "
          "judged (STALE): record them again on the machine")
    for why, n in (not_compared or {}).items():
        p(f"gate: {n} regression cases not compared: {why}")
    for c in failed:
        tag = f" [known miss: {c.known}]" if c.known else ""
        if c.kind == "threshold":
            p(f"FAIL threshold: {c.label} = {_fmt(c.value)}, required {c.limit} ({c.note}){tag}")
        else:
            p(f"FAIL regression: {c.label} = {_fmt(c.value)}, allowed {c.limit}; {c.note}{tag}")
    for k in stale:
        p(f"gate: known miss no longer fails (remove it from known_misses): {k.label}")
    for k in unchecked:
        p(f"gate: known miss not checked here (no measured value of it in these results): {k.label}")
    unknown = [c for c in failed if not c.known]
    not_checked = f"; {len(missing)} gated results without a value NOT checked (--allow-missing)" if missing else ""
    if not checks:
        what = f"--bench {bench!r} selects no benchmark with a check" if bench else "nothing to check"
        p(f"gate: FAILED: no checks ran ({what}); a gate that checks nothing does not pass")
    elif not measured:
        p(f"gate: FAILED: no measured value was checked ({len(missing)} gated results without a value); a gate "
          "that checks nothing does not pass")
    elif not failed:
        p(f"gate: PASSED ({len(measured)} measured values checked{not_checked})")
    elif not unknown and allow_known_misses:
        p(f"gate: PASSED with {len(known)} known misses (--allow-known-misses; {len(measured)} measured values "
          f"checked{not_checked}); the targets above are still missed")
    elif not unknown:
        p(f"gate: FAILED: only known misses ({len(known)}); --allow-known-misses accepts them")
    else:
        p(f"gate: FAILED ({len(unknown)} failures not excused by known_misses)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=".asv/results", help="ASV results_dir (default .asv/results)")
    ap.add_argument("--machine", required=True, help="ASV machine name, e.g. h100")
    ap.add_argument("--commit", default=None, help="commit to check: hash or prefix, HEAD (default), latest")
    ap.add_argument("--previous", default=None, help="commit to compare against (default: from git log)")
    ap.add_argument("--thresholds", default=str(DEFAULT_THRESHOLDS))
    ap.add_argument("--accuracy-thresholds", default=str(DEFAULT_ACCURACY_THRESHOLDS))
    ap.add_argument("--repo", default=".", help="git repository used to order commits (default .)")
    ap.add_argument("--env", default=None, help="ASV environment name, when a commit has several")
    ap.add_argument("--bench", default=None, metavar="REGEX",
                    help="check only benchmarks whose name matches REGEX (e.g. bench_accuracy on a CPU machine)")
    ap.add_argument("--allow-missing", action="store_true",
                    help="do not fail gated benchmarks that have no value: failed, skipped or absent (a partial run)")
    ap.add_argument("--allow-known-misses", action="store_true",
                    help="do not fail on failures listed in known_misses of the thresholds file whose value is no "
                    "worse than recorded (still reported); an absent result is never a known miss")
    args = ap.parse_args(argv)
    try:
        ok, _ = run_gate(
            args.results, args.machine, commit=args.commit, previous=args.previous,
            thresholds_path=args.thresholds, accuracy_path=args.accuracy_thresholds,
            repo=args.repo, env=args.env, allow_missing=args.allow_missing, bench=args.bench,
            allow_known_misses=args.allow_known_misses,
        )
    except GateError as exc:
        print(f"gate: error: {exc}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
