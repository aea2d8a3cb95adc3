"""Where a compiled decode step's time goes: the kernels of ``loki bench --e2e``'s compiled paths (static-cache
SDPA and static-cache Loki, CUDA graphs), from torch.profiler over a few steps, grouped by kernel name.

    PYTHONPATH=. python3 -m benchmarks.tuning.e2e_profile --model llama2-7b --batch 8 --seq-len 4096
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def profile_path(model, path, B, S, steps=8, prof_steps=4, k=0.25, aggregate="sum", sdpa_backend="default"):
    from loki._hf import cache_keyword
    from loki.basis import PCABasis
    from loki.bench import e2e
    from loki.integrations.transformers import disable_loki, enable_loki

    from .kernel_profile import kernel_rows

    cfg = model.config
    if path.startswith("loki"):
        L, _, HKV, D = e2e._dims(cfg)
        enable_loki(model, PCABasis.random(L, HKV, D, seed=0), k=k, d=0.25,
                    gqa_select="kv" if HKV != cfg.num_attention_heads else "query", aggregate=aggregate)
    cache = e2e._make_cache(model, path, B, S)
    n0 = S - steps - prof_steps
    e2e.fill_cache(cache, cfg, B, n0, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    key = cache_keyword(model)
    ids = torch.randint(0, 1000, (B, 1), device="cuda")

    def step(i):
        torch.compiler.cudagraph_mark_step_begin()
        fn(input_ids=ids, position_ids=torch.full((B, 1), n0 + i, device="cuda"),
           cache_position=torch.tensor([n0 + i], device="cuda"), use_cache=True, **{key: cache})

    with torch.no_grad(), e2e._sdpa_context(sdpa_backend):
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(steps, steps + prof_steps):
                step(i)
            torch.cuda.synchronize()
    rows = kernel_rows(prof, prof_steps)
    if path.startswith("loki"):
        disable_loki(model)
    cache = fn = None  # the closure above holds them: released here
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return {"total_us": sum(t for _, t, _ in rows), "kernels": sum(c for _, _, c in rows),
            "top": [{"name": n[:90], "us": t, "count": c} for n, t, c in rows[:30]]}


def main() -> int:
    from loki.bench import e2e

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--paths", default="sdpa_compiled,loki_compiled",
                    help="comma-separated paths; a Loki path may name its aggregate: loki_compiled:softmax-max")
    ap.add_argument("--k", default="0.25", help="Loki budget: a fraction (0.25) or a token count (2048)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--sdpa-backend", default="native-gqa", help="dense SDPA variant (loki.bench.e2e)")
    a = ap.parse_args()
    dims = dict(e2e.E2E_MODELS[a.model])
    if a.layers:
        dims["num_hidden_layers"] = a.layers
    model = e2e.build_model(e2e.llama_config(dims), "cuda")
    k = float(a.k) if "." in a.k else int(a.k)
    res = {}
    for spec in a.paths.split(","):
        path, _, agg = spec.partition(":")
        r = profile_path(model, path, a.batch, a.seq_len, k=k, aggregate=agg or "sum", sdpa_backend=a.sdpa_backend)
        res[spec] = r
        print(f"\n## {spec} {a.model} L={dims['num_hidden_layers']} B={a.batch} S={a.seq_len} k={k}: "
              f"{r['total_us'] / 1e3:.3f} ms of kernels per step, {r['kernels']:.0f} kernels")
        for t in r["top"]:
            print(f"{t['us']:9.1f} us {t['count']:5.0f}x  {t['name']}")
    name = f"profile-{a.model}-B{a.batch}-S{a.seq_len}-k{a.k}.json"
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
