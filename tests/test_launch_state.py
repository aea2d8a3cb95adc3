"""benchmarks/tuning/launch_state.py: the stage-by-stage probe's bookkeeping on the CPU (the GPU command times it)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tuning import launch_state


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
