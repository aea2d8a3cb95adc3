"""Loki beyond one process, on the CPU: two processes of a gloo group (spawned once for the module) against the
single-process results computed here.

- tensor parallelism: a tiny Llama loaded with transformers' ``tp_plan="auto"``; each rank's basis is its KV
  heads' slice of the full basis, and greedy ``generate`` under Loki (a score-aware basis: components and query
  components) gives the single-process tokens (the multi-GPU script's equality check, at tiny size);
- distributed calibration: the score-aware basis from two ranks equals the single-process one bit for bit, on
  both ranks, and ranks handed different data are refused;
- perplexity: windows split across ranks, the gathered NLLs equal the single-process ones.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from loki.basis import PCABasis
from loki.calibration import calibrate
from loki.evaluation.perplexity import MethodSpec, perplexity
from loki.integrations.transformers import LokiError, enable_loki
from loki.testing.models import tiny_model

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
ARCH = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256)
CALIB = dict(kind="score", num_tokens=150, seq_len=16, max_positions=64, batch_size=2, progress=False)
PROMPT = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
WINDOWS = torch.randint(0, 256, (5, 12), generator=torch.Generator().manual_seed(4))
SETTINGS = [dict(k=0.25, d=0.25, gqa_select="kv"), dict(k=0.25, d=0.5, gqa_select="query")]


def _bench():
    spec = importlib.util.spec_from_file_location("multi_gpu_bench", ROOT / "scripts" / "multi_gpu_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _calib_data():
    return torch.randint(0, 256, (11, 16), generator=torch.Generator().manual_seed(5))


def _fields(b: PCABasis) -> dict:
    return dict(components=b.components, query_components=b.query_components, eigenvalues=b.eigenvalues,
                means=b.means, num_tokens=b.num_tokens)


def _generate(model, basis, setting):
    enable_loki(model, basis, **setting)
    return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=8, do_sample=False,
                          min_new_tokens=8, pad_token_id=0)[:, PROMPT.shape[1]:]


def _worker(rank: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    folder = Path(folder)
    out: dict = {}
    try:
        basis = PCABasis.load(folder / "basis.safetensors")
        model = _bench().load(folder / "model", torch.float32, torch.device("cpu"), tp=True)
        out["tp_generate"] = [_generate(model, basis, s) for s in SETTINGS]
        out["tp_components"] = model._loki.transforms.key
        out["tp_query_components"] = model._loki.transforms.query
        del model
        out["bench_equality"] = _bench().equality(folder / "model", torch.device("cpu"), 16, 6,
                                                  dtypes=(torch.float32,))
        model = tiny_model(**ARCH)
        out["calibrated"] = _fields(calibrate(model, _calib_data(), **CALIB))
        try:  # every rank must be given the same data
            calibrate(model, _calib_data()[rank:], **CALIB)
        except ValueError as exc:
            out["different_data"] = str(exc)
        out["ppl"] = perplexity(model, WINDOWS, MethodSpec("loki", "loki", k=0.25, d=0.25, basis="b"),
                                {"b": basis}, batch_size=2).token_nll
    finally:
        torch.save(out, folder / f"rank{rank}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process results, [results of rank 0, rank 1])."""
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("distributed")
    model = tiny_model(**ARCH)
    model.save_pretrained(folder / "model")
    basis = calibrate(model, _calib_data(), **CALIB)
    basis.save(folder / "basis.safetensors")
    basis = PCABasis.load(folder / "basis.safetensors")
    single = dict(
        basis=basis,
        generate=[_generate(tiny_model(**ARCH), basis, s) for s in SETTINGS],
        ppl=perplexity(tiny_model(**ARCH), WINDOWS, MethodSpec("loki", "loki", k=0.25, d=0.25, basis="b"),
                       {"b": basis}, batch_size=2).token_nll,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the spawned processes import this module
    mp.spawn(_worker, args=(port, str(folder)), nprocs=WORLD, join=True)
    return single, [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_tensor_parallel_basis_is_the_rank_slice(runs):
    single, ranks = runs
    b = single["basis"]
    assert b.query_components is not None  # a score-aware pair: both tensors are sliced
    for r, out in enumerate(ranks):
        assert torch.equal(out["tp_components"], b.components[:, r : r + 1].float())
        assert torch.equal(out["tp_query_components"], b.query_components[:, r : r + 1].float())


def test_tensor_parallel_generate_equals_single_process(runs):
    single, ranks = runs
    for out in ranks:
        for tokens, want in zip(out["tp_generate"], single["generate"]):
            assert torch.equal(tokens, want)


def test_multi_gpu_script_equality_on_cpu(runs):
    rows = runs[1][0]["bench_equality"]
    assert [r["method"] for r in rows] == ["loki", "sdpa"]
    assert all(r["same_tokens"] and r["tp"] == WORLD and r["max_logit_diff"] < 1e-4 for r in rows)
    assert runs[1][1]["bench_equality"] == []  # rank 0 reports


def test_distributed_calibration_is_bit_for_bit(runs):
    single, ranks = runs
    want = _fields(single["basis"])
    for out in ranks:
        got = out["calibrated"]
        assert got["num_tokens"] == want["num_tokens"] == 150
        for name in sorted(set(want) - {"num_tokens"}):
            t = want[name]
            assert torch.equal(got[name], t), name


def test_distributed_calibration_refuses_different_data(runs):
    for out in runs[1]:
        assert "different calibration data" in out["different_data"]


def test_perplexity_windows_split_across_ranks(runs):
    single, ranks = runs
    for out in ranks:
        assert out["ppl"].shape == single["ppl"].shape
        assert torch.equal(out["ppl"], single["ppl"])


def test_multi_gpu_script_arguments():
    bench = _bench()
    args = bench.parse_args(["--tiny", "--device", "cpu", "--batch", "2"])
    assert (args.batch, args.context, args.steps, args.tiny) == (2, 8192, 32, True)
    assert bench.model_config(bench.parse_args([])).num_key_value_heads == 8
    with pytest.raises(SystemExit):
        bench.parse_args(["--context", "0"])


def test_sharded_heads_without_a_process_group_are_refused():
    """A k_proj holding half the KV heads in a single process: which heads cannot be told, so no silent guess."""
    model = tiny_model(**ARCH)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.k_proj = torch.nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features // 2, bias=False)
        attn.q_proj = torch.nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features // 2, bias=False)
    with pytest.raises(LokiError, match="KV heads, but which ones cannot be determined"):
        enable_loki(model, PCABasis.random(2, 2, 16), k=0.25, d=0.25)


def test_basis_follows_the_device_of_each_layer():
    """device_map: a layer's basis and its cache layer's P go to the device of the tensors they meet."""
    from loki.integrations.transformers import loki_cache, state_of

    model = enable_loki(tiny_model(**ARCH), PCABasis.random(2, 2, 16), k=0.25, d=0.25)
    state = state_of(model)
    assert state.transforms.layer(1, torch.device("meta")).key.device.type == "meta"
    assert state.transforms.layer(1, torch.device("cpu")).query.device.type == "cpu"
    cache = loki_cache(model)
    k = torch.randn(1, 2, 3, 16, device="meta")
    cache.update(k, k, 1)
    assert cache.layers[1].loki.transforms.key.device.type == "meta" and cache.layers[1].keys.device.type == "meta"


def _byte_tokenizer():
    """A 256-token byte-level tokenizer (no merges) for a tiny model folder the command line can load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[0])


def test_calibrate_command_under_torchrun_equals_one_process(tmp_path):
    """``torchrun --nproc_per_node 2 -m loki.cli calibrate`` (gloo on the CPU) writes the basis a single process
    writes, bit for bit, from rank 0 only."""
    import subprocess

    folder = tmp_path / "model"
    tiny_model(**ARCH).save_pretrained(folder)
    _byte_tokenizer().save_pretrained(folder)
    args = ["-m", "loki.cli", "calibrate", "--model", str(folder), "--device", "cpu", "--corpus", "wikitext",
            "--tokens", "300", "--seq-len", "32", "--max-positions", "64", "--batch-size", "2", "--no-progress",
            "--threads", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, *args, "--output", str(tmp_path / "one.safetensors")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(_free_port()), *args, "--output", str(tmp_path / "two.safetensors")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("Rank@90") == 1, two.stdout  # one writer: rank 0 of a group of two
    a = PCABasis.load(tmp_path / "one.safetensors")
    b = PCABasis.load(tmp_path / "two.safetensors")
    for name, t in _fields(a).items():
        other = _fields(b)[name]
        same = torch.equal(t, other) if isinstance(t, torch.Tensor) else t == other
        assert same, name
    assert a.num_tokens > 0 and a.query_components is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ppl_command_under_torchrun_equals_one_process(tmp_path):
    """``torchrun --nproc_per_node 2 -m loki.cli ppl`` splits the windows across two gloo processes and prints
    the single-process perplexity, once (rank 0)."""
    import re
    import subprocess

    folder = tmp_path / "model"
    model = tiny_model(**ARCH)
    model.save_pretrained(folder)
    _byte_tokenizer().save_pretrained(folder)
    calibrate(model, _calib_data(), **CALIB).save(tmp_path / "basis.safetensors")
    args = ["-m", "loki.cli", "ppl", "--model", str(folder), "--device", "cpu", "--method", "loki", "--k", "0.25",
            "--dims", "0.5", "--basis", str(tmp_path / "basis.safetensors"), "--windows", "5", "--seq-len", "32",
            "--no-progress", "--threads", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), *args], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    pattern = r"perplexity ([\d.]+) \(nll ([\d.]+), (\d+) predictions\), effective density ([\d.]+)"
    nums = [re.findall(pattern, out.stdout) for out in (one, two)]  # not the elapsed time printed after them
    assert nums[0] and nums[0] == nums[1], (one.stdout, two.stdout)
    assert two.stdout.count("\n") == one.stdout.count("\n"), two.stdout  # printed by rank 0 only


def test_multi_gpu_script_profile_summary_and_table():
    """--profile: device us per step from the profiler's CUDA events (collectives = NCCL kernels), shown in the
    table below the speeds."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(device_type=cuda, name="ncclDevKernel_AllReduce_Sum_bf16", device_time_total=400.0),
              SimpleNamespace(device_type=cuda, name="nvjet_gemm", device_time_total=1200.0),
              SimpleNamespace(device_type=cuda, name="nvjet_gemm", device_time_total=800.0),
              SimpleNamespace(device_type=cpu, name="aten::mm", device_time_total=0.0)]
    s = _bench().kernel_summary(SimpleNamespace(events=lambda: events), steps=4)
    assert s["kernel_us_per_step"] == 600.0 and s["collective_us_per_step"] == 100.0
    assert s["top"][0] == {"name": "nvjet_gemm", "us": 500.0}
    result = dict(device="cpu", world_size=2, commit="x", torch="t", transformers="t", model="tiny", equality=[],
                  speed=[dict(method="loki+compile", ms_per_step=1.0, tokens_per_s=8.0, vs_sdpa=1.1, profile=s)],
                  speed_setting=dict(batch=8, context=64, steps=4, **_bench().LOKI))
    table = _bench().markdown(result)
    assert "| loki+compile | 600 | 100 | nvjet_gemm 500; ncclDevKernel_AllReduce_Sum_bf16 100 |" in table


def test_multi_gpu_script_times_the_compiled_paths_without_autograd(monkeypatch):
    """The compiled static-cache timing runs the model with autograd off (as the eager one): with it on, the
    weights' requires_grad makes enable_loki's "auto" backend take the differentiable PyTorch reference instead of
    the Triton decode step (which then failed to compile under TP), and the dense path records a backward graph.
    The CUDA-only pieces are stubbed so that it runs on the CPU."""
    import functools
    from types import SimpleNamespace

    bench = _bench()
    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    seen = []
    forward = model.forward

    @functools.wraps(forward)  # the same signature: the cache keyword is read from it
    def spy(*args, **kwargs):
        seen.append(torch.is_grad_enabled())
        return forward(*args, **kwargs)

    class Event:
        def __init__(self, **_):
            pass

        def record(self):
            pass

        def elapsed_time(self, _other):
            return 1.0

    monkeypatch.setattr(model, "forward", spy)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr("loki.bench.e2e.rewind", lambda cache, n: None)
    monkeypatch.setattr(bench, "fill_cache", lambda model, B, S, cache=None, seed=0: cache if cache is not None
                        else SimpleNamespace())
    torch.set_grad_enabled(True)
    bench.decode_speed_static(model, 1, 4, 2)
    assert seen and not any(seen)
