"""benchmarks/tuning/e2e_steps.py: the step timer's arithmetic on the CPU with a fake clock and fake device events
(the GPU command times the compiled step)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tuning import e2e_steps


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_measure_steps_separates_host_enqueue_device_time_and_back_to_back():
    """Each step costs 1 ms of host time; a sync waits 4 ms for the device after a step.  Synced: host 1 ms per step,
    device (events around the enqueue) 5 ms; back to back: n steps of 1 ms then one sync of 4 ms."""
    clock, calls, syncs = _Clock(), [], []

    def step(i):
        calls.append(i)
        clock.t += 1e-3

    def sync():
        syncs.append(clock.t)
        clock.t += 4e-3

    class Ev:
        def __init__(self):
            self.at = None

        def record(self):
            self.at = clock.t

        def elapsed_time(self, other):  # ms, as torch.cuda.Event: the device finishes 4 ms after the enqueue ends
            return (other.at + 4e-3 - self.at) * 1e3

    r = e2e_steps.measure_steps(step, first=3, n=5, sync=sync, clock=clock, events=lambda: (Ev(), Ev()))
    assert calls == list(range(3, 13))  # the synced steps, then the back-to-back ones
    assert r["host_enqueue_ms"] == pytest.approx(1.0) and r["device_synced_ms"] == pytest.approx(5.0)
    assert r["back_to_back_ms"] == pytest.approx((5 * 1 + 4) / 5)
    assert len(syncs) == 5 + 2  # one per synced step, one before and one after the back-to-back loop


def test_measure_steps_without_events_counts_the_host_wait_as_device_time():
    clock = _Clock()

    def step(i):
        clock.t += 2e-3

    def sync():
        clock.t += 1e-3

    r = e2e_steps.measure_steps(step, first=0, n=3, sync=sync, clock=clock)
    assert r["host_enqueue_ms"] == pytest.approx(2.0) and r["device_synced_ms"] == pytest.approx(3.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_main_refuses_without_a_cuda_device():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        e2e_steps.main(["--layers", "1"])


def test_plan_steps_gives_each_path_its_warm_up_loops_rounds_and_profiled_steps():
    """One path: warm-up, the synced and back-to-back loops, the profiled steps; several paths: the loops again in every
    round.  The steps fill the cache's last slots."""
    assert e2e_steps.plan_steps(1000, steps=10, n_paths=1, rounds=2, warm=8, extra=6) == (1000 - 34, 34)
    assert e2e_steps.plan_steps(1000, steps=10, n_paths=2, rounds=2, warm=8, extra=0) == (1000 - 68, 68)
    assert e2e_steps.plan_steps(69, steps=10, n_paths=3, rounds=2, warm=8, extra=0) == (1, 68)


@pytest.mark.parametrize("steps, rounds, seq_len", [(0, 2, 1000), (10, -1, 1000), (10, 2, 68)])
def test_plan_steps_refuses_what_does_not_fit_naming_the_arguments(steps, rounds, seq_len):
    with pytest.raises(SystemExit, match="--steps .* --rounds"):
        e2e_steps.plan_steps(seq_len, steps=steps, n_paths=2, rounds=rounds, warm=8, extra=0)


def test_compiled_step_refuses_steps_beyond_the_cache_before_building_anything():
    from benchmarks.tuning.e2e_profile import compiled_step

    with pytest.raises(ValueError, match="n_fill \\+ n_steps must fit in the cache of 100 tokens"):
        compiled_step(None, "loki_compiled", 1, 100, 90, 11, 16)


def test_main_with_several_paths_gives_each_its_own_steps_and_times_all_again(monkeypatch, capsys):
    """Two paths in one process (the GPU parts faked): each path's step is called with its own indices 0..n-1 once
    each, within what its cache holds; each path is timed right after its build and again in every round, in order."""
    from benchmarks.tuning import e2e_profile
    from loki.bench import e2e

    calls, built = {}, []

    def fake_compiled_step(model, path, B, S, n_fill, n_steps, k, aggregate="auto", score_format="native"):
        label = f"{path}@{score_format}"
        built.append((label, n_fill, n_steps))
        calls[label] = []

        def step(i):
            assert 0 <= i < n_steps
            calls[label].append(i)
        return step

    class Ev:
        def record(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake")
    monkeypatch.setattr(e2e_profile, "compiled_step", fake_compiled_step)
    monkeypatch.setattr(e2e, "build_model", lambda config, device: None)
    monkeypatch.setattr(e2e_steps, "_cuda_events", lambda: (Ev(), Ev()))
    assert e2e_steps.main(["--path", "loki_compiled,loki_compiled@int8", "--layers", "1", "--seq-len", "1000",
                           "--steps", "5", "--rounds", "2"]) == 0
    per_path = 8 + 2 * 5 * 3
    assert built == [("loki_compiled@native", 1000 - per_path, per_path), ("loki_compiled@int8", 1000 - per_path,
                                                                            per_path)]
    assert calls["loki_compiled@native"] == list(range(per_path)) == calls["loki_compiled@int8"]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT")]
    assert [ln.split(" L=")[0] for ln in lines] == ["RESULT loki_compiled", "RESULT loki_compiled@int8"] * 3
    assert "(built: loki_compiled)" in lines[0] and "(built: loki_compiled, loki_compiled@int8)" in lines[1]
    assert "(round 2, all built)" in lines[-1]


@pytest.mark.parametrize("argv, match", [
    (["--path", "loki_compild"], "--path must be loki_compiled"),
    (["--path", "sdpa_compiled@int8"], "--path must be loki_compiled"),
    (["--path", "loki_compiled@fp8"], "--path must be loki_compiled"),
    (["--path", "loki_compiled,loki_compiled"], "names a path twice"),
    (["--model", "gpt2"], "--model must be one of"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_main_refuses_bad_arguments_naming_them(argv, match):
    with pytest.raises(SystemExit, match=match):
        e2e_steps.main(argv)


def test_dump_graphs_keeps_every_new_graph_with_its_debug_mode(monkeypatch):
    """The CUDA graphs made after ``dump_graphs_when_captured`` are kept (``keep_graph=True`` reaches the bound
    object's ``__init__``, which is where torch's graph takes it: without it torch drops the cudaGraph_t and
    ``debug_dump`` writes nothing) with their debug mode on, and collected in the returned list."""

    class FakeGraph:  # as torch's: the Python class's __new__ passes keep_graph on, the bound __init__ stores it
        def __new__(cls, keep_graph=False):
            return super().__new__(cls)

        def __init__(self, keep_graph=False):
            self.keep_graph, self.debug = keep_graph, False

        def enable_debug_mode(self):
            self.debug = True

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    graphs = e2e_steps.dump_graphs_when_captured()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(keep_graph=False)
    assert graphs == [g1, g2]
    assert all(g.keep_graph and g.debug for g in graphs)
