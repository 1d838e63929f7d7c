"""Hypothesis stateful test: random admit / extend / write / select / free / abort / round
sequences against a plain-Python reference model. After every operation: check_integrity()
and every live address of every layer reads back the bytes last written to it."""

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

from .helpers import assert_same, row_bytes_for, snapshot

RB = 8
OPS = {"count": 0}


class CacheMachine(RuleBasedStateMachine):
    """Reference model: {rid: list of per-position byte versions} plus the reservation ledger."""

    @initialize(cfg=st.fixed_dictionaries({
        "gpu_slots": st.sampled_from([12, 20, 40]),
        "cpu_slots": st.sampled_from([0, 30, 80]),
        "page_size": st.sampled_from([1, 4, 64]),
        "layers_per_group": st.sampled_from([1, 2]),
        "policy": st.sampled_from(["pblru", "lru"]),
        "n_buckets": st.sampled_from([2, 4]),
    }))
    def setup(self, cfg):
        self.cfg = UlaCacheConfig(layout="tiny", row_bytes=RB, n_layers=2, max_requests=4, **cfg)
        self.cache = UlaCache(self.cfg)
        self.model: dict[int, list[int]] = {}  # rid -> version of each position
        self.reserved: dict[int, int] = {}
        self.next_rid = 0
        self.version = 0

    def _bump(self) -> None:
        OPS["count"] += 1

    def _write(self, rid: int, positions: list[int]) -> None:
        self.version += 1
        addrs = self.cache.addresses(rid, torch.tensor(positions, dtype=torch.int64))
        for layer in range(self.cfg.n_layers):
            self.cache.write(addrs, layer, row_bytes_for(addrs, layer, self.version, RB))
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
        if self._expect_unchanged(lambda: out.append(self.cache.access(group, sel)),
                                  CapacityExhausted):
            phys = out[0]
            assert phys.dtype == torch.int32 and phys.shape == sel.shape
            assert torch.equal(phys < 0, sel < 0)
            g = self.cache.groups[group]
            for li, layer in enumerate(g.layers):  # attention would read exactly these bytes
                got = g.pools.gpu[li][phys[sel >= 0].long()]
                vers = {int(a): v for rid in self.model
                        for a, v in zip(self.cache.addresses(rid).tolist(), self.model[rid])}
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
        self.cache.begin_round()

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
                exp = torch.cat([row_bytes_for(addrs[i : i + 1], layer, v, RB)
                                 for i, v in enumerate(versions)])
                assert torch.equal(self.cache.read(addrs, layer), exp), "data lost"


def test_stateful_against_reference_model():
    OPS["count"] = 0
    run_state_machine_as_test(
        CacheMachine,
        settings=settings(max_examples=40, stateful_step_count=80, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )
    assert OPS["count"] >= 2000, f"only {OPS['count']} operations ran"
