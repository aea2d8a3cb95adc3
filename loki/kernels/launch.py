"""Host-side launch path of the decode step: every Triton launch of the kernels goes through ``launch``,
and ``DecodePlan`` replays a recorded step with the compiled kernels called directly (the mechanism under
:class:`~loki.kernels.plan.DecodeRun`, the kernels' one replay object).

Why: Triton's ``kernel[grid](...)`` binds ~30 arguments, computes a specialization key and looks the
compiled kernel up on every call (25-40 us of host time per launch in triton 3.6); at small batch the
4-launch decode step is host-bound (docs/kernels.md).  A ``DecodePlan`` is recorded once per argument
signature (shapes, strides, dtypes, pointer alignment, scalar options; ``DecodeRun`` records at a
signature's second call): that call launches normally and records each launch's compiled kernel, grid and
argument list; later calls allocate the per-call
buffers (one ``torch.empty`` each, NaN-filled with ``LOKI_POISON_OUTPUTS=1``), patch the pointers of
the tensors that change (inputs by identity, internal buffers by storage and byte offset) and call the
compiled kernels' launchers directly, with no other torch op.
"""

from __future__ import annotations

import collections
import os

import torch

from .common import interpreting

try:  # triton >= 3.4
    from triton import knobs as _knobs
    from triton.compiler.compiler import CompiledKernel as _CompiledKernel
    from triton.runtime import driver as _driver
except Exception:  # noqa: BLE001 - older triton: no direct launches
    _knobs = _CompiledKernel = _driver = None

__all__ = ["DecodePlan", "counting", "launch", "new_output", "pdl", "recording"]

#: Programmatic dependent launch (Hopper+), opt-in with ``LOKI_PDL=1``: the decode kernels are launched so
#: that each may start while the previous one drains, and wait (griddepcontrol.wait) before reading its
#: results.  Off by default: on an H100 it saved ~1 us per step with one head per program and cost 3-7 us
#: on the GQA group path (docs/kernels.md).  Never used by the interpreter or below compute capability 9.0.
PDL = os.environ.get("LOKI_PDL", "0") == "1"
_CAPS: dict = {}


def pdl(device) -> bool:
    """Whether the decode kernels use programmatic dependent launch on this device."""
    if not PDL or interpreting() or getattr(device, "type", "cpu") != "cuda":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _CAPS:
        _CAPS[key] = torch.cuda.get_device_capability(key)[0] >= 9
    return _CAPS[key]

_RECORD: list | None = None
_ALLOCS: list | None = None
_COUNTERS: list = []  # the active ``counting`` contexts


def _count(fn) -> None:
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", repr(fn))
    for c in _COUNTERS:
        c[name] += 1


class counting:
    """Context manager counting the Triton launches of Loki's kernels made inside it, by kernel name (a
    ``collections.Counter``), whether they go through :func:`launch` or are replayed by a :class:`DecodePlan`;
    contexts nest, and each sees every launch made while it is open (from Python: a CUDA graph's replay launches
    without it)::

        with counting() as launches:
            model(...)
        sum(launches.values()), launches["_approx_scores_kernel"]
    """

    def __enter__(self) -> collections.Counter:
        self.counter = collections.Counter()
        _COUNTERS.append(self.counter)
        return self.counter

    def __exit__(self, *exc):
        del _COUNTERS[next(i for i, c in enumerate(_COUNTERS) if c is self.counter)]  # by identity: equal counts
        return False


def note_allocation(t: torch.Tensor) -> torch.Tensor:
    """Called by ``new_output``: while recording, remember every per-call buffer (in allocation order)."""
    if _ALLOCS is not None:
        _ALLOCS.append(t)
    return t


#: The int a poisoned output is filled with (``LOKI_POISON_OUTPUTS=1``): a slot still holding it was never written.
POISON_INT = 2**30 + 7


def _poison(dtype: torch.dtype):
    """The fill of a poisoned output (``LOKI_POISON_OUTPUTS=1``): NaN for floats, :data:`POISON_INT` for ints."""
    return float("nan") if dtype.is_floating_point else POISON_INT


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate a kernel output; with ``LOKI_POISON_OUTPUTS=1`` fill it with NaN (floats) or a huge
    sentinel (ints) so that an element a kernel forgets to write fails the tests."""
    if os.environ.get("LOKI_POISON_OUTPUTS") == "1":
        return note_allocation(torch.full(shape, _poison(dtype), dtype=dtype, device=device))
    return note_allocation(torch.empty(shape, dtype=dtype, device=device))


def launch(fn, grid, args, opts):
    """``fn[grid](*args, **opts)`` (args: every kernel parameter in order, constexprs included), recorded
    while a ``recording()`` is active.  Returns what Triton returns (the compiled kernel on a GPU)."""
    if opts.pop("pdl", False):
        opts = dict(opts, launch_pdl=True)
    if _COUNTERS:
        _count(fn)
    ret = fn[grid](*args, **opts)
    if _RECORD is not None:
        _RECORD.append((fn, tuple(grid) + (1,) * (3 - len(grid)), list(args), opts, ret))
    return ret


class recording:
    """Context manager collecting the ``launch`` calls made inside it."""

    def __enter__(self):
        global _RECORD, _ALLOCS
        self.prev = (_RECORD, _ALLOCS)
        _RECORD, _ALLOCS = [], []
        self.launches, self.buffers = _RECORD, _ALLOCS
        return self

    def __exit__(self, *exc):
        global _RECORD, _ALLOCS
        _RECORD, _ALLOCS = self.prev
        return False


def tensor_key(t: torch.Tensor | None):
    """What a compiled kernel depends on for one tensor argument (not its address, only its alignment)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, (t.data_ptr() & 15) == 0)


def _storage_ptr(t):
    return t.untyped_storage().data_ptr()


class DecodePlan:
    """A recorded sequence of launches replayed with new input tensors and fresh per-call buffers.

    ``inputs``: the tensors of the recorded call that the caller passes again on every call (by
    position); ``buffers``: the tensors the recorded call allocated per call (returned ones first, in the
    order ``returns`` names them), re-allocated with the same shape and dtype on every call.  Every
    tensor argument of every launch must be one of the inputs (identity) or lie in one of the buffers'
    storages; otherwise ``ok`` is False and the caller keeps the normal path.
    """

    def __init__(self, launches, inputs, buffers):
        self.ret = self.ret_idx = None  # the buffers the step returns: its output and selection (set by the recorder)
        self.ok = all(interpreting() or (rec[4] is not None and hasattr(rec[4], "packed_metadata")
                                         and hasattr(rec[4], "function")) for rec in launches)
        self.buffers = [(tuple(b.shape), b.dtype, b.device) for b in buffers]
        self.device_index = buffers[0].device.index if buffers and buffers[0].device.type == "cuda" else None
        buf_storage = {}
        for j, b in enumerate(buffers):
            if b.storage_offset() != 0 or not b.is_contiguous():
                self.ok = False
            buf_storage.setdefault(_storage_ptr(b), j)
        self.launches = []
        for fn, grid, args, opts, compiled in launches:
            subs = []
            template = list(args)
            for pos, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    continue
                src = next((("in", i) for i, t in enumerate(inputs) if t is a), None)
                off = 0
                if src is None:
                    j = buf_storage.get(_storage_ptr(a))
                    if j is None:
                        self.ok = False
                        continue
                    src = ("buf", j)
                    off = a.data_ptr() - buffers[j].data_ptr()
                subs.append((pos, src[0] == "in", src[1], off, a.shape, a.stride(), a.storage_offset()
                             - (buffers[src[1]].storage_offset() if src[0] == "buf" else 0)))
                template[pos] = None
            self.launches.append((fn, grid, template, subs, opts, compiled))

    def new_buffers(self):
        if os.environ.get("LOKI_POISON_OUTPUTS") == "1":
            return [torch.full(s, _poison(dt), dtype=dt, device=dev) for s, dt, dev in self.buffers]
        return [torch.empty(s, dtype=dt, device=dev) for s, dt, dev in self.buffers]

    def bind(self, inputs, buffers, as_tensors: bool):
        """The argument lists of every launch for these inputs and buffers: raw device addresses
        (``as_tensors=False``, the direct launch) or tensor views (the interpreter, and the tests)."""
        out = []
        for _fn, _grid, template, subs, _opts, _compiled in self.launches:
            args = list(template)
            for pos, is_in, i, off, shape, stride, soff in subs:
                t = inputs[i] if is_in else buffers[i]
                if as_tensors:
                    args[pos] = t if (is_in or (off == 0 and t.shape == shape)) else torch.as_strided(
                        t, shape, stride, soff)
                else:
                    args[pos] = t.data_ptr() + off
            out.append(args)
        return out

    @staticmethod
    def direct() -> bool:
        """Whether launches call the compiled kernels directly (raw addresses), not through the interpreter."""
        return not (interpreting() or _CompiledKernel is None)

    def launch_all(self, arg_lists) -> None:
        """Launch every recorded kernel with its argument list (as ``bind`` gives them for ``direct()``)."""
        if _COUNTERS:
            for rec in self.launches:
                _count(rec[0])
        if not self.direct():
            for (fn, grid, _, _, opts, _), args in zip(self.launches, arg_lists):
                fn[grid](*args, **opts)
            return
        stream = _driver.active.get_current_stream(self.device_index)
        enter, exit_ = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        for (_fn, grid, _, _, _opts, ck), args in zip(self.launches, arg_lists):
            meta = ck.launch_metadata(grid, stream, *args) if enter is not None else None
            ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata, meta, enter, exit_, *args)

    def __call__(self, inputs):
        """Launch the recorded step on new inputs; returns the fresh buffers."""
        buffers = self.new_buffers()
        self.launch_all(self.bind(inputs, buffers, not self.direct()))
        return buffers
