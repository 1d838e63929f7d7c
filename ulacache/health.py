"""Counters off the device without stalling it, and a warning for every overflow.

The decode path only adds to device counters (``SelectionGroup.counters``); reading them on the
host would synchronise the GPU. :class:`CounterMonitor` instead copies them, together with the
pools' occupancy, into a host buffer with a non-blocking copy issued on the core stream at each
round boundary, and reads the copy at a later boundary once its event has completed (on CPU the
copy is immediate). Whenever an overflow counter (``access_overflow``, ``place_overflow``,
``invalid``) grew, one warning per group and kind is logged, naming what was lost and what to
change. The same snapshot feeds the Prometheus collector (:mod:`ulacache.metrics`) and SGLang's
token stats, so a scrape never touches the device either.
"""

from __future__ import annotations

import logging

import torch

from .group import COUNTERS, OVERFLOWS, SelectionGroup
from .streams import capturing

logger = logging.getLogger("ulacache")

OCCUPANCY = ("gpu_used", "cpu_used")
COLUMNS = COUNTERS + OCCUPANCY
"""Columns of a snapshot row (one row per selection group)."""

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


class CounterMonitor:
    """Snapshots of every group's counters and occupancy, taken without host sync."""

    def __init__(self, groups: list[SelectionGroup], device: torch.device):
        self.groups, self.device = groups, device
        shape = (len(groups), len(COLUMNS))
        self._pending: torch.cuda.Event | None = None
        self._host = torch.zeros(shape, dtype=torch.int64,
                                 pin_memory=device.type == "cuda" and torch.cuda.is_available())
        self._last = torch.zeros(shape, dtype=torch.int64)
        self.warnings = 0  # warnings logged so far (tests, metrics)

    def _device_rows(self) -> torch.Tensor:
        return torch.stack([torch.cat([g.counters, g.policy.used_count().view(1),
                                       g.pools.cpu_used().view(1)]) for g in self.groups])

    def poll(self) -> None:
        """At a round boundary, on the core stream, outside graph capture: report a snapshot
        whose copy has completed, and start the next one. Never blocks on the device."""
        if self.device.type != "cuda":
            self._report(self._device_rows())
            return
        if capturing(self.device):
            return
        if self._pending is not None:
            if not self._pending.query():
                return  # last copy still in flight: try again next round
            self._report(self._host.clone())
        self._host.copy_(self._device_rows(), non_blocking=True)
        self._pending = torch.cuda.Event()
        self._pending.record()

    def flush(self) -> None:
        """Report the current counters now (synchronises; tests, shutdown, tools)."""
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None
        self._report(self._device_rows().cpu())

    def snapshot(self) -> list[dict[str, int]]:
        """The last reported values, one dict per group (host data; may lag by a round)."""
        return [dict(zip(COLUMNS, row)) for row in self._last.tolist()]

    def _report(self, rows: torch.Tensor) -> None:
        rows = rows.to("cpu", torch.int64)
        grew = rows - self._last
        for gi, row in enumerate(grew.tolist()):
            for name in OVERFLOWS:
                delta = row[COLUMNS.index(name)]
                if delta > 0:
                    self.warnings += 1
                    logger.warning("ulacache: selection group %d: %d %s", gi, delta, _WHAT[name])
        self._last = rows
