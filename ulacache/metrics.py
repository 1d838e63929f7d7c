"""Prometheus metrics (prometheus_client, as SGLang's own) of an address space.

:class:`UlaCacheCollector` reads the host snapshot the counter monitor keeps
(:mod:`ulacache.health`): a scrape never touches the device, and values may lag by one round.
Register it in SGLang's registry (or any) with ``REGISTRY.register(UlaCacheCollector(space))``.
Every series carries the selection group as a label; names use an ``ulacache_`` prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .space import AddressSpace

HELP = {
    "accesses": "distinct selected rows resolved by sparse access",
    "gpu_hits": "selected rows already in the GPU pool",
    "promotions": "rows promoted CPU -> GPU (H2D row copies)",
    "writebacks": "victim rows written back GPU -> CPU during promotions",
    "placed": "new rows given a GPU slot",
    "spills": "rows spilled GPU -> CPU to make room for new rows",
    "released_gpu": "rows dropped from the GPU pool (finished or aborted requests)",
    "released_cpu": "rows dropped from the CPU pool (finished or aborted requests)",
    "access_overflow": "selected rows served as padding: no GPU slot could take them (must be 0)",
    "place_overflow": "new rows not stored: no GPU slot, or no CPU slot for the victim (must be 0)",
    "invalid": "masked invalid addresses (validate off; must be 0)",
    "remaps": "victim rows evicted onto their shadow (their CPU copy): nothing copied",
    "shadowed": "promoted rows that kept their CPU copy as a shadow",
    "reclaims": "shadows given back to the CPU free stack to make room for spills",
    "shadows_released": "shadows freed with their row (finished or aborted requests)",
    "rewrites": "write-backs and spills of rows that had been in the CPU tier before "
                "(eviction-path D2H)",
    "prefetches": "rows promoted CPU -> GPU ahead of their access by the look-ahead prefetch "
                  "(H2D off the critical path)",
}


TP_HELP = {
    "selected": "distinct selected rows (TP: every rank reads every selected row)",
    "own_rows": "selected rows this rank owns, read in place from its pool",
    "buffer_hits": "peers' selected rows already in this rank's buffer (no transfer)",
    "peer_fetches": "peers' rows copied owner GPU -> this rank's buffer",
    "peer_missing": "peers' rows their owner could not serve, read as padding (must be 0)",
    "buffer_overflow": "peers' rows with no buffer slot, read as padding (must be 0)",
    "new_buffered": "new rows of peers copied into the buffer as they were written",
    "buffer_evictions": "buffer copies evicted to make room (the owner keeps the row)",
    "buffer_drops": "buffer copies dropped because their address was released",
}


class UlaCacheCollector:
    """A prometheus_client collector over one :class:`AddressSpace` (and, optionally, the
    reserved-token gauge of a request ledger)."""

    def __init__(self, space: AddressSpace, prefix: str = "ulacache",
                 reserved_tokens=None):
        self.space, self.prefix = space, prefix
        self.reserved_tokens = reserved_tokens  # callable -> int, or None

    def collect(self) -> Iterator[Metric]:
        p, snap = self.prefix, self.space.health.snapshot()
        groups = [str(i) for i in range(len(snap))]
        for name, text in HELP.items():
            fam = CounterMetricFamily(f"{p}_{name}", text, labels=["group"])
            for gi, row in zip(groups, snap):
                fam.add_metric([gi], row[name])
            yield fam
        rb = self.space.config.row_layout.row_bytes
        fam = CounterMetricFamily(f"{p}_bytes_moved", "row bytes moved between tiers, all layers "
                                  "of the group", labels=["group", "link"])
        for gi, g, row in zip(groups, self.space.groups, snap):
            per_row = rb * len(g.layers)
            fam.add_metric([gi, "h2d"], (row["promotions"] + row["prefetches"]) * per_row)
            fam.add_metric([gi, "d2h"], (row["writebacks"] + row["spills"]) * per_row)
        yield fam
        for tier, text in (("gpu", "GPU slots holding a row"), ("cpu", "CPU slots holding a row")):
            fam = GaugeMetricFamily(f"{p}_{tier}_used_slots", text, labels=["group"])
            for gi, row in zip(groups, snap):
                fam.add_metric([gi], row[f"{tier}_used"])
            yield fam
        warnings = self.space.health.warnings
        tp = getattr(self.space, "tp_health", None)
        if tp is not None:
            yield from self._collect_tp(tp.snapshot(), groups, rb)
            warnings += tp.warnings
        yield GaugeMetricFamily(f"{p}_overflow_warnings", "overflow warnings logged so far",
                                value=warnings)
        if self.reserved_tokens is not None:
            yield GaugeMetricFamily(f"{p}_reserved_tokens", "tokens charged by admitted requests",
                                    value=self.reserved_tokens())


    def _collect_tp(self, snap: list[dict[str, int]], groups: list[str], rb: int
                    ) -> Iterator[Metric]:
        """TP mode: the gate counters of this rank (label ``rank``), peer bytes, buffer use."""
        p, rank = self.prefix, str(self.space.rank)
        for name, text in TP_HELP.items():
            fam = CounterMetricFamily(f"{p}_tp_{name}", text, labels=["group", "rank"])
            for gi, row in zip(groups, snap):
                fam.add_metric([gi, rank], row[name])
            yield fam
        fam = CounterMetricFamily(f"{p}_tp_peer_bytes", "row bytes copied from peers' GPU pools "
                                  "into this rank's buffer (NVLink), all layers of the group",
                                  labels=["group", "rank"])
        for gi, g, row in zip(groups, self.space.groups, snap):
            fam.add_metric([gi, rank], row["peer_fetches"] * rb * len(g.layers))
        yield fam
        fam = GaugeMetricFamily(f"{p}_tp_buffer_used_slots", "buffer slots holding a copy",
                                labels=["group", "rank"])
        for gi, row in zip(groups, snap):
            fam.add_metric([gi, rank], row["buffer_used"])
        yield fam


def prometheus_text(space: AddressSpace, reserved_tokens=None, prefix: str = "ulacache") -> str:
    """The text exposition of one address space's metrics (a private registry)."""
    registry = CollectorRegistry()
    registry.register(UlaCacheCollector(space, prefix, reserved_tokens))
    return generate_latest(registry).decode()
