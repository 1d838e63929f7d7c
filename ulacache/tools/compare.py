"""The main job's report: what ulacache gains over SGLang's HiSparse at the same GPU memory.

Three parts, all from the same run of ``ulacache replay``:

1. **Residency on a real trace at equal GPU memory.** The trace's selections replayed through
   ulacache's real core (:func:`ulacache.tools.replay.replay`: a shared GPU pool with an
   exclusive CPU tier, production mode) and through HiSparse's per-request buffers
   (:func:`ulacache.tools.hisparse.replay_hisparse`, its swap-in kernel's rules, checked against
   SGLang's own coordinator) with the same rows per layer: HiSparse's ``requests x (H + 64)``.
   Per decode step: GPU hit rate, misses, H2D and D2H bytes, and kernel launches (ulacache's
   counted on the real core, :mod:`ulacache.tools.launches`; HiSparse's read off SGLang's
   code). Each row names its winner.
2. **Capacity on a real deployment** (:mod:`ulacache.tools.capacity`, the accounting that
   ``bench/capacity.py`` prints and the SGLang sizing hook charges): GLM-5 with FP8 KV on 8xH200
   and 8xB300, unique tokens held and requests admitted at 32K and 128K, for SGLang's resident
   pool, HiSparse and ulacache in DP8 and TP8 (what ships under SGLang: index-K replicated in
   TP). Arithmetic on stated budgets, not a measurement.
3. Optionally (``--compare-lru``) ulacache's own policies, PB-LRU against exact LRU, on the same
   selections, with the scheduling time per step measured in the same run.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hisparse import HiSparseReplayResult
from .replay import ReplayResult

CAPACITY_SYSTEMS = ("sglang_dp", "hisparse_dp", "hisparse_tp", "ulacache_dp", "ulacache_tp_repl",
                    "ulacache_dcp_shard")
CAPACITY_LABELS = {"sglang_dp": "SGLang DP8 (resident)", "hisparse_dp": "HiSparse DP8",
                   "hisparse_tp": "HiSparse TP8", "ulacache_dp": "ulacache DP8",
                   "ulacache_tp_repl": "ulacache TP8", "ulacache_dcp_shard": "ulacache TP8 DCP"}
CAPACITY_LENGTHS = (32768, 131072)
CAPACITY_PLATFORMS = "h200,b300"


@dataclass
class Row:
    """One compared figure per decode step: the two values, which is better, by how much."""

    metric: str
    ulacache: float
    hisparse: float
    higher_is_better: bool
    unit: str = ""
    note: str = ""

    TIE = 1.005  # values within 0.5% of each other: no winner (the printed precision)

    @property
    def winner(self) -> str | None:
        lo, hi = sorted((self.ulacache, self.hisparse))
        if hi == lo or (lo > 0 and hi / lo < self.TIE):
            return None
        ula_better = (self.ulacache > self.hisparse) == self.higher_is_better
        return "ulacache" if ula_better else "HiSparse"

    def verdict(self) -> str:
        w = self.winner
        if w is None:
            return "tie"
        if self.metric == "GPU hit rate":
            return f"{w}: {100 * abs(self.ulacache - self.hisparse):+.1f} points"
        hi, lo = max(self.ulacache, self.hisparse), min(self.ulacache, self.hisparse)
        ratio = f"x{hi / lo:.2f}" if lo else "none at all"
        word = "fewer" if self.unit in ("rows", "launches") else "less"
        return f"{w}: {ratio} {word}" if lo else f"{w}: {ratio}"

    def to_dict(self) -> dict:
        return {"metric": self.metric, "ulacache": self.ulacache, "hisparse": self.hisparse,
                "winner": self.winner, "verdict": self.verdict(), "note": self.note}


def residency_rows(ula: ReplayResult, hs: HiSparseReplayResult, launches: dict) -> list[Row]:
    """The compared figures, per decode step summed over the replayed layers."""
    s = ula.steps
    ula_pcie = ula.h2d_bytes_per_step + ula.d2h_bytes_per_step
    lu, lh = launches["ulacache"], launches["hisparse"]
    return [
        Row("GPU hit rate", ula.hit_rate, hs.hit_rate, True),
        Row("misses (rows CPU -> GPU)", ula.misses / s, hs.misses / s, False, "rows"),
        Row("H2D KB", ula.h2d_bytes_per_step / 1024, hs.h2d_bytes_per_step / 1024, False),
        Row("D2H KB", ula.d2h_bytes_per_step / 1024, hs.d2h_bytes_per_step / 1024, False,
            note=("ulacache's tiers are exclusive: an evicted row without a CPU copy is "
                  "written back (a row born on the GPU once; with shadows off, every time); "
                  if ula.shadows else "ulacache's tiers are exclusive and shadows are off: "
                  "every evicted row is written back; ")
            + "HiSparse's host mirror already holds every row, it backs up each new token "
              "once"),
        Row("PCIe KB, both directions", ula_pcie / 1024, hs.pcie_bytes_per_step / 1024, False),
        Row("kernel launches", lu["per_step"], lh["per_step"], False, "launches",
            note=f"ulacache: {lu['how']}; HiSparse: {lh['how']}"),
    ]


def launch_summary(counts: dict[str, dict[str, int]], groups: int) -> dict:
    """Launches per decode step of both systems for ``groups`` selection groups (one per
    layer). ``counts``: :func:`ulacache.tools.launches.count_launches` per counted path."""
    from .launches import hisparse_step_launches, step_launches

    path = "fused" if "fused" in counts else "torch"
    c = counts[path]
    per_step = step_launches(c, groups)
    release = step_launches(c, groups, finished=True) - per_step
    how = (f"counted on the real core, {path} path: {c['round']} round start + {groups} groups "
           f"x ({c['place']} place + {c['access']} access), +{release} on steps that finish a "
           "request")
    if path == "torch":
        how += "; the fused path (the CUDA default) was not counted: Triton is not installed"
    return {
        "ulacache": {"path": path, "per_step": per_step, "release_extra": release,
                     "counts": counts, "how": how},
        "hisparse": {"per_step": hisparse_step_launches(groups),
                     "how": "from SGLang 0.5.23's code, one swap-in kernel per layer + one "
                            "all-layer backup of the newest tokens, not counted"},
    }


def capacity_summary() -> dict:
    """GLM-5 FP8 on 8xH200 and 8xB300 from the capacity accounting, the systems that ship."""
    from . import capacity as cap

    res = cap.run(platforms=CAPACITY_PLATFORMS, models="glm5", layouts="fp8",
                  lengths=CAPACITY_LENGTHS, systems=CAPACITY_SYSTEMS)
    budgets = {}
    a = res["assumptions"]
    for plat in CAPACITY_PLATFORMS.split(","):
        budgets[plat] = {"label": cap.PLATFORMS[plat].label,
                         "kv_gb_per_gpu": a["static_gb_per_gpu"][plat]
                         - a["weights_gb_per_gpu"]["glm5"],
                         "host_gb_per_gpu": a["host_gb_per_gpu"][plat]}
    rows = [{k: r[k] for k in ("platform", "system", "ratio", "unique_tokens", "max_requests")}
            for r in res["rows"]]
    return {"model": "GLM-5", "layout": "fp8", "lengths": list(CAPACITY_LENGTHS),
            "budgets": budgets, "rows": rows,
            "source": "ulacache.tools.capacity (python bench/capacity.py): accounting on stated "
                      "budgets, what SGLang's sizing hook charges; not a measurement"}


def _capacity_verdicts(cap: dict, plat: str) -> str:
    by = {r["system"]: r for r in cap["rows"] if r["platform"] == plat}
    ula, hs = by["ulacache_dp"], by["hisparse_dp"]

    def one(what: str, a: float, b: float, fmt) -> str:
        if a == b:
            return f"{what}: a tie ({fmt(a)})"
        win, lose = ("ulacache DP8", "HiSparse DP8") if a > b else ("HiSparse DP8",
                                                                   "ulacache DP8")
        hi, lo = max(a, b), min(a, b)
        return f"{what}: {win} ({fmt(hi)} vs {lose} {fmt(lo)}, x{hi / lo:.2f})" if lo else \
            f"{what}: {win} ({fmt(hi)}; {lose} none)"

    parts = [one("most unique history", ula["unique_tokens"], hs["unique_tokens"],
                 lambda v: f"{v / 1e6:.2f}M")]
    for n in cap["lengths"]:
        parts.append(one(f"most {n // 1024}K requests", ula["max_requests"][str(n)],
                         hs["max_requests"][str(n)], lambda v: f"{v:,}"))
    return f"{cap['budgets'][plat]['label']}: " + "; ".join(parts)


def _dcp_verdict(cap: dict, plat: str) -> str | None:
    """ulacache TP8 under DCP against HiSparse DP8 (the TP criterion of issue 21); ``None``
    when the capacity rows have no DCP row."""
    by = {r["system"]: r for r in cap["rows"] if r["platform"] == plat}
    if "ulacache_dcp_shard" not in by:
        return None
    d, h = by["ulacache_dcp_shard"], by["hisparse_dp"]
    parts = [f"unique {d['unique_tokens'] / 1e6:.2f}M vs {h['unique_tokens'] / 1e6:.2f}M "
             f"(x{d['unique_tokens'] / h['unique_tokens']:.2f})"]
    for n in cap["lengths"]:
        a, b = d["max_requests"][str(n)], h["max_requests"][str(n)]
        parts.append(f"{n // 1024}K requests {a:,} vs {b:,}" + (f" (x{a / b:.2f})" if b else ""))
    return f"{cap['budgets'][plat]['label']}: ulacache TP8 DCP vs HiSparse DP8: " + \
        "; ".join(parts)


def format_report(trace, ula: ReplayResult, hs: HiSparseReplayResult, launches: dict,
                  capacity: dict | None, lru: ReplayResult | None = None,
                  seconds: float | None = None, write_back: ReplayResult | None = None,
                  equal_host: ReplayResult | None = None) -> str:
    """The report as text (see the module docstring)."""
    meta = trace.meta.raw
    rows = residency_rows(ula, hs, launches)
    lines = [
        "ulacache vs SGLang HiSparse at the same GPU memory",
        f"trace {meta.get('text_file', '?')}: real top-{trace.k} selections of "
        f"{meta.get('model', '?')}, {trace.layers} layers x {trace.steps} steps",
        f"replayed: {ula.requests} interleaved requests x {ula.steps} decode steps, {ula.groups} "
        f"layers (one selection group each), {ula.row_bytes} B rows, through ulacache's real "
        "core in production mode",
        f"GPU rows per layer: HiSparse {hs.requests} requests x (H {hs.h_slots} + "
        f"{hs.reserved_slots} reserved) = {hs.gpu_slots}; ulacache's shared pool: the same "
        f"{ula.gpu_slots}"
        + ("" if ula.gpu_slots == hs.gpu_slots else " (NOT equal)")
        + f", over an exclusive CPU tier of {ula.cpu_slots} rows (HiSparse mirrors every token "
        "on the host)",
        "",
        f"{'per decode step, all layers':<28}{'ulacache':>11}{'HiSparse':>11}   winner",
    ]
    for r in rows:
        fmt = (lambda v: f"{v:.4f}") if r.metric == "GPU hit rate" else \
            (lambda v: f"{v:,.0f}") if r.unit == "launches" else (lambda v: f"{v:,.1f}")
        lines.append(f"{r.metric:<28}{fmt(r.ulacache):>11}{fmt(r.hisparse):>11}   "
                     f"{r.verdict()}")
    for r in rows:
        if r.note:
            lines.append(f"  {r.metric}: {r.note}")
    if write_back is not None:
        lines += format_shadows(ula, write_back, equal_host)
    if capacity:
        lengths = capacity["lengths"]
        head = "".join(f"{'req@' + str(n // 1024) + 'K':>9}" for n in lengths)
        lines += ["", f"What the memory buys on a real deployment: {capacity['model']}, FP8 KV, "
                  "8 GPUs (accounting on stated budgets, not a measurement: python "
                  "bench/capacity.py)"]
        plats = list(capacity["budgets"])
        width = 10 + 9 * len(lengths)  # a platform's columns
        titles = []
        for p in plats:
            b = capacity["budgets"][p]
            titles.append(f"{b['label']}: KV {b['kv_gb_per_gpu']:.0f} GB + host "
                          f"{b['host_gb_per_gpu']:.0f} GB per GPU")
        lines.append(f"{'':<23}" + "".join(f"  {t:<{width}}" for t in titles))
        lines.append(f"{'system':<23}" + "".join(f"  {'unique M':>10}{head}" for _ in plats))
        for system in CAPACITY_SYSTEMS:
            cells = []
            for p in plats:
                r = next(x for x in capacity["rows"] if x["platform"] == p
                         and x["system"] == system)
                cells.append(f"  {r['unique_tokens'] / 1e6:>10.2f}"
                             + "".join(f"{r['max_requests'][str(n)]:>9,}" for n in lengths))
            lines.append(f"{CAPACITY_LABELS[system]:<23}" + "".join(cells))
        lines += [_capacity_verdicts(capacity, p) for p in plats]
        lines += [v for v in (_dcp_verdict(capacity, p) for p in plats) if v]
        lines.append("  ulacache TP8: index-K replicated on every rank; TP8 DCP: each rank attends "
                     "its own stripe under SGLang's --dcp-size 8, index-K striped by page (mode "
                     "'dcp', never run on a GPU); DP8 admits per rank, x8")
    if lru is not None:
        pb = ula if ula.policy == "pblru" else lru
        ex = lru if ula.policy == "pblru" else ula
        lines += ["", "ulacache's own policies on the same selections (scheduling time per step "
                  "measured in this run, 1 torch thread unless --threads):",
                  f"{'policy':<11}{'GPU hit':>9}{'misses':>9}{'sched ms/step':>15}"
                  f"{'policy ms/step':>16}"]
        for r, name in ((pb, "PB-LRU"), (ex, "exact LRU")):
            lines.append(f"{name:<11}{r.hit_rate:>9.4f}{r.misses:>9,}{r.sched_ms_per_step:>15.2f}"
                         f"{r.policy_ms_per_step:>16.2f}")
        rel = (pb.misses - ex.misses) / max(1, ex.misses)
        ratio = pb.policy_ms_per_step / max(1e-9, ex.policy_ms_per_step)
        lines.append(
            f"PB-LRU vs exact LRU: {pb.misses - ex.misses:+,} misses ({rel:+.2%}), policy time "
            f"x{ratio:.2f}. PB-LRU's victim search is a fixed sequence of ops over bucket "
            "counts (O(k + n_b G/1008)), exact LRU scans all G slots: "
            + (f"at {pb.gpu_slots} slots on a CPU the scan is the cheaper; "
               if ratio > 1 else f"even at {pb.gpu_slots} slots PB-LRU is the cheaper; ")
            + "PB-LRU stays flat as pools grow to millions of slots, where the scan dominates "
            "(python bench/pblru_vs_lru.py)")
    else:
        lines += ["", "ulacache's own policies, PB-LRU vs exact LRU: ulacache replay "
                  "--compare-lru"]
    lines += ["", summary(rows, capacity)]
    if seconds is not None:
        lines.append(f"(replay, counts and accounting: {seconds:.1f} s)")
    return "\n".join(lines)


def summary(rows: list[Row], capacity: dict | None) -> str:
    """One paragraph: where ulacache wins and where it does not."""
    by = {r.metric: r for r in rows}
    parts = []
    for metric, noun in (("misses (rows CPU -> GPU)", "misses"),
                         ("PCIe KB, both directions", "PCIe bytes"),
                         ("kernel launches", "kernel launches")):
        r = by[metric]
        if r.winner is None:
            parts.append(f"as many {noun}")
        elif r.ulacache < r.hisparse:
            parts.append(f"x{r.hisparse / max(r.ulacache, 1e-12):.2f} fewer {noun}")
        else:
            parts.append(f"x{r.ulacache / max(r.hisparse, 1e-12):.2f} more {noun}")
    text = (f"In short: at the same GPU memory ulacache has {parts[0]}, {parts[1]} and "
            f"{parts[2]} per decode step than HiSparse on this trace.")
    if capacity:
        held = []
        for plat, b in capacity["budgets"].items():
            rows_p = {r["system"]: r for r in capacity["rows"] if r["platform"] == plat}
            u, h = rows_p["ulacache_dp"]["unique_tokens"], rows_p["hisparse_dp"]["unique_tokens"]
            held.append(f"x{u / h:.2f} ({b['label']})")
        text += (" Per GPU budget ulacache DP8 holds " + " and ".join(held)
                 + " HiSparse DP8's unique history (accounting).")
    return text


def shadow_summary(on: ReplayResult, off: ReplayResult,
                   equal_host: ReplayResult | None = None) -> dict:
    """Write-back-free eviction on the same selections: shadows on vs off, per step (all
    groups). The GPU side is identical (``rows_identical``: every access returned the same
    GPU rows), only the D2H differs. ``equal_host``: shadows on again with the CPU tier at
    HiSparse's host rows (its mirror of every token) instead of the smallest tier that fits;
    the GPU side is again identical, and the shadows have room."""
    def side(r: ReplayResult) -> dict:
        return {"h2d_bytes": r.h2d_bytes_per_step, "eviction_d2h_bytes":
                r.eviction_d2h_bytes_per_step, "backup_d2h_bytes": r.backup_d2h_bytes_per_step,
                "d2h_bytes": r.d2h_bytes_per_step, "remaps": r.remaps_per_step,
                "reclaims": r.reclaims_per_step}
    h2d = on.h2d_bytes_per_step or 1.0
    runs = {"on": on, "off": off} | ({} if equal_host is None else {"equal_host": equal_host})
    return {**{name: side(r) for name, r in runs.items()},
            "cpu_slots": {name: r.cpu_slots for name, r in runs.items()},
            "rows_identical": all(r.rows_digest == on.rows_digest and r.misses == on.misses
                                  for r in runs.values()),
            "eviction_d2h_over_h2d": {name: r.eviction_d2h_bytes_per_step / h2d
                                      for name, r in runs.items()},
            "d2h_over_h2d": {name: r.d2h_bytes_per_step / h2d for name, r in runs.items()}}


def format_shadows(on: ReplayResult, off: ReplayResult,
                   equal_host: ReplayResult | None = None) -> list[str]:
    """The shadow comparison as text lines."""
    s = shadow_summary(on, off, equal_host)
    kb = 1024.0
    cols = ["on", "off"] + ([] if equal_host is None else ["equal_host"])
    head = {"on": "shadows on", "off": "off", "equal_host": "on, CPU +"}
    lines = ["", "Evictions without write-back (shadows) on the same selections, KB per step, "
             "all layers:",
             f"{'':<28}" + "".join(f"{head[c]:>11}" for c in cols)]
    for label, key in (("H2D (promotions)", "h2d_bytes"),
                       ("D2H eviction (rewrites)", "eviction_d2h_bytes"),
                       ("D2H backup (first copies)", "backup_d2h_bytes"),
                       ("D2H total", "d2h_bytes")):
        lines.append(f"{label:<28}" + "".join(f"{s[c][key] / kb:>11,.1f}" for c in cols))
    e, d = s["eviction_d2h_over_h2d"], s["d2h_over_h2d"]
    lines.append(f"  eviction D2H / H2D {e['on']:.3f} on, {e['off']:.3f} off; total D2H / H2D "
                 f"{d['on']:.3f} on, {d['off']:.3f} off; {s['on']['remaps']:,.1f} remaps and "
                 f"{s['on']['reclaims']:,.1f} reclaims per step; every access returned "
                 + ("the same GPU rows" if s["rows_identical"] else "DIFFERENT GPU rows (a bug)"))
    if equal_host is not None:
        c = s["cpu_slots"]
        lines.append(f"  CPU +: the CPU tier at HiSparse's host rows ({c['equal_host']:,}, its "
                     f"mirror of every token) instead of the {c['on']:,} that fit: eviction "
                     f"D2H / H2D {e['equal_host']:.3f}, total {d['equal_host']:.3f} (rows "
                     "born on the GPU, copied once)")
    return lines


def report_dict(ula: ReplayResult, hs: HiSparseReplayResult, launches: dict,
                capacity: dict | None, lru: ReplayResult | None = None,
                write_back: ReplayResult | None = None,
                equal_host: ReplayResult | None = None) -> dict:
    """The report as one JSON-able object (``write_back``: the same replay, shadows off;
    ``equal_host``: shadows on, the CPU tier at HiSparse's host rows)."""
    results = [ula.to_dict()] + ([lru.to_dict()] if lru is not None else [])
    pcie = {r["policy"]: r["h2d_bytes_per_step"] + r["d2h_bytes_per_step"] for r in results}
    return {
        "mode": "dp", "equal_gpu_rows_per_layer": hs.gpu_slots, "results": results,
        "hisparse": hs.to_dict(),
        "rows": [r.to_dict() for r in residency_rows(ula, hs, launches)],
        "launches": launches, "capacity": capacity,
        "pcie_bytes_per_step_ratio_hisparse_over": {
            p: hs.pcie_bytes_per_step / v if v else None for p, v in pcie.items()},
        "shadows": None if write_back is None else {
            **shadow_summary(ula, write_back, equal_host), "shadows_off": write_back.to_dict()},
    }
