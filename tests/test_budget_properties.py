"""The budget rule and the selection width, as properties: every row's count is the rule's, the host bound is the
largest count (tight), and the selection width the kernels are launched with covers it, for every cache length and
every budget (an int count or a fraction).  Then the Triton path at the boundary shapes where rounding the bound
down instead of up would drop a token: k = 0.25 over 65 tokens needs 17 (16.25 rounded up), one more than the 16
a rounded-down bound leaves room for.

The rule (``loki._checks.budget_counts``): an int count keeps ``min(k, n)`` of a row's ``n`` valid tokens; a fraction
keeps ``ceil(k * n)``, at least 1 and at most n; an empty row keeps 0.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from loki._checks import budget_bound, budget_counts
from loki.kernels.decode import decode_attention, launch_decode_step, selection_bound, selection_width
from loki.testing.inputs import make_decode_inputs
from loki.testing.invariants import assert_same_sets
from loki.testing.strategies import decode_shapes

#: The drawn-shape test runs the Triton path on the CPU under the interpreter only (conftest sets TRITON_INTERPRET=1
#: without CUDA; hypothesis takes no per-test device fixture); the boundary shapes run on both devices.
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the Triton kernels on the CPU need TRITON_INTERPRET=1")


def rule(k: int | float, n: int) -> int:
    """The budget rule written out for one row, independently of ``budget_counts``: the fewest tokens that reach
    ``k * n`` (up to the rule's 1e-9 slack for fractions whose product rounds just above an integer, as
    0.1 * 30 = 3.0000000000000004), at least 1 and at most n."""
    if n == 0:
        return 0
    if isinstance(k, int):
        return min(k, n)
    need = k * n - 1e-9
    c = 1
    while c < need:  # the smallest integer c >= k * n (no ceil: the mutation check must not share its code)
        c += 1
    return min(c, n)


def _ceil16(x: int) -> int:
    return (x + 15) // 16 * 16


def check_rule(k: int | float, S: int) -> None:
    counts = budget_counts(k, torch.arange(S + 1)).tolist()
    want = [rule(k, n) for n in range(S + 1)]
    assert counts == want, f"k={k!r}, S={S}: budget_counts {counts} != rule {want}"
    bound = budget_bound(k, S)
    assert bound == max(counts[1:]), f"k={k!r}, S={S}: budget_bound {bound} is not the largest count {max(counts)}"
    assert selection_bound(k, S) == bound
    width = selection_width(k, S)
    assert width >= bound, f"k={k!r}, S={S}: selection width {width} < largest count {bound}"
    assert width == min(S, _ceil16(bound)), f"k={k!r}, S={S}: width {width}, want {min(S, _ceil16(bound))}"


budgets = st.one_of(
    st.integers(1, 600),
    st.floats(1e-3, 1.0, allow_nan=False, exclude_min=False),
    st.builds(lambda num, den: num / den, st.integers(1, 64), st.integers(64, 128)),  # fractions of few bits
    st.sampled_from([0.25, 0.125, 0.1, 1 / 3, 0.2, 0.3, 0.5, 0.75, 1.0]),
)


@given(k=budgets, S=st.integers(1, 520))
@settings(max_examples=300)
@example(k=0.25, S=65)  # the reported boundary: 17 tokens, width 32
@example(k=0.1, S=30)  # 0.1 * 30 = 3.0000000000000004 keeps 3
@example(k=17, S=65)
@example(k=1.0, S=1)
@example(k=1e-12, S=5)  # a fraction so small that k * n rounds to 0: every non-empty row still keeps 1
def test_width_covers_every_rows_budget(k, S):
    """For every length S and budget k: each row of n <= S valid tokens keeps the rule's count, the host bound is
    the largest of them, and the selection width covers it (rounded up to 16, at most S)."""
    check_rule(k, S)


@pytest.mark.parametrize("k", [i / 100 for i in range(1, 101)] + [1 / 3, 2 / 3, 1 / 6, 1 / 7, 0.125, 0.0625,
                                                                   1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 300])
def test_width_covers_every_rows_budget_on_a_grid(k):
    """The same properties over every length 1..300 for common budgets (a grid, so that the boundaries where
    ``k * n`` is just above an integer are all visited, whatever the draw)."""
    counts = budget_counts(k, torch.arange(301)).tolist()
    assert counts == [rule(k, n) for n in range(301)]
    for S in range(1, 301):
        bound = budget_bound(k, S)
        assert bound == max(counts[1:S + 1]), (k, S)
        assert bound <= selection_width(k, S) == min(S, _ceil16(bound)), (k, S)


def test_rounded_down_width_would_miss_the_boundary():
    """The boundary the kernels below run at: a fraction whose product with the length is not an integer needs
    the bound rounded up (17 of 65 at k = 0.25, so the width grows to 32), and an int count needs itself."""
    assert budget_bound(0.25, 65) == 17 and selection_width(0.25, 65) == 32
    assert budget_bound(0.25, 64) == 16 and selection_width(0.25, 64) == 16
    assert budget_bound(0.125, 17) == 3 and selection_width(0.125, 17) == 16
    assert budget_bound(0.1, 30) == 3 and budget_bound(17, 65) == 17 and budget_bound(700, 65) == 65
    assert budget_counts(1e-12, torch.tensor([0, 1, 5])).tolist() == [0, 1, 1]  # at least 1, an empty row 0


# ------------------------------------------------------------------------------------------ the Triton path
def _check_triton_attends_the_budget(B, HQ, HKV, S, D, d, k, *, ragged, left_pad, seed=0, gqa_select="query",
                                     device="cpu"):
    """decode_attention(backend="triton") and launch_decode_step at the integration's selection width against the
    reference: every row attends exactly its count of tokens (the reference's set), and the outputs agree."""
    x = make_decode_inputs(B, HQ, HKV, S, D, dtype=torch.float32, ragged=ragged, left_pad=left_pad, seed=seed,
                           device=device)
    n = (x.lengths - x.starts).tolist()
    want = torch.tensor([rule(k, m) for m in n], device=x.q.device)
    kw = dict(d=d, k=k, lengths=x.lengths, starts=x.starts, gqa_select=gqa_select, aggregate="sum",
              return_indices=True)
    ref_out, (ref_idx, ref_counts) = decode_attention(x.q, x.k_cache, x.v_cache, backend="torch", **kw)
    assert ref_counts.tolist() == want.tolist()
    out, (idx, counts) = decode_attention(x.q, x.k_cache, x.v_cache, backend="triton", **kw)
    assert counts.tolist() == want.tolist()
    assert idx.shape[-1] >= int(want.max()), f"selection width {idx.shape[-1]} < count {int(want.max())}"
    assert_same_sets(idx, ref_idx, want)  # exactly count tokens per row, the reference's
    torch.testing.assert_close(out, ref_out, rtol=2e-5, atol=2e-5)
    # the integration's route: the selection width rounded up to 16, counts on the device
    W = selection_width(k, S)
    idx2, out2 = launch_decode_step(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=None,
                                    lengths=x.lengths, starts=x.starts, counts=want, d=d, width=W,
                                    gqa_select=gqa_select, aggregate="sum", scale=None)
    assert idx2.shape[-1] == W >= int(want.max())
    assert_same_sets(idx2, ref_idx, want)
    torch.testing.assert_close(out2, ref_out, rtol=2e-5, atol=2e-5)
    return ref_out


BOUNDARY = [
    # (B, HQ, HKV, S, D, d, k, ragged, left_pad)
    pytest.param(1, 4, 2, 65, 16, 8, 0.25, False, False, id="S65-k0.25"),  # 17 tokens: width 32, not 16
    pytest.param(3, 4, 2, 65, 16, 8, 0.25, True, True, id="B3-S65-k0.25-ragged"),
    pytest.param(2, 3, 1, 17, 16, 4, 0.125, True, False, id="S17-k0.125"),  # 3 tokens (2.125 rounded up)
    pytest.param(2, 4, 4, 65, 16, 8, 17, True, True, id="S65-k17"),  # an int count, one past a multiple of 16
]


@pytest.mark.parametrize("B, HQ, HKV, S, D, d, k, ragged, left_pad", BOUNDARY)
def test_triton_attends_exactly_the_budget_at_boundary_shapes(triton_device, B, HQ, HKV, S, D, d, k, ragged,
                                                              left_pad):
    _check_triton_attends_the_budget(B, HQ, HKV, S, D, d, k, ragged=ragged, left_pad=left_pad, device=triton_device)


def test_one_token_short_is_caught_at_the_reported_boundary():
    """The reported defect's size at S = 65, k = 0.25: leaving the 17th token out changes the output by far more
    than the comparison's tolerance, so the checks above can fail."""
    x = make_decode_inputs(1, 4, 2, 65, 16, dtype=torch.float32)
    full = decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=0.25, backend="torch", gqa_select="query",
                            aggregate="sum")
    short = decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=16, backend="torch", gqa_select="query", aggregate="sum")
    assert float((full - short).abs().max()) > 1e-2


@pytest.mark.interpreter
@needs_interpreter
@given(shape=decode_shapes(max_batch=2, max_seq=140, head_dims=(16,), groups=(1, 2), max_kv_heads=2,
                           max_elements=8_000))
@settings(max_examples=12)
def test_triton_attends_exactly_the_budget_for_drawn_shapes(shape):
    """Drawn shapes and budgets (fractions, counts, counts above S), ragged and left-padded."""
    s = shape
    _check_triton_attends_the_budget(s.B, s.HQ, s.HKV, s.S, s.D, min(s.d, 8), s.k, ragged=s.B > 1,
                                     left_pad=s.B > 1, seed=s.S)


def test_rule_helper_can_fail():
    """The independent rule differs from a rounded-down one exactly where the reported defect lives."""
    assert rule(0.25, 65) == 17 != math.floor(0.25 * 65)
    assert rule(0.1, 30) == 3 and rule(1.0, 7) == 7 and rule(0.001, 5) == 1 and rule(9, 4) == 4
