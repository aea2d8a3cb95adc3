"""Mutation check of the decode path, the budget rule, calibration, the intervals and the gates: plant one-line
defects, one at a time, and require the test suite to fail on each (a mutant the tests do not "kill" shows a hole
in them).

Mutant ids: M (the integration's decode paths and the kernels), G (the gates' fail-closed rules), B (the budget
rule and the selection width), I (the 95% intervals), R (every gate's interval or value rule, loki/evaluation and
ci/gate.py), C (calibration).  Each names the narrow test selection that must catch it.

Each mutant replaces one exact line fragment (it must occur once) in a copy of the working tree under a temporary
folder, then runs the tests named for it there (``pytest -x``, the copy first on ``PYTHONPATH``).  A mutant is
killed when those tests fail, survives when they pass; mutants marked ``equivalent`` (no observable behaviour
changes) and, on the CPU, those that only a GPU run can see (``gpu``) are reported but not counted.

    python tools/mutation_check.py                      # every CPU mutant (about 35-45 minutes on 2 cores)
    python tools/mutation_check.py --only M03,M07       # some of them
    python tools/mutation_check.py --only B01,I01,R01   # the B, I, R and C mutants take 12-20 s each
    python tools/mutation_check.py --gpu                # on a CUDA machine: the GPU-only mutants, -m gpu tests
    python tools/mutation_check.py --out results/mutation-cpu.json

The kill rate is killed / (mutants run - equivalent).  docs/mutation.md records the last run and the survivors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DECODE_TESTS = ["tests/test_decode_paths.py", "tests/test_static_cache.py"]
KERNEL_TESTS = ["tests/test_decode_paths.py", "tests/test_kernels.py", "-k",
                "replay or plan or write or budget or second_call or errors_name or matches"]
GATE_TESTS = ["tests/test_gate.py", "tests/test_evaluation.py"]
# the mutants of the budget rule, the intervals, the gate rules and calibration (B, I, R, C): narrow selections
BUDGET_TESTS = ["tests/test_budget_properties.py"]
INTERVAL_TESTS = ["tests/test_intervals.py"]
RULE_TESTS = ["tests/test_gate_rules.py"]
CI_RULE_TESTS = ["tests/test_gate_rules.py", "-k", "ci_"]
STATS_TESTS = ["tests/test_calibration.py", "-k", "stats or statistics or padding or calibrated_basis"]
SCORE_TESTS = ["tests/test_score_aware.py"]


@dataclass
class Mutant:
    id: str
    file: str
    old: str
    new: str
    what: str
    tests: list = field(default_factory=lambda: list(DECODE_TESTS))
    gpu: bool = False  # only a GPU run executes the mutated code
    equivalent: str | None = None  # why no behaviour changes (not counted)


T = "loki/integrations/transformers/"
K = "loki/kernels/"
MUTANTS = [
    # the step plan (step.py): ranges, budgets, bounds, the runner
    Mutant("M01", T + "step.py", "hi = (q_pos + 1)[None, :].expand(B, L)", "hi = (q_pos + 2)[None, :].expand(B, L)",
           "every row also sees the slot after its own"),
    Mutant("M02", T + "step.py", "lo = torch.maximum(lo, (q_pos - window + 1)[None, :])",
           "lo = torch.maximum(lo, (q_pos - window)[None, :])", "sliding window one token too wide"),
    Mutant("M03", T + "step.py", "g.counts = budget_counts(k, lengths[:, 0] - starts[:, 0])",
           "g.counts = budget_counts(k, lengths[:, 0])", "budget from the length, padding counted"),
    Mutant("M04", T + "step.py", "end = M - mi.flip(-1).argmax(-1).long()",
           "end = M - mi.flip(-1).argmax(-1).long() + 1", "sequence end one past the mask"),
    Mutant("M05", T + "step.py", "first = mi.argmax(-1).long()", "first = mi.argmax(-1).long() * 0",
           "left padding ignored"),
    Mutant("M06", T + "step.py", "checks.append((last < static_len,", "checks.append((last <= static_len,",
           "static bound off by one"),
    Mutant("M07", T + "step.py", "checks.append((((count == end - first) | ~has).all(),",
           "checks.append((((count <= end - first) | ~has).all(),", "masks with holes accepted"),
    # the decode step's two routes (run.py)
    Mutant("M08", T + "run.py", "q_hat = rotate_query_op(query[:, :, 0], transforms.query)",
           "q_hat = rotate_query_op(query[:, :, 0], transforms.key)",
           "kernels route: query rotated with the key transform"),
    Mutant("M09", T + "run.py", "run = state.decode_run = DecodeRun(s, scale=scale)",
           "run = state.decode_run = DecodeRun(s, scale=scale * 1.05)", "kernels route: 5% wrong softmax scale"),
    Mutant("M10", T + "run.py", "starts=g.dec_starts, counts=g.counts, width=g.width)",
           "starts=g.dec_starts * 0, counts=g.counts, width=g.width)", "kernels route ignores left padding"),
    Mutant("M11", T + "attention.py", "q_use = rotate_rows(query, transforms.query) if keys_rotated else query",
           "q_use = rotate_rows(query, transforms.key) if keys_rotated else query",
           "prefill queries with the key transform"),
    Mutant("M12", T + "run.py",
           "        q = rotate_query(query[:, :, 0], transforms.query)\n        if not keys_rotated:",
           "        q = rotate_query(query[:, :, 0], transforms.key)\n        if not keys_rotated:",
           "reference route: query rotated with the key transform"),
    Mutant("M13", T + "run.py", "kw = dict(k=s.k, d=s.d, lengths=g.dec_lengths, starts=g.dec_starts,",
           "kw = dict(k=s.k, d=s.d, lengths=g.dec_lengths, starts=g.dec_starts * 0,",
           "reference route ignores left padding"),
    # cache layers, transforms, hooks, dispatch
    Mutant("M14", T + "layers.py", "check = not self.loki.owner.in_forward and not torch.compiler.is_compiling()",
           "check = False", "static writes outside a forward unchecked"),
    Mutant("M15", T + "state.py", "per = (key, query, query.transpose(-1, -2).contiguous())",
           "per = (key, query, key.transpose(-1, -2).contiguous())", "inverse of a score basis taken as P_k^T"),
    Mutant("M16", T + "enable.py", "attention_mask=arg(\"attention_mask\", args, kwargs)", "attention_mask=None",
           "the 2-D mask never read"),
    Mutant("M17", "loki/reference/dispatch.py",
           "budget = {\"counts\": counts} if counts is not None else {\"k\": k}",
           "budget = {\"counts\": (counts - 1).clamp(min=1)} if counts is not None else {\"k\": k}",
           "reference route: budgets one short"),
    Mutant("M33", T + "layers.py", "kb[:, :, :n].copy_(self.keys)", "kb[:, :, :n - 1].copy_(self.keys[:, :, 1:])",
           "dynamic buffers regrown with the keys shifted by one",
           tests=["tests/test_integration_transformers.py", "-k", "regrows or prefix"]),
    Mutant("M34", T + "enable.py", "AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask)", "pass",
           "no mask builder: generate drops the padding mask of a static cache",
           tests=["tests/test_static_cache.py", "-k", "generate_equals_dynamic"]),
    Mutant("M35", "loki/settings.py", "mode = GQAMode.KV if self.method is Method.LOKI and num_kv_heads < num_q_heads",
           "mode = GQAMode.KV if self.method is Method.LOKI and num_kv_heads <= num_q_heads",
           "\"auto\" shares selections on models without GQA",
           tests=["tests/test_integration_transformers.py", "-k", "default_selection"]),
    # kernels: replay object, op, cache write, decode step, launch
    Mutant("M18", K + "plan.py", "or (q_hat.is_cuda and torch.cuda.is_current_stream_capturing())):",
           "or False):", "replays recorded while a CUDA graph is captured",
           tests=["tests/test_softmax_aggregates_kernels.py", "tests/test_static_cache.py", "-m", "gpu"], gpu=True),
    Mutant("M19", K + "launch.py",
           "        return [torch.empty(s, dtype=dt, device=dev) for s, dt, dev in self.buffers]",
           "        return self.__dict__.setdefault(\"_b\", [torch.empty(s, dtype=dt, device=dev) for s, dt, dev in "
           "self.buffers])", "replays share one set of output buffers", tests=KERNEL_TESTS),
    Mutant("M20", K + "decode.py", "    return min(S, -(-selection_bound(k, S) // 16) * 16)",
           "    return min(S, selection_bound(k, S) // 16 * 16)", "selection width rounded down", tests=KERNEL_TESTS),
    Mutant("M21", K + "cache_write.py", "inside = (p >= 0) & (p < S_CACHE) & (b < B_CACHE)",
           "inside = (p >= 0) & (p <= S_CACHE) & (b < B_CACHE)", "write kernel stores one row past the cache",
           tests=KERNEL_TESTS),
    Mutant("M22", K + "cache_write.py", "if lo < 0 or hi >= S:", "if lo < 0 or hi > S:",
           "write check accepts position max_cache_len", tests=KERNEL_TESTS),
    Mutant("M23", K + "ops.py", "gqa_select=gqa_select, aggregate=aggregate, scale=scale).to(q_hat.dtype)",
           "gqa_select=gqa_select, aggregate=aggregate, scale=scale * 1.05).to(q_hat.dtype)",
           "5% wrong scale in the op's CPU registration"),
    Mutant("M24", "loki/_checks.py", "        return torch.clamp(n, max=int(k))",
           "        return torch.clamp(n, max=int(k) - 1)", "int budgets one short everywhere", tests=KERNEL_TESTS),
    Mutant("M25", K + "launch.py", "                    args[pos] = t.data_ptr() + off",
           "                    args[pos] = t.data_ptr()", "direct-launch replay ignores buffer offsets",
           tests=["tests/test_kernels.py", "tests/test_decode_paths.py", "-m", "gpu"], gpu=True),
    Mutant("M26", K + "plan.py", "        self._plans[key] = plan if plan.ok else False",
           "        self._plans[key] = False", "replay never happens (results unchanged, host time 4x)",
           tests=KERNEL_TESTS),
    Mutant("M27", K + "rotate.py",
           "    return rotate_query_reference(q, P).contiguous()\n\n\n@rotate_query_op.register_fake",
           "    return rotate_query_reference(q, P.transpose(-1, -2)).contiguous()\n\n\n"
           "@rotate_query_op.register_fake",
           "the rotation op's CPU registration transposes the basis"),
    Mutant("M28", K + "rotate.py", "P = tl.load(p_ptr + h * D * D + offs_i[:, None] * D + offs_j[None, :])",
           "P = tl.load(p_ptr + h * D * D + offs_i[:, None] + offs_j[None, :] * D)",
           "rotation kernel reads the basis transposed", tests=["tests/test_rotate_query.py"]),
    Mutant("M29", K + "cache_write.py", "offs_j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)",
           "offs_j = tl.arange(0, BLOCK_J)", "cache write: every program writes the first 32 dims",
           tests=["tests/test_static_cache.py", "-k", "write_rotated"]),
    Mutant("M30", K + "tl_helpers.py", "return m_new, l2 * tl.exp(m2 - ref) + tl.exp(x - ref)",
           "return m_new, l2 + tl.exp(x - ref)", "running log-sum-exp: sums not rescaled (both softmax kernels)",
           tests=["tests/test_softmax_aggregates_kernels.py"]),
    Mutant("M31", K + "score_select_softmax.py", "l = tl.sum(l2 * tl.exp(m2 - top[:, None]), axis=1)",
           "l = tl.sum(l2, axis=1)", "fused softmax select: lanes' sums combined without rescaling",
           tests=["tests/test_softmax_aggregates_kernels.py"]),
    Mutant("M32", K + "select_split.py", "if n <= CAND_BLOCK // 4:", "if n <= CAND_BLOCK // 2:",
           "final select: more candidates than the quarter tile holds", tests=["tests/test_select_split.py"]),
    # gates
    Mutant("G01", "ci/gate.py",
           "Check(\"threshold\", rule.benchmark, rule.params, \"absent\", \"present\", allow_missing,",
           "Check(\"threshold\", rule.benchmark, rule.params, \"absent\", \"present\", True,",
           "absent gated results pass", tests=GATE_TESTS),
    Mutant("G02", "ci/gate.py", "                    ok = ok and value >= rule.minimum",
           "                    ok = ok and value >= rule.minimum * 0.5", "minimum thresholds halved",
           tests=GATE_TESTS),
    Mutant("G03", "ci/gate.py", "worse = check.value < worst if check.better == \"higher\" else check.value > worst",
           "worse = False", "known misses excuse any value", tests=GATE_TESTS),
    Mutant("G04", "ci/gate.py", "                    ok = value - old <= allowed", "                    ok = True",
           "regressions never fail", tests=GATE_TESTS),
    Mutant("G05", "loki/evaluation/gates.py",
           "return False, \"FAILED: no gates ran (the results hold nothing to check)\"",
           "return True, \"FAILED: no gates ran (the results hold nothing to check)\"", "empty runs pass",
           tests=GATE_TESTS),
    Mutant("G06", "loki/evaluation/gates.py", "v, t[\"min\"], v >= t[\"min\"], f\">= {t['min']:.4f}\"",
           "v, t[\"min\"], v >= t[\"min\"] - 1, f\">= {t['min']:.4f}\"", "Jaccard / mass gates never fail",
           tests=GATE_TESTS),
    Mutant("G07", "loki/evaluation/gates.py", "return _gate(name, None, None, allow_missing, bound_text=\"present\"",
           "return _gate(name, None, None, True, bound_text=\"present\"", "missing rows pass", tests=GATE_TESTS),
    # the budget rule: loki/_checks.py (budget_counts, budget_bound) and the selection width (kernels/decode.py)
    Mutant("B01", "loki/_checks.py", "    return max(1, min(S, math.ceil(float(k) * S - 1e-9)))",
           "    return max(1, min(S, math.floor(float(k) * S - 1e-9)))",
           "fractional budget bound rounded down (k = 0.25, S = 65: 16 of 17)", tests=BUDGET_TESTS),
    Mutant("B02", "loki/_checks.py", "    return max(1, min(S, math.ceil(float(k) * S - 1e-9)))",
           "    return max(1, min(S, math.ceil(float(k) * S)))",
           "bound without the rule's slack (k = 0.1, S = 30: 4 > the largest count 3)", tests=BUDGET_TESTS),
    Mutant("B03", "loki/_checks.py", "        return max(1, min(int(k), S))", "        return max(1, int(k))",
           "an int budget's bound not capped at S", tests=BUDGET_TESTS),
    Mutant("B04", "loki/_checks.py", "    kk = torch.ceil(n.double() * float(k) - 1e-9).long()",
           "    kk = torch.floor(n.double() * float(k) - 1e-9).long()", "fractional counts rounded down",
           tests=BUDGET_TESTS),
    Mutant("B05", "loki/_checks.py", "    return torch.clamp(kk, min=1).minimum(n)",
           "    return torch.clamp(kk, min=1)", "an empty row keeps one token", tests=BUDGET_TESTS),
    Mutant("B06", "loki/_checks.py", "    return torch.clamp(kk, min=1).minimum(n)",
           "    return torch.clamp(kk, min=0).minimum(n)", "a tiny fraction keeps no token", tests=BUDGET_TESTS),
    Mutant("B07", K + "decode.py", "    return min(S, -(-selection_bound(k, S) // 16) * 16)",
           "    return min(S, -(-selection_bound(k, S - 1) // 16) * 16)",
           "selection width from a cache one token shorter", tests=BUDGET_TESTS),
    Mutant("B08", K + "decode.py", "d=settings.d, width=selection_bound(settings.k, S),",
           "d=settings.d, width=selection_bound(settings.k, S - 1),",
           "decode_attention's bound from a cache one token shorter", tests=BUDGET_TESTS),
    # the intervals: loki/evaluation/intervals.py
    Mutant("I01", "loki/evaluation/intervals.py", "[0.025, 0.975]", "[0.05, 0.95]",
           "the bootstrap's \"95%\" interval computed at 90%", tests=INTERVAL_TESTS),
    Mutant("I02", "loki/evaluation/intervals.py", "Z95 = 1.959963984540054", "Z95 = 1.6448536269514722",
           "score intervals at 90% (z of 90%)", tests=INTERVAL_TESTS),
    Mutant("I03", "loki/evaluation/intervals.py", "counts.view(N * nb, block).sum(-1)",
           "counts.view(N * nb, block).sum(-1).clamp(min=block)", "a window's short last block weighed as full",
           tests=INTERVAL_TESTS),
    Mutant("I04", "loki/evaluation/intervals.py", "boot = sums[pick].sum(-1) / counts[pick].sum(-1)",
           "boot = (sums[pick] / counts[pick]).mean(-1)", "resampled means not weighed by tokens",
           tests=INTERVAL_TESTS),
    Mutant("I05", "loki/evaluation/intervals.py", "return {\"increase\": math.expm1(mean),",
           "return {\"increase\": math.exp(mean) - 1,", "exp(x) - 1 for expm1(x)", tests=INTERVAL_TESTS,
           equivalent="equal to rounding (about 1e-17 absolute) at every increase the suite reports; expm1 only "
                      "matters below |x| ~ 1e-8, where no bound lies"),
    Mutant("I06", "loki/evaluation/intervals.py", "half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den",
           "half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n)) / den", "Wilson half-width misread",
           tests=INTERVAL_TESTS),
    Mutant("I07", "loki/evaluation/intervals.py",
           "corrected = cross - n / 2 if cross > n / 2 else (cross if cross < 0 else 0.0)", "corrected = cross",
           "Newcombe's phi without its continuity correction", tests=INTERVAL_TESTS),
    Mutant("I08", "loki/evaluation/intervals.py",
           "lo = d - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))",
           "lo = d - math.sqrt(max(0.0, (p1 - l1) ** 2 + 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))",
           "paired interval's lower bound with the correlation's sign flipped", tests=INTERVAL_TESTS),
    Mutant("I09", "loki/evaluation/intervals.py", "    if n <= 0:\n        return 0.0, 1.0",
           "    if n <= 1:\n        return 0.0, 1.0", "Wilson interval of one sample is (0, 1)",
           tests=INTERVAL_TESTS),
    # the gate rules: loki/evaluation/gates.py, targets.py, gate_rows.py and ci/gate.py
    Mutant("R01", "loki/evaluation/gates.py",
           "c[\"increase\"], 0.0, c[\"lo\"] <= 0.0,\n", "c[\"increase\"], 0.0, c[\"hi\"] <= 0.0,\n",
           "default-vs-PCA fidelity rule flipped (fails unless significantly better)", tests=RULE_TESTS),
    Mutant("R02", "loki/evaluation/gates.py", "c[\"lo\"] <= 0.0, f\"interval vs h2o",
           "c[\"lo\"] < 0.0, f\"interval vs h2o", "Loki vs H2O fails an interval touching 0", tests=RULE_TESTS),
    Mutant("R03", "loki/evaluation/gates.py", "c[\"hi\"] >= -otol,", "c[\"lo\"] >= -otol,",
           "ordering fails an interval straddling the bound", tests=RULE_TESTS),
    Mutant("R04", "loki/evaluation/targets.py", "r[\"increase_lo\"] <= t.max, f\"interval",
           "r[\"increase\"] <= t.max, f\"interval", "perplexity target decided on the point estimate",
           tests=RULE_TESTS),
    Mutant("R05", "loki/evaluation/targets.py", "d[\"hi\"] >= -t.max_drop,", "d[\"lo\"] >= -t.max_drop,",
           "retrieval target fails an interval straddling it", tests=RULE_TESTS),
    Mutant("R06", "loki/evaluation/targets.py", "if (lo > km.measured) if worse == \"higher\"",
           "if (hi > km.measured) if worse == \"higher\"", "known miss refused when straddling its value",
           tests=RULE_TESTS),
    Mutant("R07", "loki/evaluation/targets.py",
           "km = next((m for m in kms if in_default_mode({\"gqa_select\": m.gqa_select, \"aggregate\": "
           "m.aggregate}, gqa)), None)", "km = kms[0]", "a known miss of another GQA mode excuses",
           tests=RULE_TESTS),
    Mutant("R08", "loki/evaluation/gates.py", "r[\"increase_lo\"] <= t[\"max\"],",
           "r[\"increase_hi\"] <= t[\"max\"],", "perplexity regression fails an interval straddling its limit",
           tests=RULE_TESTS),
    Mutant("R09", "loki/evaluation/gates.py", "c[\"accuracy\"], t[\"min\"], c[\"hi\"] >= t[\"min\"],",
           "c[\"accuracy\"], t[\"min\"], c[\"accuracy\"] >= t[\"min\"],",
           "retrieval regression decided on the point estimate", tests=RULE_TESTS),
    Mutant("R10", "loki/evaluation/gates.py", "r[\"lo\"] <= 0.0 <= r[\"hi\"] or abs(r[\"diff\"]) <= tol,",
           "r[\"lo\"] <= 0.0 <= r[\"hi\"],", "retrieval through generate ignores its tolerance",
           tests=RULE_TESTS),
    Mutant("R11", "loki/evaluation/gates.py", "abs(r[\"rel_diff\"]) <= tol,", "r[\"rel_diff\"] <= tol,",
           "fast path passes any negative difference", tests=RULE_TESTS),
    Mutant("R12", "loki/evaluation/gates.py", "rel = abs(r[\"ppl\"] / ref[\"ppl\"] - 1)",
           "rel = r[\"ppl\"] / ref[\"ppl\"] - 1", "exactness passes any lower perplexity", tests=RULE_TESTS),
    Mutant("R13", "loki/evaluation/gates.py", "drop, t[\"max\"], drop <= t[\"max\"],",
           "drop, t[\"max\"], drop < t[\"max\"],", "downstream fails a drop at its limit", tests=RULE_TESTS),
    Mutant("R14", "loki/evaluation/gates.py", "    if not unknown and allow_known_misses:", "    if not unknown:",
           "known misses pass without --allow-known-misses", tests=RULE_TESTS),
    Mutant("R15", "loki/evaluation/gate_rows.py", "    if row.get(\"gqa_select\", \"query\") != mode:",
           "    if False:", "every row in the default GQA mode", tests=RULE_TESTS),
    Mutant("R16", "ci/gate.py", "ok = old - value <= allowed", "ok = value - old <= allowed",
           "higher-is-better regressions checked the wrong way", tests=CI_RULE_TESTS),
    Mutant("R17", "ci/gate.py", "ok = ok and value <= rule.maximum", "ok = ok and value < rule.maximum",
           "a value at its maximum fails", tests=CI_RULE_TESTS),
    Mutant("R18", "ci/gate.py", "allowed = max(abs(old) * (rule.factor - 1.0), rule.floor)",
           "allowed = abs(old) * (rule.factor - 1.0)", "min_abs_change ignored", tests=CI_RULE_TESTS),
    Mutant("R19", "ci/gate.py", "slack = abs(self.measured) * self.tolerance", "slack = 0.0",
           "known misses without their tolerance", tests=CI_RULE_TESTS),
    Mutant("R20", "ci/gate.py", "            return self.measured + slack", "            return self.measured - slack",
           "lower-is-better known misses: the tolerance the wrong way", tests=CI_RULE_TESTS),
    # calibration: loki/calibration/
    Mutant("C01", "loki/calibration/stats.py", "cov = cov - mu[..., :, None] * mu[..., None, :]",
           "cov = cov - mu[..., None, :] * mu[..., None, :]", "covariance centred with a wrong outer product",
           tests=STATS_TESTS),
    Mutant("C02", "loki/calibration/stats.py", "return self.outer / self.count[..., None, None].to(torch.float64)",
           "return self.outer / (self.count[..., None, None] - 1).to(torch.float64)",
           "second moment divided by N - 1", tests=STATS_TESTS),
    Mutant("C03", "loki/calibration/stats.py", "torch.einsum(\"nhd,nhe->hde\", k, k)",
           "torch.einsum(\"nhd,nhe->hed\", k, k)", "outer products summed transposed", tests=STATS_TESTS,
           equivalent="a sum of k k^T is symmetric: its transpose is itself, to the bit"),
    Mutant("C04", "loki/calibration/stats.py", "        self.outer += other.outer.to(dev)",
           "        self.outer = other.outer.to(dev)", "merge keeps only the other statistics' outer products",
           tests=STATS_TESTS),
    Mutant("C05", "loki/calibration/collect.py", "stats[\"post\"].update(layer, key.transpose(1, 2)[valid][:take])",
           "stats[\"post\"].update(layer, key.transpose(1, 2)[valid])",
           "token budget ignored for post-rotary keys", tests=STATS_TESTS),
    Mutant("C06", "loki/calibration/collect.py", "take = n if num_tokens is None else min(n, num_tokens - seen)",
           "take = n", "the last batch not truncated to the budget", tests=STATS_TESTS),
    Mutant("C07", "loki/calibration/collect.py", "q.reshape(-1, HKV, G, D).transpose(1, 2).reshape(-1, HKV, D)",
           "q.reshape(-1, G, HKV, D).reshape(-1, HKV, D)", "query heads pooled into the wrong KV groups",
           tests=SCORE_TESTS + ["-k", "pools"]),
    Mutant("C08", "loki/calibration/collect.py", "% 1.0) * (max_positions - seq_len + 1))",
           "% 1.0) * (max_positions - seq_len + 2))", "calibration offsets past the covered positions",
           tests=["tests/test_calibration.py", "-k", "position"]),
    Mutant("C09", "loki/calibration/hooks.py", "return (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)",
           "return attention_mask.long().cumsum(dim=-1).clamp_min(0)", "positions start at 1",
           tests=["tests/test_calibration.py", "-k", "rotary or padding or shifted"]),
    Mutant("C10", "loki/calibration/hooks.py", "mask = causal[None, None] & self.valid[:, None, None, :]",
           "mask = causal[None, None]", "the recorder attends to padding", tests=STATS_TESTS),
    Mutant("C11", "loki/calibration/score_aware.py", "pk = b_inv @ vh.transpose(-1, -2) * root",
           "pk = b_inv @ vh * root", "score-aware key transform not dual to the query's", tests=SCORE_TESTS),
    Mutant("C12", "loki/calibration/score_aware.py",
           "w = torch.where(spread > 0, 1.0 / spread.clamp_min(1e-300), 0.0)", "w = torch.ones_like(spread)",
           "group-normalised query moment not normalised", tests=SCORE_TESTS + ["-k", "group"]),
    Mutant("C13", "loki/calibration/calibrate.py", "covered = max_positions if max_positions is not None else seq_len",
           "covered = seq_len", "the basis records the sequence length as its covered positions",
           tests=["tests/test_calibration.py", "-k", "covered or records"]),
]


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run_mutant(m: Mutant, base: Path, gpu: bool, timeout: int) -> dict:
    work = base / m.id
    shutil.copytree(base / "tree", work)
    path = work / m.file
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        return {"status": "stale", "note": f"the fragment occurs {n} times in {m.file}"}
    path.write_text(text.replace(m.old, m.new))
    env = dict(os.environ, PYTHONPATH=str(work), OMP_NUM_THREADS="1", HYPOTHESIS_PROFILE="ci",
               PYTHONDONTWRITEBYTECODE="1")
    if not gpu:
        env["TRITON_INTERPRET"] = "1"
    args = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
    if not gpu and "-m" not in m.tests:
        args += ["-m", "not gpu"]
    t0 = time.time()
    try:
        p = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        rc, tail = p.returncode, (p.stdout + p.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, ["timeout"]
    shutil.rmtree(work, ignore_errors=True)
    status = "survived" if rc == 0 else ("killed" if rc in (1, 2, 3, 4) or rc < 0 else f"rc {rc}")
    if rc == 5:
        status = "no tests"
    return {"status": status, "seconds": round(time.time() - t0, 1), "tail": tail}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated mutant ids (default: all that run on this machine)")
    ap.add_argument("--gpu", action="store_true", help="run the GPU-only mutants with -m gpu tests (CUDA machine)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per mutant (default 1200)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    chosen = MUTANTS
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {m.id for m in MUTANTS}
        if unknown:
            ap.error(f"--only: unknown mutant ids {sorted(unknown)}")
        chosen = [m for m in MUTANTS if m.id in want]
    if args.list:
        for m in chosen:
            flags = (" [gpu]" if m.gpu else "") + (" [equivalent]" if m.equivalent else "")
            print(f"{m.id}  {m.file}: {m.what}{flags}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="loki-mutants-") as tmp:
        base = Path(tmp)
        _copy_tree(base / "tree")
        for m in chosen:
            if m.gpu != args.gpu and not args.only:
                continue
            res = run_mutant(m, base, args.gpu, args.timeout)
            row = {**asdict(m), **res}
            rows.append(row)
            print(f"{m.id} {res['status']:>8} {res.get('seconds', 0):6.1f}s  {m.what}", flush=True)
    counted = [r for r in rows if not r["equivalent"] and r["status"] in ("killed", "survived")]
    killed = sum(r["status"] == "killed" for r in counted)
    rate = killed / len(counted) if counted else float("nan")
    equiv = sum(bool(r["equivalent"]) for r in rows)
    print(f"\nkilled {killed} of {len(counted)} non-equivalent mutants ({rate:.0%}); equivalent {equiv}; "
          f"other {len(rows) - len(counted) - equiv}")
    for r in rows:
        if r["status"] == "survived" and not r["equivalent"]:
            print(f"  survivor {r['id']}: {r['what']} ({r['file']})")
    if args.out:
        Path(args.out).write_text(json.dumps({"kill_rate": rate, "killed": killed, "counted": len(counted),
                                              "mutants": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
