"""Loki beyond one GPU: tensor parallelism against one process, and decode speed of SDPA against Loki.

Launch on a machine with two GPUs (torch >= 2.11, transformers >= 5.17; nothing is downloaded)::

    torchrun --nproc_per_node 2 scripts/multi_gpu_bench.py --out results/multi_gpu

1. A Llama model of Llama-3-8B's dimensions (32 layers, hidden 4096, 32 heads, 8 KV heads, D = 128, MLP 14336,
   vocab 128256) with random weights is written once, in bf16, to ``--model-dir`` by rank 0.
2. Equality: the model loaded with ``tp_plan="auto"`` (TP = the number of processes) and loaded whole on rank 0
   (TP = 1), each with ``enable_loki`` (a random basis, ``PCABasis.random``) and plain SDPA, greedy ``generate``
   on a short prompt: the tokens of TP = 2 and TP = 1 in fp32 (the bf16 weights computed in fp32; must be
   equal) and in bf16 (reported: matching tokens and the largest logit difference of the prompt).
3. Speed (TP = 2, bf16): B = ``--batch`` sequences, a KV cache of ``--context`` random tokens written directly
   into the cache (no prefill), then ``--steps`` decode steps timed with CUDA events, after the same steps run
   once untimed on another cache of the same length (every cache length timed was seen before).  SDPA
   (``attn_implementation="sdpa"``) against Loki (``k=0.25, d=0.25`` in the default configuration: one selection
   per KV group with ``aggregate="softmax-max"``).  Both use transformers' ``DynamicCache``, whose append copies the
   cache on every step.

Writes ``multi_gpu.json`` and ``multi_gpu.md`` under ``--out`` (rank 0) and prints the table last.  ``--tiny``
runs the same on a model of a few MB (the CPU and gloo: ``torchrun --nproc_per_node 2 ... --tiny --device cpu``;
the CPU tests call :func:`equality` the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

LLAMA3_8B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, intermediate_size=14336, vocab_size=128256, max_position_embeddings=16384,
                 rope_theta=500000.0)
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=256, max_position_embeddings=2048)
LOKI = dict(k=0.25, d=0.25)  # enable_loki's default selection: on these GQA dims one per KV group, softmax-max


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="results/multi_gpu", help="folder for multi_gpu.json / .md")
    p.add_argument("--model-dir", default="/tmp/loki-multi-gpu-model", help="random checkpoint (written once)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run) instead of Llama-3-8B dims")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 128256; smaller saves memory)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batch", type=int, default=16, help="decode batch B (default: %(default)s)")
    p.add_argument("--context", type=int, default=8192, help="cached tokens S (default: %(default)s)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=64, help="equality prompt length (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=16, help="equality greedy tokens (default: %(default)s)")
    p.add_argument("--skip-speed", action="store_true", help="equality only")
    p.add_argument("--profile", action="store_true",
                   help="with --compiled: also profile a few compiled decode steps on rank 0 (kernels per step by "
                   "name, the collectives' share: where the TP step's time goes)")
    p.add_argument("--compiled", action="store_true",
                   help="also time the compiled static-cache paths (SDPA and Loki, CUDA graphs; GPU only)")
    p.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse of the checkout)")
    args = p.parse_args(argv)
    for name in ("batch", "context", "steps", "prompt", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab is not None and args.vocab < 2:
        p.error(f"--vocab must be >= 2, got {args.vocab}")
    return args


def model_config(args):
    from transformers import LlamaConfig

    dims = dict(TINY if args.tiny else LLAMA3_8B)
    if args.vocab:
        dims["vocab_size"] = args.vocab
    return LlamaConfig(**dims, tie_word_embeddings=False)


def write_checkpoint(config, path: Path, device) -> None:
    """Random weights (bf16), written once; a checkpoint of another config is replaced."""
    from transformers import LlamaForCausalLM

    marker = path / "loki_dims.json"
    dims = json.dumps(config.to_dict(), sort_keys=True, default=str)
    if marker.is_file() and marker.read_text() == dims:
        return
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(path)
    del model
    marker.write_text(dims)


def load(path, dtype, device, tp: bool):
    from transformers import AutoModelForCausalLM

    if tp:
        with warnings.catch_warnings():  # newer transformers prefer distributed_config=, which 5.17 lacks
            warnings.simplefilter("ignore", FutureWarning)
            return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": device}).eval()


def _barrier():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


@torch.no_grad()
def greedy(model, ids, new_tokens, method: str):
    """(generated tokens [B, new], prompt logits [B, V] of the last prompt token) with Loki or SDPA."""
    from loki.basis import PCABasis
    from loki.integrations.transformers import disable_loki, enable_loki

    c = model.config
    if method == "loki":
        basis = PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=1)
        enable_loki(model, basis, **LOKI)
    try:
        ids = ids.to(model.device)
        logits = model(input_ids=ids).logits[:, -1].float().cpu()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=0)
        return out[:, ids.shape[1]:].cpu(), logits
    finally:
        disable_loki(model)


def equality(path, device, prompt: int, new_tokens: int, dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """Greedy tokens of TP = world size against TP = 1 (rank 0), for Loki and SDPA; rows on rank 0 ([] else)."""
    from loki._distributed import world

    rank, size = world()
    rows = []
    for dtype in dtypes:
        vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        ids = torch.randint(0, vocab, (2, prompt), generator=torch.Generator().manual_seed(0))
        model = load(path, dtype, device, tp=True)
        tp = {m: greedy(model, ids, new_tokens, m) for m in ("loki", "sdpa")}
        del model
        if rank == 0:
            model = load(path, dtype, device, tp=False)
            for m, (tok, logits) in tp.items():
                tok1, logits1 = greedy(model, ids, new_tokens, m)
                rows.append(dict(dtype=str(dtype).replace("torch.", ""), method=m, tp=size,
                                 same_tokens=bool(torch.equal(tok, tok1)),
                                 matching_tokens=f"{int((tok == tok1).sum())}/{tok.numel()}",
                                 max_logit_diff=float((logits - logits1).abs().max()),
                                 tokens_tp=tok.tolist(), tokens_1=tok1.tolist()))
            del model
        _barrier()
    return rows


def fill_cache(model, B, S, seed=0, cache=None):
    """A cache of S random tokens per sequence, written directly (Loki: a Loki cache, keys rotated on write);
    ``cache``: fill this one (a static cache) instead of a new dynamic one.  Each rank writes its local heads."""
    from transformers import DynamicCache

    from loki._hf import text_config
    from loki.integrations.transformers import is_loki_enabled, loki_cache

    if cache is None:
        cache = loki_cache(model) if is_loki_enabled(model) else DynamicCache(config=text_config(model.config))
    g = torch.Generator(device=model.device).manual_seed(seed)
    pos = torch.arange(S, device=model.device)
    for layer, attn in enumerate(model.model.layers):
        k_proj = attn.self_attn.k_proj.weight
        rows = k_proj.to_local().shape[0] if hasattr(k_proj, "to_local") else k_proj.shape[0]
        shape = (B, rows // model.config.head_dim, S, model.config.head_dim)
        k = torch.randn(shape, generator=g, device=model.device, dtype=k_proj.dtype)
        v = torch.randn(shape, generator=g, device=model.device, dtype=k_proj.dtype)
        cache.update(k, v, layer, {"cache_position": pos})
    return cache


@torch.no_grad()
def decode_speed(model, B, S, steps) -> dict:
    from loki._hf import cache_keyword

    kw = cache_keyword(model)
    ids = torch.randint(0, model.config.vocab_size, (B, 1), device=model.device)

    def run(cache):
        for t in range(steps):
            pos = torch.full((B, 1), S + t, device=model.device)
            model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **{kw: cache})

    run(fill_cache(model, B, S))  # every cache length of the timed steps, once
    cache = fill_cache(model, B, S)
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    run(cache)
    if cuda:
        end.record()
        torch.cuda.synchronize()
        sec = start.elapsed_time(end) / 1e3
    else:
        sec = time.perf_counter() - t0
    del cache
    return dict(seconds=sec, ms_per_step=1e3 * sec / steps, tokens_per_s=B * steps / sec)


def kernel_summary(prof, steps: int, top: int = 15) -> dict:
    """Kernels of ``steps`` profiled decode steps: device us per step in all, in the collectives (NCCL kernels) and
    in the top kernels by name."""
    import collections

    per = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time_total / steps
    nccl = sum(v for n, v in per.items() if "nccl" in n.lower())
    return {"kernel_us_per_step": sum(per.values()), "collective_us_per_step": nccl,
            "top": [{"name": n[:90], "us": round(v, 2)} for n, v in per.most_common(top)]}


@torch.no_grad()  # autograd would make Loki's decode step take the differentiable reference (enable_loki's "auto")
def decode_speed_static(model, B, S, steps, profile: bool = False) -> dict:
    """Decode steps on a static cache (``loki_cache(static=True)`` under Loki, else transformers' ``StaticCache``; each
    rank's layers allocate their local heads at the first write), the forward compiled with CUDA graphs
    (``mode="reduce-overhead"``); the steps run once untimed, the cache is rewound, then they are timed."""
    from transformers import StaticCache

    from loki._hf import cache_keyword, text_config
    from loki.bench.e2e import rewind
    from loki.integrations.transformers import is_loki_enabled, loki_cache

    kw = cache_keyword(model)
    n = S + steps
    cache = fill_cache(model, B, S, cache=loki_cache(model, static=True, max_cache_len=n) if is_loki_enabled(model)
                       else StaticCache(config=text_config(model.config), max_cache_len=n))
    ids = torch.randint(0, model.config.vocab_size, (B, 1), device=model.device)
    fn = torch.compile(model.forward, mode="reduce-overhead")
    poss = [torch.full((B, 1), S + t, device=model.device) for t in range(steps)]
    cps = [torch.tensor([S + t], device=model.device) for t in range(steps)]

    def run():
        for t in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            fn(input_ids=ids, position_ids=poss[t], cache_position=cps[t], use_cache=True, logits_to_keep=1,
               **{kw: cache})

    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    rewind(cache, S)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    sec = start.elapsed_time(end) / 1e3
    prof_res = None
    if profile:  # every rank runs the steps (the collectives need them); rank 0's kernels are reported
        rewind(cache, S)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        prof_res = kernel_summary(prof, steps)
    cache = fn = None  # the closure above holds them: released here
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    out = dict(seconds=sec, ms_per_step=1e3 * sec / steps, tokens_per_s=B * steps / sec, first_pass_s=first)
    if prof_res is not None:
        out["profile"] = prof_res
    return out


def speed_compiled(path, device, B, S, steps, profile: bool = False) -> list[dict]:
    """The compiled static-cache paths under TP: SDPA with grouped K/V passed as they are (transformers would
    copy them per query head under the static cache's mask; ``loki.bench.e2e._native_gqa``) and Loki."""
    from loki.basis import PCABasis
    from loki.bench.e2e import _native_gqa
    from loki.integrations.transformers import disable_loki, enable_loki

    model = load(path, torch.bfloat16, device, tp=True)
    c = model.config
    rows = []
    for name in ("sdpa+compile", "loki+compile"):
        try:
            if name.startswith("loki"):
                enable_loki(model, PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=1),
                            **LOKI)
                rows.append(dict(method=name, **decode_speed_static(model, B, S, steps, profile)))
                disable_loki(model)
            else:
                with _native_gqa():
                    rows.append(dict(method=name, **decode_speed_static(model, B, S, steps, profile)))
        except Exception as exc:  # noqa: BLE001 - reported in the table, the other rows still run
            rows.append(dict(method=name, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    del model
    torch.cuda.empty_cache()
    return rows


def speed(path, device, B, S, steps) -> list[dict]:
    from loki.basis import PCABasis
    from loki.integrations.transformers import disable_loki, enable_loki

    model = load(path, torch.bfloat16, device, tp=True)
    c = model.config
    rows = [dict(method="sdpa", **decode_speed(model, B, S, steps))]
    enable_loki(model, PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=1), **LOKI)
    rows.append(dict(method="loki", **decode_speed(model, B, S, steps)))
    disable_loki(model)
    for r in rows:
        r["vs_sdpa"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def markdown(result) -> str:
    lines = [f"Multi-GPU run: {result['device']} x {result['world_size']}, commit {result['commit']}, "
             f"torch {result['torch']}, transformers {result['transformers']}, model {result['model']}", "",
             "| dtype | method | TP | same tokens as TP=1 | matching | max logit diff |", "|---|---|---|---|---|---|"]
    for r in result["equality"]:
        lines.append(f"| {r['dtype']} | {r['method']} | {r['tp']} | {r['same_tokens']} | {r['matching_tokens']} "
                     f"| {r['max_logit_diff']:.3g} |")
    if result["speed"]:
        s = result["speed_setting"]
        sel = ""
        if "gqa_select" in s:
            sel = "; Loki " + ("one selection per KV group, " + s["aggregate"] if s["gqa_select"] == "kv"
                               else "per query head")
        lines += ["", f"Decode, TP={result['world_size']}, bf16, B={s['batch']}, S={s['context']}, "
                  f"{s['steps']} steps{sel}:", "", "| method | ms/step | tokens/s | vs SDPA |", "|---|---|---|---|"]
        for r in result["speed"]:
            if "error" in r:
                lines.append(f"| {r['method']} | failed: {r['error']} | | |")
                continue
            lines.append(f"| {r['method']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['vs_sdpa']:.2f}x |")
        profiled = [r for r in result["speed"] if "profile" in r]
        if profiled:
            lines += ["", "Profiled compiled steps (rank 0, device us per step):", "",
                      "| method | kernels | collectives | top kernels |", "|---|---|---|---|"]
            for r in profiled:
                p = r["profile"]
                top = "; ".join(f"{t['name'][:40]} {t['us']:.0f}" for t in p["top"][:5])
                lines.append(f"| {r['method']} | {p['kernel_us_per_step']:.0f} | {p['collective_us_per_step']:.0f} | "
                             f"{top} |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import transformers

    from loki._distributed import init_from_env

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device; use --device cpu (with --tiny)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    rank, size = init_from_env()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    path = Path(args.model_dir)
    config = model_config(args)
    t0 = time.perf_counter()
    if rank == 0:
        write_checkpoint(config, path, device)
    _barrier()
    eq = equality(path, device, args.prompt, args.new_tokens)
    sp = [] if args.skip_speed else speed(path, device, args.batch, args.context, args.steps)
    if sp and args.compiled and device.type == "cuda":
        sp += speed_compiled(path, device, args.batch, args.context, args.steps, args.profile)
        for r in sp:
            if "tokens_per_s" in r:
                r["vs_sdpa"] = r["tokens_per_s"] / sp[0]["tokens_per_s"]
    if rank != 0:
        return 0
    from loki.settings import LokiSettings

    mode = LokiSettings(backend="torch").resolve(config).kernel_args()  # the selection Loki's defaults resolve to
    gqa, agg = mode["gqa_select"], mode["aggregate"]
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", world_size=size,
                  commit=args.commit or _commit(), torch=torch.__version__, transformers=transformers.__version__,
                  model="tiny" if args.tiny else f"Llama-3-8B dims, vocab {config.vocab_size}, random bf16",
                  equality=eq, speed=sp, seconds=time.perf_counter() - t0,
                  speed_setting=dict(batch=args.batch, context=args.context, steps=args.steps, **LOKI, gqa_select=gqa,
                                     aggregate=agg))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (out / "multi_gpu.md").write_text(table)
    print(table)
    return 0 if all(r["same_tokens"] for r in eq if r["dtype"] == "float32") else 1


if __name__ == "__main__":
    sys.exit(main())
