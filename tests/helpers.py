"""Shared test helpers: deterministic row bytes and full-state snapshots of the core."""

from __future__ import annotations

import copy

import torch

from ulacache.cache import UlaCache


def row_bytes_for(addrs: torch.Tensor, layer: int, version: int, row_bytes: int) -> torch.Tensor:
    """``uint8 [n, row_bytes]`` rows that identify (address, layer, version)."""
    a = addrs.to(torch.int64).view(-1, 1)
    j = torch.arange(row_bytes, dtype=torch.int64).view(1, -1)
    return ((a * 131 + layer * 31 + version * 7 + j * 13) % 251).to(torch.uint8)


def snapshot(cache: UlaCache) -> dict:
    """Every piece of mutable state, cloned, for 'unchanged after an error' checks."""
    snap = {
        "requests": copy.deepcopy(cache.requests),
        "reserved": cache.reserved_total,
        "pages_free": list(cache.pages._free),
        "pages_used": bytes(cache.pages._used),
    }
    for i, g in enumerate(cache.groups):
        pol = g.policy
        for name, t in [("loc", g.loc), ("gown", g.gpu_owner), ("cown", g.cpu_owner),
                        ("gpu", g.pools.gpu), ("cpu", g.pools.cpu), ("free", g.pools.cpu_free),
                        ("top", g.pools.cpu_top), ("claim", g._claim), ("ctr", g.counters)]:
            snap[f"{i}.{name}"] = t.clone()
        for name in ("bits", "counts", "stamp", "round_t"):
            if hasattr(pol, name):
                snap[f"{i}.pol.{name}"] = getattr(pol, name).clone()
        snap[f"{i}.pol.round"] = pol._round
    return snap


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"state {k} changed"
        else:
            assert a[k] == b[k], f"state {k} changed"
