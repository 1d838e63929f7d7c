"""Byte accounting of device memory on the meta device: what a launch would allocate, without
the memory.

:class:`Ledger` is a ``TorchDispatchMode``: every aten op run under it (in this thread) that
returns a tensor on the ``meta`` device records the tensor's storage (its bytes, and the call
site in ulacache or SGLang that made it); a storage stops counting when it is garbage collected,
exactly when the caching allocator would get the block back. Meta tensors carry shapes, dtypes
and strides but no data, so every allocation the real code makes at production geometry is
made, at its real size, and costs nothing.

Data-dependent ops: an op whose output *shape* depends on values (``nonzero``, ``unique``,
``masked_select``) is answered with its largest possible output (every element selected,
every value distinct), the worst case for memory; a read of a value (``.item()``, ``bool(t)``)
is answered 0 / ``False`` and counted per call site in :attr:`Ledger.value_reads` (production
paths make none on the decode step; the report lists any it met, so a rehearsal whose control
flow depended on a value says so).

Not counted: memory outside torch's allocator (NCCL/CUDA IPC internals, Triton's launch
state), and alignment: the caching allocator rounds each block up to 512 B (small blocks to
2 MB segments), which the report states rather than models.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

_SITE_PACKAGES = ("ulacache", "sglang", "kernels", "patches", "tests")


def call_site() -> str:
    """``file:line (function)`` of the innermost frame in ulacache, SGLang or the tests
    (torch's own frames and this module skipped)."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("/ledger.py"):
            parts = path.split("/")
            for i, p in enumerate(parts[:-1]):
                if p in _SITE_PACKAGES:
                    return f"{'/'.join(parts[i:])}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "elsewhere"


@dataclass
class Allocation:
    """One live storage: its bytes and where it was made."""

    key: int
    nbytes: int
    site: str
    ref: StorageWeakRef


def _worst_case(func, args, kwargs):
    """The largest output of a data-dependent op on a meta tensor, or ``None`` if ``func`` is
    not one of them."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.device.type != "meta":
        return None
    n = x.numel()
    dev = x.device
    if func in (aten.nonzero.default,):
        return torch.empty((n, x.dim()), dtype=torch.int64, device=dev)
    if func in (aten.masked_select.default,):
        return torch.empty((n,), dtype=x.dtype, device=dev)
    if func in (aten._unique2.default, aten.unique_consecutive.default):
        return_inverse = kwargs.get("return_inverse", args[2] if len(args) > 2 else False)
        return_counts = kwargs.get("return_counts", args[3] if len(args) > 3 else False)
        out = torch.empty((n,), dtype=x.dtype, device=dev)
        inv = torch.empty(x.shape if return_inverse else (0,), dtype=torch.int64, device=dev)
        cnt = torch.empty((n,) if return_counts else (0,), dtype=torch.int64, device=dev)
        return out, inv, cnt
    if func in (aten._unique.default,):
        return (torch.empty((n,), dtype=x.dtype, device=dev),
                torch.empty(x.shape, dtype=torch.int64, device=dev))
    return None


class Ledger(TorchDispatchMode):
    """Live and peak bytes of meta-device storages allocated under this mode.

    ``with ledger:`` counts in the current thread only (dispatch modes are thread-local); one
    ledger per simulated rank. :meth:`mark` starts a phase: what is alive then is the phase's
    base (assumed to stay alive through it, so a base tensor freed mid-phase is still counted:
    the peak errs high), and :meth:`peak_since_mark` is the highest total of the allocations
    made since, with those alive at that moment.
    """

    def __init__(self) -> None:
        super().__init__()
        self._base: dict[int, Allocation] = {}
        self._live: dict[int, Allocation] = {}  # made since the mark
        self._live_bytes = 0
        self.value_reads: Counter[str] = Counter()
        self._phase = False
        self._peak = 0
        self._peak_set: list[Allocation] = []

    # -- accounting --------------------------------------------------------------------------
    def _record(self, out) -> None:
        flat, _ = tree_flatten(out)
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.device.type != "meta":
                continue
            st = t.untyped_storage()
            key = st._cdata
            old = self._live.get(key) or self._base.get(key)
            if old is not None and not old.ref.expired():
                continue
            a = Allocation(key, st.nbytes(), call_site(), StorageWeakRef(st))
            self._live[key] = a
            self._live_bytes += a.nbytes
            if self._phase and self._live_bytes > self._peak:
                self._prune()  # only a new peak needs the exact live total
                if self._live_bytes > self._peak:
                    self._peak = self._live_bytes
                    self._peak_set = list(self._live.values())

    def _prune(self) -> None:
        for k in [k for k, a in self._live.items() if a.ref.expired()]:
            self._live_bytes -= self._live.pop(k).nbytes

    def live(self) -> list[Allocation]:
        """Every allocation alive now (base and phase)."""
        self._prune()
        for k in [k for k, a in self._base.items() if a.ref.expired()]:
            del self._base[k]
        return list(self._base.values()) + list(self._live.values())

    def mark(self) -> None:
        """Start a phase: what is alive now becomes the base; the peak restarts at 0."""
        self._base = {a.key: a for a in self.live()}
        self._live, self._live_bytes = {}, 0
        self._phase, self._peak, self._peak_set = True, 0, []

    def peak_since_mark(self) -> tuple[int, dict[str, int]]:
        """``(bytes, {site: bytes})``: the highest total of the allocations made since the
        mark that were alive together, and those allocations by call site."""
        sites: Counter[str] = Counter()
        for a in self._peak_set:
            sites[a.site] += a.nbytes
        return self._peak, dict(sites)

    def retained_since_mark(self) -> tuple[int, dict[str, int]]:
        """``(bytes, {site: bytes})`` of the allocations made since the mark that are still
        alive: what a call left behind (state that grows with the calls made)."""
        self._prune()
        sites: Counter[str] = Counter()
        for a in self._live.values():
            sites[a.site] += a.nbytes
        return self._live_bytes, dict(sites)

    # -- dispatch ----------------------------------------------------------------------------
    def _read(self, what):
        self.value_reads[call_site()] += 1
        return what

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        on_meta = isinstance(x, torch.Tensor) and x.device.type == "meta"
        if func is aten._local_scalar_dense.default and on_meta:
            return self._read(False if x.dtype == torch.bool else 0)
        if func is aten._to_copy.default and on_meta and \
                kwargs.get("device", x.device).type not in ("meta",):
            # a device-to-host copy of values the meta device does not have: zeros
            return self._read(torch.zeros(x.shape, dtype=kwargs.get("dtype") or x.dtype,
                                          device=kwargs["device"]))
        if func is aten.copy_.default and x.device.type != "meta" and \
                isinstance(args[1], torch.Tensor) and args[1].device.type == "meta":
            return self._read(x.zero_())
        out = _worst_case(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        self._record(out)
        return out


def reachable_storages(roots: dict[str, object], modules: tuple[str, ...] = ("ulacache",),
                       stop: tuple[type, ...] = (), skip_attrs: tuple[str, ...] = (),
                       max_depth: int | None = None) -> dict[int, tuple[str, torch.Tensor]]:
    """Every tensor storage reachable from ``roots`` (name -> object): storage key (its
    ``_cdata``, unique on every device, meta included) -> (the attribute path it was first
    reached at, a tensor on it). Followed: lists, tuples, dicts and the attributes (``__dict__``
    and ``__slots__``) of objects whose class lives in one of ``modules``; not followed:
    instances of ``stop``, attributes named in ``skip_attrs``, anything deeper than
    ``max_depth``. Views count once, as their storage (what was allocated, not viewed)."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()

    def walk(obj, path: str, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            found.setdefault(obj.untyped_storage()._cdata, (path, obj))
            return
        if id(obj) in seen or isinstance(obj, stop) or \
                (max_depth is not None and depth > max_depth):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}[{k!r}]", depth + 1)
        elif type(obj).__module__.startswith(modules):
            attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    attrs[name] = getattr(obj, name)
            for name, v in attrs.items():
                if name not in skip_attrs:
                    walk(v, f"{path}.{name}", depth + 1)

    for name, root in roots.items():
        walk(root, name, 0)
    return found
