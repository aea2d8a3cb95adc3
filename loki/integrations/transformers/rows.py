"""Query rows of an attention call: the rows rotated into the basis (with the layer's query transform), and
whether a step runs on the Triton kernels.  What each row sees comes from the step metadata (:mod:`.metadata`).

Shape letters: B batch, HQ query heads, L query length, D head dim.
"""

from __future__ import annotations

import torch

from loki._checks import check_no_grad, check_triton_device
from loki.reference import rotate_query

from .config import LokiError

__all__ = ["check_compiled_backend", "check_triton_inputs", "reference_outside_graph", "rotate_rows", "triton_backend"]


def rotate_rows(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """x: [B, HQ, L, D] -> x P per KV head (query heads of a group share their KV head's transform)."""
    B, HQ, L, D = x.shape
    flat = x.transpose(1, 2).reshape(B * L, HQ, D)
    return rotate_query(flat, P).reshape(B, L, HQ, D).transpose(1, 2)


def triton_backend(backend: str, query: torch.Tensor) -> bool:
    """Whether a decode step with this ``backend`` setting runs the Triton kernels ("auto": on CUDA tensors that
    need no gradient; the kernels have no backward)."""
    if backend == "triton":
        return True
    return backend == "auto" and query.is_cuda and not (torch.is_grad_enabled() and query.requires_grad)


def check_triton_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """backend='triton' at forward time: a device the kernels run on, and no gradient wanted."""
    try:
        check_triton_device(query, "enable_loki(backend='triton')")
        check_no_grad("Loki's Triton decode step (enable_loki(backend='triton'))", query=query, key=key,
                      value=value)
    except RuntimeError as exc:
        raise LokiError(str(exc)) from None


def check_compiled_backend(backend: str, device, where: str) -> None:
    """Refuse, before compiling, a whole-graph (``fullgraph=True``) CUDA decode step on ``backend="torch"``:
    its PyTorch reference runs outside the compiled graph (:func:`reference_outside_graph`), which a whole graph
    cannot hold."""
    if backend == "torch" and torch.device(device).type == "cuda":
        raise ValueError(f"{where}: backend='torch' runs Loki's PyTorch reference, which a compiled CUDA step runs "
                         "eagerly outside its graph, so a whole-graph (fullgraph) compilation cannot hold it: use "
                         "backend='auto' or 'triton' (the kernels), or compile=False")


@torch.compiler.disable
def reference_outside_graph(state, compiling: bool, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a PyTorch reference step on CUDA, run eagerly: under ``torch.compile`` the step
    breaks its graph here instead of tracing the reference (Inductor does not compile it; a refusal raised while
    tracing would not reach the user either: Dynamo breaks the graph on the raise and reruns the frame eagerly).
    ``compiling``: whether the caller was being traced; the first such call warns once per enabled model
    (``state``) that the compiled step is not the kernels'.  Same result as eager decoding."""
    if compiling and not state.warned_compiled_reference:
        import warnings

        state.warned_compiled_reference = True
        cfg = state.config
        if cfg.backend == "torch":
            why = "backend='torch'"
        elif cfg.method != "loki":
            why = f"method={cfg.method!r}, which has no kernels"
        else:
            why = f"backend={cfg.backend!r} with autograd recording (the Triton kernels have no backward)"
        warnings.warn(
            f"Loki's decode step runs the PyTorch reference ({why}): inside torch.compile it runs eagerly, outside "
            "the compiled graph and any CUDA graph, so the step is much slower than the kernels' (results are the "
            "same). Decode under torch.no_grad() (as generate does) with backend='auto' or 'triton' on a static "
            "cache for the compiled kernels", RuntimeWarning, stacklevel=3)
    return fn(*args, **kwargs)
