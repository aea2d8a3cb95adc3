"""Shared pytest configuration: markers, the ``device`` fixture, hypothesis profiles, thread limits.

``TRITON_INTERPRET=1`` is set here, before anything imports Triton, whenever no CUDA device is present, so
the Triton kernels run in the interpreter on CPU tensors.  On a GPU machine the interpreter stays off and
kernel tests run on ``cuda`` tensors (``pytest -m gpu``).
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Two cores are shared with a second pytest worker on CI: one torch thread per worker.
torch.set_num_threads(1)

settings.register_profile(
    "dev",
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=25,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu",
    deadline=None,
    max_examples=60,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """Run a test on the CPU and, where one exists, on a CUDA device (the cuda case is marked ``gpu``)."""
    return torch.device(request.param)


@pytest.fixture(params=[pytest.param("cpu", marks=pytest.mark.interpreter),
                        pytest.param("cuda", marks=pytest.mark.gpu)])
def triton_device(request) -> torch.device:
    """The device a Triton-kernel test runs on: the CPU under the interpreter (``TRITON_INTERPRET=1``, CI) and
    CUDA on a GPU machine; the CUDA case is marked ``gpu`` so that ``pytest -m gpu`` selects it."""
    if request.param == "cuda":
        if INTERPRET:
            pytest.skip("TRITON_INTERPRET=1 is set: the kernels run in the interpreter on the CPU")
        return torch.device("cuda")
    if not INTERPRET:
        pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
