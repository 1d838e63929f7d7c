"""The public boundary under hostile input: :class:`AddressSpace` (``place``, ``release``,
``access``, ``translate``, ``write``, ``read``, ``group``, ``group_of``, ``begin_round``) and
:class:`UlaCache` (``admit``, ``extend``, ``extend_batch``, ``addresses``, ``free``).

With ``validate`` on, every bad argument raises a typed :class:`UlaCacheError` that names the
argument, and the full state (mapping, reverse maps, pools, CPU free stack, policy bitmaps,
counters, ledger) is exactly what it was. With ``validate`` off (production), type and shape
errors still raise (metadata checks need no sync), while bad values (addresses out of range,
negative other than -1, not live, duplicated, already mapped) are masked: no exception, every
invariant holds, no live row is lost, and ``counters["invalid"]`` counts exactly the masked
entries. Capacity overflow (placement and access) is masked, counted and warned about once per
occurrence.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ulacache.cache import UlaCache
from ulacache.config import UlaCacheConfig
from ulacache.errors import (
    AddressError,
    CapacityExhausted,
    DoubleFreeError,
    ShapeError,
    UlaCacheError,
    UnknownRequest,
)
from ulacache.metrics import prometheus_text
from ulacache.space import AddressSpace

from .helpers import assert_same, fill, row_bytes_for, snapshot

RB = 16
N = 64  # logical addresses of the spaces built here
G, C = 8, 32
BASE = dict(layout="tiny", n_layers=2, layers_per_group=1, gpu_slots=G, cpu_slots=C, page_size=1,
            n_buckets=4)
t = torch.tensor


def make_space(validate: bool, **kw) -> AddressSpace:
    return AddressSpace(UlaCacheConfig(**{**BASE, "validate": validate, **kw}), n_logical=N)


def populated(validate: bool) -> tuple[AddressSpace, torch.Tensor]:
    """A space with rows on both tiers: 0..7 placed in round 1, 8..11 in round 2 (spilling four
    of the first ones to the CPU), every row written; a fresh round started."""
    s = make_space(validate)
    first = torch.arange(8)
    s.place(first)
    fill(s, first)
    s.begin_round()
    second = torch.arange(8, 12)
    s.place(second)
    fill(s, second)
    s.begin_round()
    live = torch.arange(12)
    for g in s.groups:
        loc = g.loc[live]
        assert int((loc >= G).sum()) == 4 and int(((loc >= 0) & (loc < G)).sum()) == 8
    return s, live


def on_cpu(s: AddressSpace, live: torch.Tensor, group: int = 0) -> list[int]:
    return [int(a) for a in live if int(s.groups[group].loc[a]) >= G]


def on_gpu(s: AddressSpace, live: torch.Tensor, group: int = 0) -> list[int]:
    return [int(a) for a in live if 0 <= int(s.groups[group].loc[a]) < G]


def assert_rows(s: AddressSpace, live: torch.Tensor) -> None:
    """Every live address reads back the row it was written with, in every layer."""
    for layer in range(s.config.n_layers):
        assert torch.equal(s.read(layer, live), row_bytes_for(live, layer, 0, RB)), layer


def invalid(s: AddressSpace) -> list[int]:
    return [g.counter_values()["invalid"] for g in s.groups]


def overflow_warnings(caplog, kind: str) -> list[logging.LogRecord]:
    text = {"access": "could not be made GPU-resident", "place": "were not stored",
            "invalid": "invalid address(es) were masked"}[kind]
    return [r for r in caplog.records if r.name == "ulacache" and r.levelno == logging.WARNING
            and text in r.getMessage()]


# -- AddressSpace: type and shape errors (raise in both modes, nothing changes) -----------------
def _rows(n: int, **kw) -> torch.Tensor:
    return torch.zeros(n, RB, dtype=torch.uint8, **kw)


def _sel(s: AddressSpace, live: torch.Tensor) -> torch.Tensor:
    """A selection holding a CPU-resident row: an access that got past its checks would promote
    it (mapping, pools, policy and counters would change)."""
    return t([[on_gpu(s, live)[0], on_cpu(s, live)[0]]])


SHAPE_CASES = [
    # place: integer tensors only (floats and bools are not truncated into addresses)
    ("place-float", lambda s, a: s.place(t([20.0])), "addrs"),
    ("place-float-integral", lambda s, a: s.place(t([20.0, 21.0], dtype=torch.float64)), "addrs"),
    ("place-bool", lambda s, a: s.place(t([True, False])), "addrs"),
    ("place-uint8", lambda s, a: s.place(t([20], dtype=torch.uint8)), "addrs"),
    ("place-int8", lambda s, a: s.place(t([20], dtype=torch.int8)), "addrs"),
    ("place-int16", lambda s, a: s.place(t([20], dtype=torch.int16)), "addrs"),
    ("place-complex", lambda s, a: s.place(t([20 + 0j])), "addrs"),
    ("place-list", lambda s, a: s.place([20, 21]), "addrs"),
    ("place-int", lambda s, a: s.place(20), "addrs"),
    ("place-None", lambda s, a: s.place(None), "addrs"),
    # release
    ("release-float", lambda s, a: s.release(a[:2].double()), "addrs"),
    ("release-bool", lambda s, a: s.release(t([True])), "addrs"),
    ("release-uint8", lambda s, a: s.release(a[:2].to(torch.uint8)), "addrs"),
    ("release-complex", lambda s, a: s.release(a[:2].to(torch.complex64)), "addrs"),
    ("release-list", lambda s, a: s.release(a[:2].tolist()), "addrs"),
    ("release-int", lambda s, a: s.release(0), "addrs"),
    # access: int32/int64 [bs, k]
    ("access-float", lambda s, a: s.access(0, _sel(s, a).float()), "addrs"),
    ("access-bool", lambda s, a: s.access(0, _sel(s, a).bool()), "addrs"),
    ("access-uint8", lambda s, a: s.access(0, _sel(s, a).to(torch.uint8)), "addrs"),
    ("access-complex", lambda s, a: s.access(0, _sel(s, a).to(torch.complex64)), "addrs"),
    ("access-list", lambda s, a: s.access(0, _sel(s, a).tolist()), "addrs"),
    ("access-1d", lambda s, a: s.access(0, _sel(s, a).view(-1)), "addrs"),
    ("access-0d", lambda s, a: s.access(0, t(on_cpu(s, a)[0])), "addrs"),
    ("access-3d", lambda s, a: s.access(0, _sel(s, a).view(1, 1, 2)), "addrs"),
    # access: out must match exactly (checked before anything moves)
    ("out-narrow", lambda s, a: s.access(0, _sel(s, a), out=torch.empty(1, 1, dtype=torch.int32)),
     "out"),
    ("out-larger", lambda s, a: s.access(0, _sel(s, a), out=torch.empty(2, 2, dtype=torch.int32)),
     "out"),
    ("out-wider", lambda s, a: s.access(0, _sel(s, a), out=torch.empty(1, 3, dtype=torch.int32)),
     "out"),
    ("out-transposed", lambda s, a: s.access(0, _sel(s, a), out=torch.empty(2, 1,
                                                                             dtype=torch.int32)),
     "out"),
    ("out-flat", lambda s, a: s.access(0, _sel(s, a), out=torch.empty(2, dtype=torch.int32)),
     "out"),
    ("out-int64", lambda s, a: s.access(0, _sel(s, a), out=torch.empty(1, 2, dtype=torch.int64)),
     "out"),
    ("out-int16", lambda s, a: s.access(0, _sel(s, a), out=torch.empty(1, 2, dtype=torch.int16)),
     "out"),
    ("out-float", lambda s, a: s.access(0, _sel(s, a), out=torch.empty(1, 2)), "out"),
    ("out-list", lambda s, a: s.access(0, _sel(s, a), out=[[0, 0]]), "out"),
    # group indices: [0, len) integers only (no negative indexing, no bool / float / str)
    ("access-group-neg", lambda s, a: s.access(-1, _sel(s, a)), "group"),
    ("access-group-len", lambda s, a: s.access(2, _sel(s, a)), "group"),
    ("access-group-true", lambda s, a: s.access(True, _sel(s, a)), "group"),
    ("access-group-false", lambda s, a: s.access(False, _sel(s, a)), "group"),
    ("access-group-float", lambda s, a: s.access(1.0, _sel(s, a)), "group"),
    ("access-group-str", lambda s, a: s.access("0", _sel(s, a)), "group"),
    ("access-group-None", lambda s, a: s.access(None, _sel(s, a)), "group"),
    ("access-group-tensor", lambda s, a: s.access(t(0), _sel(s, a)), "group"),
    ("translate-group-neg", lambda s, a: s.translate(-1, a), "group"),
    ("translate-group-len", lambda s, a: s.translate(2, a), "group"),
    ("translate-group-true", lambda s, a: s.translate(True, a), "group"),
    ("translate-group-float", lambda s, a: s.translate(0.0, a), "group"),
    ("translate-float", lambda s, a: s.translate(0, a.float()), "addrs"),
    ("translate-bool", lambda s, a: s.translate(0, a.bool()), "addrs"),
    ("translate-list", lambda s, a: s.translate(0, a.tolist()), "addrs"),
    ("group-neg", lambda s, a: s.group(-1), "group"),
    ("group-len", lambda s, a: s.group(2), "group"),
    ("group-huge", lambda s, a: s.group(2**40), "group"),
    ("group-true", lambda s, a: s.group(True), "group"),
    ("group-float", lambda s, a: s.group(1.0), "group"),
    ("group-str", lambda s, a: s.group("0"), "group"),
    ("group_of-neg", lambda s, a: s.group_of(-1), "layer"),
    ("group_of-len", lambda s, a: s.group_of(2), "layer"),
    ("group_of-true", lambda s, a: s.group_of(True), "layer"),
    ("group_of-float", lambda s, a: s.group_of(0.0), "layer"),
    ("group_of-str", lambda s, a: s.group_of("1"), "layer"),
    # write / read: layer ids, address types, row tensors
    ("write-layer-neg", lambda s, a: s.write(-1, a[:1], _rows(1)), "layer"),
    ("write-layer-len", lambda s, a: s.write(2, a[:1], _rows(1)), "layer"),
    ("write-layer-true", lambda s, a: s.write(True, a[:1], _rows(1)), "layer"),
    ("write-layer-float", lambda s, a: s.write(1.0, a[:1], _rows(1)), "layer"),
    ("write-layer-str", lambda s, a: s.write("0", a[:1], _rows(1)), "layer"),
    ("write-addrs-float", lambda s, a: s.write(0, a[:1].float(), _rows(1)), "addrs"),
    ("write-addrs-bool", lambda s, a: s.write(0, t([True]), _rows(1)), "addrs"),
    ("write-addrs-list", lambda s, a: s.write(0, [0], _rows(1)), "addrs"),
    ("write-rows-list", lambda s, a: s.write(0, a[:1], [[0] * RB]), "rows"),
    ("write-rows-int8", lambda s, a: s.write(0, a[:1], _rows(1).to(torch.int8)), "rows"),
    ("write-rows-float", lambda s, a: s.write(0, a[:1], _rows(1).float()), "rows"),
    ("write-rows-bool", lambda s, a: s.write(0, a[:1], _rows(1).bool()), "rows"),
    ("write-rows-more", lambda s, a: s.write(0, a[:1], _rows(2)), "rows"),
    ("write-rows-fewer", lambda s, a: s.write(0, a[:2], _rows(1)), "rows"),
    ("write-rows-wide", lambda s, a: s.write(0, a[:1], torch.zeros(1, RB + 1,
                                                                   dtype=torch.uint8)), "rows"),
    ("write-rows-1d", lambda s, a: s.write(0, a[:1], torch.zeros(RB, dtype=torch.uint8)), "rows"),
    ("write-rows-3d", lambda s, a: s.write(0, a[:1], _rows(1).unsqueeze(0)), "rows"),
    ("read-layer-neg", lambda s, a: s.read(-1, a[:1]), "layer"),
    ("read-layer-len", lambda s, a: s.read(2, a[:1]), "layer"),
    ("read-layer-true", lambda s, a: s.read(True, a[:1]), "layer"),
    ("read-layer-float", lambda s, a: s.read(1.0, a[:1]), "layer"),
    ("read-addrs-float", lambda s, a: s.read(0, a[:1].float()), "addrs"),
    ("read-addrs-bool", lambda s, a: s.read(0, t([True])), "addrs"),
    ("read-addrs-list", lambda s, a: s.read(0, [0]), "addrs"),
]


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "production"])
@pytest.mark.parametrize(("call", "arg"), [c[1:] for c in SHAPE_CASES],
                         ids=[c[0] for c in SHAPE_CASES])
def test_type_and_shape_errors_raise_and_change_nothing(validate, call, arg):
    s, live = populated(validate)
    before = snapshot(s)
    with pytest.raises(ShapeError) as info:
        call(s, live)
    assert isinstance(info.value, UlaCacheError)
    assert arg in str(info.value), str(info.value)
    assert_same(before, snapshot(s))
    s.check_integrity()
    assert_rows(s, live)


# The only other device a CPU run has is "meta" (no data): enough to prove the device check.
META_CASES = [
    ("place", lambda s, m: s.place(m.view(-1)), "addrs"),
    ("release", lambda s, m: s.release(m.view(-1)), "addrs"),
    ("write-addrs", lambda s, m: s.write(0, m.view(-1), _rows(1)), "addrs"),
    ("write-rows", lambda s, m: s.write(0, t([0]), _rows(1, device="meta")), "rows"),
    ("read", lambda s, m: s.read(0, m.view(-1)), "addrs"),
]


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "production"])
def test_tensors_on_another_device_are_refused_before_anything_changes(validate):
    s, live = populated(validate)
    m = t([[0]], device="meta")
    before = snapshot(s)
    for call, arg in [(lambda: s.access(0, m), "addrs"), (lambda: s.translate(1, m), "addrs"),
                      (lambda: s.access(0, t([[0]]), out=torch.empty(1, 1, dtype=torch.int32,
                                                                    device="meta")), "out")]:
        with pytest.raises(ShapeError, match=arg):
            call()
        assert_same(before, snapshot(s))
    for _, call, _ in META_CASES:
        with pytest.raises(ShapeError):
            call(s, m)
        assert_same(before, snapshot(s))
    s.check_integrity()


@pytest.mark.parametrize(("call", "arg"), [c[1:] for c in META_CASES],
                         ids=[c[0] for c in META_CASES])
def test_uncopyable_device_is_a_typed_error(call, arg):
    s, _ = populated(True)
    with pytest.raises(ShapeError, match=arg):
        call(s, t([[0]], device="meta"))


# -- AddressSpace: value errors ------------------------------------------------------------------
# (name, call, arg, invalid entries masked per group when validate is off)
def _cpu(s, a):
    return on_cpu(s, a)[0]


def _gpu(s, a):
    return on_gpu(s, a)[0]


VALUE_CASES = [  # (id, call, masked invalid entries per group, rows a release drops)
    ("place-neg2", lambda s, a: s.place(t([20, -2])), [1, 1], 0),
    ("place-int32-min", lambda s, a: s.place(t([-(2**31)], dtype=torch.int32)), [1, 1], 0),
    ("place-int64-min", lambda s, a: s.place(t([-(2**63)])), [1, 1], 0),
    ("place-n_logical", lambda s, a: s.place(t([N])), [1, 1], 0),
    ("place-2**40", lambda s, a: s.place(t([20, 2**40])), [1, 1], 0),
    ("place-dup", lambda s, a: s.place(t([20, 21, 20])), [1, 1], 0),
    ("place-dup-padding-between", lambda s, a: s.place(t([20, -1, 20, -1])), [1, 1], 0),
    ("place-mapped-gpu", lambda s, a: s.place(t([20, _gpu(s, a)])), [1, 1], 0),
    ("place-mapped-cpu", lambda s, a: s.place(t([_cpu(s, a)])), [1, 1], 0),
    ("release-neg2", lambda s, a: s.release(t([0, -2])), [1, 1], 1),
    ("release-n_logical", lambda s, a: s.release(t([N, 1])), [1, 1], 1),
    ("release-2**40", lambda s, a: s.release(t([2**40])), [1, 1], 0),
    ("release-int64-min", lambda s, a: s.release(t([-(2**63)])), [1, 1], 0),
    ("release-dup-cpu", lambda s, a: s.release(t([_cpu(s, a), _cpu(s, a)])), [1, 1], 1),
    ("release-dup-gpu", lambda s, a: s.release(t([_gpu(s, a), -1, _gpu(s, a)])), [1, 1], 1),
    ("release-dup-x3", lambda s, a: s.release(t([_gpu(s, a)] * 3 + [_cpu(s, a)] * 3)), [4, 4],
     2),
    ("release-dup-unmapped", lambda s, a: s.release(t([40, 40])), [1, 1], 0),
    ("access-neg2", lambda s, a: s.access(0, t([[_gpu(s, a), -2]])), [1, 0], 0),
    ("access-n_logical", lambda s, a: s.access(0, t([[N, _cpu(s, a)]])), [1, 0], 0),
    ("access-2**40", lambda s, a: s.access(0, t([[2**40], [_cpu(s, a)]])), [1, 0], 0),
    ("access-int32-min", lambda s, a: s.access(1, t([[-(2**31)]], dtype=torch.int32)), [0, 1],
     0),
    ("access-not-live", lambda s, a: s.access(1, t([[40, _cpu(s, a), 41, 40]])), [0, 3], 0),
]


@pytest.mark.parametrize(("call", "masked", "drops"), [c[1:] for c in VALUE_CASES],
                         ids=[c[0] for c in VALUE_CASES])
def test_bad_values_raise_and_change_nothing_when_validating(call, masked, drops):
    s, live = populated(True)
    before = snapshot(s)
    with pytest.raises(AddressError) as info:
        call(s, live)
    assert "addrs" in str(info.value), str(info.value)
    assert_same(before, snapshot(s))
    s.check_integrity()
    assert_rows(s, live)


@pytest.mark.parametrize(("call", "masked", "drops"), [c[1:] for c in VALUE_CASES],
                         ids=[c[0] for c in VALUE_CASES])
def test_bad_values_are_masked_and_counted_in_production(call, masked, drops, caplog):
    caplog.set_level(logging.WARNING, logger="ulacache")
    s, live = populated(False)
    before = invalid(s)
    call(s, live)  # no exception
    assert [x - y for x, y in zip(invalid(s), before)] == masked
    s.check_integrity()
    # nothing live was lost except what a release legitimately dropped
    keep = torch.tensor([a for a in live.tolist()
                         if all(int(g.loc[a]) >= 0 for g in s.groups)], dtype=torch.int64)
    assert len(live) - len(keep) == drops  # only a release drops rows: the valid ones it named
    assert_rows(s, keep)
    s.begin_round()  # counters polled: one warning per group whose invalid count grew
    assert len(overflow_warnings(caplog, "invalid")) == sum(1 for m in masked if m)


def test_masked_place_exact_counts_and_results():
    s, live = populated(False)
    g0 = s.groups[0]
    gpu_b, cpu_a = _gpu(s, live), _cpu(s, live)
    mapped_before = int(g0.loc[gpu_b])
    ctr = [g.counter_values() for g in s.groups]
    addrs = t([-2, N, 2**40, -(2**63), 20, 20, gpu_b, cpu_a, -1, 21])
    slots = s.place(addrs)
    assert slots.tolist()[:4] == [-1] * 4 and slots[4] >= 0 and slots[9] >= 0
    assert slots[[5, 6, 7, 8]].tolist() == [-1] * 4
    for g, c in zip(s.groups, ctr):
        now = g.counter_values()
        assert now["invalid"] - c["invalid"] == 7  # -2, N, 2**40, int64 min, dup, 2 mapped
        assert now["placed"] - c["placed"] == 2 and now["place_overflow"] == 0
        assert int(g.loc[20]) >= 0 and int(g.loc[21]) >= 0
    assert int(g0.loc[gpu_b]) >= 0 and int(g0.loc[cpu_a]) >= 0
    assert mapped_before >= 0
    s.check_integrity()
    fill(s, t([20, 21]))
    assert_rows(s, torch.cat([live, t([20, 21])]))


def test_masked_release_keeps_the_free_stack_and_bitmaps_exact():
    """The issue's corruption: a duplicated address in ``release`` pushed its CPU slot twice
    (or cleared a GPU bit twice). Masked now: one push, one release, the rest counted."""
    s, live = populated(False)
    cpu_a, gpu_b = _cpu(s, live), _gpu(s, live)
    tops = [int(g.pools.cpu_top) for g in s.groups]
    used = [int(g.policy.used_count()) for g in s.groups]
    s.release(t([cpu_a, cpu_a, gpu_b, gpu_b, gpu_b, -1, 40, 40, -2, N]))
    for g, top, u in zip(s.groups, tops, used):
        assert int(g.pools.cpu_top) == top + 1  # cpu_a's slot pushed once
        assert int(g.policy.used_count()) == u - 1  # gpu_b's slot freed once
        assert int(g.loc[cpu_a]) == -1 and int(g.loc[gpu_b]) == -1
        assert g.counter_values()["invalid"] == 6  # dup cpu_a, 2 dup gpu_b, dup 40, -2, N
    s.check_integrity()
    rest = t([a for a in live.tolist() if a not in (cpu_a, gpu_b)])
    assert_rows(s, rest)
    # fill both tiers completely across rounds: no slot may be handed out twice
    nxt = 20
    while True:
        s.begin_round()
        room = G + C - int((s.groups[0].loc[:N] >= 0).sum())
        if room == 0:
            break
        new = torch.arange(nxt, nxt + min(room, G // 2))
        assert bool((s.place(new) >= 0).all())
        fill(s, new)
        nxt += new.numel()
        s.check_integrity()
    for g in s.groups:
        assert int(g.pools.cpu_top) == 0 and int(g.policy.used_count()) == G
    assert_rows(s, torch.cat([rest, torch.arange(20, nxt)]))


def test_masked_access_serves_padding_for_bad_entries_only():
    s, live = populated(False)
    cpu_a, gpu_b = _cpu(s, live), _gpu(s, live)
    sel = t([[-2, N, 2**40, 40, gpu_b, gpu_b, cpu_a, -1], [-1, cpu_a, -(2**63), 41, 0, 0, 0, 0]])
    before1 = snapshot(s)
    rows = s.access(0, sel)
    assert rows.dtype == torch.int32 and rows.shape == sel.shape
    bad = torch.zeros_like(sel, dtype=torch.bool)
    bad[0, :4] = True
    bad[1, 2:4] = True
    assert bool((rows[bad] == -1).all()) and int(rows[0, 7]) == -1 and int(rows[1, 0]) == -1
    good = (sel >= 0) & ~bad
    assert bool((rows[good] >= 0).all())
    gpu = s.groups[0].pools.gpu[0]
    for addr, row in zip(sel[good].tolist(), rows[good].tolist()):
        assert torch.equal(gpu[row], row_bytes_for(t([addr]), 0, 0, RB)[0])
    c = s.groups[0].counter_values()
    assert c["invalid"] == 6 and c["access_overflow"] == 0
    assert s.groups[1].counter_values()["invalid"] == 0
    s.check_integrity()
    assert_rows(s, live)
    # group 1 was not touched at all by a group-0 access
    after1 = snapshot(s)
    assert all(torch.equal(before1[k], after1[k]) for k in before1 if k.startswith("1."))
    # with an out buffer: same rows, written in place
    out = torch.full(sel.shape, 7, dtype=torch.int32)
    assert s.access(0, sel, out=out) is out and torch.equal(out, s.translate(0, sel))
    assert bool((out[bad] == -1).all())


def test_translate_has_no_side_effect_and_masks_bad_entries_in_production():
    s, live = populated(False)
    before = snapshot(s)
    sel = t([-2, N, 2**40, 40, -1, _gpu(s, live), _cpu(s, live)])
    rows = s.translate(0, sel)
    assert rows.tolist()[:6] == [-1] * 5 + [int(s.groups[0].loc[_gpu(s, live)])]
    assert int(rows[6]) == -1  # CPU-resident: not a GPU row
    assert_same(before, snapshot(s))


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "production"])
@pytest.mark.parametrize("case", ["neg2", "n_logical", "2**40", "not-live", "dup", "dup-cpu"])
def test_write_and_read_check_addresses_in_both_modes(validate, case):
    """Data calls are host-checked tools: they raise whatever ``validate`` says."""
    s, live = populated(validate)
    addrs = {"neg2": t([0, -2]), "n_logical": t([N]), "2**40": t([2**40]),
             "not-live": t([40, 1]), "dup": t([1, 2, 1]),
             "dup-cpu": t([_cpu(s, live)] * 2)}[case]
    before = snapshot(s)
    with pytest.raises(AddressError, match="addrs"):
        s.write(0, addrs, _rows(addrs.numel()) + 1)
    assert_same(before, snapshot(s))
    if case.startswith("dup"):  # reading the same row twice is fine
        assert torch.equal(s.read(1, addrs), row_bytes_for(addrs, 1, 0, RB))
    else:
        with pytest.raises(AddressError, match="addrs"):
            s.read(1, addrs)
    assert_same(before, snapshot(s))
    assert_rows(s, live)


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "production"])
def test_padding_minus_one_stays_legal_everywhere(validate):
    s, live = populated(validate)
    assert s.place(t([-1, 20, -1])).tolist()[::2] == [-1, -1]
    fill(s, t([-1, 20]))
    assert torch.equal(s.read(0, t([-1, 20]))[1], row_bytes_for(t([20]), 0, 0, RB)[0])
    rows = s.access(1, t([[-1, 20], [-1, -1]]))
    assert rows[:, 0].tolist() == [-1, -1] and int(rows[0, 1]) >= 0 and int(rows[1, 1]) == -1
    assert s.translate(0, t([-1])).tolist() == [-1]
    s.release(t([-1, 20, -1]))
    assert invalid(s) == [0, 0]
    s.check_integrity()
    assert_rows(s, live)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int32_and_int64_are_equivalent(dtype):
    a, b = populated(True)[0], populated(True)[0]
    live = torch.arange(12)
    sel = t([[0, 5, -1, 11]])
    assert torch.equal(a.access(0, sel.to(dtype)), b.access(0, sel))
    assert torch.equal(a.place(t([20, -1]).to(dtype)), b.place(t([20, -1])))
    a.release(t([3, 20]).to(dtype))
    b.release(t([3, 20]))
    assert_same(snapshot(a), snapshot(b))
    assert_rows(a, live[live != 3])


def test_empty_inputs_are_no_ops():
    s, live = populated(True)
    before = snapshot(s)
    assert s.place(torch.zeros(0, dtype=torch.int64)).numel() == 0
    s.release(torch.zeros(0, dtype=torch.int32))
    assert s.access(0, torch.zeros(0, 4, dtype=torch.int64)).shape == (0, 4)
    assert s.access(1, torch.zeros(3, 0, dtype=torch.int64)).shape == (3, 0)
    assert s.translate(0, torch.zeros(0, dtype=torch.int64)).numel() == 0
    s.write(0, torch.zeros(0, dtype=torch.int64), _rows(0))
    assert s.read(1, torch.zeros(0, dtype=torch.int64)).shape == (0, RB)
    assert_same(before, snapshot(s))


# -- the random hostile workload, model-checked --------------------------------------------------
def _hostile(gen: torch.Generator, n: int) -> torch.Tensor:
    """``n`` addresses: mostly in range (with duplicates), some -1, some out of range."""
    a = torch.randint(0, 24, (n,), generator=gen)
    kind = torch.randint(0, 10, (n,), generator=gen)
    junk = t([-2, -3, N, N + 1, 2**40, -(2**40)])
    a = torch.where(kind == 0, t(-1), a)
    return torch.where(kind == 1, junk[torch.randint(0, 6, (n,), generator=gen)], a)


def _expected_invalid(op: str, addrs: torch.Tensor, mapped: set[int]) -> int:
    seen: set[int] = set()
    bad = 0
    for a in addrs.view(-1).tolist():
        if a == -1:
            continue
        if not 0 <= a < N:
            bad += 1
        elif op == "access":
            bad += a not in mapped
        elif a in seen or (op == "place" and a in mapped):
            bad += 1
        seen.add(a)
    return bad


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "production"])
def test_random_hostile_workload(validate):
    """Random place / access / release of hostile address mixes for 40 rounds. Validate on: a
    call raises iff its input is invalid (or it needs more room than there is), and then
    nothing changed. Off: nothing raises, ``invalid`` grows by exactly the masked entries,
    every invariant holds, and every live row reads back."""
    s = make_space(validate)
    gen = torch.Generator().manual_seed(1234)
    raised = masked = 0
    for _ in range(40):
        s.begin_round()
        for op in ("place", "access", "release"):
            mapped = {a for a in range(N) if int(s.groups[0].loc[a]) >= 0}
            n = int(torch.randint(1, 7, (1,), generator=gen))
            addrs = _hostile(gen, n)
            if op == "access":
                addrs = addrs.view(1, -1)
            expect = _expected_invalid(op, addrs, mapped)
            before_inv = invalid(s)
            before = snapshot(s)
            try:
                if op == "place":
                    s.place(addrs)
                elif op == "access":
                    s.access(int(torch.randint(0, 2, (1,), generator=gen)), addrs)
                else:
                    s.release(addrs)
            except (AddressError, CapacityExhausted) as e:
                assert validate, f"{op}({addrs.tolist()}) raised in production: {e}"
                assert expect or isinstance(e, CapacityExhausted), (op, addrs.tolist(), e)
                assert_same(before, snapshot(s))
                raised += 1
                continue
            if validate:
                assert expect == 0, f"{op}({addrs.tolist()}) accepted {expect} bad entries"
            elif op == "access":
                assert sum(invalid(s)) - sum(before_inv) == expect, (op, addrs.tolist())
            else:
                assert [x - y for x, y in zip(invalid(s), before_inv)] == [expect] * 2, \
                    (op, addrs.tolist())
            masked += expect
            if op == "place":
                new = [a for a in set(addrs.view(-1).tolist()) - mapped
                       if 0 <= a < N and int(s.groups[0].loc[a]) >= 0]
                fill(s, t(sorted(new), dtype=torch.int64))
            s.check_integrity()
            live = t(sorted(a for a in range(N) if int(s.groups[0].loc[a]) >= 0),
                     dtype=torch.int64)
            for g in s.groups:  # both groups agree on which addresses hold a row
                assert torch.equal((g.loc[:N] >= 0).nonzero().view(-1), live)
            assert_rows(s, live)
    assert (raised if validate else masked) > 20  # the workload really was hostile


# -- capacity overflow in production: masked, counted, warned -----------------------------------
@pytest.mark.parametrize("n_layers", [1, 2], ids=["one-group", "two-groups"])
def test_place_overflow_issue_reproduction(n_layers, caplog):
    """G=2, C=0, validate off: two rows placed, next round a third finds no CPU slot for the
    row it would displace. It is not stored (slot -1), nothing breaks, it is counted, one
    warning per group is logged and the metric shows it."""
    caplog.set_level(logging.WARNING, logger="ulacache")
    cfg = UlaCacheConfig(layout="tiny", n_layers=n_layers, gpu_slots=2, cpu_slots=0,
                         n_buckets=2, validate=False)
    space = AddressSpace(cfg, n_logical=16)
    assert space.place(t([0, 1])).tolist() == [0, 1]
    fill(space, t([0, 1]))
    space.begin_round()
    assert space.place(t([2])).tolist() == [-1]
    space.check_integrity()
    for g in space.groups:
        assert g.counter_values()["place_overflow"] == 1
        assert int(g.loc[2]) == -1
    assert_rows(space, t([0, 1]))  # the rows that were there are untouched
    with pytest.raises(AddressError, match="not live"):
        space.read(0, t([2]))
    assert overflow_warnings(caplog, "place") == []  # reported at the next boundary / flush
    space.health.flush()
    assert len(overflow_warnings(caplog, "place")) == n_layers
    assert len(caplog.records) == n_layers  # and nothing else
    text = prometheus_text(space)
    for gi in range(n_layers):
        assert f'ulacache_place_overflow_total{{group="{gi}"}} 1.0' in text
    assert f"ulacache_overflow_warnings {float(n_layers)}" in text
    space.health.flush()
    space.begin_round()
    assert len(overflow_warnings(caplog, "place")) == n_layers  # no growth, no new warning


def test_place_overflow_is_refused_when_validating():
    space = AddressSpace(UlaCacheConfig(layout="tiny", n_layers=1, gpu_slots=2, cpu_slots=0,
                                        n_buckets=2), n_logical=16)
    space.place(t([0, 1]))
    space.begin_round()
    before = snapshot(space)
    with pytest.raises(CapacityExhausted, match="place"):
        space.place(t([2]))
    assert_same(before, snapshot(space))


def _overflow_space(validate: bool) -> AddressSpace:
    """One group of two layers, G=4, C=16: 0..3 placed in round 1, spilled to the CPU by 4..7
    in round 2; a fresh round started."""
    space = AddressSpace(UlaCacheConfig(layout="tiny", n_layers=2, layers_per_group=2,
                                        gpu_slots=4, cpu_slots=16, n_buckets=2,
                                        validate=validate), n_logical=32)
    for new in (torch.arange(4), torch.arange(4, 8)):
        space.place(new)
        fill(space, new)
        space.begin_round()
    return space


def _check_served(space: AddressSpace, sel: torch.Tensor, rows: torch.Tensor) -> int:
    """Served rows hold the selected data in both layers; returns how many were not served."""
    g = space.groups[0]
    for addr, row in zip(sel.view(-1).tolist(), rows.view(-1).tolist()):
        if row >= 0:
            for li, layer in enumerate(g.layers):
                assert torch.equal(g.pools.gpu[li][row], row_bytes_for(t([addr]), layer, 0, RB)[0])
    return int((rows == -1).sum())


def test_access_overflow_is_masked_counted_and_warned_once_per_occurrence(caplog):
    caplog.set_level(logging.WARNING, logger="ulacache")
    space = _overflow_space(False)
    live = torch.arange(8)
    g = space.groups[0]
    # 5 distinct selections, 4 GPU slots: the four hits pin every slot, the miss overflows
    sel = t([[4, 5, 6, 7, 0]])
    rows = space.access(0, sel)
    assert _check_served(space, sel, rows) == 1 and int(rows[0, 4]) == -1
    assert g.counter_values()["access_overflow"] == 1
    space.check_integrity()
    assert_rows(space, live)
    assert overflow_warnings(caplog, "access") == []
    space.begin_round()
    assert len(overflow_warnings(caplog, "access")) == 1
    # a round without overflow logs nothing
    rows = space.access(0, t([[0, 1], [1, -1]]))
    assert _check_served(space, t([[0, 1], [1, -1]]), rows) == 1  # only the padding
    space.begin_round()
    assert len(overflow_warnings(caplog, "access")) == 1
    # a second overflow in a later round logs again
    sel = t([[0, 1, 2], [3, 4, 0]])
    rows = space.access(0, sel)
    assert _check_served(space, sel, rows) == 1
    assert g.counter_values()["access_overflow"] == 2
    space.check_integrity()
    assert_rows(space, live)
    space.begin_round()
    assert len(overflow_warnings(caplog, "access")) == 2
    assert space.health.warnings == 2 and len(caplog.records) == 2
    text = prometheus_text(space)
    assert 'ulacache_access_overflow_total{group="0"} 2.0' in text
    assert 'ulacache_invalid_total{group="0"} 0.0' in text


def test_access_overflow_is_refused_when_validating():
    space = _overflow_space(True)
    before = snapshot(space)
    with pytest.raises(CapacityExhausted, match="access"):
        space.access(0, t([[4, 5, 6, 7, 0]]))
    assert_same(before, snapshot(space))
    out = torch.zeros(1, 4, dtype=torch.int32)
    assert space.access(0, t([[4, 5, 6, 0]]), out=out) is out  # 4 distinct fit: served
    assert bool((out >= 0).all())


# -- UlaCache: the request ledger ------------------------------------------------------------------
def make_cache(validate: bool) -> UlaCache:
    c = UlaCache(UlaCacheConfig(layout="tiny", n_layers=2, layers_per_group=1, gpu_slots=32,
                                cpu_slots=96, page_size=4, max_requests=8, n_buckets=4,
                                validate=validate))
    c.admit("a", 20)
    fill(c.space, c.extend("a", 6))
    c.admit("b", 8)
    fill(c.space, c.extend("b", 3))
    c.space.begin_round()
    return c


BAD_COUNTS = [float("nan"), float("inf"), float("-inf"), 2.5, 3.0, 0.0, True, False, -1, -(2**70),
              "3", None, t(3), 3 + 0j, [3]]
CACHE_CASES = (
    [(f"admit-tokens-{v!r}", lambda c, v=v: c.admit("x", v), ShapeError, "admit: tokens")
     for v in BAD_COUNTS]
    + [(f"admit-rid-{type(r).__name__}", lambda c, r=r: c.admit(r, 3), ShapeError, "request id")
       for r in ([], {}, set(), bytearray(b"x"), ["a"])]
    + [("admit-again", lambda c: c.admit("a", 3), ShapeError, "'a'"),
       ("admit-too-many-tokens", lambda c: c.admit("x", 10**30), CapacityExhausted, "'x'"),
       ("admit-over-capacity", lambda c: c.admit("x", 128 - 28 + 1), CapacityExhausted, "'x'")]
    + [(f"extend-n-{v!r}", lambda c, v=v: c.extend("a", v), ShapeError, "extend: n")
       for v in BAD_COUNTS]
    + [("extend-unknown", lambda c: c.extend("zz", 1), UnknownRequest, "zz"),
       ("extend-none-rid", lambda c: c.extend(None, 1), UnknownRequest, "None"),
       ("extend-room", lambda c: c.extend("a", 40), CapacityExhausted, "place")]
    + [(f"extend_batch-{type(v).__name__}", lambda c, v=v: c.extend_batch(v), ShapeError,
        "counts") for v in ([("a", 1)], ("a", 1), None, "a", 3)]
    + [("extend_batch-bad-second-n", lambda c: c.extend_batch({"a": 1, "b": 2.5}), ShapeError,
        "extend: n"),
       ("extend_batch-bad-second-rid", lambda c: c.extend_batch({"a": 1, "zz": 1}),
        UnknownRequest, "zz"),
       ("extend_batch-outgrow", lambda c: c.extend_batch({"a": 1, "b": 106}), CapacityExhausted,
        "outgrow")]
    + [(f"addresses-{name}", lambda c, p=p: c.addresses("a", p), exc, "positions")
       for name, p, exc in [("float", t([1.0]), ShapeError), ("bool", t([True]), ShapeError),
                            ("uint8", t([1], dtype=torch.uint8), ShapeError),
                            ("list", [1], ShapeError), ("int", 1, ShapeError),
                            ("neg2", t([0, -2]), AddressError),
                            ("n_tokens", t([6]), AddressError),
                            ("2**40", t([2**40]), AddressError),
                            ("other-request", t([0, 7]), AddressError)]]
    + [("addresses-unknown", lambda c: c.addresses("zz"), UnknownRequest, "zz"),
       ("addresses-unhashable", lambda c: c.addresses(["a"]), UnknownRequest, "['a']"),
       ("free-unknown", lambda c: c.free("zz"), DoubleFreeError, "zz"),
       ("free-unhashable", lambda c: c.free(["a"]), DoubleFreeError, "['a']"),
       ("abort-unknown", lambda c: c.abort("zz"), DoubleFreeError, "zz")]
)


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "production"])
@pytest.mark.parametrize(("call", "exc", "arg"), [c[1:] for c in CACHE_CASES],
                         ids=[c[0] for c in CACHE_CASES])
def test_cache_refuses_bad_arguments_and_changes_nothing(validate, call, exc, arg):
    """Ledger checks are control plane: they raise whatever ``validate`` says."""
    c = make_cache(validate)
    before = snapshot(c)
    with pytest.raises(exc) as info:
        call(c)
    assert isinstance(info.value, UlaCacheError)
    assert arg in str(info.value), str(info.value)
    assert_same(before, snapshot(c))
    c.check_integrity()
    for rid in ("a", "b"):
        assert_rows(c.space, c.addresses(rid))
    # still fully usable
    c.extend_batch({"a": 2, "b": 1})
    c.free("b")
    c.check_integrity()


def test_extend_with_unhashable_rid_is_typed():
    c = make_cache(True)
    with pytest.raises(UnknownRequest):
        c.extend(["a"], 1)


def test_free_twice_and_freed_requests_are_unknown():
    c = make_cache(True)
    addrs = c.addresses("b")
    c.free("b")
    before = snapshot(c)
    for call, exc in [(lambda: c.free("b"), DoubleFreeError),
                      (lambda: c.abort("b"), DoubleFreeError),
                      (lambda: c.extend("b", 1), UnknownRequest),
                      (lambda: c.addresses("b"), UnknownRequest)]:
        with pytest.raises(exc, match="'b'"):
            call()
        assert_same(before, snapshot(c))
    for g in c.space.groups:
        assert bool((g.loc[addrs] == -1).all())
    c.check_integrity()


def test_admit_accepts_exact_boundaries():
    c = make_cache(True)
    c.admit("zero", 0)  # nothing reserved yet is legal
    c.admit("rest", c.free_capacity)
    assert c.free_capacity == 0
    with pytest.raises(CapacityExhausted):
        c.admit("one-more", 1)
    big = 2**70  # a Python int beyond int64 is still just "too many"
    with pytest.raises(CapacityExhausted):
        c.admit("huge", big)
    c.check_integrity()
