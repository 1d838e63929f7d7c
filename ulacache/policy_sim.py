"""Residency-only cache simulation: hit rates and scheduling time of a replacement policy.

Used by ``bench/pblru_vs_lru.py``, ``ulacache trace stats`` and ``ulacache replay`` to compare
PB-LRU with exact LRU on the same selection stream. It drives the real policy objects of
:mod:`ulacache.pblru` with the core's per-step protocol (touch hits, choose victims excluding
the current round, touch promoted, advance once per step) but moves no row data.

A step whose distinct misses outnumber the eligible victims leaves the excess uncached
(counted as ``bypass``): in a serving engine those rows would be read in place from the CPU
tier; the core itself refuses such a step (``CapacityExhausted``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .pblru import make_policy
from .pools import resolve_device


@dataclass
class SimResult:
    """Totals of one simulated run. ``policy_seconds`` times only the policy's own work
    (touch, victim choice, advance): the residency bookkeeping is identical across policies."""

    accesses: int = 0
    hits: int = 0
    promotions: int = 0
    bypass: int = 0
    steps: int = 0
    policy_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.accesses)


class ResidencySim:
    """GPU-slot residency of a growing address space under one policy.

    ``slot_of int64 [A]`` maps address -> GPU slot (-1 = not resident); ``owner int64 [G + 1]``
    the reverse. Both grow on demand.
    """

    def __init__(self, policy: str, n_slots: int, n_buckets: int = 64,
                 device: torch.device | str = "cpu"):
        self.device = resolve_device(device)
        self.n_slots = n_slots
        self.policy = make_policy(policy, n_slots, n_buckets, self.device)
        self.slot_of = torch.full((1025,), -1, dtype=torch.int64, device=self.device)
        self.owner = torch.full((n_slots + 1,), -1, dtype=torch.int64, device=self.device)
        self.result = SimResult()

    @property
    def _scratch(self) -> int:  # last entry of slot_of absorbs masked writes
        return self.slot_of.numel() - 1

    def _grow(self, max_addr: int) -> None:
        if max_addr >= self._scratch:
            cap = max(max_addr + 1, 2 * self._scratch)
            grown = torch.full((cap + 1,), -1, dtype=torch.int64, device=self.device)
            grown[: self._scratch] = self.slot_of[: self._scratch]
            self.slot_of = grown

    def preload(self, addrs: torch.Tensor) -> None:
        """Fill slots ``0..n-1`` with ``addrs`` (distinct) as a finished prefill would, then age
        them past every recent bucket so the run starts under full replacement pressure."""
        n = addrs.numel()
        if n > self.n_slots:
            raise ValueError(f"preload of {n} addresses into {self.n_slots} slots")
        self._grow(int(addrs.max()))
        slots = torch.arange(n, device=self.device)
        self.slot_of[addrs.to(self.device)] = slots
        self.owner[:n] = addrs.to(self.device)
        self.policy.touch(slots)
        for _ in range(getattr(self.policy, "n_buckets", 1) + 1):
            self.policy.advance()

    def step(self, addrs: torch.Tensor, timed: bool = True) -> None:
        """One scheduling round selecting ``addrs`` (``int64 [n]``, distinct, ``>= 0``)."""
        addrs = addrs.to(self.device, torch.int64)
        if addrs.numel():
            self._grow(int(addrs.max()))
        n = addrs.numel()
        slot = self.slot_of[addrs]
        hit = slot >= 0
        miss = ~hit
        n_miss = int(miss.sum())  # host-known here (no graph): both policies pick exactly that
        t0 = time.perf_counter()
        self.policy.touch(torch.where(hit, slot, -1))
        cand = self.policy.victims(max(1, n_miss))
        t1 = time.perf_counter()
        rank = torch.cumsum(miss, 0) - 1
        victim = torch.where(miss, cand[rank.clamp(min=0, max=cand.numel() - 1)], -1)
        ok = victim >= 0
        old = self.owner[torch.where(ok, victim, self.n_slots)]
        evicted = torch.where(ok & (old >= 0), old, self._scratch)
        self.slot_of.index_put_((evicted,), torch.full_like(evicted, -1))
        self.slot_of.index_put_((addrs,), torch.where(ok, victim, slot))
        self.owner.index_put_((torch.where(ok, victim, self.n_slots),),
                              torch.where(ok, addrs, -1))
        t2 = time.perf_counter()
        self.policy.touch(victim)
        self.policy.advance()
        t3 = time.perf_counter()
        r = self.result
        if timed:
            dt = (t1 - t0) + (t3 - t2)
            r.policy_seconds += dt
            r.step_seconds.append(dt)
            r.steps += 1
            r.accesses += n
            r.hits += int(hit.sum())
            r.promotions += int(ok.sum())
            r.bypass += int((miss & ~ok).sum())


def simulate(policy: str, n_slots: int, steps: Iterable[torch.Tensor], n_buckets: int = 64,
             warmup: int = 0) -> SimResult:
    """Run a selection stream; each step is ``int64 [n]`` addresses (duplicates are removed).
    The first ``warmup`` steps fill the pool and are not counted."""
    sim = ResidencySim(policy, n_slots, n_buckets)
    for i, s in enumerate(steps):
        sim.step(torch.unique(s[s >= 0]), timed=i >= warmup)
    return sim.result


def simulate_hit_rate(policy_name: str, n_slots: int, steps: Iterable[torch.Tensor],
                      n_buckets: int = 64) -> float:
    """Hits / accesses of ``policy_name`` (``"pblru"`` or ``"lru"``) with ``n_slots`` GPU slots."""
    return simulate(policy_name, n_slots, steps, n_buckets).hit_rate
