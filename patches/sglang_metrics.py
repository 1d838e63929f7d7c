"""ulacache's counters in SGLang's own ``/metrics`` scrape (``--enable-metrics``).

SGLang runs prometheus_client in multiprocess mode: its schedulers write metric values to
files under ``PROMETHEUS_MULTIPROC_DIR`` (``utils/common.py`` ``set_prometheus_multiproc_dir``,
set by the launcher before it spawns them) and the HTTP server's ``/metrics`` merges those
files. A collector registered in a scheduler's registry (:class:`ulacache.metrics.
UlaCacheCollector`) is invisible there, so :class:`MetricsBridge` mirrors the collector's
families into multiprocess gauges of the same names (a ``rank`` label added: the scheduler's
global rank), updated from the host snapshot the counter monitor keeps (no device work), at
most once per ``interval_s``. Counters are exported as gauges holding the running total
(``multiprocess_mode="mostrecent"``: a process's last value, one series per rank).
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)


def _rank() -> str:
    try:
        import torch.distributed as dist  # noqa: PLC0415

        return str(dist.get_rank()) if dist.is_initialized() else "0"
    except Exception:  # noqa: BLE001 - no process group: one rank
        return "0"


class MetricsBridge:
    """Mirrors one address space's ulacache metrics into SGLang's multiprocess registry;
    inert (``enabled`` False) unless SGLang's metrics are on in this process."""

    def __init__(self, space, interval_s: float = 1.0) -> None:
        self.space, self.interval_s = space, interval_s
        self.enabled = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")) and _metrics_on()
        self._gauges: dict[str, object] = {}
        self._last = 0.0
        self.rank = _rank()

    def update(self, force: bool = False) -> None:
        """Copy the current snapshot into the gauges (rate-limited unless ``force``)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        from prometheus_client import Gauge  # noqa: PLC0415 - after the multiproc dir is set

        from ulacache.metrics import UlaCacheCollector  # noqa: PLC0415

        try:
            for fam in UlaCacheCollector(self.space).collect():
                for sample in fam.samples:
                    if sample.name.endswith("_created"):
                        continue
                    name = sample.name[:-len("_total")] if sample.name.endswith("_total") \
                        else sample.name
                    labels = {**sample.labels, "rank": self.rank}
                    gauge = self._gauges.get(name)
                    if gauge is None:
                        gauge = Gauge(name, fam.documentation, sorted(labels),
                                      multiprocess_mode="mostrecent")
                        self._gauges[name] = gauge
                    gauge.labels(**labels).set(sample.value)
        except Exception:  # noqa: BLE001 - metrics never stop serving
            logger.exception("ulacache: metrics export failed; disabled")
            self.enabled = False


def _metrics_on() -> bool:
    try:
        from sglang.srt.runtime_context import get_server_args  # noqa: PLC0415

        return bool(getattr(get_server_args(), "enable_metrics", False))
    except Exception:  # noqa: BLE001 - no published server args (tests, tools)
        return False
