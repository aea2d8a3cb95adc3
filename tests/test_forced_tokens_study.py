"""tools/studies/forced_tokens_study.py: the forced-token rule it wraps around the reference's row top-k selects the
last ``recent`` and first ``sink`` visible tokens of each row first, the rest by score, and is gone afterwards."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from loki.reference import teacher_forced

ROOT = Path(__file__).resolve().parent.parent


def _study():
    spec = importlib.util.spec_from_file_location("forced_tokens_study",
                                                  ROOT / "tools" / "studies" / "forced_tokens_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_forced_tokens_come_first_and_the_rule_is_removed_after():
    study = _study()
    real = teacher_forced.topk_mask
    scores = torch.tensor([[[[0.9, 0.1, 0.8, 0.7, 0.2, 0.3, 0.05, float("-inf")]]]])  # row sees tokens 0-6
    counts = torch.tensor([[[4]]])
    assert real(scores, counts)[0, 0, 0].nonzero().flatten().tolist() == [0, 2, 3, 5]
    with study.forced_tokens(recent=2, sink=1):
        assert teacher_forced.topk_mask is not real
        got = teacher_forced.topk_mask(scores, counts)[0, 0, 0].nonzero().flatten().tolist()
        assert got == [0, 2, 5, 6]  # 5, 6 the last two visible, 0 the first, then 2 by score
        few = teacher_forced.topk_mask(scores, torch.tensor([[[2]]]))[0, 0, 0].nonzero().flatten().tolist()
        assert few == [0, 5]  # more forced tokens than the budget: the best of them by score
    assert teacher_forced.topk_mask is real
    with study.forced_tokens(recent=0, sink=0):
        assert teacher_forced.topk_mask is real


def test_variants_are_parsed_by_name_and_bad_ones_refused():
    study = _study()
    assert study.variant("recent64+sink4") == ("recent64+sink4", 64, 4, 0)
    assert study.variant("sink8") == ("sink8", 0, 8, 0)
    assert study.variant("recent128@L2") == ("recent128@L2", 128, 0, 2)
    for bad in ("recent", "recent0", "sink-4", "recent8+recent4", "window8", "recent8+", "@L2"):
        with pytest.raises(argparse.ArgumentTypeError, match="recentN, sinkM or recentN"):
            study.variant(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="@Lj"):
        study.variant("sink4@Lx")


def test_forcing_from_a_layer_on_leaves_the_earlier_layers_to_the_scores():
    """With ``first_layer`` the rule applies only once a layer at or after it has started (the model's attention
    modules name their layers), and its hooks are removed afterwards."""
    from loki._hf import attention_modules
    from loki.testing.models import tiny_model

    study = _study()
    real = teacher_forced.topk_mask
    model = tiny_model("llama", num_layers=3, num_heads=2, num_kv_heads=1, head_dim=16, seed=0)
    mods = attention_modules(model)
    scores = torch.tensor([[[[0.9, 0.1, 0.8, 0.7, 0.2, 0.3, 0.05, float("-inf")]]]])
    counts = torch.tensor([[[4]]])
    picked = []

    def record(mod, args):
        picked.append(teacher_forced.topk_mask(scores, counts)[0, 0, 0].nonzero().flatten().tolist())

    with pytest.raises(ValueError, match="needs the model"):
        with study.forced_tokens(recent=2, sink=1, first_layer=1):
            pass
    with study.forced_tokens(recent=2, sink=1, first_layer=1, model=model):
        hs = [m.register_forward_pre_hook(record) for m in mods]  # after the study's hooks: the layer is named
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
        for h in hs:
            h.remove()
    assert picked == [[0, 2, 3, 5], [0, 2, 5, 6], [0, 2, 5, 6]]  # layer 0 by score, layers 1 and 2 forced
    assert teacher_forced.topk_mask is real
    assert all(not m._forward_pre_hooks for m in mods)
