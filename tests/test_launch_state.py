"""benchmarks/tuning/launch_state.py: the stage-by-stage probe's bookkeeping on the CPU (the GPU command times it)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tuning import launch_state


def fake_cuda(monkeypatch) -> None:
    """``main``'s checks of the device pass on the CPU: a CUDA device "fake" that is there and syncs at once."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake")


def test_run_stages_probes_before_any_stage_and_after_each_in_order():
    """A fake process whose probe reads 9.4 ms until the "compile" stage has run, then 9.9 ms: the rows name the
    stage each probe followed, so the flip shows after "compile" and not before."""
    state, ran = {"slow": False}, []

    def stage(name):
        def fn():
            ran.append(name)
            if name == "compile":
                state["slow"] = True
        return fn

    rows = launch_state.run_stages([(n, stage(n)) for n in launch_state.STAGES],
                                   probe=lambda: 9.9 if state["slow"] else 9.4)
    assert ran == list(launch_state.STAGES)
    assert [r["after"] for r in rows] == ["before", *launch_state.STAGES]
    assert [r["probe_ms"] for r in rows] == [9.4, 9.4, 9.4, 9.4, 9.4, 9.9, 9.9]
    assert all(r["stage_s"] >= 0 for r in rows)


@pytest.mark.parametrize("argv, match", [
    (["--build", "sdpa_eager"], "--build must be loki_compiled"),
    (["--probe", "loki_eager"], "--probe must be loki_compiled"),
    (["--model", "gpt2"], "--model must be one of"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "3000", "--seq-len", "4096"], "--steps must be >= 1 with"),
])
def test_main_refuses_bad_arguments_naming_them(argv, match):
    with pytest.raises(SystemExit, match=match):
        launch_state.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_main_refuses_without_a_cuda_device():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        launch_state.main(["--layers", "1"])


TINY = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=97, rope_theta=10000.0, max_position_embeddings=256)


@pytest.mark.parametrize("path", ["loki_compiled", "loki_compiled@int8", "sdpa_compiled"])
def test_build_stages_before_the_compile_build_a_model_its_cache_and_an_eager_step(path):
    """The stages up to the eager step on a tiny model on the CPU: Loki enabled on a Loki path only, the cache filled,
    and the eager step's logits finite (the compile and capture stages run on the GPU command)."""
    stages, st = launch_state.build_stages(TINY, path, B=1, S=64, n_fill=60, k=8, fresh=False, device="cpu")
    names = [n for n, _ in stages]
    assert names == [n for n in launch_state.STAGES if n != "loki" or path.startswith("loki")]
    for name, fn in stages:
        if name == "compile":
            break
        fn()
    from loki.integrations.transformers import is_loki_enabled

    assert is_loki_enabled(st["model"]) == path.startswith("loki")
    logits = st["eager_logits"]
    assert logits.shape == (1, 1, TINY["vocab_size"]) and torch.isfinite(logits.float()).all()


def test_main_probes_with_fresh_steps_before_after_each_stage_and_again(monkeypatch, capsys):
    """The GPU parts faked: the probe's step gets indices 0..n-1 once each (warm-up, then 2 x steps per probe), and
    the printed rows name every stage the build ran."""
    from benchmarks.tuning import e2e_profile
    from loki.bench import e2e

    seen, ran = [], []

    def fake_compiled_step(model, path, B, S, n_fill, n_steps, k, aggregate="auto", score_format="native"):
        assert n_fill + n_steps == S

        def step(i):
            assert 0 <= i < n_steps
            seen.append(i)
        return step

    def fake_build_stages(dims, path, B, S, n_fill, k, fresh, device="cuda", patch=None):
        return [(n, lambda n=n: ran.append(n)) for n in launch_state.STAGES], {}

    fake_cuda(monkeypatch)
    monkeypatch.setattr(launch_state, "stream_state", lambda: "s")
    monkeypatch.setattr(e2e_profile, "compiled_step", fake_compiled_step)
    monkeypatch.setattr(launch_state, "build_stages", fake_build_stages)
    monkeypatch.setattr(e2e, "build_model", lambda config, device: None)
    assert launch_state.main(["--layers", "1", "--steps", "3", "--seq-len", "1000"]) == 0
    probes = len(launch_state.STAGES) + 2
    assert seen == list(range(8 + 2 * 3 * probes))
    assert ran == list(launch_state.STAGES)
    rows = [ln.split()[2] for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT")]
    assert rows == ["before", *launch_state.STAGES, "again"]


def test_parse_patches_reads_inductor_settings_and_refuses_unknown_keys():
    patch = launch_state.parse_patches(["triton.autotune_pointwise=False", "compile_threads=1"])
    assert patch == {"triton.autotune_pointwise": False, "compile_threads": 1}
    for bad in ("triton.no_such_setting=1", "no_such=1", "compile_threads"):
        with pytest.raises(SystemExit, match="--inductor must be KEY=VALUE"):
            launch_state.parse_patches([bad])


def test_main_adds_the_worker_and_allocator_stages_last_and_counts_gpu_processes(monkeypatch, capsys):
    """--stop-workers and --empty-cache run after "again", in that order, each followed by a probe; every row carries
    the GPU's process count; the Inductor patch reaches the build."""
    import torch._inductor.async_compile as async_compile

    from benchmarks.tuning import e2e_profile
    from loki.bench import e2e

    ran, got = [], {}

    def fake_build_stages(dims, path, B, S, n_fill, k, fresh, device="cuda", patch=None):
        got["patch"] = patch
        return [(n, lambda n=n: ran.append(n)) for n in launch_state.STAGES], {}

    fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: ran.append("empty_cache"))
    monkeypatch.setattr(async_compile, "shutdown_compile_workers", lambda: ran.append("shutdown"))
    monkeypatch.setattr(launch_state, "profile_once", lambda: ran.append("profile"))
    monkeypatch.setattr(launch_state, "gpu_processes", lambda: 1 + len(ran))
    monkeypatch.setattr(launch_state, "stream_state", lambda: f"s{len(ran)}")
    monkeypatch.setattr(e2e_profile, "compiled_step", lambda *a, **k: (lambda i: None))
    monkeypatch.setattr(launch_state, "build_stages", fake_build_stages)
    monkeypatch.setattr(e2e, "build_model", lambda config, device: None)
    argv = ["--layers", "1", "--steps", "2", "--seq-len", "1000", "--stop-workers", "--empty-cache", "--profile-once",
            "--inductor", "compile_threads=1"]
    assert launch_state.main(argv) == 0
    assert ran == [*launch_state.STAGES, "shutdown", "profile", "empty_cache"]
    assert got["patch"] == {"compile_threads": 1}
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT")]
    assert [r[2] for r in rows] == ["before", *launch_state.STAGES, "again", "workers", "profiled", "emptied"]
    counts = [int(r[r.index("processes") - 1]) for r in rows]
    assert [r[r.index("stream") + 1] for r in rows][-3:] == ["s7;", "s8;", "s9;"]  # the stream after each probe
    assert counts == [1, *range(2, 2 + len(launch_state.STAGES)), 1 + len(launch_state.STAGES), 8, 9, 10]


def test_idle_runs_first_and_every_row_carries_the_clocks_read_after_its_probe(monkeypatch, capsys):
    """--idle: an "idle" stage (the GPU left idle for the seconds asked) before the build's stages, probed like the
    others; every row names the clocks read right after its probe (a GPU's power state is a suspect for the slow
    launch-gap state: a compile leaves the GPU idle for most of a minute)."""
    import time

    from benchmarks.tuning import e2e_profile
    from loki.bench import e2e

    ran, slept = [], []
    fake_cuda(monkeypatch)
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), ran.append("sleep")))
    monkeypatch.setattr(launch_state, "stream_state", lambda: "s")
    monkeypatch.setattr(launch_state, "gpu_processes", lambda: 1)
    monkeypatch.setattr(launch_state, "gpu_clocks", lambda: f"{1980 - 100 * len(ran)} MHz, 3201 MHz, P0")
    monkeypatch.setattr(e2e_profile, "compiled_step", lambda *a, **k: (lambda i: None))
    monkeypatch.setattr(launch_state, "build_stages", lambda *a, **k: (
        [(n, lambda n=n: ran.append(n)) for n in launch_state.STAGES], {}))
    monkeypatch.setattr(e2e, "build_model", lambda config, device: None)
    assert launch_state.main(["--layers", "1", "--steps", "2", "--seq-len", "1000", "--idle", "90"]) == 0
    assert slept == [90.0] and ran == ["sleep", *launch_state.STAGES]
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT")]
    assert [r.split()[2] for r in rows] == ["before", "idle", *launch_state.STAGES, "again"]
    assert [r.split("clocks ")[1].split()[0] for r in rows] == [
        str(1980 - 100 * i) for i in (0, 1, *range(2, 2 + len(launch_state.STAGES)), 1 + len(launch_state.STAGES))]
    with pytest.raises(SystemExit, match="--idle must be"):
        launch_state.main(["--layers", "1", "--idle", "-1"])


def test_profile_once_runs_a_profiler_session_on_the_cpu():
    launch_state.profile_once(device="cpu")
    assert not torch.autograd.profiler._is_profiler_enabled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_state_names_a_side_stream():
    assert "(default)" in launch_state.stream_state()
    side = torch.cuda.Stream(priority=-1)
    with torch.cuda.stream(side):
        state = launch_state.stream_state()
    assert "(default)" not in state and f"0x{side.cuda_stream:x}" in state and "priority -1" in state


def test_graph_functions_watch_the_probes_graphs_from_before_the_build(monkeypatch, capsys):
    """--graph-functions: the graphs kept while the probe was built are snapshot before the first probe and after
    each one; a change shows under the row of the stage after which it appeared."""
    from benchmarks.tuning import e2e_profile, e2e_steps, graph_functions
    from loki.bench import e2e

    kept, ran = [], []

    class FakeGraph:
        def raw_cuda_graph(self):
            return 1

    def fake_compiled_step(*a, **k):
        kept.append(FakeGraph())  # the probe's graph, captured while its step is built
        return lambda i: None

    def fake_snapshot(graph, drv):
        return [{"node": 1, "name": "k", "func_attrs": {"carveout": 100 if "compile" in ran else 0}}]

    def fake_build_stages(dims, path, B, S, n_fill, k, fresh, device="cuda", patch=None):
        kept.append(FakeGraph())  # a graph of the build: not watched
        return [(n, lambda n=n: ran.append(n)) for n in launch_state.STAGES], {}

    fake_cuda(monkeypatch)
    monkeypatch.setattr(launch_state, "stream_state", lambda: "s")
    monkeypatch.setattr(launch_state, "gpu_processes", lambda: 1)
    monkeypatch.setattr(e2e_steps, "dump_graphs_when_captured", lambda: kept)
    monkeypatch.setattr(graph_functions, "Driver", lambda: None)
    monkeypatch.setattr(graph_functions, "snapshot", fake_snapshot)
    monkeypatch.setattr(e2e_profile, "compiled_step", fake_compiled_step)
    monkeypatch.setattr(launch_state, "build_stages", fake_build_stages)
    monkeypatch.setattr(e2e, "build_model", lambda config, device: None)
    assert launch_state.main(["--layers", "1", "--steps", "2", "--seq-len", "1000", "--graph-functions"]) == 0
    out = capsys.readouterr().out
    assert "watching 1 graphs of the probe: 1 kernel nodes" in out
    lines = out.splitlines()
    at = {ln.split()[2]: i for i, ln in enumerate(lines) if ln.startswith("RESULT")}
    assert "graphs: k: func_attrs.carveout 0 -> 100" in lines[at["compile"] + 1]
    assert not lines[at["eager"] + 1].strip().startswith("graphs:")


def test_triggers_run_one_stage_each_before_the_build_and_build_none_leaves_it_out(monkeypatch, capsys):
    """--triggers: each named trigger is a stage of its own, probed after it, before the build; --build none runs no
    build stage (only the triggers and "again"); an unknown trigger is refused by name."""
    from benchmarks.tuning import e2e_profile, launch_triggers
    from loki.bench import e2e

    ran = []
    fake_cuda(monkeypatch)
    monkeypatch.setattr(launch_state, "stream_state", lambda: "s")
    monkeypatch.setattr(launch_state, "gpu_processes", lambda: 1)
    monkeypatch.setattr(launch_state, "gpu_clocks", lambda: None)
    monkeypatch.setattr(launch_triggers, "trigger_stages", lambda names, device="cuda": (
        [(n, lambda n=n: ran.append(n)) for n in names], []))
    monkeypatch.setattr(e2e_profile, "compiled_step", lambda *a, **k: (lambda i: None))
    monkeypatch.setattr(launch_state, "build_stages", lambda *a, **k: (
        [(n, lambda n=n: ran.append(n)) for n in launch_state.STAGES], {}))
    monkeypatch.setattr(e2e, "build_model", lambda config, device: None)
    base = ["--layers", "1", "--steps", "2", "--seq-len", "1000"]
    assert launch_state.main([*base, "--triggers", "pinned,gc"]) == 0
    assert ran == ["pinned", "gc", *launch_state.STAGES]
    rows = [ln.split()[2] for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT")]
    assert rows == ["before", "pinned", "gc", *launch_state.STAGES, "again"]
    ran.clear()
    assert launch_state.main([*base, "--triggers", "all", "--build", "none"]) == 0
    assert ran == list(launch_triggers.TRIGGERS)
    rows = [ln.split()[2] for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT")]
    assert rows == ["before", *launch_triggers.TRIGGERS, "again"]
    with pytest.raises(SystemExit, match="--triggers takes names of .* got nope"):
        launch_state.main([*base, "--triggers", "gc,nope"])


def test_the_cheap_triggers_run_on_the_cpu_and_keep_what_they_allocate():
    """The triggers that need no GPU or compiler run on the CPU; pinned memory and streams stay referenced (a trigger
    whose allocation was freed at once would test nothing)."""
    from benchmarks.tuning import launch_triggers

    names = ["pinned", "host-copy", "events", "streams", "cublas", "gc", "bench"]
    stages, keep = launch_triggers.trigger_stages(names, device="cpu")
    assert [n for n, _ in stages] == names
    for _, fn in stages:
        fn()
    assert len(keep) == 1 and keep[0].numel() == 256 << 20


def test_parse_triggers_takes_counts_on_the_stream_triggers_only():
    """``streams:N`` / ``streams-idle:N`` take a count N >= 1; the variants outside ``all`` are named one by one; a
    count on another trigger, a zero or a non-number is refused by name."""
    from benchmarks.tuning import launch_triggers as lt

    assert lt.parse_triggers("streams:3, streams-idle:2,side-work,tree-sync") == [
        "streams:3", "streams-idle:2", "side-work", "tree-sync"]
    assert lt.parse_triggers("all") == list(lt.TRIGGERS) and not set(lt.EXTRA) & set(lt.TRIGGERS)
    for bad in ("streams:0", "gc:2", "streams:x", "nope"):
        with pytest.raises(SystemExit, match=f"got {bad}"):
            lt.parse_triggers(bad)
    stages, keep = lt.trigger_stages(["streams:3", "streams-idle:2", "side-gemm"], device="cpu")
    assert [n for n, _ in stages] == ["streams:3", "streams-idle:2", "side-gemm"]
    for _, fn in stages:
        fn()
