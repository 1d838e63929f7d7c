"""Device launches of a decode step, counted on the real core (not modelled).

A GPU runs every aten op of the torch path as one kernel launch, and each fused Triton kernel
as one; a decode step of ulacache is one round start (every group's PB-LRU at once), then per
selection group the placement of the step's new tokens and the sparse access of its top-k,
plus a release per group on steps where a request finishes. :func:`count_launches` runs each
of those once on a small real core and counts them at the dispatcher; the code is fixed-shape,
so the counts do not depend on the sizes (tests hold the fused ones), and a small core keeps
the count fast under Triton's CPU interpreter.

HiSparse's step is read off SGLang 0.5.23's code, not counted here (it needs CUDA):
``HiSparseCoordinator.swap_in_selected_pages`` (``srt/managers/hisparse_coordinator.py``)
launches its swap-in kernel once per layer, and ``_eager_backup_previous_token`` backs the
previous newest token of every request up in one all-layer transfer (plus a few small index
ops that are not counted): :func:`hisparse_step_launches`.
"""

from __future__ import annotations

from functools import cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PATHS = ("fused", "torch")

_NO_KERNEL = ("view", "squeeze", "expand", "slice", "select", "alias", "detach", "as_strided",
              "scalar_tensor", "permute", "transpose", "reshape", "aten.t.", "empty")
_SYNCS = ("nonzero", "_local_scalar_dense", "item")


class OpCounter(TorchDispatchMode):
    """Counts aten ops at the dispatcher: ``ops`` (all of them), ``launches`` (ops other than
    views and scalar wrappers: each a kernel launch on a GPU) and ``syncs`` (ops that need the
    host on a GPU). ``skip_launches``: ops issued inside a fused Triton launch (the
    interpreter's own work on CPU) are not counted; the launch itself is, by the caller."""

    def __init__(self, skip_launches: bool = False):
        super().__init__()
        self.ops = self.launches = self.syncs = 0
        self.skip = skip_launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.skip:
            from ulacache.kernels import fused_access

            if fused_access.in_launch():
                return func(*args, **(kwargs or {}))
        name = str(func)
        self.ops += 1
        if not any(x in name for x in _NO_KERNEL):
            self.launches += 1
        if any(x in name for x in _SYNCS):
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def fused_countable() -> bool:
    """Whether the fused path can be counted here: Triton installed (on CPU its interpreter
    runs the kernels, selected with ``TRITON_INTERPRET=1`` before Triton is imported)."""
    from ulacache.kernels import fused_access

    return fused_access.available() and (torch.cuda.is_available() or fused_access.INTERPRETED)


@cache
def count_launches(path: str, groups: int, k: int = 64, batch: int = 4) -> dict[str, int]:
    """Device launches of ulacache's decode-step control plane on ``path`` (``"fused"`` or
    ``"torch"``): ``round`` (one round start of ``groups`` PB-LRU policies in an arena, as an
    address space holds them), and per group ``place`` (``batch`` new tokens), ``access``
    (``[batch, k]`` selections, with promotions and write-backs), ``release`` (a finished
    request's addresses) and ``prefetch`` (a look-ahead prefetch of ``batch x k``
    predictions, :meth:`SelectionGroup.prefetch`); ``syncs``: host-syncing ops among them.
    Fused: Triton launches plus every aten op outside them; torch: aten ops, views excluded.
    Raises :class:`RuntimeError` for the fused path where :func:`fused_countable` is false."""
    from ulacache.group import advance_policies
    from ulacache.kernels import fused_access
    from ulacache.pblru import PBLRUArena

    from .residency import Residency

    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    fused = path == "fused"
    if fused and not fused_countable():
        raise RuntimeError("counting the fused path needs Triton (pip install 'ulacache[cuda]'; "
                           "on CPU with TRITON_INTERPRET=1 set before Triton is imported)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu_slots = batch * (k + 1)  # one step's selections and new tokens fit, no more
    res = Residency("pblru", gpu_slots, 4 * gpu_slots, 8, device=dev, access_path=path)
    g = res.group
    # a full pool and as many rows spilled: the access promotes and writes back
    res.place(torch.arange(2 * gpu_slots, device=dev), chunk=gpu_slots)
    res.new_round()
    gen = torch.Generator().manual_seed(0)
    sel = torch.randint(0, 2 * gpu_slots, (batch, k), generator=gen).to(dev)
    # The fused round start is one launch whatever the number of policies (its grid has one
    # program per policy), so it is counted over two (the interpreter runs each program);
    # the torch path issues each policy's own ops: counted over all of them.
    arena = PBLRUArena(2 if fused else groups, 64, 8, dev)
    new = torch.arange(2 * gpu_slots, 2 * gpu_slots + batch, device=dev)
    predicted = torch.randint(0, 2 * gpu_slots, (batch * k,), generator=gen).to(dev)
    budget = torch.tensor(gpu_slots, dtype=torch.int64, device=dev)
    calls = {
        "round": lambda: advance_policies(arena.policies, arena, fused),
        "place": lambda: g.place(new),
        "access": lambda: g.access(sel),
        "release": lambda: g.release(new),
        # a look-ahead prefetch of predicted rows, some of them on the CPU (after the access)
        "prefetch": lambda: g.prefetch(predicted, budget),
    }
    out, syncs = {}, 0
    for name, call in calls.items():
        before = fused_access.launch_count()
        with OpCounter(skip_launches=fused) as oc:
            call()
        out[name] = oc.launches + (fused_access.launch_count() - before if fused else 0)
        syncs += oc.syncs
    out["syncs"] = syncs
    return out


def step_launches(counts: dict[str, int], groups: int, finished: bool = False) -> int:
    """Launches of one ulacache decode step from :func:`count_launches` ``counts``: a round
    start, placement + access per group, a release per group when a request finished."""
    per_group = counts["place"] + counts["access"] + (counts["release"] if finished else 0)
    return counts["round"] + groups * per_group


def hisparse_step_launches(layers: int) -> int:
    """SGLang 0.5.23 HiSparse's kernel launches per decode step, from its code (see the module
    docstring): one swap-in per layer and one all-layer backup."""
    return layers + 1
