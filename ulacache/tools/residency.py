"""Residency studies that drive the real core: hit rates and scheduling time of a policy.

:class:`Residency` is a :class:`~ulacache.group.SelectionGroup` with no layers (its pools hold
zero bytes), so a simulation runs exactly the code a serving engine runs (``place``,
``access``, ``begin_round`` of the policy), including every later change to it, and moves no
data. ``bench/pblru_vs_lru.py``, ``ulacache trace stats`` and the tests use it.

Timing: ``step_seconds`` is the group's whole scheduling work per step (round start, placement
of the new tokens, access: resolve, dedup, policy, mapping), ``policy_seconds`` the policy's own
calls inside it (touch, victims, advance), both ``time.perf_counter`` around synchronous CPU
work.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ulacache.group import COUNTERS, SelectionGroup, advance_policies
from ulacache.pblru import DEFAULT_BUCKETS, PBLRUArena, ReplacementPolicy

_TIMED = ("touch", "victims", "advance", "release", "eligible")


@dataclass
class SimResult:
    """Totals of a simulated run (the steps counted after warm-up)."""

    accesses: int = 0  # distinct selected rows
    hits: int = 0
    overflow: int = 0  # selected rows that found no GPU slot
    steps: int = 0
    step_seconds: list[float] = field(default_factory=list)  # per step
    policy_seconds: list[float] = field(default_factory=list)  # per step

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.accesses)


class PolicyClock:
    """Accumulates the wall time of a policy's own calls (instance-level wrappers)."""

    def __init__(self, policy: ReplacementPolicy):
        self.seconds = 0.0
        for name in _TIMED:
            fn = getattr(policy, name)

            def timed(*args, _fn=fn, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(policy, name, timed)


class Residency:
    """GPU-slot residency of ``n_logical`` addresses under one policy, through the real
    :class:`SelectionGroup` (zero layers; ``cpu_slots = n_logical``, so nothing is refused
    for lack of CPU room). ``validate`` is off, as in serving."""

    def __init__(self, policy: str, gpu_slots: int, n_logical: int,
                 n_buckets: int = DEFAULT_BUCKETS,
                 device: torch.device | str = "cpu", bucket_fill: int | None = None,
                 access_path: str = "auto", layers: int = 0, row_bytes: int = 16,
                 shadows: bool = True, cpu_slots: int | None = None):
        if bucket_fill is not None and policy != "pblru":
            raise ValueError("bucket_fill is a PB-LRU setting")
        # PB-LRU lives in a one-policy arena, as a serving address space keeps it (the fused
        # path starts a round in one launch); bucket_fill: another epoch pacing (0: per round)
        self.arena = PBLRUArena(1, gpu_slots, n_buckets, device, bucket_fill) \
            if policy == "pblru" else None
        # layers > 0: real row pools (bench/decode_rows.py times the data movement too)
        # cpu_slots: the CPU tier (default: as many as addresses, a tier that never fills)
        cpu_slots = n_logical if cpu_slots is None else cpu_slots
        self.group = SelectionGroup(list(range(layers)), n_logical, gpu_slots, cpu_slots,
                                    row_bytes, device,
                                    self.arena.policies[0] if self.arena else policy,
                                    n_buckets, validate=False, access_path=access_path,
                                    shadows=shadows)
        self.clock = PolicyClock(self.group.policy)
        self.result = SimResult()

    @property
    def device(self) -> torch.device:
        return self.group.device

    def new_round(self) -> None:
        advance_policies([self.group.policy], self.arena, self.group.fused is not None)

    def place(self, addrs: torch.Tensor, chunk: int | None = None) -> None:
        """Place new addresses (a prefill), one round per ``chunk`` (default: half the GPU
        pool), so each round's rows fit."""
        addrs = addrs.to(self.device, torch.int64).reshape(-1)
        chunk = chunk or max(1, self.group.gpu_slots // 2)
        for i in range(0, addrs.numel(), chunk):
            self.new_round()
            self.group.place(addrs[i: i + chunk])

    def step(self, new: torch.Tensor | None, selected: torch.Tensor, timed: bool = True,
             predicted: torch.Tensor | None = None, budget: int = 0) -> torch.Tensor:
        """One decode round: a new round, the new tokens placed, then the access of
        ``selected`` (``int [bs, k]``, ``-1`` padded; duplicates allowed). Returns the access's
        ``int32 [bs, k]`` GPU rows. ``predicted`` (``int [n]``, rank order): a look-ahead
        prefetch of at most ``budget`` rows between the placement and the access, as
        :class:`ulacache.prefetch.PrefetchEngine` orders it (counted in ``prefetches``)."""
        before = self.group.counters.clone()
        p0 = self.clock.seconds
        t0 = time.perf_counter()
        self.new_round()
        if new is not None and new.numel():
            self.group.place(new.to(self.device, torch.int64).reshape(-1))
        if predicted is not None:  # one stream: the access's dedup table serves it too
            self.group.prefetch(predicted.to(self.device, torch.int64),
                                torch.tensor(budget, dtype=torch.int64, device=self.device))
        rows = self.group.access(selected.to(self.device, torch.int64))
        t1 = time.perf_counter()
        if not timed:
            return rows
        d = dict(zip(COUNTERS, (self.group.counters - before).tolist()))
        r = self.result
        r.steps += 1
        r.accesses += d["accesses"]
        r.hits += d["gpu_hits"]
        r.overflow += d["access_overflow"]
        r.step_seconds.append(t1 - t0)
        r.policy_seconds.append(self.clock.seconds - p0)
        return rows


def simulate_trace(selections: Iterable[torch.Tensor], positions: Iterable[int], policy: str,
                   gpu_slots: int, n_tokens: int, n_buckets: int = DEFAULT_BUCKETS,
                   bucket_fill: int | None = None) -> SimResult:
    """One request decoding a recorded trace: the prompt before the first step is placed,
    then each step places its query token and accesses that step's selections
    (``int [k]``, ``-1`` padded). ``bucket_fill``: see :class:`Residency`."""
    positions = list(positions)
    sim = Residency(policy, gpu_slots, n_tokens, n_buckets, bucket_fill=bucket_fill)
    if positions and positions[0] > 0:
        sim.place(torch.arange(positions[0]))
    for pos, sel in zip(positions, selections):
        sim.step(torch.tensor([pos]), sel.view(1, -1))
    return sim.result
