"""Prometheus text exposition of the core's counters and gauges.

Counters live on the pool's device (``SelectionGroup.counters``) and are read here, outside the
decode path. Names follow SGLang's ``sglang:`` style with an ``ulacache_`` prefix; every series
carries the selection group as a label.
"""

from __future__ import annotations

from .cache import UlaCache

_HELP = {
    "accesses": "distinct selected rows resolved by sparse access",
    "gpu_hits": "selected rows already in the GPU pool",
    "promotions": "rows promoted CPU -> GPU (H2D row copies)",
    "writebacks": "victim rows written back GPU -> CPU during promotions",
    "spills": "rows spilled GPU -> CPU to make room for new tokens",
    "placed": "new rows given a GPU slot",
    "overflow": "rows that found no GPU slot (must stay 0)",
}


def prometheus_text(cache: UlaCache, prefix: str = "ulacache") -> str:
    """Counters (``*_total``), row bytes moved per link, and occupancy gauges."""
    lines: list[str] = []
    per_group = [g.counter_values() for g in cache.groups]
    rb = cache.config.row_layout.row_bytes
    for name, text in _HELP.items():
        metric = f"{prefix}_{name}_total"
        lines += [f"# HELP {metric} {text}", f"# TYPE {metric} counter"]
        lines += [f'{metric}{{group="{i}"}} {v[name]}' for i, v in enumerate(per_group)]
    metric = f"{prefix}_bytes_moved_total"
    lines += [f"# HELP {metric} row bytes moved between tiers, all layers of the group",
              f"# TYPE {metric} counter"]
    for i, (g, v) in enumerate(zip(cache.groups, per_group)):
        per_row = rb * len(g.layers)
        lines.append(f'{metric}{{group="{i}",link="h2d"}} {v["promotions"] * per_row}')
        lines.append(f'{metric}{{group="{i}",link="d2h"}} '
                     f'{(v["writebacks"] + v["spills"]) * per_row}')
    for tier, help_text in (("gpu", "GPU slots holding a row"), ("cpu", "CPU slots holding a row")):
        metric = f"{prefix}_{tier}_used_slots"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
        for i, g in enumerate(cache.groups):
            used = int((g.gpu_owner[: g.G] >= 0).sum()) if tier == "gpu" else \
                g.C - int(g.pools.cpu_top)
            lines.append(f'{metric}{{group="{i}"}} {used}')
    lines += [f"# HELP {prefix}_reserved_tokens tokens charged by admitted requests",
              f"# TYPE {prefix}_reserved_tokens gauge",
              f"{prefix}_reserved_tokens {cache.reserved_total}"]
    return "\n".join(lines) + "\n"
