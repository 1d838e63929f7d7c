"""Hypothesis state machines against plain-Python reference models.

``LedgerMachine`` (validate on): random admit / extend / write / select / free / abort / round
sequences through :class:`UlaCache`; bad calls must raise with the state unchanged.

``ProductionMachine`` (validate off, as under SGLang): random place / write / access / release
/ round sequences straight on an :class:`AddressSpace` with tiny pools (no CPU tier included),
hostile entries mixed in (duplicates, out-of-range and negative addresses, already-mapped or
dead ones). Nothing may raise; the model predicts, from the residency it observes, exactly how
many rows overflow and how many entries are invalid, and checks the counters against it.

After every operation of both: ``check_integrity()``, and every live address of every layer
reads back the bytes last written to it; rows lost to overflow are unmapped, never wrong.
Examples are derandomized in CI (tests/conftest.py), so every run explores the same cases.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ulacache.cache import UlaCache
from ulacache.config import UlaCacheConfig
from ulacache.errors import CapacityExhausted, DoubleFreeError, UnknownRequest
from ulacache.space import AddressSpace

from .helpers import assert_same, row_bytes_for, snapshot

RB = 8
OPS = {"ledger": 0, "production": 0}


class LedgerMachine(RuleBasedStateMachine):
    """Reference model: {rid: list of per-position byte versions} plus the reservation ledger."""

    @initialize(cfg=st.fixed_dictionaries({
        "gpu_slots": st.sampled_from([12, 20, 40]),
        "cpu_slots": st.sampled_from([0, 30, 80]),
        "page_size": st.sampled_from([1, 4, 64]),
        "layers_per_group": st.sampled_from([1, 2]),
        "policy": st.sampled_from(["pblru", "lru"]),
        "n_buckets": st.sampled_from([2, 4]),
        "shadows": st.booleans(),
    }))
    def setup(self, cfg):
        self.cfg = UlaCacheConfig(layout="tiny", row_bytes=RB, n_layers=2, max_requests=4, **cfg)
        self.cache = UlaCache(self.cfg)
        self.space = self.cache.space
        self.model: dict[int, list[int]] = {}  # rid -> version of each position
        self.reserved: dict[int, int] = {}
        self.next_rid = 0
        self.version = 0

    def _bump(self) -> None:
        OPS["ledger"] += 1

    def _write(self, rid: int, positions: list[int]) -> None:
        self.version += 1
        addrs = self.cache.addresses(rid, torch.tensor(positions, dtype=torch.int64))
        for layer in range(self.cfg.n_layers):
            self.space.write(layer, addrs, row_bytes_for(addrs, layer, self.version, RB))
        for p in positions:
            self.model[rid][p] = self.version

    def _expect_unchanged(self, call, exc) -> bool:
        before = snapshot(self.cache)
        try:
            call()
        except exc:
            assert_same(before, snapshot(self.cache))
            return False
        return True

    @rule(tokens=st.integers(0, 60))
    def admit(self, tokens):
        self._bump()
        rid = self.next_rid
        fits = (sum(self.reserved.values()) + tokens <= self.cfg.unique_capacity
                and len(self.model) < self.cfg.max_requests)
        ok = self._expect_unchanged(lambda: self.cache.admit(rid, tokens), CapacityExhausted)
        assert ok == fits
        if ok:
            self.next_rid += 1
            self.model[rid] = []
            self.reserved[rid] = tokens

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 16))
    def extend(self, data, n):
        self._bump()
        rid = data.draw(st.sampled_from(sorted(self.model)))
        ok = self._expect_unchanged(lambda: self.cache.extend(rid, n), CapacityExhausted)
        if ok:
            start = len(self.model[rid])
            self.model[rid] += [0] * n
            self.reserved[rid] = max(self.reserved[rid], len(self.model[rid]))
            self._write(rid, list(range(start, start + n)))

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def overwrite(self, data):
        self._bump()
        rid = data.draw(st.sampled_from([r for r, v in self.model.items() if v]))
        pos = data.draw(st.lists(st.integers(0, len(self.model[rid]) - 1), min_size=1,
                                 max_size=6, unique=True))
        self._write(rid, pos)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def select(self, data):
        """One step's sparse access for a batch of requests (-1 padding, duplicates allowed)."""
        self._bump()
        rids = data.draw(st.lists(st.sampled_from([r for r, v in self.model.items() if v]),
                                  min_size=1, max_size=3))
        k = data.draw(st.integers(1, 6))
        group = data.draw(st.integers(0, self.cfg.n_groups - 1))
        rows = []
        for rid in rids:
            pos = data.draw(st.lists(st.integers(-1, len(self.model[rid]) - 1), min_size=k,
                                     max_size=k))
            rows.append(self.cache.addresses(rid, torch.tensor(pos, dtype=torch.int64)))
        sel = torch.stack(rows)
        out = []
        if self._expect_unchanged(lambda: out.append(self.space.access(group, sel)),
                                  CapacityExhausted):
            phys = out[0]
            assert phys.dtype == torch.int32 and phys.shape == sel.shape
            assert torch.equal(phys < 0, sel < 0)
            g = self.space.groups[group]
            vers = {int(a): v for rid in self.model
                    for a, v in zip(self.cache.addresses(rid).tolist(), self.model[rid])}
            for li, layer in enumerate(g.layers):  # attention would read exactly these bytes
                got = g.pools.gpu[li][phys[sel >= 0].long()]
                exp = torch.cat([row_bytes_for(torch.tensor([a]), layer, vers[a], RB)
                                 for a in sel[sel >= 0].tolist()]) if got.numel() else got
                assert torch.equal(got, exp)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), abort=st.booleans())
    def finish(self, data, abort):
        self._bump()
        rid = data.draw(st.sampled_from(sorted(self.model)))
        (self.cache.abort if abort else self.cache.free)(rid)
        del self.model[rid], self.reserved[rid]
        before = snapshot(self.cache)
        for bad in (lambda: self.cache.free(rid), lambda: self.cache.extend(rid, 1)):
            try:
                bad()
                raise AssertionError("freeing twice must fail")
            except (DoubleFreeError, UnknownRequest):
                pass
        assert_same(before, snapshot(self.cache))

    @rule()
    def new_round(self):
        self._bump()
        self.space.begin_round()

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        for rid, versions in self.model.items():
            if not versions:
                continue
            addrs = self.cache.addresses(rid)
            for layer in range(self.cfg.n_layers):
                exp = torch.cat([row_bytes_for(addrs[i: i + 1], layer, v, RB)
                                 for i, v in enumerate(versions)])
                assert torch.equal(self.space.read(layer, addrs), exp), "data lost"


N_LOGICAL = 24
# entries a hostile caller might send besides live/dead addresses
HOSTILE = st.sampled_from([-1, -1, -2, -7, N_LOGICAL, N_LOGICAL + 3, 2**40])


class ProductionMachine(RuleBasedStateMachine):
    """Validate off, tiny pools. Model: ``version[a]`` for live addresses (placed and stored),
    the set of addresses touched this round, and the expected counters."""

    @initialize(cfg=st.fixed_dictionaries({
        "gpu_slots": st.sampled_from([1, 2, 3, 5]),
        "cpu_slots": st.sampled_from([0, 1, 3, 8]),
        "layers_per_group": st.sampled_from([1, 2]),
        "policy": st.sampled_from(["pblru", "lru"]),
        "n_buckets": st.sampled_from([2, 3]),
        "shadows": st.booleans(),
    }))
    def setup(self, cfg):
        self.cfg = UlaCacheConfig(layout="tiny", row_bytes=RB, n_layers=2, page_size=1,
                                  validate=False, **cfg)
        self.space = AddressSpace(self.cfg, n_logical=N_LOGICAL)
        self.G, self.C = self.cfg.gpu_slots, self.cfg.cpu_slots
        self.version: dict[int, int] = {}
        self.touched = [set() for _ in self.space.groups]  # GPU-resident rows used this round
        self.expect = [dict.fromkeys(("place_overflow", "access_overflow", "invalid",
                                      "placed"), 0) for _ in self.space.groups]
        self.v = 0

    def _bump(self) -> None:
        OPS["production"] += 1

    def _tier(self, gi: int, a: int) -> str:
        loc = int(self.space.groups[gi].loc[a])
        return "none" if loc < 0 else "gpu" if loc < self.G else "cpu"

    def _entries(self, data, n_max: int) -> list[int]:
        live = sorted(self.version)
        pick = st.one_of(st.integers(0, N_LOGICAL - 1), HOSTILE,
                         *([st.sampled_from(live)] if live else []))
        return data.draw(st.lists(pick, min_size=1, max_size=n_max))

    @rule(data=st.data())
    def place(self, data):
        self._bump()
        entries = self._entries(data, 6)
        fresh, seen = [], set()
        for a in entries:
            if 0 <= a < N_LOGICAL and a not in self.version and a not in seen:
                fresh.append(a)
            seen.add(a)
        invalid = sum(1 for i, a in enumerate(entries)
                      if a != -1 and not (a in fresh and entries.index(a) == i))
        stored_by_group = []
        for gi in range(len(self.space.groups)):
            gpu = {a for a in self.version if self._tier(gi, a) == "gpu"}
            free = self.G - len(gpu)
            eligible = self.G - len(gpu & self.touched[gi])
            cpu_free = self.C - sum(1 for a in self.version if self._tier(gi, a) == "cpu")
            stored_by_group.append(min(len(fresh), free + min(eligible - free, cpu_free)))
        slots = self.space.place(torch.tensor(entries))
        stored = [a for a in fresh if self._tier(0, a) == "gpu"]
        assert len(stored) == stored_by_group[0], "placement overflowed when room was left"
        assert sorted(int(s) for s in slots if s >= 0) == sorted(
            int(self.space.groups[0].loc[a]) for a in stored)
        for gi, n_stored in enumerate(stored_by_group):
            got = [a for a in fresh if self._tier(gi, a) == "gpu"]
            assert len(got) == n_stored
            e = self.expect[gi]
            e["placed"] += n_stored
            e["place_overflow"] += len(fresh) - n_stored
            e["invalid"] += invalid
        # a row is live only if every group stored it; drop it where it got in (the engine's
        # view: that token's KV is missing)
        everywhere = [a for a in fresh
                      if all(self._tier(gi, a) == "gpu" for gi in range(len(self.space.groups)))]
        partial = [a for a in fresh if a not in everywhere and any(
            self._tier(gi, a) != "none" for gi in range(len(self.space.groups)))]
        if partial:
            self.space.release(torch.tensor(partial))
        for a in everywhere:
            for gi in range(len(self.space.groups)):
                self.touched[gi].add(a)
        if everywhere:
            self._write(everywhere)

    def _write(self, addrs: list[int]) -> None:
        self.v += 1
        t = torch.tensor(addrs)
        for layer in range(self.cfg.n_layers):
            self.space.write(layer, t, row_bytes_for(t, layer, self.v, RB))
        for a in addrs:
            self.version[a] = self.v

    @precondition(lambda self: self.version)
    @rule(data=st.data())
    def overwrite(self, data):
        self._bump()
        addrs = data.draw(st.lists(st.sampled_from(sorted(self.version)), min_size=1,
                                   max_size=4, unique=True))
        self._write(addrs)

    @rule(data=st.data())
    def access(self, data):
        self._bump()
        gi = data.draw(st.integers(0, len(self.space.groups) - 1))
        bs = data.draw(st.integers(1, 3))
        k = data.draw(st.integers(1, 4))
        sel = torch.tensor([(self._entries(data, k) + [-1] * k)[:k] for _ in range(bs)])
        flat = sel.reshape(-1).tolist()
        valid = [a for a in flat if a in self.version]
        distinct = list(dict.fromkeys(valid))
        hits = [a for a in distinct if self._tier(gi, a) == "gpu"]
        misses = [a for a in distinct if self._tier(gi, a) == "cpu"]
        pinned = self.touched[gi] | set(hits)
        gpu = {a for a in self.version if self._tier(gi, a) == "gpu"}
        room = self.G - len(gpu & pinned)
        overflow = max(0, len(misses) - room)
        e = self.expect[gi]
        e["invalid"] += sum(1 for a in flat if a != -1 and a not in self.version)
        e["access_overflow"] += overflow
        rows = self.space.access(gi, sel)
        assert rows.dtype == torch.int32 and rows.shape == sel.shape
        g = self.space.groups[gi]
        served = set()
        for a, r in zip(flat, rows.reshape(-1).tolist()):
            if a not in self.version:
                assert r == -1, "padding or an invalid entry was given a row"
                continue
            if r == -1:
                continue
            served.add(a)
            for li, layer in enumerate(g.layers):
                exp = row_bytes_for(torch.tensor([a]), layer, self.version[a], RB)[0]
                assert torch.equal(g.pools.gpu[li, r], exp), "attention would read wrong bytes"
        assert len(distinct) - len(served) == overflow, "overflow count disagrees with room"
        self.touched[gi] |= served

    @rule(data=st.data())
    def release(self, data):
        self._bump()
        entries = self._entries(data, 6)
        seen = set()
        for a in entries:
            if a != -1 and (not 0 <= a < N_LOGICAL or a in seen):
                for e in self.expect:
                    e["invalid"] += 1
            seen.add(a)
        self.space.release(torch.tensor(entries))
        for a in set(entries):
            self.version.pop(a, None)
            for t in self.touched:
                t.discard(a)

    @rule()
    def new_round(self):
        self._bump()
        self.space.begin_round()
        for t in self.touched:
            t.clear()

    @invariant()
    def consistent(self):
        if not hasattr(self, "space"):
            return
        live = torch.zeros(N_LOGICAL, dtype=torch.bool)
        live[list(self.version)] = True
        self.space.check_integrity(live)
        for g, e in zip(self.space.groups, self.expect):
            got = g.counter_values()
            assert {k: got[k] for k in e} == e, (got, e)
            assert bool((g.loc[:N_LOGICAL][live] >= 0).all()), "live row lost"
        if self.version:
            addrs = torch.tensor(sorted(self.version))
            for layer in range(self.cfg.n_layers):
                exp = torch.cat([row_bytes_for(addrs[i: i + 1], layer, self.version[a], RB)
                                 for i, a in enumerate(addrs.tolist())])
                assert torch.equal(self.space.read(layer, addrs), exp), "data lost"


def _run(machine, examples: int, steps: int) -> None:
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=list(HealthCheck)))


def test_ledger_machine_against_reference_model():
    OPS["ledger"] = 0
    _run(LedgerMachine, 40, 80)
    assert OPS["ledger"] >= 2000, f"only {OPS['ledger']} operations ran"


def test_production_machine_never_corrupts():
    OPS["production"] = 0
    _run(ProductionMachine, 70, 100)
    assert OPS["production"] >= 5000, f"only {OPS['production']} operations ran"
