"""Cheap candidate triggers of the launch-gap state, one stage each, for ``launch_state --triggers``.

A compile in the process sets the slow state of every compiled step's CUDA graph and a load from Inductor's cache the
fast one (results/launch-state-h200-2026-11-28/NOTES.md); a build takes a minute.  Each trigger here is one piece of
what a compile does, or of what the driver keeps per process, done alone in a second or two, so one process can try
many: the stage after which the probe moves names the piece.

The triggers of ``all``, in this order:

* ``pinned``: 256 MB of page-locked host memory, kept alive;
* ``host-copy``: 64 MB copied host -> device -> host without blocking, through page-locked memory;
* ``events``: 200 pairs of timing events recorded around a small kernel, their times read;
* ``streams``: 40 streams taken from torch's stream pool (``torch.cuda.Stream()``), a small kernel on each, as
  ``loki bench --e2e`` settles before a timing (``loki.bench.e2e_cache.settle_launch_state``; ``streams:N``: N);
* ``cublas``: matmuls of shapes the probe does not use (bf16 and fp32);
* ``gc``: ``gc.collect()``;
* ``bench``: Inductor's GPU benchmarker timing a small kernel (its L2-flush buffer, events, repeats);
* ``triton-new``: four Triton kernels compiled in this process and run;
* ``tiny-compile``: ``torch.compile`` of a small softmax with Inductor's caches off (Dynamo, Inductor, Triton
  compile, reduction autotuning), run once;
* ``tiny-graph``: the same with ``mode="reduce-overhead"`` (a CUDA-graph tree of its own), run three times.

Variants of ``streams``, named one by one (:data:`EXTRA`):

* ``streams-idle:N``: N pool streams taken, nothing launched on them;
* ``side-stream``: a pool stream made the current stream, so every later probe replays on it;
* ``side-wait``: the current stream waits on a new pool stream that ran nothing; ``side-work``: a small kernel on a
  new pool stream, no waits between it and the current stream (a device sync after); ``side-fork``: a new pool
  stream waits on the current one, then runs a small kernel (no join; a device sync after);
* ``tree-sync`` / ``tree-wait``: what ``streams:1`` does, or only the current stream's wait, with the stream of
  Inductor's CUDA-graph tree manager (the one the probe's graphs were recorded on) instead of a new one;
* ``tree-gemm`` / ``side-gemm``: a bf16 cuBLAS matmul (large shared memory) instead of the small kernel, on that
  stream or on a new pool stream; ``tree-many``: 2000 small kernels on the tree manager's stream;
* ``graph-big``: a new CUDA graph of 1000 small kernels captured (torch captures on a side stream) and replayed
  twice on the current stream, as a build's capture does at the probe's size.

The matmul, ``tree-many`` and ``graph-big`` triggers are candidates for what makes a slow process fast again, as a
build loaded from the cache does; results/launch-streams-h200-2026-12-01/NOTES.md has the ones run so far.
"""

from __future__ import annotations

import gc

import torch

TRIGGERS = ("pinned", "host-copy", "events", "streams", "cublas", "gc", "bench", "triton-new", "tiny-compile",
            "tiny-graph")


#: Triggers left out of ``all`` (each a variant of ``streams``).
EXTRA = ("streams-idle", "side-stream", "side-wait", "side-work", "side-fork", "tree-sync", "tree-wait", "tree-gemm",
         "side-gemm", "tree-many", "graph-big")
#: Triggers that take a count: ``name:N``.
COUNTED = ("streams", "streams-idle")


def _split(name: str) -> tuple[str, int | None]:
    base, sep, n = name.partition(":")
    return base, (int(n) if sep and n.isdigit() and int(n) > 0 else -1 if sep else None)


def parse_triggers(text: str) -> list[str]:
    """A comma-separated list of :data:`TRIGGERS` and :data:`EXTRA` (``all``: every one of TRIGGERS, in order;
    ``streams:N`` / ``streams-idle:N`` with a count N >= 1); refuses an unknown name or a bad count."""
    names = list(TRIGGERS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    known = (*TRIGGERS, *EXTRA)
    bad = [n for n, (base, count) in zip(names, map(_split, names))
           if base not in known or count == -1 or (count is not None and base not in COUNTED)]
    if bad:
        raise SystemExit(f"--triggers takes names of {', '.join(known)} (or all; streams:N and streams-idle:N "
                         f"with N >= 1), got {', '.join(bad)}")
    return names


def _tiny_compile(mode: str | None, device: str, calls: int) -> None:
    import torch._inductor.config as cfg

    def f(x):
        return torch.softmax(x * 1.5, dim=-1).sum(dim=0)

    fn = torch.compile(f, mode=mode, fullgraph=True, dynamic=False)
    x = torch.randn(64, 4096 + (17 if mode else 13), device=device)  # a shape of its own: nothing to reuse
    with cfg.patch({"force_disable_caches": True}):
        for _ in range(calls):
            if mode:
                torch.compiler.cudagraph_mark_step_begin()
            fn(x)


def _triton_new(device: str) -> None:
    from loki._triton import tl, triton

    @triton.jit
    def _scale_kernel(x_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * C, mask=m)

    x = torch.ones(1 << 20, device=device)
    for c in (3, 5, 7, 11):  # one new specialisation (a new module) per constant
        _scale_kernel[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), C=c, BLOCK=1024)


def trigger_stages(names: list[str], device: str = "cuda") -> tuple[list, list]:
    """(name, fn) stages for ``names`` and the list that keeps what they allocate alive (pinned memory, streams)."""
    from loki.bench.e2e_cache import settle_launch_state

    keep: list = []

    def cuda() -> bool:
        return torch.device(device).type == "cuda"

    def sync():
        if cuda():
            torch.cuda.synchronize()

    def pinned():
        keep.append(torch.empty(256 << 20, dtype=torch.uint8, pin_memory=cuda()))

    def host_copy():
        h = torch.ones(64 << 20, dtype=torch.uint8, pin_memory=cuda())
        d = h.to(device, non_blocking=True)
        h.copy_(d, non_blocking=True)
        sync()

    def events():
        x = torch.ones(1 << 20, device=device)
        pairs = []
        for _ in range(200):
            if cuda():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                x.mul_(1.0)
                b.record()
                pairs.append((a, b))
            else:
                x.mul_(1.0)
        sync()
        for a, b in pairs:
            a.elapsed_time(b)

    def streams(n=40, work=True):
        for _ in range(n):  # what the benchmark's settle does, once per new stream (or the streams alone)
            if work:
                settle_launch_state(device)
            elif cuda():
                pool_stream()

    def pool_stream():
        s = torch.cuda.Stream()
        keep.append(s)
        return s

    def tree_stream():
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if manager is None:
            raise SystemExit("tree-sync / tree-wait need a CUDA-graph tree manager: the probe's compiled step")
        return manager.stream

    def exchange(s, work=True, fork=True, join=True, gemm=False, kernels=1):
        x = torch.ones(1 << 16, device=device)
        a = torch.ones(4096, 4096, device=device, dtype=torch.bfloat16) if gemm else None
        if cuda():
            if fork:
                s.wait_stream(torch.cuda.current_stream())
            if work:
                with torch.cuda.stream(s):
                    if gemm:
                        keep.append(a @ a)
                    else:
                        for _ in range(kernels):
                            x.add_(1.0)
            if join:
                torch.cuda.current_stream().wait_stream(s)
        sync()

    def graph_big():
        x = torch.ones(1 << 16, device=device)
        if cuda():
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(1000):
                    x.add_(1.0)
            keep.append((g, x))
            g.replay()
            g.replay()
        sync()

    def side_stream():
        if cuda():
            s = pool_stream()
            s.wait_stream(torch.cuda.current_stream())
            torch.cuda.set_stream(s)

    def cublas():
        for dtype in (torch.bfloat16, torch.float32):
            a = torch.randn(3000, 1000, device=device, dtype=dtype)
            b = torch.randn(1000, 700, device=device, dtype=dtype)
            (a @ b).sum()
        sync()

    def bench():
        from torch._inductor.runtime.benchmarking import benchmarker

        x = torch.randn(1 << 20, device=device)
        if cuda():
            benchmarker.benchmark_gpu(lambda: x.mul(2.0))
        else:
            benchmarker.benchmark_cpu(lambda: x.mul(2.0))

    named = {"pinned": pinned, "host-copy": host_copy, "events": events, "streams": streams, "cublas": cublas,
             "gc": gc.collect, "bench": bench, "triton-new": lambda: (_triton_new(device), sync()),
             "tiny-compile": lambda: (_tiny_compile(None, device, 1), sync()),
             "tiny-graph": lambda: (_tiny_compile("reduce-overhead", device, 3), sync()), "side-stream": side_stream,
             "side-wait": lambda: exchange(pool_stream() if cuda() else None, work=False, fork=False),
             "side-work": lambda: exchange(pool_stream() if cuda() else None, fork=False, join=False),
             "side-fork": lambda: exchange(pool_stream() if cuda() else None, join=False),
             "tree-sync": lambda: exchange(tree_stream() if cuda() else None),
             "tree-wait": lambda: exchange(tree_stream() if cuda() else None, work=False, fork=False),
             "tree-gemm": lambda: exchange(tree_stream() if cuda() else None, gemm=True),
             "side-gemm": lambda: exchange(pool_stream() if cuda() else None, gemm=True),
             "tree-many": lambda: exchange(tree_stream() if cuda() else None, kernels=2000), "graph-big": graph_big}

    def stage(name):
        base, n = _split(name)
        if base in COUNTED:
            return lambda: streams(40 if n is None else n, work=base == "streams")
        return named[base]

    return [(n, stage(n)) for n in names], keep
