"""Counters off the device without stalling it, and a warning for every overflow.

The decode path only adds to device counters (one ``int64 [groups, counters]`` table, a row per
selection group); reading them on the host would synchronise the GPU. :class:`CounterMonitor`
instead copies the table into a host buffer with one non-blocking copy issued on the core stream
at each round boundary, and reads the copy at a later boundary once its event has completed (on
CPU the copy is immediate). The pools' occupancy is derived from the counters
(:func:`ulacache.group.occupancy`), so it costs no device work. Whenever an overflow counter
(``access_overflow``, ``place_overflow``, ``invalid``) grew, one warning per group and kind is
logged, naming what was lost and what to change. The same snapshot feeds the Prometheus
collector (:mod:`ulacache.metrics`) and SGLang's token stats, so a scrape never touches the
device either.
"""

from __future__ import annotations

import logging

import torch

from .group import COUNTERS, OVERFLOWS, occupancy
from .streams import capturing

logger = logging.getLogger("ulacache")

OCCUPANCY = ("gpu_used", "cpu_used")  # derived columns of a snapshot

_WHAT = {
    "access_overflow": "selected row(s) could not be made GPU-resident (every GPU slot was "
                       "pinned by this round's rows) and were served as padding, so attention "
                       "skipped them; lower the batch or top-k, or enlarge the GPU pool",
    "place_overflow": "new row(s) were not stored (no evictable GPU slot this round, or no free "
                      "CPU slot for the row they would displace), so those tokens' KV is "
                      "missing and reads of them return padding; admission let in more tokens "
                      "than the pools hold, or one round placed more rows than the GPU pool",
    "invalid": "invalid address(es) were masked (out of range, not live, duplicated, or "
               "already mapped): a caller bug; run with validate on to raise at the first one",
}


def _occupancy_columns(values: dict[str, int]) -> dict[str, int]:
    return dict(zip(OCCUPANCY, occupancy(values)))


class CounterMonitor:
    """Snapshots of every group's counters (and the columns derived from them), taken without
    host sync. ``table``: an ``int64 [groups, len(names)]`` counter table (default: the
    address space's, :data:`ulacache.group.COUNTERS`, with the occupancy derived); TP mode
    monitors its gate counters with its own ``names``, ``overflows`` and warning texts."""

    def __init__(self, table: torch.Tensor, names: tuple[str, ...] = COUNTERS,
                 overflows: tuple[str, ...] = OVERFLOWS, what: dict[str, str] | None = None,
                 derive=_occupancy_columns):
        self.names, self.overflows, self.what = names, overflows, what or _WHAT
        self.derive = derive
        self.table, self.device = table, table.device
        self._pending: torch.cuda.Event | None = None
        self._host = torch.zeros(table.shape, dtype=torch.int64,
                                 pin_memory=self.device.type == "cuda")
        self._last = torch.zeros(table.shape, dtype=torch.int64)
        self.warnings = 0  # warnings logged so far (tests, metrics)

    def poll(self) -> None:
        """At a round boundary, on the core stream, outside graph capture: report a snapshot
        whose copy has completed, and start the next one. Never blocks on the device."""
        if self.device.type == "meta":
            return  # ulacache rehearse: shapes without values, nothing to report
        if self.device.type != "cuda":
            self._report(self.table)
            return
        if capturing(self.device):
            return
        if self._pending is not None:
            if not self._pending.query():
                return  # last copy still in flight: try again next round
            self._report(self._host)
        self._host.copy_(self.table, non_blocking=True)
        self._pending = torch.cuda.Event()
        self._pending.record()

    def flush(self) -> None:
        """Report the current counters now (synchronises; tests, shutdown, tools)."""
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None
        self._report(self.table)

    def snapshot(self) -> list[dict[str, int]]:
        """The last reported values, one dict per group (host data; may lag by a round): the
        counters plus ``gpu_used`` / ``cpu_used``."""
        out = []
        for row in self._last.tolist():
            values = dict(zip(self.names, row))
            out.append({**values, **(self.derive(values) if self.derive else {})})
        return out

    def _report(self, rows: torch.Tensor) -> None:
        rows = rows.to("cpu", torch.int64, copy=True)  # never alias the live table
        grew = rows - self._last
        for gi, row in enumerate(grew.tolist()):
            for name in self.overflows:
                delta = row[self.names.index(name)]
                if delta > 0:
                    self.warnings += 1
                    logger.warning("ulacache: selection group %d: %d %s", gi, delta,
                                   self.what[name])
        self._last = rows
