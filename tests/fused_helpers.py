"""Twin groups for the fused-path tests: one on the torch reference path, one on the fused
Triton path (CPU tensors run under Triton's interpreter), driven by the same operations and
compared table by table, counter by counter and byte by byte after every one."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ulacache.group import SelectionGroup, advance_policies
from ulacache.kernels import fused_access
from ulacache.kernels.fused_access import equivalence_state as state
from ulacache.pblru import PBLRUArena

__all__ = ["make_twins", "state", "assert_same", "TwinDriver", "DeviceOps"]


def make_twins(n_layers: int = 2, n_logical: int = 400, gpu_slots: int = 64,
               cpu_slots: int = 400, row_bytes: int = 16, n_buckets: int = 4,
               validate: bool = False, device: str = "cpu", hyper: int = 64, **kw
               ) -> tuple[SelectionGroup, SelectionGroup]:
    """(reference, fused) groups with identical geometry and identical (zeroed) pools.
    ``hyper``: superblocks per PB-LRU hyper block (small values make small pools exercise
    every level of the fused victim search)."""
    # each policy in its own one-policy arena, as an address space holds them: the fused
    # twin starts rounds with the fused advance (TwinDriver.advance)
    twins = tuple(SelectionGroup(list(range(n_layers)), n_logical, gpu_slots, cpu_slots,
                                 row_bytes, device,
                                 PBLRUArena(1, gpu_slots, n_buckets, device,
                                            hyper=hyper).policies[0],
                                 n_buckets, validate, access_path=path, **kw)
                  for path in ("torch", "fused"))
    assert twins[0].fused is None and twins[1].fused is not None
    return twins


def assert_same(ref: SelectionGroup, fused: SelectionGroup, what: str = "") -> None:
    a, b = state(ref), state(fused)
    for name in a:
        x, y = a[name].cpu(), b[name].cpu()
        assert torch.equal(x, y), f"{what}: {name} differs between the torch and fused paths"


class TwinDriver:
    """Random operations on both twins (seeded: every run draws the same sequence)."""

    def __init__(self, ref: SelectionGroup, fused: SelectionGroup, seed: int):
        self.ref, self.fused = ref, fused
        self.gen = torch.Generator().manual_seed(seed)
        self.live: set[int] = set()
        self.serial = 0

    def _rand(self, hi: int, n: int) -> torch.Tensor:
        return torch.randint(0, hi, (n,), generator=self.gen)

    def both(self, fn, *args) -> tuple:
        """Call ``fn(group, *args)`` on each twin; results and state must agree."""
        self.serial += 1
        r = fn(self.ref, *args)
        f = fn(self.fused, *args)
        if isinstance(r, torch.Tensor):
            assert torch.equal(r.cpu(), f.cpu()), f"op {self.serial}: results differ"
        assert_same(self.ref, self.fused, f"op {self.serial} {getattr(fn, '__name__', fn)}")
        return r, f

    def place(self, n: int, hostile: bool) -> torch.Tensor:
        N = self.ref.n_logical
        addrs = self._rand(N, n)
        if hostile:  # duplicates, -1 padding, out of range, already-live addresses
            k = max(1, n // 4)
            addrs[self._rand(n, k)] = addrs[self._rand(n, k)]
            addrs[self._rand(n, k)] = -1
            addrs[self._rand(n, 1)] = N + 3
        else:
            addrs = torch.tensor(sorted(set(addrs.tolist()) - self.live), dtype=torch.int64)
        slots, _ = self.both(lambda g, a: g.place(a), addrs)
        self._write(addrs, slots)
        return addrs

    def _write(self, addrs: torch.Tensor, slots: torch.Tensor) -> None:
        """Fill the rows of the addresses just placed with fresh random bytes (both twins)."""
        new = addrs[slots >= 0]
        self.live.update(new.tolist())
        if new.numel() == 0:
            return
        rb = self.ref.pools.row_bytes
        for layer in self.ref.layers:
            rows = torch.randint(0, 256, (new.numel(), rb), dtype=torch.uint8, generator=self.gen)
            for g in (self.ref, self.fused):
                g.write(layer, new.to(g.device), rows)

    def access(self, bs: int, k: int, hostile: bool, dtype=torch.int64) -> None:
        live = torch.tensor(sorted(self.live), dtype=torch.int64)
        if live.numel() == 0:
            addrs = torch.full((bs, k), -1, dtype=torch.int64)
        else:
            addrs = live[self._rand(live.numel(), bs * k)].view(bs, k)
        if bs > 1:
            addrs[self._rand(bs, 1), :] = -1  # an empty row
        pad = self._rand(2, bs * k).view(bs, k).bool() & (self._rand(4, bs * k).view(bs, k) == 0)
        addrs[pad] = -1
        if hostile:
            N = self.ref.n_logical
            addrs.view(-1)[self._rand(bs * k, 2)] = torch.tensor([N + 1, -5])
            dead = sorted(set(range(N)) - self.live)
            if dead:
                addrs.view(-1)[self._rand(bs * k, 1)] = dead[0]
        self.both(lambda g, a: g.access(a.to(dtype).to(g.device)), addrs)

    def prefetch(self, n: int, cap: int) -> None:
        """A prefetch of ``n`` predictions (live addresses, a few dead, out-of-range and
        padding entries, duplicates) with a fetch cap of ``cap``: both twins promote the
        same rows and leave the same budget."""
        live = torch.tensor(sorted(self.live), dtype=torch.int64)
        N = self.ref.n_logical
        addrs = self._rand(N + 8, n) - 4
        if live.numel():
            pick = self._rand(4, n) != 0
            addrs[pick] = live[self._rand(live.numel(), int(pick.sum()))]

        def run(g, a):
            budget = torch.tensor(cap, dtype=torch.int64, device=g.device)
            g.prefetch(a.to(g.device), budget)
            return budget

        self.both(run, addrs)

    def release(self, n: int, hostile: bool) -> None:
        live = sorted(self.live)
        if not live:
            return
        pick = torch.tensor(live, dtype=torch.int64)[self._rand(len(live), n)].unique()
        if hostile:  # padding, out of range, a duplicate, a dead address
            dead = sorted(set(range(self.ref.n_logical)) - self.live)[:1]
            pick = torch.cat([pick, torch.tensor([-1, self.ref.n_logical + 2, *dead]),
                              pick[self._rand(pick.numel(), 1)]])
            pick = pick[torch.randperm(pick.numel(), generator=self.gen)]
        self.both(lambda g, a: g.release(a.to(g.device)), pick)
        self.live -= set(pick.tolist())

    def advance(self) -> None:
        """A round start: the reference advances in torch, the fused twin in one launch."""
        self.both(lambda g: advance_policies([g.policy], g.policy.arena, g.fused is not None))


class DeviceOps(TorchDispatchMode):
    """Counts aten ops issued outside the fused launches (views and allocations are metadata,
    not device work; the interpreter's own ops inside a launch belong to the launch)."""

    FREE = ("view", "_reshape_alias", "reshape", "alias", "empty", "detach", "as_strided",
            "_unsafe_view", "slice")

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not fused_access.in_launch() and name not in self.FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))
