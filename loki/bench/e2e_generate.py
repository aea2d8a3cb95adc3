"""Whole ``model.generate`` calls of the end-to-end decode benchmark (:mod:`loki.bench.e2e`): the per-token cost
of greedy generation as users run it, beside the timed forward of the decode step.

Method (:func:`time_generate`): one prompt of ``n0 = S - N - 1`` tokens, greedy, ``max_new_tokens`` =
``min_new_tokens`` (EOS cannot stop a call early), generated once with 1 new token and once with N + 1; each
length runs once untimed (``generate``'s own compilation of the decode step, CUDA-graph recording, warm-up), then
``reps`` times timed (wall clock around the call, the device synchronised before and after).  Per token:
``(median t(N + 1) - median t(1)) / N``: the prompt, the first token and everything else a call does once cancel,
and what remains is one decode step of ``generate`` (the forward, the logits processors, the stopping criteria,
the cache bookkeeping, the host work between steps).  The cache reaches ``n0 + N = S - 1`` tokens.

The prompt (``prompt=``): ``"cache"`` (default) passes the path's cache holding the first ``n0 - 1`` prompt
positions already (random keys and values, written by :func:`loki.bench.e2e_cache.fill_cache`), so ``generate``
runs the last prompt token as its first forward: cheap at any S.  ``"prefill"`` starts from an empty cache and
``generate`` prefills the whole prompt (what a user's first call does; a 131072-token prefill takes seconds per
call, and it is run four times per path).  Either way the cache is the path's own (a ``DynamicCache`` for the eager
paths, a ``StaticCache`` / ``LokiStaticCache`` of S tokens for the compiled ones), passed under the model's cache
keyword and rewound between calls; on CUDA ``generate`` compiles its decode step for a static cache with the
model's ``generation_config`` compile settings (``compile=False``: ``disable_compile=True``).
"""

from __future__ import annotations

import statistics
import time

import torch

from .e2e_cache import rewind, settle_launch_state

__all__ = ["PROMPTS", "time_generate"]

PROMPTS = ("cache", "prefill")

#: The clock of the timed calls (seconds); a test replaces it.
_now = time.perf_counter


def time_generate(model, cache, *, B: int, S: int, new_tokens: int, key: str, device, reps: int = 3,
                  prompt: str = "cache", compile: bool = True, seed: int = 0) -> dict:
    """Time greedy ``model.generate`` at cache length S with ``cache`` (see the module docstring); for
    ``prompt="cache"`` the cache must hold at least ``S - new_tokens - 2`` valid tokens.  Returns
    ``generate_ms_per_token`` = (median t(N + 1) - median t(1)) / N in ms, the medians
    (``generate_t1_ms``, ``generate_tn_ms``), every timed call (``generate_times_ms``: {"1": [...], "N+1": [...]}),
    each repetition's own (t(N + 1) - t(1)) / N (``generate_ms_per_token_reps``) and their range
    (``generate_ms_per_token_spread``: how far the host-side jitter of ``generate`` moves the per-token time),
    ``generate_tokens_per_s`` = B / per-token time, the first (untimed) calls' wall time
    (``generate_warmup_s``), whether the timed N + 1 call produced the warm-up's tokens
    (``generate_same_tokens``; compiled bf16 steps may differ after a near tie) and the settings."""
    if prompt not in PROMPTS:
        raise ValueError(f"prompt must be one of {PROMPTS}, got {prompt!r}")
    N = int(new_tokens)
    n0 = S - N - 1
    if N < 1 or n0 < 2:
        raise ValueError(f"new_tokens={new_tokens} needs 1 <= N <= S - 3 (S = {S})")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    dev = torch.device(device)
    cached = n0 - 1 if prompt == "cache" else 0
    g = torch.Generator(device="cpu").manual_seed(seed + 11)
    ids = torch.randint(0, int(model.config.vocab_size), (B, n0), generator=g).to(dev)
    mask = torch.ones_like(ids)
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def call(n: int):
        rewind(cache, cached)
        kw = {key: cache, "attention_mask": mask, "max_new_tokens": n, "min_new_tokens": n, "do_sample": False,
              "pad_token_id": 0}
        if not compile:
            kw["disable_compile"] = True
        return model.generate(ids, **kw)

    lengths = {"1": 1, "N+1": N + 1}
    warm, times = {}, {name: [] for name in lengths}
    with torch.no_grad():
        t0 = time.perf_counter()
        for name, n in lengths.items():
            warm[name] = call(n)
        sync()
        warmup_s = time.perf_counter() - t0
        settled = settle_launch_state(dev)  # after generate's own compile: the state of the forward's timing
        last = None
        for _ in range(reps):
            for name, n in lengths.items():
                sync()
                t = _now()
                out = call(n)
                sync()
                times[name].append((_now() - t) * 1e3)
                if name == "N+1":
                    last = out
    for name, n in lengths.items():
        if warm[name].shape != (B, n0 + n):
            raise RuntimeError(f"generate returned {list(warm[name].shape)} for {n} new tokens, expected "
                               f"{[B, n0 + n]}")
    t1, tn = statistics.median(times["1"]), statistics.median(times["N+1"])
    per_token = (tn - t1) / N
    paired = [(b - a) / N for a, b in zip(times["1"], times["N+1"])]
    return {"generate_ms_per_token": per_token, "generate_t1_ms": t1, "generate_tn_ms": tn,
            "generate_times_ms": times, "generate_ms_per_token_reps": paired,
            "generate_ms_per_token_spread": max(paired) - min(paired), "generate_new_tokens": N, "generate_reps": reps,
            "generate_prompt": prompt, "generate_prompt_tokens": n0,
            "generate_tokens_per_s": B / (per_token * 1e-3) if per_token > 0 else None,
            "generate_warmup_s": warmup_s, "generate_same_tokens": bool(torch.equal(last, warm["N+1"])),
            "generate_launch_state_settled": settled}
