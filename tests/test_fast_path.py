"""The fast path's own accuracy (loki.evaluation.fast_path): token-by-token decoding through the Loki static cache
gives the evaluation engine's perplexity (same decode-time semantics); on CUDA compiled, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from loki.evaluation.fast_path import fast_path_perplexity, fast_path_section
from loki.evaluation.perplexity import MethodSpec, perplexity
from loki.testing.decode import random_score_basis
from loki.testing.models import tiny_model


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, seed=3)
    basis = random_score_basis(2, 2, 16, seed=1)
    windows = torch.randint(1, 128, (2, 21), generator=torch.Generator().manual_seed(5))
    return model, basis, windows


@pytest.mark.parametrize("k,gqa,aggregate,mask,fmt", [
    (0.3, "kv", "sum", "none", "native"), (0.25, "query", "sum", "grow", "int8"), (4, "kv", "union", "none", "native"),
    (0.5, "kv", "softmax-max", "grow", "int8")])
def test_fast_path_equals_the_engine(tiny, k, gqa, aggregate, mask, fmt):
    model, basis, windows = tiny
    spec = MethodSpec("l", "loki", k=k, d=5, basis="b", gqa_select=gqa, aggregate=aggregate, score_format=fmt)
    engine = perplexity(model, windows, spec, {"b": basis})
    # the int8 rows take the fast path's default score copy (enable_loki's "auto": the int8 copy)
    kw = {} if fmt == "int8" else {"score_format": fmt}
    fast = fast_path_perplexity(model, windows, basis, k=k, d=5, gqa_select=gqa, aggregate=aggregate, compile=False,
                                backend="torch", attention_mask=mask, **kw)
    assert fast["tokens"] == engine.tokens == 2 * 20 and fast["steps"] == 20
    assert fast["ppl"] == pytest.approx(engine.ppl, rel=1e-4)
    torch.testing.assert_close(fast["token_nll"], engine.token_nll, rtol=1e-4, atol=1e-4)
    assert not hasattr(model, "_loki")  # Loki disabled again
    full = perplexity(model, windows, MethodSpec("full", "full"))
    assert abs(fast["ppl"] / full.ppl - 1) > 1e-4  # the sparse setting really differs from dense attention


def test_fast_path_on_the_triton_interpreter(tiny, triton_device):
    model, basis, windows = tiny
    if triton_device.type == "cuda":
        pytest.skip("the GPU case is test_gpu_compiled_fast_path")
    spec = MethodSpec("l", "loki", k=0.3, d=5, basis="b", gqa_select="kv", aggregate="softmax-max")
    engine = perplexity(model, windows[:1, :9], spec, {"b": basis})
    fast = fast_path_perplexity(model, windows[:1, :9], basis, k=0.3, d=5, compile=False, backend="triton")
    assert (fast["gqa_select"], fast["aggregate"]) == ("kv", "softmax-max")  # the default on this GQA model
    assert fast["ppl"] == pytest.approx(engine.ppl, rel=1e-4)


def test_fast_path_arguments(tiny):
    model, basis, windows = tiny
    with pytest.raises(ValueError, match="compile=True"):
        fast_path_perplexity(model, windows, basis, compile=True)
    with pytest.raises(ValueError, match="windows"):
        fast_path_perplexity(model, windows[0], basis, compile=False)
    with pytest.raises(ValueError, match="attention_mask"):
        fast_path_perplexity(model, windows, basis, compile=False, attention_mask="full")
    with pytest.raises(ValueError, match="aggregate"):
        fast_path_perplexity(model, windows, basis, compile=False, aggregate="mean")
    res = fast_path_section(model, windows, basis, basis_name="b", k=0.25, d=0.25)
    assert "skipped" in res and "CUDA" in res["skipped"]


@pytest.mark.gpu
def test_gpu_compiled_fast_path():
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, seed=3).cuda()
    basis = random_score_basis(2, 2, 16, seed=1)
    windows = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    sec = fast_path_section(model, windows, basis, basis_name="b", k=0.25, d=0.25)
    fp32 = next(r for r in sec["rows"] if r["dtype"] == "float32")
    assert abs(fp32["rel_diff"]) < 1e-3 and fp32["compiled"]
    bf16 = next(r for r in sec["rows"] if r["dtype"] == "bfloat16")
    assert abs(bf16["rel_diff"]) < 0.05


def _with_fast_path(fp, fast_path_part=True):
    from loki.evaluation import suite

    res = {"settings": {"windows": [[8192, 2]], "k": 0.25, "d": 0.25,
                        "parts": {"perplexity": False, "fast_path": fast_path_part}}, "perplexity": []}
    if fp is not None:
        res["fast_path"] = fp
    assert suite.profile_options("long").fast_path and not suite.profile_options("check").fast_path
    return res


def _section(rel32, rel16=0.004):
    row = lambda dt, rel: {"dtype": dt, "ppl": 17.0 * (1 + rel), "rel_diff": rel, "increase": rel,  # noqa: E731
                           "increase_lo": rel - 1e-4, "increase_hi": rel + 1e-4, "seconds": 30.0, "steps": 8191,
                           "compiled": True}
    return {"setting": {"name": "loki-score[kv]", "method": "loki", "basis": "score", "k": 0.25, "d": 0.25,
                        "gqa_select": "kv", "aggregate": "sum", "seq_len": 8192, "windows": 2},
            "engine": {"ppl": 17.0, "dtype": "float32", "seconds": 2.0, "bytes_fraction": 0.375},
            "rows": [row("float32", rel32), row("bfloat16", rel16)]}


def test_fast_path_gate_and_report():
    from loki.evaluation import gates, report

    thr = gates.load_thresholds()
    assert thr["fast_path_rel_tol"] == 0.003

    def fast_gates(res):
        return [g for g in gates.evaluate_gates(res, thr, "long") if g["name"].startswith("fast path")]

    ok = fast_gates(_with_fast_path(_section(0.001)))
    assert len(ok) == 1 and ok[0]["passed"] and "fp32" in ok[0]["name"]
    bad = fast_gates(_with_fast_path(_section(-0.0045)))
    assert not bad[0]["passed"] and bad[0]["value"] == pytest.approx(0.0045)
    skipped = fast_gates(_with_fast_path({"skipped": "needs CUDA"}))
    assert skipped[0]["passed"] and skipped[0]["note"] == "needs CUDA"
    assert not fast_gates(_with_fast_path(None))[0]["passed"]  # asked for, absent
    assert fast_gates(_with_fast_path(None, fast_path_part=False)) == []
    md = report.markdown_report(_with_fast_path(_section(0.001)), thr)
    assert "## The fast path's own accuracy" in md and "| bfloat16 | 17.0680 | +0.400% |" in md
    assert "Skipped: needs CUDA." in report.markdown_report(_with_fast_path({"skipped": "needs CUDA"}), thr)


def test_fast_path_check_script_runs_on_the_cpu(tmp_path, capsys):
    """tools/fast_path_check.py --tiny: the GPU command's code paths (gate, JSON, table) on a tiny model."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "fast_path_check.py"
    spec = importlib.util.spec_from_file_location("fast_path_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "fp.json"
    assert mod.main(["--tiny", "--out", str(out)]) == 0
    sec = json.loads(out.read_text())
    assert sec["gate"]["passed"] and {r["dtype"] for r in sec["rows"]} == {"float32", "bfloat16"}
    # the default configuration of the (GQA) model: one selection per KV group, softmax-max
    assert (sec["setting"]["gqa_select"], sec["setting"]["aggregate"]) == ("kv", "softmax-max")
    printed = capsys.readouterr().out
    assert "gate (fp32 within 0.3%): PASS" in printed and "(aggregate softmax-max)" in printed
    assert mod.main(["--tiny", "--aggregate", "sum", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["setting"]["aggregate"] == "sum"
    with pytest.raises(SystemExit):
        mod.main(["--tiny", "--aggregate", "union", "--out", str(out)])  # not on the kernels
    with pytest.raises(SystemExit):
        mod.main(["--out", str(out), "--windows", "8192"])
