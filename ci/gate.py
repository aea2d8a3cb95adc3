#!/usr/bin/env python3
"""Benchmark gate: fail a commit whose ASV results miss a threshold or regress against the previous commit.

``asv compare`` always exits 0, so this script is the blocking check of the GPU job.  It reads ASV's own
results files (``<results>/<machine>/<hash8>-<env>.json``, api version 2: one row per benchmark, the columns
named by ``result_columns``, parameterised values flattened over the product of the ``params`` lists) and
the benchmark metadata ASV writes beside them (``<results>/benchmarks.json``: units and parameter names).

Checks (all listed in one table, then a summary; exit status 1 when any fails):

- ``threshold``: a value outside its limit.  Speed-up limits are in ``ci/thresholds.json`` (``checks``);
  accuracy limits live in ``loki/evaluation/accuracy_thresholds.json`` (owned by the evaluation code, shipped
  with the package) and are referenced from ``ci/thresholds.json`` by a pointer (``limit_from``), never
  copied.  A gated benchmark without a value (failed, skipped or absent) fails too, unless ``--allow-missing``.
- ``regression``: a value worse than the previous commit's result on the same machine by more than the
  regression factor, in the benchmark's own direction (ms and MiB: higher is worse; x, GB/s, Jaccard:
  lower is worse; perplexity delta: higher is worse).  Directions come from the unit, overridden by name
  patterns in ``ci/thresholds.json``; a change smaller than ``min_abs_change`` never counts (noise floor for
  values near zero).  A benchmark that had a value before and now failed is a regression too.

The previous commit is ``--previous`` if given, else the nearest first-parent ancestor in ``git log`` with
results on the machine, else (commits unknown to git) the newest results with an earlier commit ``date``.
With no previous results the regression check is skipped and said so.

Known misses: ``known_misses`` in ``ci/thresholds.json`` lists failures that are documented, not fixed (a target
the kernels do not reach, a regression flagged on measurement noise), each with ``kind`` (threshold or
regression), ``benchmark`` (fnmatch pattern), optional ``params`` and ``commit`` (hash prefix: the entry applies
to that commit only) and the measured ``reason``.  A failing check an entry matches is still printed as a
failure (``KNOWN`` in the table, ``FAIL ... [known miss: reason]`` in the summary) and still fails the gate,
unless ``--allow-known-misses`` is given; then only unlisted failures fail.  An entry that matches no failing
check of the commit is reported as stale (the target is now met: remove the entry).

Usage::

    python ci/gate.py --results .asv/results --machine h100 [--commit HASH] [--previous HASH] [--bench REGEX]

Exit status: 0 pass, 1 a check failed, 2 the inputs could not be read (no results for the commit, ...).
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
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_THRESHOLDS = HERE / "thresholds.json"
DEFAULT_ACCURACY_THRESHOLDS = HERE.parent / "loki" / "evaluation" / "accuracy_thresholds.json"
SKIP_FILES = {"machine.json", "benchmarks.json"}

__all__ = ["GateError", "ResultsFile", "Check", "KnownMiss", "load_known_misses", "load_results", "run_gate", "main"]


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
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise GateError(f"cannot read ASV results file {path}: {exc}") from exc
        if data.get("version") != 2 or "result_columns" not in data:
            raise GateError(f"{path}: not an ASV results file of api version 2 (asv 0.6)")
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
            row = list(row) + [None] * (len(columns) - len(row))  # ASV drops trailing None columns
            params = row[i_params] or []
            result = row[i_result]
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


def load_results(results_dir: str | os.PathLike, machine: str) -> list[ResultsFile]:
    """All results files of one machine (``machine.json`` and ``benchmarks.json`` are not results)."""
    mdir = Path(results_dir) / machine
    if not mdir.is_dir():
        raise GateError(f"no results for machine {machine!r}: {mdir} does not exist")
    files = [ResultsFile.load(p) for p in sorted(mdir.glob("*.json")) if p.name not in SKIP_FILES]
    return [f for f in files if f.machine == machine]


def load_benchmark_meta(results_dir: str | os.PathLike) -> dict[str, dict]:
    """``benchmarks.json`` (units, parameter names) or ``{}`` when ASV has not written it."""
    path = Path(results_dir) / "benchmarks.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if isinstance(v, dict)}


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


def resolve_previous(files, current: ResultsFile, previous: str | None, repo) -> tuple[ResultsFile | None, str]:
    """The results to compare against, and how they were found."""
    others = [f for f in files if f.commit_hash != current.commit_hash]
    same_env = [f for f in others if f.env_name == current.env_name]
    pool = same_env or others
    if previous:
        found = _match(pool, previous)
        if not found:
            raise GateError(f"no results for previous commit {previous} on this machine")
        return _pick_env(found, current.env_name if same_env else None, f"previous {previous}"), "--previous"
    if not pool:
        return None, "none"
    log = _git(repo, "rev-list", "--first-parent", current.commit_hash)
    if log:
        by_hash = {}
        for f in pool:
            by_hash.setdefault(f.commit_hash, f)
        for h in log.split()[1:]:
            if h in by_hash:
                return by_hash[h], "git log"
        return None, "none"
    if current.date is None:
        return None, "none"
    earlier = [f for f in pool if f.date is not None and f.date < current.date]
    if not earlier:
        return None, "none"
    return max(earlier, key=lambda f: f.date), "results date"


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


@dataclass
class Rule:
    benchmark: str  # fnmatch pattern on the full ASV name (module.Class.track_x)
    params: dict[str, str]
    minimum: float | None
    maximum: float | None
    source: str
    optional: bool = False  # from the accuracy profile: a case the suite does not measure is not an error

    def matches(self, name: str, params: dict[str, str]) -> bool:
        return fnmatch.fnmatchcase(name, self.benchmark) and all(
            params.get(k) == str(v) for k, v in self.params.items()
        )


def load_rules(thresholds: dict, accuracy: dict | None, thresholds_path: str, accuracy_path: str) -> list[Rule]:
    """Threshold rules.

    ``checks``: literal ``min``/``max`` (speed) or ``min_from``/``max_from`` pointers into the accuracy file.
    ``accuracy``: ``{"profile": name, "limits": [{"section", "bound", "benchmark", "param"}]}`` turns every
    entry ``profiles/<profile>/<section>/<name>/<bound>`` of the accuracy file into a rule on the benchmark
    case whose parameter ``param`` is ``name`` (the accuracy file owns the numbers; nothing is copied).
    """
    acc_name = Path(accuracy_path).name
    rules = []
    for i, spec in enumerate(thresholds.get("checks", [])):
        bounds = {}
        source = spec.get("why", f"{Path(thresholds_path).name}#checks/{i}")
        for side in ("min", "max"):
            if side in spec:
                bounds[side] = float(spec[side])
            elif f"{side}_from" in spec:
                if accuracy is None:
                    raise GateError(f"{thresholds_path}: check {i} reads {accuracy_path}, which does not exist")
                pointer = spec[f"{side}_from"]
                try:
                    bounds[side] = float(_lookup(accuracy, pointer))
                except (KeyError, IndexError, ValueError, TypeError) as exc:
                    raise GateError(f"{accuracy_path} has no number at {pointer!r} (check {i})") from exc
                source = f"{acc_name}:{pointer}"
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
    if acc_spec and accuracy is not None:
        profile = acc_spec["profile"]
        prof = accuracy.get("profiles", {}).get(profile) or {}
        for lim in acc_spec.get("limits", []):
            section, bound = lim["section"], lim["bound"]
            if bound not in ("min", "max"):
                raise GateError(f"{thresholds_path}: accuracy limit bound must be min or max, got {bound!r}")
            for name, entry in (prof.get(section) or {}).items():
                value = entry.get(bound) if isinstance(entry, dict) else entry
                if not isinstance(value, (int, float)):
                    raise GateError(f"{accuracy_path}: profiles/{profile}/{section}/{name} has no {bound!r}")
                rules.append(
                    Rule(
                        benchmark=lim["benchmark"],
                        params={lim["param"]: name},
                        minimum=float(value) if bound == "min" else None,
                        maximum=float(value) if bound == "max" else None,
                        source=f"{acc_name}:profiles/{profile}/{section}/{name}/{bound}",
                        optional=True,
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


def regression_limits(name: str, thresholds: dict) -> tuple[float, float]:
    """(factor, min_abs_change) for one benchmark: the default, or the first matching override."""
    reg = thresholds.get("regression", {})
    factor, floor = float(reg.get("factor", 1.25)), float(reg.get("min_abs_change", 0.0))
    for spec in reg.get("overrides", []):
        if fnmatch.fnmatchcase(name, spec["benchmark"]):
            return float(spec.get("factor", factor)), float(spec.get("min_abs_change", floor))
    return factor, floor


@dataclass
class KnownMiss:
    kind: str  # threshold | regression
    benchmark: str  # fnmatch pattern
    params: dict[str, str]
    commit: str | None  # hash prefix, or None: every commit
    reason: str

    def applies_to(self, commit_hash: str) -> bool:
        return self.commit is None or commit_hash.lower().startswith(self.commit.lower())

    def matches(self, check: Check) -> bool:
        return (check.kind == self.kind and fnmatch.fnmatchcase(check.benchmark, self.benchmark)
                and all(check.params.get(k) == str(v) for k, v in self.params.items()))

    @property
    def label(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.params.items())
        where = f" at {self.commit}" if self.commit else ""
        return f"{self.kind} {self.benchmark}{f'({extra})' if extra else ''}{where}"


def load_known_misses(thresholds: dict, thresholds_path: str = "thresholds.json") -> list[KnownMiss]:
    """``known_misses`` of the thresholds file: a list of entries (or ``{"entries": [...]}``)."""
    spec = thresholds.get("known_misses") or []
    if isinstance(spec, dict):
        spec = spec.get("entries", [])
    out = []
    for i, e in enumerate(spec):
        if e.get("kind") not in ("threshold", "regression") or not e.get("benchmark") or not e.get("reason"):
            raise GateError(f"{thresholds_path}: known_misses[{i}] needs kind (threshold|regression), "
                            "benchmark and reason")
        out.append(KnownMiss(e["kind"], e["benchmark"], {k: str(v) for k, v in e.get("params", {}).items()},
                             e.get("commit"), e["reason"]))
    return out


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
    known: str = ""  # the reason of the known-miss entry a failing check matches ("" when none)

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

    ``bench``: a regular expression; only benchmarks whose name it matches (``re.search``) are checked.
    ``allow_known_misses``: failures listed in ``known_misses`` (marked in ``Check.known``) do not fail the
    gate; they are reported all the same."""
    thresholds_path, accuracy_path = Path(thresholds_path), Path(accuracy_path)
    thresholds = json.loads(thresholds_path.read_text(encoding="utf-8"))
    accuracy = json.loads(accuracy_path.read_text(encoding="utf-8")) if accuracy_path.is_file() else None
    rules = load_rules(thresholds, accuracy, str(thresholds_path), str(accuracy_path))
    known_misses = load_known_misses(thresholds, str(thresholds_path))

    files = load_results(results_dir, machine)
    meta = load_benchmark_meta(results_dir)
    current = resolve_commit(files, commit, repo, env)
    prev, how = resolve_previous(files, current, previous, repo)
    if bench:
        pattern = re.compile(bench)
        rules = [r for r in rules if pattern.search(r.benchmark)]
        for f in (current, prev):
            if f is not None:
                f.values = {k: v for k, v in f.values.items() if pattern.search(k)}

    def param_names(name):
        return meta.get(name, {}).get("param_names")

    checks: list[Check] = []

    # (a), (c): thresholds.  Every rule must match at least one case with a value.
    for rule in rules:
        hits = 0
        known = False  # the benchmark exists in the results (under any parameters)
        for name in sorted(current.values):
            if fnmatch.fnmatchcase(name, rule.benchmark):
                known = True
            for params, value in current.cases(name, param_names(name)):
                if not rule.matches(name, params):
                    continue
                hits += 1
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
                    note = f"no value ({_fmt(value)}); {rule.source}"
                    ok = ok or allow_missing
                checks.append(Check("threshold", name, params, value, " and ".join(bound), ok, note))
        if hits == 0 and rule.optional and known:
            continue  # an accuracy-file entry the ASV suite does not measure (e.g. a method it skips)
        if hits == 0:
            want = rule.benchmark + (f" {rule.params}" if rule.params else "")
            checks.append(
                Check("threshold", rule.benchmark, rule.params, "absent", "present", allow_missing,
                      f"no results match {want}; {rule.source}")
            )

    # (b): regressions against the previous commit.
    if prev is not None:
        for name in sorted(current.values):
            if name not in prev.values:
                continue
            unit = meta.get(name, {}).get("unit")
            d = direction(name, unit, thresholds)
            if d not in ("lower", "higher"):
                continue  # no direction (e.g. "none"): not checked for regressions
            v_now, v_before = current.versions.get(name), prev.versions.get(name)
            if v_now and v_before and v_now != v_before:
                continue  # the benchmark changed (ASV version): its values are not comparable
            factor, floor = regression_limits(name, thresholds)
            before = {tuple(sorted(p.items())): v for p, v in prev.cases(name, param_names(name))}
            for params, value in current.cases(name, param_names(name)):
                old = before.get(tuple(sorted(params.items())))
                if not _is_number(old):
                    continue
                if not _is_number(value):
                    if value is None:  # failed now, measured before
                        checks.append(Check("regression", name, params, value, f"was {old:.4g}", False,
                                            "benchmark failed; it had a value at the previous commit"))
                    continue
                if d == "lower":
                    allowed = max(abs(old) * (factor - 1.0), floor)
                    ok = value - old <= allowed
                    limit = f"<= {old + allowed:.4g}"
                else:
                    allowed = max(abs(old) * (1.0 - 1.0 / factor), floor)
                    ok = old - value <= allowed
                    limit = f">= {old - allowed:.4g}"
                ratio = value / old if old else float("inf")
                note = f"was {old:.4g} ({ratio:.3g}x, {d} is better, factor {factor:g})"
                checks.append(Check("regression", name, params, value, limit, ok, note))

    applicable = [k for k in known_misses if k.applies_to(current.commit_hash)
                  and (not bench or re.search(bench, k.benchmark))]
    used = set()
    for c in checks:
        if c.ok:
            continue
        for i, k in enumerate(applicable):
            if k.matches(c):
                c.known = k.reason
                used.add(i)
                break
    stale = [k for i, k in enumerate(applicable) if i not in used]
    _print_report(out, machine, current, prev, how, checks, stale, allow_known_misses)
    return all(c.ok or (allow_known_misses and c.known) for c in checks), checks


def _print_report(out, machine, current, prev, how, checks, stale=(), allow_known_misses=False):
    p = lambda *a: print(*a, file=out)
    p(f"gate: machine {machine}, commit {current.commit_hash[:12]} ({current.env_name})")
    if prev is None:
        p("gate: no previous results on this machine: regression check skipped")
    else:
        p(f"gate: previous commit {prev.commit_hash[:12]} (found by {how})")
    rows = [("status", "check", "benchmark", "value", "limit", "note")]
    for c in checks:
        rows.append(("ok" if c.ok else ("KNOWN" if c.known else "FAIL"), c.kind, c.label, _fmt(c.value), c.limit,
                     c.note))
    widths = [min(max(len(r[i]) for r in rows), 90) for i in range(5)]
    for r in rows:
        p("  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5])
    failed = [c for c in checks if not c.ok]
    known = [c for c in failed if c.known]
    n_thr = sum(c.kind == "threshold" for c in checks)
    n_reg = sum(c.kind == "regression" for c in checks)
    p(f"gate: {len(checks)} checks ({n_thr} threshold, {n_reg} regression), {len(failed)} failed"
      + (f" ({len(known)} of them known misses listed in known_misses)" if known else ""))
    for c in failed:
        tag = f" [known miss: {c.known}]" if c.known else ""
        if c.kind == "threshold":
            p(f"FAIL threshold: {c.label} = {_fmt(c.value)}, required {c.limit} ({c.note}){tag}")
        else:
            p(f"FAIL regression: {c.label} = {_fmt(c.value)}, allowed {c.limit}; {c.note}{tag}")
    for k in stale:
        p(f"gate: known miss no longer fails (remove it from known_misses): {k.label}")
    unknown = [c for c in failed if not c.known]
    if not failed:
        p("gate: PASSED")
    elif not unknown and allow_known_misses:
        p(f"gate: PASSED with {len(known)} known misses (--allow-known-misses); the targets above are still missed")
    elif not unknown:
        p(f"gate: FAILED: only known misses ({len(known)}); --allow-known-misses accepts them")
    else:
        p(f"gate: FAILED ({len(unknown)} failures not in known_misses)")


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
                    help="do not fail gated benchmarks that have no value (e.g. a partial run)")
    ap.add_argument("--allow-known-misses", action="store_true",
                    help="do not fail on failures listed in known_misses of the thresholds file (still reported)")
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
