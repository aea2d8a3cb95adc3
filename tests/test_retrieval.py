"""The RULER-style retrieval suite: generators, scoring, intervals and the decode protocol on tiny models."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loki.basis import PCABasis
from loki.calibration import calibrate
from loki.evaluation import retrieval
from loki.evaluation.perplexity import MethodSpec, standard_methods
from loki.evaluation.retrieval import (
    evaluate_retrieval,
    informative,
    markdown_table,
    paired_difference,
    plot_retrieval,
    reference_for,
    retrieval_methods,
    run_batch,
    score,
    wilson_interval,
    write_report,
)
from loki.evaluation.retrieval_tasks import CHANCE, TASKS, make_sample, make_samples
from loki.testing.models import tiny_model


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256), enough for the generators and the tiny models."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


TOK = ByteTokenizer()
CTX = 1152  # bytes: the longest fixed part (variable tracking's example and question) is ~1000


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, seed=3)
    bases = {"post": PCABasis.random(2, 2, 16, seed=1, rotary="post"),
             "pre": PCABasis.random(2, 2, 16, seed=2, rotary="pre")}
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    bases["score"] = calibrate(model, ids, rotary="post", kind="score", num_tokens=256, seq_len=64, progress=False)
    assert bases["score"].query_components is not None
    return model, bases


def _real_tokenizer():
    try:
        from transformers import AutoTokenizer

        from loki.evaluation.models import default_model_dir

        return AutoTokenizer.from_pretrained(default_model_dir(convert=False))
    except Exception:
        return None


# ------------------------------------------------------------------------------------------ generators
@pytest.mark.parametrize("task", TASKS)
def test_generators_deterministic_exact_length_answer_inside(task):
    L = 2048
    a = make_samples(task, TOK, L, 3, seed=7)
    b = make_samples(task, TOK, L, 3, seed=7)
    assert [s.input_ids for s in a] == [s.input_ids for s in b]
    assert [s.answers for s in a] == [s.answers for s in b]
    assert make_samples(task, TOK, L, 3, seed=8)[0].input_ids != a[0].input_ids
    for s in a:
        assert len(s.input_ids) == L
        text = TOK.decode(s.input_ids)
        assert s.answers and all(ans in text for ans in s.answers)
        assert not text.rstrip().endswith(s.answers[0])  # the question, not the answer, ends the prompt
    # the asked needle moves through the context with its depth
    assert [s.depths[0] for s in a] == pytest.approx([1 / 6, 3 / 6, 5 / 6])
    pos = [s.positions[0] for s in a]
    assert pos == sorted(pos) and pos[-1] - pos[0] > L // 4


@pytest.mark.parametrize("task", TASKS)
def test_generators_real_tokenizer_exact_length(task):
    tok = _real_tokenizer()
    if tok is None:
        pytest.skip("the embedded model's tokenizer is not converted on this machine")
    for L in (1024, 2048):
        s = make_sample(task, tok, L, seed=3, depth=0.5)
        assert len(s.input_ids) == L
        assert all(ans in tok.decode(s.input_ids) for ans in s.answers)


def test_generator_rejects_short_context_and_unknown_task():
    with pytest.raises(ValueError, match="too short"):
        make_sample("variable_tracking", TOK, 300, seed=0)
    with pytest.raises(ValueError, match="task must be one of"):
        make_sample("qa", TOK, CTX, seed=0)


def test_multikey_needles_are_distinct_distractors():
    s = make_sample("multikey_needle", TOK, CTX, seed=11, depth=0.3)
    keys, values = s.meta["keys"], s.meta["values"]
    assert len(set(keys)) == len(keys) == 4 and len(set(values)) == 4 and s.answers == (values[0],)
    text = TOK.decode(s.input_ids)
    assert all(v in text for v in values) and text.rstrip().endswith(f"for {keys[0]} is:")
    assert CHANCE["multikey_needle"] == pytest.approx(0.25)


# ------------------------------------------------------------------------------------------ scoring, statistics
def test_score_is_ruler_string_match():
    assert score(" 71432. Remember", ("71432",))
    assert not score(" 7143", ("71432",))
    assert score(" VAR apple VAR PEAR", ("APPLE", "pear"))
    assert not score(" VAR APPLE", ("APPLE", "PEAR"))


def test_wilson_interval_known_values():
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_difference_newcombe_known_value():
    # Paired 2x2 table [[59, 6], [16, 80]] (Fagerland, Lydersen & Laake, ch. 8): -0.0621 (-0.1186 to -0.0046)
    a = [1] * 59 + [1] * 6 + [0] * 16 + [0] * 80
    b = [1] * 59 + [0] * 6 + [1] * 16 + [0] * 80
    d = paired_difference(a, b)
    assert d["diff"] == pytest.approx(-10 / 161)
    assert (d["lo"], d["hi"]) == pytest.approx((-0.1186, -0.0046), abs=1e-4)
    assert d["only_a"] == 6 and d["only_b"] == 16 and d["n"] == 161
    r = paired_difference(b, a)  # antisymmetric
    assert (r["diff"], r["lo"], r["hi"]) == pytest.approx((-d["diff"], -d["hi"], -d["lo"]))
    same = paired_difference(a, a)
    assert same["diff"] == 0 and same["lo"] < 0 < same["hi"]
    assert paired_difference([1] * 20, [0] * 20)["lo"] > 0.5
    with pytest.raises(ValueError):
        paired_difference([1, 0], [1])


def test_retrieval_methods_are_the_eleven_settings():
    specs = retrieval_methods(0.125)
    assert [s.name for s in specs] == [
        "full", "exact_topk[query]", "exact_topk[kv]", "loki-pre[query]", "loki-pre[kv]", "loki-post[query]",
        "loki-post[kv]", "loki-score[query]", "loki-score[kv]", "h2o", "sparq(r=16)"]
    assert all(s.k == 0.125 for s in specs[1:]) and {s.basis for s in specs} == {None, "pre", "post", "score"}


def test_reference_is_exact_topk_of_same_budget_and_gqa_mode():
    specs = standard_methods(0.25, 0.25, 64, pcaattn=False, exactness=False)
    by = {s.name: s for s in specs}
    assert reference_for(by["loki-post[kv]"], specs).name == "exact_topk[kv]"
    assert reference_for(by["loki-pre[query]"], specs).name == "exact_topk[query]"
    assert reference_for(by["h2o"], specs).name == "exact_topk[query]"
    assert reference_for(by["exact_topk[query]"], specs) is None and reference_for(by["full"], specs) is None
    assert reference_for(by["h2o"], specs, "full").name == "full"
    assert reference_for(by["h2o"], specs, None) is None


# ------------------------------------------------------------------------------------------ decode protocol
def _batch(task="passkey", n=2):
    return torch.tensor([s.input_ids for s in make_samples(task, TOK, CTX, n, seed=1)])


def test_first_answer_token_comes_from_a_sparse_step(tiny):
    """k = 1 changes the logits of the first generated token (a sparse decode step produced it); k = all, Loki
    with d = D and H2O with the whole budget reproduce full attention (the protocol itself is exact), and the
    shared dense prefill is not modified by a method that rotates its copy of the cache."""
    model, bases = tiny
    ids = _batch()
    specs = [MethodSpec("loki-all", "loki", k=1.0, d=1.0, basis="post"), MethodSpec("full", "full"),
             MethodSpec("top1", "exact_topk", k=1), MethodSpec("topall", "exact_topk", k=1.0),
             MethodSpec("h2o-all", "h2o", k=1.0)]
    for tq in (1, 6):
        res = run_batch(model, TOK, ids, specs, bases, question_tokens=tq, max_new_tokens=3, keep_logits=True)
        full = res["full"]["first_logits"]
        assert full.shape == (2, 256)
        assert (res["top1"]["first_logits"] - full).abs().max() > 1e-2
        for name in ("topall", "loki-all", "h2o-all"):
            torch.testing.assert_close(res[name]["first_logits"], full, rtol=1e-4, atol=1e-4)
            assert res[name]["tokens"] == res["full"]["tokens"]
    alone = run_batch(model, TOK, ids, [MethodSpec("full", "full")], question_tokens=6, max_new_tokens=3,
                      keep_logits=True)
    torch.testing.assert_close(alone["full"]["first_logits"], res["full"]["first_logits"])


def test_h2o_chunked_prefill_accumulates_like_one_pass(tiny):
    """H2O's own prefill in chunks (bounded materialised attention) gives the accumulated attention, hence the
    selections and logits, of a single pass."""
    model, _ = tiny
    ids = _batch()
    specs = [MethodSpec("h2o", "h2o", k=0.25)]
    one = run_batch(model, TOK, ids, specs, max_new_tokens=3, keep_logits=True)
    chunked = run_batch(model, TOK, ids, specs, max_new_tokens=3, keep_logits=True,
                        h2o_chunk_elements=2 * 4 * CTX * 100)  # ~100 query rows per chunk
    torch.testing.assert_close(chunked["h2o"]["first_logits"], one["h2o"]["first_logits"], rtol=1e-4, atol=1e-4)
    assert chunked["h2o"]["tokens"] == one["h2o"]["tokens"]


def test_loki_with_all_dims_selects_like_exact_topk(tiny):
    """Lemma 1 through the rotated copy of the dense cache: Loki with d = D scores every key exactly, so it
    decodes exactly like exact top-k at the same budget."""
    model, bases = tiny
    specs = [MethodSpec("exact", "exact_topk", k=0.1), MethodSpec("loki-dD", "loki", k=0.1, d=1.0, basis="pre")]
    res = run_batch(model, TOK, _batch("single_needle"), specs, bases, max_new_tokens=4, keep_logits=True)
    torch.testing.assert_close(res["loki-dD"]["first_logits"], res["exact"]["first_logits"], rtol=1e-4, atol=1e-4)
    assert res["loki-dD"]["tokens"] == res["exact"]["tokens"]


def test_decoding_stops_at_newline_and_once_answered(tiny):
    model, _ = tiny
    ids = _batch()
    res = run_batch(model, TOK, ids, [MethodSpec("full", "full")], max_new_tokens=5)
    toks = res["full"]["tokens"]
    assert all(len(t) <= 5 and 10 not in t for t in toks)  # newline (byte 10) ends a prediction
    # the answers are found after the first token: decoding stops there for every row
    first = [TOK.decode(t[:1]) for t in toks]
    res2 = run_batch(model, TOK, ids, [MethodSpec("full", "full")], answers=[(f,) for f in first],
                     max_new_tokens=5)
    assert all(len(t) <= 1 for t in res2["full"]["tokens"])
    assert [p[:1] for p in res["full"]["predictions"]] == [p[:1] for p in res2["full"]["predictions"]]


def test_every_method_runs_end_to_end(tiny, tmp_path):
    model, bases = tiny
    specs = retrieval_methods(0.25, 0.25, 16) + [MethodSpec("pcaattn", "pcaattn", d=0.25, basis="post")]
    impl = model.config._attn_implementation
    r = evaluate_retrieval(model, TOK, specs, bases, context_lens=(CTX,), samples=2, batch_size=2,
                           max_new_tokens=2, question_tokens=2, progress=False)
    assert model.config._attn_implementation == impl and not hasattr(model, "_loki")
    json.dumps(r)
    names = [s.name for s in specs]
    assert {(c["task"], c["name"]) for c in r["cells"]} == {(t, n) for t in (*TASKS, "all") for n in names}
    for c in r["cells"]:
        if c["task"] == "all":
            assert c["n"] == 2 * len(c["pooled_tasks"])
        else:
            assert c["n"] == 2 and 0 <= c["ci"][0] <= c["accuracy"] <= c["ci"][1] <= 1
            assert c["full_accuracy"] is not None and isinstance(c["full_above_chance"], bool)
        ref = reference_for(next(s for s in specs if s.name == c["name"]), specs)
        assert (c["diff"] is None) == (ref is None) and c["reference"] == (ref.name if ref else None)
        if c["method"] in ("loki", "sparq", "h2o") and c["k"] == 0.25:
            assert c["reference"].startswith("exact_topk[")
    assert r["chance"] == {t: CHANCE[t] for t in TASKS}
    assert len(r["timing"]) == 4 and all(set(t["methods_s"]) == set(names) for t in r["timing"])
    md = markdown_table(r)
    assert md.count("| method |") == 5 and "Δ" in md
    assert "| loki-post[kv] (softmax-max) |" in md and "| loki-post[query] |" in md and "| full |" in md
    plot_retrieval(r, tmp_path / "retrieval.png")
    assert (tmp_path / "retrieval.png").stat().st_size > 1000
    paths = write_report(r, tmp_path / "out")
    assert json.loads(open(paths["json"]).read())["cells"] == r["cells"]
    assert "| method |" in open(paths["md"]).read()


def test_batching_does_not_change_scores(tiny):
    model, bases = tiny
    specs = [MethodSpec("full", "full"), MethodSpec("loki", "loki", k=0.25, d=0.5, basis="post")]
    kw = dict(tasks=("passkey",), context_lens=(CTX,), samples=3, max_new_tokens=3, progress=False)
    a = evaluate_retrieval(model, TOK, specs, bases, batch_size=3, **kw)
    b = evaluate_retrieval(model, TOK, specs, bases, batch_size=2, **kw)
    assert a["samples"] == b["samples"]
    assert not math.isnan(a["cells"][0]["accuracy"])


def test_cells_pool_only_tasks_where_full_attention_is_above_chance(monkeypatch):
    """The statistics assembled from scripted predictions: full attention right on passkey only, exact top-k
    always right, "half" right on even samples."""

    def fake_run_batch(model, tokenizer, ids, specs, bases, *, answers, **kw):
        out = {"_prefill_seconds": 0.0}
        for s in specs:
            preds = []
            for i, ans in enumerate(answers):
                right = {"full": ans[0].isdigit() and len(ans[0]) == 5 and len(ans) == 1, "exact": True,
                         "half": i % 2 == 0}[s.name]
                preds.append(" ".join(ans) if right else "no")
            out[s.name] = {"predictions": preds, "tokens": [], "seconds": 0.0}
        return out

    monkeypatch.setattr(retrieval, "run_batch", fake_run_batch)
    model = tiny_model("llama", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, vocab_size=256)
    specs = [MethodSpec("full", "full"), MethodSpec("exact", "exact_topk", k=0.25),
             MethodSpec("half", "loki", k=0.25, basis="b")]
    r = evaluate_retrieval(model, TOK, specs, {}, context_lens=(CTX,), samples=8, batch_size=4, progress=False)
    by = {(c["task"], c["name"]): c for c in r["cells"]}
    assert by[("passkey", "full")]["accuracy"] == 1 and by[("passkey", "full")]["full_above_chance"]
    assert by[("single_needle", "full")]["accuracy"] == 0 and not by[("single_needle", "half")]["full_above_chance"]
    assert by[("all", "half")]["pooled_tasks"] == ["passkey"] and by[("all", "half")]["n"] == 8
    d = by[("multikey_needle", "half")]["diff"]
    assert by[("multikey_needle", "half")]["reference"] == "exact" and (d["diff"], d["only_b"]) == (-0.5, 4)
    assert by[("multikey_needle", "half")]["ci"] == pytest.approx(list(wilson_interval(4, 8)))
    assert "full attention not above chance at " + str(CTX) in markdown_table(r)
    assert informative([1] * 8, 0.25) and not informative([1, 0, 0, 0] * 2, 0.25) and not informative([], 0.0)
