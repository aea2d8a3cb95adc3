"""Score dims allocated per layer and KV head (loki.calibration.allocation): the allocation keeps the total, the
engine scores each head on its own dims, and everything else refuses such a basis."""

from __future__ import annotations

import pytest
import torch

from loki.basis import PCABasis
from loki.calibration.allocation import allocate_score_dims, score_dims_of, with_score_dims
from loki.reference.teacher_forced import teacher_forced_rows


def _basis(L=2, HKV=2, D=16, seed=0):
    b = PCABasis.random(L, HKV, D, seed=seed)
    # head (0, 0): all its variance in 2 dims; the others spread it
    ev = torch.ones(L, HKV, D, dtype=torch.float64)
    ev[0, 0] = torch.tensor([10.0, 10.0] + [1e-6] * (D - 2), dtype=torch.float64)
    ev[1, 1] = torch.linspace(2, 1, D, dtype=torch.float64)
    b.eigenvalues = ev
    return b


def test_allocation_keeps_the_total_and_gives_dims_where_the_spectrum_spreads():
    b = _basis()
    dims = allocate_score_dims(b, 0.25)  # d = 4 of 16
    assert dims.shape == (2, 2) and int(dims.sum()) == 2 * 2 * 4 and int(dims.min()) >= 1
    assert int(dims[0, 0]) == 2  # two dims hold all its variance: the rest goes elsewhere
    assert int(dims[1, 1]) > 4 or int(dims[0, 1]) > 4 or int(dims[1, 0]) > 4
    absolute = allocate_score_dims(b, 4, how="absolute", min_dims=2)
    assert int(absolute.sum()) == 16 and int(absolute.min()) >= 2
    assert int(absolute[0, 0]) == 2 + 0  # its two large values are within its minimum already
    flat = PCABasis.random(2, 2, 16, seed=1)
    flat.eigenvalues = torch.ones(2, 2, 16, dtype=torch.float64)
    assert allocate_score_dims(flat, 0.25).tolist() == [[4, 4], [4, 4]]  # ties: the stable order keeps d each
    with pytest.raises(ValueError, match="how must be"):
        allocate_score_dims(b, 0.25, how="magic")
    with pytest.raises(ValueError, match="min_dims"):
        allocate_score_dims(b, 0.25, min_dims=5)


def test_the_engine_scores_each_head_on_its_own_dims():
    """Per-head dims equal the uniform rows where every head has d dims, and equal, head by head, the rows at that
    head's own d; a planted mistake (one head's dims ignored) changes the result."""
    g = torch.Generator().manual_seed(0)
    B, HQ, HKV, L, S, D = 1, 4, 2, 20, 24, 16
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((HQ, L), (HKV, S), (HKV, S)))
    lengths = (S - L + 1 + torch.arange(L))[None]
    starts = torch.zeros(1, L, dtype=torch.long)
    kw = dict(method="loki", k_budget=0.25, gqa_select="query", aggregate="sum")
    uniform = teacher_forced_rows(q, k, v, starts, lengths, d=4, **kw)
    same = teacher_forced_rows(q, k, v, starts, lengths, d=4, score_dims=torch.tensor([4, 4]), **kw)
    torch.testing.assert_close(same, uniform, rtol=0, atol=0)
    mixed = teacher_forced_rows(q, k, v, starts, lengths, d=4, score_dims=torch.tensor([2, 6]), **kw)
    at2 = teacher_forced_rows(q, k, v, starts, lengths, d=2, **kw)
    at6 = teacher_forced_rows(q, k, v, starts, lengths, d=6, **kw)
    torch.testing.assert_close(mixed[:, :2], at2[:, :2], rtol=1e-6, atol=1e-6)  # KV head 0: query heads 0, 1
    torch.testing.assert_close(mixed[:, 2:], at6[:, 2:], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(mixed[:, :2], at6[:, :2])
    with pytest.raises(ValueError, match="score_dims must be 2 ints"):
        teacher_forced_rows(q, k, v, starts, lengths, d=4, score_dims=torch.tensor([2, 17]), **kw)
    with pytest.raises(ValueError, match="score_dims apply to method='loki'"):
        teacher_forced_rows(q, k, v, starts, lengths, d=4, score_dims=torch.tensor([2, 6]),
                            **dict(kw, method="exact_topk"))


def test_a_model_with_an_allocated_basis_evaluates_and_decode_steps_refuse_it():
    from loki.integrations.transformers import disable_loki, enable_loki
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    b = PCABasis.random(2, 2, 16, seed=1)
    b.eigenvalues = torch.rand(2, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).sort(
        -1, descending=True).values
    dims = allocate_score_dims(b, 0.25)
    alloc = with_score_dims(b, dims)
    assert score_dims_of(alloc).tolist() == dims.tolist() and score_dims_of(b) is None
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))

    def logits(basis, **kw):
        enable_loki(model, basis, k=0.5, d=4, semantics="decode", backend="torch", gqa_select="query",
                    score_format="native", **kw)
        try:
            with torch.no_grad():
                return model(input_ids=ids, use_cache=False).logits
        finally:
            disable_loki(model)

    uniform = logits(with_score_dims(b, torch.full((2, 2), 4)))
    torch.testing.assert_close(uniform, logits(b), rtol=0, atol=0)  # d everywhere: the default's rows
    assert not torch.allclose(logits(alloc), uniform)
    with pytest.raises(ValueError, match="semantics='generate'"):
        enable_loki(model, alloc, k=0.5, d=4)
    with pytest.raises(ValueError, match="score_format='int8'"):
        enable_loki(model, alloc, k=0.5, d=4, semantics="decode", score_format="int8")
    with pytest.raises(ValueError, match="score_format='int8'"):  # the default copy: the allocation names it
        enable_loki(model, alloc, k=0.5, d=4, semantics="decode")
    assert not hasattr(model, "_loki")


def test_a_saved_allocation_loads_back_with_its_dims(tmp_path):
    b = PCABasis.random(2, 2, 16, seed=1)
    alloc = with_score_dims(b, torch.tensor([[2, 6], [5, 3]]))
    alloc.save(tmp_path / "b.pt")
    assert score_dims_of(PCABasis.load(tmp_path / "b.pt")).tolist() == [[2, 6], [5, 3]]
    with pytest.raises(ValueError, match="score dims must be"):
        with_score_dims(b, torch.tensor([[0, 6], [5, 3]]))
