"""Decode steps through the transformers integration on a GPU: what ``enable_loki`` (defaults: Triton
backend on CUDA, fused score+select where it pays, Triton select, key-prefix buffer, recorded launches)
gives inside a model, against the same model with ``attn_implementation="sdpa"``.

The model is a randomly initialised Llama with the attention shapes of a real one (HQ, HKV, D) and 8 layers
(all layers of a step share their shapes: the first takes the normal launch path, the second records the
step's launches, the others replay them, as in a real model); its MLP is narrow (intermediate size 256) so
that attention and the KV cache dominate a step, as they do at long context. B sequences of S prompt tokens
are prefilled once with SDPA into a ``DynamicCache``; then both paths run N single-token steps from a copy of
that cache (Loki converts its copy: keys rotated into the basis once, key prefix built) after 32 warm-up steps
(a growing cache makes Triton compile a few more variants of the kernels in its first steps: it specialises
integer arguments on their divisibility by 16; the count is reported). Each step is timed with CUDA events;
the table reports the median step and, for reference, the median time of the cache append alone
(``DynamicCache`` concatenates the whole cache every step, for both paths). SDPA is timed twice: restricted to
the flash and memory-efficient kernels (the baseline), and with torch's default backend choice (cuDNN on torch
2.11, which builds an execution plan on the host for every new sequence length, ~27 ms per call on an H100
machine).

    PYTHONPATH=. python3 -m benchmarks.tuning.integration --out $OUT [--steps 40] [--layers 8]

Writes ``integration.json`` under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

from .._shapes import TARGET_SHAPES, shape_dims

_COMPILES = [0]


def _count_compiles() -> None:
    """Count Triton compilations (JIT binders take ``triton.compiler.compile`` when first launched)."""
    import triton.compiler as tc

    if getattr(tc.compile, "_loki_counting", False):
        return
    orig = tc.compile

    def counting(*args, **kwargs):
        _COMPILES[0] += 1
        return orig(*args, **kwargs)

    counting._loki_counting = True
    tc.compile = counting


def _events_ms(fn, steps):
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2], times


def run_config(name, B, HQ, HKV, S, *, layers, steps, gqa_select, warmup=32):
    from transformers import DynamicCache

    from loki.basis import PCABasis
    from loki.integrations.transformers import enable_loki
    from loki.testing.models import tiny_model

    D = 128
    model = tiny_model("llama", num_layers=layers, num_heads=HQ, num_kv_heads=HKV, head_dim=D, vocab_size=512,
                       intermediate_size=256, max_position_embeddings=S + 4 * steps + 2 * warmup + 16)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    model.set_attn_implementation("sdpa")
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, 512, (B, S), device="cuda", generator=g)
    with torch.no_grad():
        prefill = DynamicCache(config=model.config)
        chunk = max(1, (1 << 14) // B)  # prefill in slices: bounded activation memory
        for s0 in range(0, S, chunk):
            model(ids[:, s0:s0 + chunk], past_key_values=prefill, use_cache=True)
    torch.cuda.synchronize()
    tok = torch.randint(1, 512, (B, 1), device="cuda", generator=g)
    out = {"name": name, "B": B, "HQ": HQ, "HKV": HKV, "S": S, "D": D, "layers": layers, "steps": steps,
           "gqa_select": gqa_select, "warmup": warmup}

    def steps_of(m, cache):
        def step():
            with torch.no_grad():
                m(tok, past_key_values=cache, use_cache=True)
        return step

    # SDPA on a copy of the prefilled cache: torch's default backend choice (cuDNN on this torch, which builds
    # an execution plan for every new sequence length on the host), then flash / memory-efficient only
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cache = copy.deepcopy(prefill)
    steps_of(model, cache)()  # warm-up
    out["sdpa_default_ms"], _ = _events_ms(steps_of(model, cache), steps)
    del cache
    cache = copy.deepcopy(prefill)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        steps_of(model, cache)()
        out["sdpa_ms"], out["sdpa_all"] = _events_ms(steps_of(model, cache), steps)
    del cache
    # the cache append alone (what DynamicCache does per layer per step, for both paths)
    app_cache = copy.deepcopy(prefill)
    kv = torch.randn(B, HKV, 1, D, device="cuda", dtype=torch.bfloat16)

    def append(c=app_cache):
        for li in range(layers):
            c.layers[li].update(kv, kv)
    out["append_ms"], _ = _events_ms(append, steps)
    del app_cache, append
    # Loki with the library's defaults on a copy of the same cache
    basis = PCABasis.random(layers, HKV, D, seed=1)
    enable_loki(model, basis, k=0.25, d=0.25, gqa_select=gqa_select)
    out["aggregate"] = model._loki.settings.aggregate.value  # the default: softmax-max for a shared selection
    cache = copy.deepcopy(prefill)
    before_warm = _COMPILES[0]
    # warm-up: the first step converts the cache (rotation, key prefix); Triton specialises integer arguments
    # on divisibility by 16, so the first steps of a growing cache compile a few variants (cached after)
    for _ in range(warmup):
        steps_of(model, cache)()
    torch.cuda.synchronize()
    out["loki_compiles_during_warmup"] = _COMPILES[0] - before_warm
    before = _COMPILES[0]
    out["loki_ms"], out["loki_all"] = _events_ms(steps_of(model, cache), steps)
    out["loki_compiles_during_steps"] = _COMPILES[0] - before  # the cache grows by one token per step
    out["speedup"] = out["sdpa_ms"] / out["loki_ms"]
    del cache, prefill, model
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.tuning.integration: needs a CUDA device")
        return 2
    _count_compiles()
    rows = []
    for name in TARGET_SHAPES[:3]:
        B, HQ, HKV, S, _, mode = shape_dims(name)
        r = run_config(name, B, HQ, HKV, S, layers=args.layers, steps=args.steps, gqa_select=mode)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if not k.endswith("_all")}), flush=True)
    dev = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "integration.json"), "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"\n{dev}: one decode step of a {args.layers}-layer model (narrow MLP), bf16, k_f = d_f = 0.25, "
          f"median of {args.steps} steps (ms)")
    print("| model shape | sdpa step (flash/efficient) | loki step | x | sdpa step, torch's default backend | "
          "cache append alone (both paths) | Triton compiles: warm-up / timed steps |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['sdpa_ms']:.3f} | {r['loki_ms']:.3f} | {r['speedup']:.2f} | "
              f"{r['sdpa_default_ms']:.3f} | {r['append_ms']:.3f} | {r['loki_compiles_during_warmup']} / "
              f"{r['loki_compiles_during_steps']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
