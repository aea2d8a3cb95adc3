"""Hypothesis strategies for decode-attention shapes (needs the ``test`` extra).

``decode_shapes()`` draws consistent B, HQ, HKV, S, D, d, k with the element count capped, so property
tests stay small on a 2-core CPU.  Budgets are drawn as every user can give them: an int count up to S, a
fraction in (0, 1], or an int count above S (which keeps every valid token).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

__all__ = ["DecodeShape", "decode_shapes", "HEAD_DIMS", "GQA_GROUPS"]

HEAD_DIMS = (16, 64, 80, 96, 128)
GQA_GROUPS = (1, 3, 4, 8)


@dataclass(frozen=True)
class DecodeShape:
    B: int
    HQ: int
    HKV: int
    S: int
    D: int
    d: int
    k: int | float

    @property
    def id(self) -> str:
        return f"B{self.B}-HQ{self.HQ}-HKV{self.HKV}-S{self.S}-D{self.D}-d{self.d}-k{self.k}"


@st.composite
def decode_shapes(
    draw,
    *,
    max_batch: int = 8,
    max_seq: int = 3000,
    head_dims=HEAD_DIMS,
    groups=GQA_GROUPS,
    max_kv_heads: int = 8,
    max_elements: int = 400_000,
) -> DecodeShape:
    """Draw a decode shape whose cache holds at most ``max_elements`` elements (B * HKV * S * D)."""
    D = draw(st.sampled_from(head_dims))
    G = draw(st.sampled_from(groups))
    HKV = draw(st.integers(1, max_kv_heads))
    B = draw(st.integers(1, max_batch))
    cap = max(1, min(max_seq, max_elements // (B * HKV * D)))
    S = draw(st.one_of(st.integers(1, min(cap, 64)), st.integers(1, cap)))
    d = draw(st.integers(1, D))
    k = draw(st.one_of(st.integers(1, S), st.floats(0.01, 1.0, allow_nan=False), st.integers(S + 1, 4 * S + 4)))
    return DecodeShape(B=B, HQ=HKV * G, HKV=HKV, S=S, D=D, d=d, k=k)
