"""Triton where it can be imported, stand-ins where it cannot.

The project depends on ``triton`` only where Triton ships wheels (Linux x86_64 and aarch64; see pyproject.toml).
Elsewhere the PyTorch backend of every kernel runs, and a kernel module can still be imported if it takes
``triton`` and ``tl`` from here instead of importing them itself::

    from loki._triton import tl, triton      # instead of: import triton; import triton.language as tl

With Triton installed these are the real modules.  Without it they are stand-ins that let a module *define* its
kernels (``@triton.jit``, ``@triton.autotune``, ``triton.Config``, ``tl.constexpr`` in annotations, the host
helpers ``triton.cdiv`` and ``triton.next_power_of_2``), and launching such a kernel raises
:class:`TritonUnavailableError`, as does :func:`require_triton`, which a ``backend="triton"`` request calls first.

This module imports nothing else of ``loki`` (it can be loaded on its own).
"""

from __future__ import annotations

import types

__all__ = ["HAS_TRITON", "TRITON_IMPORT_ERROR", "TritonUnavailableError", "require_triton", "tl", "triton"]


class TritonUnavailableError(RuntimeError):
    """A Triton kernel was asked for where the ``triton`` package cannot be imported."""


def _message(what: str) -> str:
    return (f"{what} need(s) the 'triton' package, which cannot be imported here ({TRITON_IMPORT_ERROR}); Triton "
            "ships wheels for Linux x86_64 and aarch64 (`pip install 'triton>=3.4,<3.9'`). Use backend='torch' "
            "(or 'auto', which picks the PyTorch reference where Triton cannot run) instead")


def require_triton(what: str = "the Triton kernels") -> None:
    """Raise :class:`TritonUnavailableError` naming ``what`` unless ``triton`` can be imported."""
    if not HAS_TRITON:
        raise TritonUnavailableError(_message(what))


class _MissingKernel:
    """What ``@triton.jit`` gives without Triton: defined, never launched."""

    def __init__(self, fn=None):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _fail(self, *args, **kwargs):
        raise TritonUnavailableError(_message(f"the Triton kernel {self.__name__}"))

    def __getitem__(self, grid):
        return self._fail

    __call__ = _fail
    run = _fail
    warmup = _fail


def _decorator(*args, **kwargs):
    """``@triton.jit`` / ``@triton.jit(...)`` and the other kernel decorators, with or without arguments."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0] if isinstance(args[0], _MissingKernel) else _MissingKernel(args[0])
    return lambda fn: fn if isinstance(fn, _MissingKernel) else _MissingKernel(fn)


class _Placeholder:
    """Any other attribute of the stand-ins (``tl.constexpr``, ``tl.float32``, ...): usable in annotations and
    as a value, and raising :class:`TritonUnavailableError` when called."""

    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return f"<{self._name}: triton is not installed>"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise TritonUnavailableError(_message(self._name))


class _Config:
    def __init__(self, kwargs=None, num_warps=4, num_stages=3, **rest):
        self.kwargs = dict(kwargs or {})
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.extra = rest


def _cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def _next_power_of_2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


def _stand_ins() -> tuple[types.ModuleType, types.ModuleType]:
    lang = _StandIn("triton.language")
    lang.constexpr = _Placeholder("triton.language.constexpr")
    mod = _StandIn("triton")
    mod.__version__ = None
    mod.jit = mod.autotune = mod.heuristics = _decorator
    mod.Config = _Config
    mod.cdiv = _cdiv
    mod.next_power_of_2 = _next_power_of_2
    mod.language = lang
    return mod, lang


try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: BaseException | None = None
except ImportError as exc:  # not installed (a platform without Triton wheels) or unusable
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = exc
    triton, tl = _stand_ins()
