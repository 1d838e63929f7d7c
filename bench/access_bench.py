"""Per group-step cost of the fused access path vs the torch reference path, in one run.

For every cell of the grid (batch ``bs`` x top-k ``k``, GPU pool of ``G`` slots, target hit
rate ``h``) two :class:`ulacache.group.SelectionGroup` twins are built with identical geometry
(``--layers`` layers, default 1; ``--row-bytes`` rows, default 656 = one FP8 GLM-5 latent row;
PB-LRU, ``validate=False`` as in serving): ``access_path="torch"`` (the reference, ~300 small
ops per step) and ``access_path="fused"`` (four Triton launches). Both are filled identically:
``G + M`` addresses (``M = --cpu-ratio x G`` rows for the CPU tier) placed in rounds of
``G / 2`` and written with self-describing rows, so the GPU pool ends full and the CPU tier
holds the rest. Then every step, on both twins: a new round (``policy.advance()``, untimed),
then ``access(addrs int64 [bs, k]) -> int32 [bs, k]`` (timed).

Selections (how the hit rate is controlled): each step takes ``bs x k`` DISTINCT addresses,
``round(h x bs x k)`` drawn uniformly without replacement from the rows resident on the GPU
and the rest from the rows on the CPU tier (read from the reference twin's reverse maps before
the step, untimed), shuffled into ``[bs, k]``. So every step has exactly that many hits; the
MEASURED rate ``gpu_hits / accesses`` (the group's counters over the timed steps) is printed
next to the target. A step's selections must fit the pool (``bs x k <= G``; its misses must fit
the CPU tier): other cells are skipped with the reason. (The calibrated locality generator of
bench/decode_sweep.py drives the HiSparse comparison below, whose hit rate it sets itself.)

Per cell: median time per group-step of each path and the ratio torch / fused ("fused
speed-up"); fused launches per group-step (``launch_count()`` diff / steps; must be <= 4);
whether both paths returned identical rows and counters, and identical tables (mapping, owners,
CPU free stack, claim table, every PB-LRU level) on every step, identical pools at the end of
the cell, and whether the rows the fused path points at hold the bytes of the selected
addresses. On CUDA:

- eager: CUDA events with ``torch.cuda.synchronize()`` around each call, after ``--warmup``
  untimed steps (host launch cost included: what an eager step costs);
- graph (unless ``--no-graph``): each path's access captured in a CUDA graph on a static input
  and replayed each step, timed by CUDA events behind a ~2 ms ``_sleep`` (GPU time, as under
  SGLang's decode graphs); a capture failure is reported and the eager figures stand;
- data movement: bytes promoted per step (promotions x row_bytes x layers) / the pinned H2D
  copy bandwidth measured in the same run, and ``access / data-movement`` (fused time, graph
  if captured else eager; goal <= 1.10);
- HiSparse: with SGLang's wheels carried in ``.whl-hisparse/`` and nvcc present, SGLang's own
  swap-in kernel vs ulacache's fused access on identical calibrated selection streams through
  bench/hisparse_head_to_head.py (per batch, ``--hs-context`` tokens, equal GPU rows, one layer):
  ulacache-fused / HiSparse per layer. Otherwise the output says why it did not run.

On CPU the fused kernels run under Triton's interpreter: only launches per group-step and
correctness are results; times are printed labelled "interpreter, not performance". CPU
defaults are small (batch 2, k 64, 256 GPU slots; a few seconds) and cells above
``bs x k = 1024`` or ``2^14`` slots are skipped unless ``--no-cpu-cap``.

    python bench/access_bench.py --json             # CPU: launches + interpreter correctness
    python bench/access_bench.py --quick --json     # on the lent H200 (not run on a GPU yet)
    python bench/access_bench.py                    # GPU: the full grid, a table

Exit status: 0 when every cell matched the reference with <= 4 launches per step; 1 when a cell
differs, exceeds 4 launches or fails; 2 for bad arguments (or no Triton).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def _import_core():
    """``ulacache.kernels`` is ``kernels/`` (pyproject package-dir): an uninstalled checkout
    (the lent GPU machine) gets that mapping here, as bench/device_check.sh's shim does. The
    fused module is imported first: it sets TRITON_INTERPRET before Triton loads on CPU."""
    try:
        import ulacache.kernels  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "ulacache.kernels":
            raise
        for m in [m for m in sys.modules if m == "ulacache" or m.startswith("ulacache.")]:
            del sys.modules[m]
        spec = importlib.util.spec_from_file_location(
            "ulacache.kernels", ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["ulacache.kernels"] = mod
        spec.loader.exec_module(mod)
    from ulacache.kernels import fused_access

    return fused_access


fused_access = _import_core()
import hisparse_head_to_head as h2h  # noqa: E402

from ulacache.group import SelectionGroup  # noqa: E402
from ulacache.pblru import DEFAULT_BUCKETS  # noqa: E402

logger = logging.getLogger("bench.access_bench")

BATCHES, K, POOLS, HIT_RATES = (1, 8, 64, 256), 2048, tuple(range(16, 23)), (0.7, 0.9, 0.99)
QUICK = dict(batches=(1, 64, 256), pools=(20, 22), hit_rates=(0.7, 0.99), steps=8, warmup=2,
             hs_batches=(1, 64))
CPU = dict(batches=(2,), k=64, pools=(256,), hit_rates=(0.7, 0.9, 0.99), steps=3, warmup=1)
CPU_MAX_ENTRIES, CPU_MAX_POOL = 1024, 1 << 14
INTERP = "interpreter, not performance"
GOAL_X_MOVE = 1.10


# -- twins, fill, selections ---------------------------------------------------------------
def make_twins(pool: int, cpu_rows: int, args, device) -> list[SelectionGroup]:
    layers = list(range(args.layers))
    return [SelectionGroup(layers, pool + cpu_rows, pool, cpu_rows, args.row_bytes, device,
                           "pblru", args.buckets, False, access_path=p)
            for p in ("torch", "fused")]


def row_bytes_of(addrs: torch.Tensor, layer: int, n_logical: int, row_bytes: int):
    """Each (address, layer) has its own row (bench/hisparse_head_to_head.encode_rows)."""
    return h2h.encode_rows(addrs + layer * n_logical, row_bytes)


def fill(twins: list[SelectionGroup]) -> None:
    """Place every address in rounds of min(G / 2, 2^18) and write its rows: the last G placed
    stay on the GPU (pool full), the earlier ones are spilled to the CPU tier (full too)."""
    g0 = twins[0]
    n, chunk = g0.n_logical, max(1, min(g0.gpu_slots // 2, 1 << 18))
    for lo in range(0, n, chunk):
        a = torch.arange(lo, min(n, lo + chunk), device=g0.device)
        rows = [row_bytes_of(a, li, n, g0.pools.row_bytes) for li in range(len(g0.layers))]
        for g in twins:
            g.policy.advance()
            g.place(a)
            for li, layer in enumerate(g.layers):
                g.write(layer, a, rows[li])


class HitRateSelections:
    """``bs x k`` distinct addresses per step, ``round(h bs k)`` of them GPU-resident."""

    def __init__(self, hit: float, bs: int, k: int, seed: int, device: torch.device):
        self.bs, self.k, self.dev = bs, k, device
        self.n_hit = round(hit * bs * k)
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def _pick(self, owners: torch.Tensor, n: int) -> torch.Tensor:
        live = owners[owners >= 0]
        assert live.numel() >= n, "the pool cannot supply this step's selections"
        return live[torch.randperm(live.numel(), generator=self.gen, device=self.dev)[:n]]

    def step(self, g: SelectionGroup) -> torch.Tensor:
        n = self.bs * self.k
        loc = g.loc[: g.n_logical]  # CPU-resident: a primary in the CPU tier
        on_cpu = torch.where(loc >= g.gpu_slots, torch.arange(g.n_logical, device=self.dev), -1)
        sel = torch.cat([self._pick(g.gpu_owner[: g.gpu_slots].long(), self.n_hit),
                         self._pick(on_cpu, n - self.n_hit)])
        return sel[torch.randperm(n, generator=self.gen, device=self.dev)].view(self.bs, self.k)


def differs(ref: SelectionGroup, fused: SelectionGroup, pools: bool) -> str | None:
    state = fused_access.equivalence_state
    a, b = state(ref, pools), state(fused, pools)
    for name in a:
        if not torch.equal(a[name], b[name].to(a[name].device)):
            return name
    return None


def bad_rows(g: SelectionGroup, rows: torch.Tensor, sel: torch.Tensor) -> int:
    """Selected rows whose returned GPU row does not hold the address's bytes (every layer)."""
    return sum(h2h.check_rows(g.pools.gpu[li], rows, sel + li * g.n_logical)
               for li in range(len(g.layers)))


# -- timing --------------------------------------------------------------------------------
def eager_seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) * 1e-3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def capture(g: SelectionGroup, static: torch.Tensor, out: torch.Tensor):
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        g.access(static, out=out)
    torch.cuda.current_stream().wait_stream(s)
    return graph


def _med_us(ts: list[float]) -> float | None:
    return round(statistics.median(ts) * 1e6, 2) if ts else None


# -- one cell ------------------------------------------------------------------------------
def run_cell(bs: int, pool: int, hit: float, args, device, h2d_gbps) -> dict:
    cpu_rows = max(1, round(args.cpu_ratio * pool))
    cell = {"batch": bs, "k": args.k, "pool": pool, "cpu_rows": cpu_rows, "layers": args.layers,
            "row_bytes": args.row_bytes, "hit_target": hit, "steps": args.steps,
            "warmup": args.warmup, "identical": True, "mismatch": None, "error": None}
    twins = make_twins(pool, cpu_rows, args, device)
    ref, fused = twins
    fill(twins)
    cuda, every_pool = device.type == "cuda", device.type != "cuda"
    what = differs(ref, fused, pools=every_pool)
    what = f"fill: {what}" if what else None
    sel_gen = HitRateSelections(hit, bs, args.k, args.seed, device)
    times = {"torch": [], "fused": [], "torch_graph": [], "fused_graph": []}
    launches, c0 = 0, None

    def step(i: int, phase: str, run) -> None:
        nonlocal launches, c0, what
        sel = sel_gen.step(ref)
        if i == args.warmup and phase == "eager":
            c0 = ref.counter_values()
        outs = []
        for name, g in (("torch", ref), ("fused", fused)):
            g.policy.advance()
            n0 = fused_access.launch_count()
            out, dt = run(name, g, sel)
            if name == "fused" and phase == "eager":
                launches += fused_access.launch_count() - n0
            if i >= args.warmup:
                times[name if phase == "eager" else f"{name}_graph"].append(dt)
            outs.append(out)
        if what is None and not torch.equal(outs[0], outs[1]):
            what = f"{phase} step {i}: returned rows"
        if what is None and bad_rows(fused, outs[1], sel):
            what = f"{phase} step {i}: fused rows hold wrong bytes"
        if what is None:
            name = differs(ref, fused, pools=every_pool)
            what = f"{phase} step {i}: {name}" if name else None

    def eager(name, g, sel):
        box = []
        dt = eager_seconds(lambda: box.append(g.access(sel)), device)
        return box[0], dt

    for i in range(args.warmup + args.steps):
        step(i, "eager", eager)
    c1 = ref.counter_values()
    cell["graph_error"] = None
    if cuda and args.graph:
        try:
            static = torch.empty(bs, args.k, dtype=torch.int64, device=device)
            outs = {n: torch.empty(bs, args.k, dtype=torch.int32, device=device)
                    for n in ("torch", "fused")}
            graphs = {"torch": capture(ref, static, outs["torch"]),
                      "fused": capture(fused, static, outs["fused"])}
            start, stop = h2h._timer(device)

            def replay(name, g, sel):
                static.copy_(sel)
                t0 = start()
                graphs[name].replay()
                return outs[name].clone(), stop(t0)

            for i in range(args.steps):
                step(args.warmup + i, "graph", replay)
        except Exception as e:  # noqa: BLE001 - reported; the eager figures stand
            cell["graph_error"] = f"{type(e).__name__}: {e}"[:300]
            logger.warning("batch %d pool %d: graph capture failed: %s", bs, pool, e)
    if what is None and not every_pool:
        name = differs(ref, fused, pools=True)
        what = f"end of cell: {name}" if name else None
    d = {k: c1[k] - c0[k] for k in c1}
    cell.update(identical=what is None, mismatch=what,
                launches_per_step=launches / (args.warmup + args.steps),
                hit_measured=round(d["gpu_hits"] / max(1, d["accesses"]), 6),
                accesses_per_step=d["accesses"] / args.steps,
                promotions_per_step=d["promotions"] / args.steps,
                access_overflow=d["access_overflow"] + d["invalid"])
    moved = cell["promotions_per_step"] * args.row_bytes * args.layers
    cell["bytes_promoted_per_step"] = moved
    if not cuda:
        cell.update(timing=INTERP, torch_ms_cpu=round(statistics.median(times["torch"]) * 1e3, 3),
                    fused_ms_interpreter=round(statistics.median(times["fused"]) * 1e3, 3))
        return cell
    t, f = _med_us(times["torch"]), _med_us(times["fused"])
    tg, fg = _med_us(times["torch_graph"]), _med_us(times["fused_graph"])
    best = fg if fg is not None else f
    move_us = round(moved / (h2d_gbps * 1e9) * 1e6, 3) if h2d_gbps else None
    cell.update(timing="cuda-events", torch_us=t, fused_us=f, speedup=round(t / f, 3),
                torch_graph_us=tg, fused_graph_us=fg,
                graph_speedup=round(tg / fg, 3) if tg and fg else None,
                data_move_us=move_us,
                access_over_move=round(best / move_us, 3) if move_us else None)
    return cell


# -- HiSparse (bench/hisparse_head_to_head.py's machinery) --------------------------------
def hisparse(args, device, h2d_gbps) -> dict:
    if not args.hisparse:
        return {"ran": False, "reason": "--no-hisparse"}
    if device.type != "cuda":
        return {"ran": False, "reason": "no CUDA device: SGLang's swap-in kernel needs one"}
    sg, tv = h2h.find_wheels(args.wheel_dir)
    if sg is None or tv is None:
        return {"ran": False, "reason": f"HiSparse wheels not carried ({args.wheel_dir} lacks "
                                        f"{h2h.SGLANG_WHEEL} / {h2h.TVM_FFI_WHEEL})"}
    if h2h.cuda_home() is None:
        return {"ran": False, "reason": "nvcc not found (set CUDA_HOME)"}
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="access_bench_hs_") as tmp:
            srcs = h2h.unpack(args.wheel_dir, Path(tmp))
            if srcs.missing():
                return {"ran": False, "reason": "missing in the wheels: " + ", ".join(
                    srcs.missing())}
            h_slots = 2 * args.k
            kernel = h2h.build_kernel(srcs, Path(tmp), args.k, h_slots)
            for b in args.hs_batches:
                sz = h2h.sizing(b, args.hs_context, args.warmup + args.steps, args.k, h_slots,
                                row_bytes=args.row_bytes)
                stream = h2h.selection_stream(b, args.hs_context, sz.steps, args.k, args.seed)
                hs = h2h.run_side(h2h.HiSparseSide(sz, device, kernel), sz, stream,
                                  args.warmup, h2d_gbps)
                side = h2h.UlaSide(sz, device)
                path = "fused" if side.g.fused is not None else "torch"
                ula = h2h.run_side(side, sz, stream, args.warmup, h2d_gbps)
                del side
                torch.cuda.empty_cache()
                rows.append({"batch": b, "context": args.hs_context, "gpu_rows": sz.gpu_rows,
                             "ulacache_path": path, "hisparse_us": hs.time_us_median,
                             "ulacache_us": ula.time_us_median,
                             "ulacache_over_hisparse": round(ula.time_us_median / max(
                                 1e-9, hs.time_us_median), 3),
                             "hit_hisparse": hs.hit_rate, "hit_ulacache": ula.hit_rate,
                             "valid": hs.valid and ula.valid})
    except Exception as e:  # noqa: BLE001 - reported, the main grid stands
        return {"ran": bool(rows), "reason": f"failed: {type(e).__name__}: {e}"[:500],
                "rows": rows}
    return {"ran": True, "reason": None, "rows": rows}


# -- grid, environment, output -------------------------------------------------------------
def plan(args, device) -> tuple[list[tuple[int, int, float]], list[dict]]:
    cells, skipped = [], []
    for pool in args.pools:
        for bs in args.batches:
            for hit in args.hit_rates:
                n, cpu_rows = bs * args.k, max(1, round(args.cpu_ratio * pool))
                why = None
                if n > pool:
                    why = f"batch x k = {n} > {pool} GPU slots (a step must fit the pool)"
                elif n - round(hit * n) > cpu_rows:
                    why = f"{n - round(hit * n)} misses per step > {cpu_rows} CPU rows"
                elif device.type != "cuda" and args.cpu_cap and \
                        (n > CPU_MAX_ENTRIES or pool > CPU_MAX_POOL):
                    why = (f"CPU cap: Triton's interpreter is slow; batch x k <= "
                           f"{CPU_MAX_ENTRIES} and pool <= {CPU_MAX_POOL} (--no-cpu-cap)")
                if why:
                    skipped.append({"batch": bs, "pool": pool, "hit_target": hit,
                                    "reason": why})
                else:
                    cells.append((bs, pool, hit))
    return cells, skipped


def environment(device) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    triton = getattr(fused_access, "triton", None)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": getattr(triton, "__version__", None),
            "interpreter": bool(fused_access.INTERPRETED), "python": sys.version.split()[0],
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git_commit": commit}


def failed(cell: dict) -> bool:
    return (not cell.get("identical")) or cell.get("error") is not None or \
        cell.get("launches_per_step", 0) > fused_access.LAUNCHES_PER_CALL


def format_table(res: dict) -> str:
    env, cfg = res["env"], res["config"]
    cpu = env["device"] == "cpu"
    lines = [f"fused vs torch access per group-step on {env['device']} (torch {env['torch']}, "
             f"triton {env['triton']}, commit {str(env['git_commit'])[:10]}): k={cfg['k']}, "
             f"{cfg['layers']} layer(s) x {cfg['row_bytes']} B rows, {cfg['steps']} timed steps "
             f"after {cfg['warmup']} warm-up; hit rate: target / measured (gpu_hits/accesses)"]
    lines += [f"note: {n}" for n in res["notes"]]
    if cpu:
        lines.append(f"{'batch':>6}{'pool':>9}{'hit tgt':>8}{'hit got':>8}{'launch/st':>10}"
                     f"{'identical':>10}   torch ms (CPU) / fused ms ({INTERP})")
    else:
        lines.append(f"{'batch':>6}{'pool':>9}{'hit tgt':>8}{'hit got':>8}{'torch us':>10}"
                     f"{'fused us':>10}{'x':>7}{'g.torch':>9}{'g.fused':>9}{'g.x':>7}"
                     f"{'move us':>9}{'acc/move':>9}{'launch/st':>10}{'identical':>10}")
    for c in res["cells"]:
        ok = "yes" if c["identical"] else f"NO ({c['mismatch'] or c['error']})"
        head = f"{c['batch']:>6}{c['pool']:>9}{c['hit_target']:>8.3f}" \
            f"{c.get('hit_measured', float('nan')):>8.4f}"
        if c.get("error"):
            lines.append(f"{head}  ERROR {c['error']}")
        elif cpu:
            lines.append(f"{head}{c['launches_per_step']:>10.2f}{ok:>10}   "
                         f"{c['torch_ms_cpu']:.1f} / {c['fused_ms_interpreter']:.1f}")
        else:
            def f(x, w=9, p=1):
                return f"{'-':>{w}}" if x is None else f"{x:>{w}.{p}f}"
            lines.append(f"{head}{f(c['torch_us'], 10)}{f(c['fused_us'], 10)}"
                         f"{f(c['speedup'], 7, 2)}{f(c['torch_graph_us'])}"
                         f"{f(c['fused_graph_us'])}{f(c['graph_speedup'], 7, 2)}"
                         f"{f(c['data_move_us'], 9, 2)}{f(c['access_over_move'], 9, 2)}"
                         f"{c['launches_per_step']:>10.2f}{ok:>10}")
    if not cpu:
        lines.append(f"x = torch / fused (fused speed-up); g. = CUDA-graph replay; move us = "
                     f"bytes promoted / pinned H2D {res['h2d_copy_gbps']} GB/s; acc/move = fused "
                     f"(graph if captured) / move, goal <= {GOAL_X_MOVE:.2f}")
    for s in res["skipped"]:
        lines.append(f"skipped batch {s['batch']} pool {s['pool']} hit {s['hit_target']}: "
                     f"{s['reason']}")
    hs = res["hisparse"]
    if not hs["ran"] or hs.get("reason"):
        lines.append(f"HiSparse comparison not run: {hs['reason']}")
    for r in hs.get("rows", []):
        lines.append(f"HiSparse batch {r['batch']} ctx {r['context']} ({r['gpu_rows']} GPU rows): "
                     f"ulacache-{r['ulacache_path']} {r['ulacache_us']:.1f} us / HiSparse "
                     f"{r['hisparse_us']:.1f} us per layer = x{r['ulacache_over_hisparse']:.3f} "
                     f"(hit {r['hit_ulacache']:.3f} / {r['hit_hisparse']:.3f}, "
                     f"{'valid' if r['valid'] else 'INVALID'})")
    lines.append("result: " + ("ok" if res["ok"] else "FAILED (a cell differs from the "
                               "reference, exceeds 4 launches per step, or failed)"))
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def pool_size(text: str) -> int:
    """``16`` -> 2^16 (plain values below 64 are log2), ``2^16`` -> 2^16, ``256`` -> 256."""
    text = text.strip()
    if text.startswith("2^"):
        return 1 << int(text[2:])
    v = int(text)
    return 1 << v if 0 <= v < 64 else v


def _pools(text: str) -> tuple[int, ...]:
    return tuple(pool_size(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None, cuda: bool) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--quick", action="store_true",
                    help=f"GPU smoke grid: {QUICK['batches']} x pools 2^{QUICK['pools']} x hit "
                         f"{QUICK['hit_rates']}, {QUICK['steps']} steps (ignored on CPU)")
    ap.add_argument("--batches", type=_ints, help=f"default {BATCHES} (CPU {CPU['batches']})")
    ap.add_argument("--k", type=int, help=f"top-k, default {K} (CPU {CPU['k']})")
    ap.add_argument("--pools", type=_pools,
                    help="GPU slots: log2 values (< 64) or ints, default 16..22 (CPU 256)")
    ap.add_argument("--hit-rates", type=_floats, help=f"targets in (0, 1], default {HIT_RATES}")
    ap.add_argument("--steps", type=int, help="timed steps per cell (default 10; CPU 3)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 3; CPU 1)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--row-bytes", type=int, default=h2h.ROW_BYTES)
    ap.add_argument("--cpu-ratio", type=float, default=1.0, help="CPU-tier rows per GPU slot")
    ap.add_argument("--buckets", type=int, default=DEFAULT_BUCKETS, help="PB-LRU recent buckets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-graph", dest="graph", action="store_false",
                    help="skip the CUDA-graph replay timing")
    ap.add_argument("--no-hisparse", dest="hisparse", action="store_false")
    ap.add_argument("--hs-context", type=int, default=32768, help="HiSparse cells' context")
    ap.add_argument("--hs-batches", type=_ints, help="HiSparse batches (default --batches)")
    ap.add_argument("--wheel-dir", type=Path, default=h2h.WHEEL_DIR)
    ap.add_argument("--no-cpu-cap", dest="cpu_cap", action="store_false",
                    help="run cells above the CPU interpreter caps anyway")
    args = ap.parse_args(argv)
    base = dict(batches=BATCHES, k=K, pools=POOLS, hit_rates=HIT_RATES, steps=10, warmup=3)
    if not cuda:
        base.update(CPU)
    elif args.quick:
        base.update({k: v for k, v in QUICK.items() if k != "hs_batches"})
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, tuple(pool_size(str(p)) for p in value)
                    if name == "pools" else value)
    if args.hs_batches is None:
        args.hs_batches = QUICK["hs_batches"] if cuda and args.quick else args.batches
    checks = [(args.k >= 1, "--k must be >= 1"), (args.steps >= 1, "--steps must be >= 1"),
              (args.warmup >= 0, "--warmup must be >= 0"),
              (args.layers >= 1, "--layers must be >= 1"),
              (args.row_bytes >= 1, "--row-bytes must be >= 1"),
              (args.buckets >= 1, "--buckets must be >= 1"),
              (args.cpu_ratio > 0, "--cpu-ratio must be > 0"),
              (bool(args.batches) and min(args.batches) >= 1, "--batches must be >= 1"),
              (bool(args.pools) and min(args.pools) >= 2, "--pools must be >= 2 slots"),
              (bool(args.hit_rates) and all(0 < h <= 1 for h in args.hit_rates),
               "--hit-rates must lie in (0, 1]")]
    for ok, msg in checks:
        if not ok:
            ap.error(msg)
    args.error = ap.error
    return args


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    args = parse_args(argv, cuda)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    device = torch.device("cuda" if cuda else "cpu")
    if not fused_access.available():
        print("bench/access_bench.py: Triton is not installed; the fused path cannot run",
              file=sys.stderr)
        return 2
    cells, skipped = plan(args, device)
    if not cells:
        args.error("no cell fits: " + "; ".join(sorted({s["reason"] for s in skipped})))
    notes = []
    if not cuda:
        notes.append(f"no CUDA: the fused kernels run in Triton's interpreter; times are "
                     f"{INTERP}; results are launches per step and correctness. Grid capped "
                     f"at batch x k <= {CPU_MAX_ENTRIES}, pool <= {CPU_MAX_POOL}"
                     + ("" if args.cpu_cap else " (cap off: --no-cpu-cap)"))
    h2d = h2h.measure_h2d_gbps(device)
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional
        def tqdm(x, **_):
            return x
    out = []
    for bs, pool, hit in tqdm(cells, desc="cells", file=sys.stderr, disable=None):
        t0 = time.perf_counter()
        try:
            out.append(run_cell(bs, pool, hit, args, device, h2d))
        except Exception as e:  # noqa: BLE001 - one failed cell is reported, the rest run
            logger.exception("batch %d pool %d hit %s failed", bs, pool, hit)
            out.append({"batch": bs, "k": args.k, "pool": pool, "hit_target": hit,
                        "identical": False, "mismatch": None,
                        "error": f"{type(e).__name__}: {e}"[:300]})
        logger.info("batch %d pool %d hit %.3f: %.1f s", bs, pool, hit, time.perf_counter() - t0)
        if cuda:
            torch.cuda.empty_cache()
    cfg = {k: getattr(args, k) for k in ("batches", "k", "pools", "hit_rates", "steps",
                                         "warmup", "layers", "row_bytes", "cpu_ratio",
                                         "buckets", "seed", "graph", "hs_context", "hs_batches")}
    cfg["graph"] = args.graph and cuda
    res = {"env": environment(device), "config": cfg, "h2d_copy_gbps": h2d, "cells": out,
           "skipped": skipped, "hisparse": hisparse(args, device, h2d), "notes": notes}
    res["ok"] = not any(failed(c) for c in out)
    print(json.dumps(res) if args.json else format_table(res))
    if args.json:
        logger.info("%s", format_table(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
