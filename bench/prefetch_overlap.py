"""Overlap of the prefetch stream's copies with an attention-sized kernel on the forward stream.

Does a prefetch (:class:`ulacache.prefetch.PrefetchEngine`, its side stream running the
group's fused prefetch) actually run *under* the attention that precedes the access it feeds,
or does it just add its time? Measured on a real address space, as a ratio to the serial time.

Setup (CUDA only): an :class:`ulacache.space.AddressSpace` with FP8 rows (656 B, the
FlashMLA "FP8 with scale" layout), ``--layers`` layers in selection groups of one,
``--gpu-slots`` GPU and ``--cpu-slots`` CPU slots per layer (pinned host memory, as the core
allocates it), ``validate=False`` and the default access path (the fused Triton kernels on
CUDA). ``gpu_slots + cpu_slots - 2 x rows`` addresses are placed (rounds of ``gpu_slots``), so
the GPU pool ends full and the CPU tier holds the rest with ``2 x --rows`` slots free: room for
the first prefetches' victims (rows born on the GPU) to be written back while the prefetched
rows keep their CPU copy as a shadow; from then on each prefetch's victims are the previous
step's prefetched rows (admitted cold), remapped to their shadows without a copy, so a step's
traffic is the prefetch's H2D rows alone (write-backs and remaps per step are reported). A
:class:`PrefetchEngine` with source ``previous_layer`` and ``fetch_cap = --rows`` (each
prefetch moves ``--rows`` rows, every layer of its group).

One timed *step* covers groups ``1 .. L - 1`` (group 0 gets no previous-layer prediction),
exactly as a decode step orders them (``issue`` after the previous group's selection,
attention of that layer on the forward stream, the group's ``before_access`` join):

- (a) attention alone: ``L - 1`` attention stand-ins on the current stream;
- (b) prefetch alone: per group ``engine.issue(g, prediction)`` then ``engine.before_access(g)``
  (the side stream waits for the caller's stream, the caller's stream for the group's event);
- (c) both: per group ``engine.issue(g, prediction)``, the attention stand-in on the current
  stream, then ``engine.before_access(g)``: the prefetch can only hide under the attention.

``overlap ratio = (c) / ((a) + (b))``: 1.0 is fully serial, ``max(a, b) / (a + b)`` (the
``ideal`` bound, printed with it) is perfect overlap; ``hidden = ((a) + (b) - (c)) / min(a, b)``
is the share of the shorter side that disappeared (1.0 perfect, 0.0 serial). Target: ratio <=
0.75 (``TARGET_RATIO``; only reachable when the ideal bound is below it, i.e. the two sides are
of comparable length, which the defaults aim for).

The attention stand-in: one layer's sparse MLA decode for a batch, dense: per request its
``--heads`` query heads ``[heads, 576]`` against its ``--topk`` selected latent rows ``[topk,
576]`` (QK^T, ``torch.bmm``), a softmax, then ``[heads, topk] x [topk, 512]`` (PV), bf16:
``2 x batch x heads x topk x (576 + 512)`` FLOP per layer (36.5 GFLOP at the defaults 64 x 128
x 2048: an estimated 0.05-0.1 ms on an H200, not measured yet; a prefetch of 4096 rows of 656 B
is 2.7 MB, ~0.05 ms at PCIe 5's ~55 GB/s plus its four bookkeeping launches, so the two sides
should be of comparable length; the JSON reports both, and the ideal bound says how balanced).

Every repetition re-fetches: before each prefetch step (untimed) the engine's step starts
(``begin_step``, ``begin_round``, ``round_started``) and each group's prediction is rebuilt
from its mapping table: ``--rows`` addresses CPU-resident *now* (drawn at random) plus
GPU-resident ones (``--pred-hit`` of the prediction, which the prefetch skips, as a real
previous-layer prediction is mostly hits), shuffled. Prefetched rows enter at the lowest
recency, so the next step's prefetch evicts them back. The ``prefetches`` counter of every
group is read around each timed step: rows moved per step are reported, and a timed prefetch
that moved nothing fails the run (exit 1).

Control: the same bytes per group (``--rows x 656 B x layers per group``) as one plain
``torch`` H2D copy from pinned memory on a side stream (the copy engine), against the same
attention, same event structure. A poor prefetch ratio next to a good control is the engine's
(its copies are SM loads of pinned memory, competing with the attention for SMs); both poor,
the hardware's.

Timing: CUDA events around each step, queued behind a ``torch.cuda._sleep`` longer than the
host's launch time (so launch gaps are hidden, as under a CUDA graph; reported as
``launch_hidden``), modes interleaved per repetition, median of ``--reps`` after ``--warmup``.

    python bench/prefetch_overlap.py --json           # the defaults, one JSON object on stdout
    python bench/prefetch_overlap.py --quick --json   # bench/device_check.sh (< 45 s, H200)

Exit status: 0 measured (the target is reported, not enforced); 1 when a timed prefetch moved
no row (or the fill overflowed); 2 when nothing could be measured (no CUDA, too little memory,
bad arguments), with a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

logger = logging.getLogger("bench.prefetch_overlap")

TARGET_RATIO = 0.75
D_QK, D_V = 576, 512  # MLA: 512 NoPE + 64 RoPE dims scored, 512 values
DEFAULTS = dict(layers=8, gpu_slots=16384, cpu_slots=65536, rows=4096, pred_hit=0.75, batch=64,
                heads=128, topk=2048, reps=30, warmup=3)
QUICK = dict(layers=4, cpu_slots=32768, reps=20, warmup=2)
SLEEP_MS = 5.0  # queue ahead of the first timed steps; recalibrated from the warm-up's host time


def overlap(a_ms: float, b_ms: float, both_ms: float) -> dict[str, float]:
    """Compute alone ``a``, transfer alone ``b``, both concurrently: ``ratio`` = both / (a +
    b) (1.0 serial), ``ideal`` = max(a, b) / (a + b) (perfect overlap), ``hidden`` = (a + b -
    both) / min(a, b) (share of the shorter side hidden: 1.0 perfect, 0.0 serial)."""
    serial = a_ms + b_ms
    return {"ratio": round(both_ms / serial, 4), "ideal": round(max(a_ms, b_ms) / serial, 4),
            "hidden": round((serial - both_ms) / min(a_ms, b_ms), 4)}


def _import_core() -> None:
    """``ulacache.kernels`` is ``kernels/`` (pyproject package-dir): an uninstalled checkout
    gets that mapping here, as bench/device_check.sh's shim does."""
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


class Unmeasurable(Exception):
    """Nothing can be measured here (exit 2, one line)."""


class Failed(Exception):
    """The measurement is invalid (exit 1, one line)."""


# -- the attention stand-in ------------------------------------------------------------------
class Attention:
    """One layer's sparse MLA decode for a batch, dense: QK^T bmm, softmax, PV bmm (bf16)."""

    def __init__(self, batch: int, heads: int, topk: int, device: torch.device):
        gen = torch.Generator(device=device).manual_seed(0)
        bf16 = torch.bfloat16
        self.q = torch.randn(batch, heads, D_QK, device=device, dtype=bf16, generator=gen)
        self.kv = torch.randn(batch, topk, D_QK, device=device, dtype=bf16, generator=gen)
        self.scores = torch.empty(batch, heads, topk, device=device, dtype=bf16)
        self.out = torch.empty(batch, heads, D_V, device=device, dtype=bf16)
        self.gflop = 2 * batch * heads * topk * (D_QK + D_V) / 1e9
        self.what = (f"bmm [{batch} x {heads} x {D_QK}] x [{D_QK} x {topk}], softmax, bmm "
                     f"[{heads} x {topk}] x [{topk} x {D_V}], bf16")

    def __call__(self) -> None:
        torch.bmm(self.q, self.kv.transpose(1, 2), out=self.scores)
        p = torch.softmax(self.scores, dim=-1)
        torch.bmm(p, self.kv[:, :, :D_V], out=self.out)


# -- timing ----------------------------------------------------------------------------------
class Timer:
    """GPU milliseconds of ``fn()`` between CUDA events on the current stream, queued behind a
    ``_sleep`` longer than the host's launches (so the GPU never waits for the host)."""

    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        probe = []
        for _ in range(3):
            self.start.record()
            torch.cuda._sleep(1_000_000)
            self.end.record()
            self.end.synchronize()
            probe.append(self.start.elapsed_time(self.end))
        self.cycles_per_ms = 1_000_000 / max(1e-3, statistics.median(probe))
        self.sleep_ms = SLEEP_MS
        self.host_ms: list[float] = []  # host launch time of every call since the last reset

    def __call__(self, fn) -> float:
        torch.cuda._sleep(int(self.sleep_ms * self.cycles_per_ms))
        self.start.record()
        t0 = time.perf_counter()
        fn()
        self.host_ms.append((time.perf_counter() - t0) * 1e3)
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)

    def calibrate(self) -> None:
        """Sleep at least twice the slowest host launch time seen since the last reset."""
        if self.host_ms:
            self.sleep_ms = max(2.0, 2.0 * max(self.host_ms))
        self.host_ms = []


# -- the address space and the engine ----------------------------------------------------------
class Setup:
    def __init__(self, args, device: torch.device):
        from ulacache.config import PrefetchConfig, UlaCacheConfig
        from ulacache.errors import CapacityExhausted
        from ulacache.group import COUNTERS
        from ulacache.prefetch import PrefetchEngine
        from ulacache.space import AddressSpace

        self.args, self.dev = args, device
        cfg = UlaCacheConfig(layout="fp8", n_layers=args.layers, layers_per_group=1,
                             gpu_slots=args.gpu_slots, cpu_slots=args.cpu_slots,
                             validate=False)
        self.G = args.gpu_slots
        self.n = args.gpu_slots + args.cpu_slots - 2 * args.rows  # 2 x rows CPU slots free
        try:
            self.space = AddressSpace(cfg, device, n_logical=self.n)
        except CapacityExhausted as e:
            raise Unmeasurable(str(e)) from None
        self.row_bytes = cfg.row_layout.row_bytes
        self.layers_per_group = cfg.layers_per_group
        self.cols = {k: COUNTERS.index(k) for k in ("prefetches", "writebacks", "remaps",
                                                    "place_overflow")}
        t0 = time.perf_counter()
        for lo in range(0, self.n, self.G):  # the last G placed stay; the rest spill
            self.space.begin_round()
            self.space.place(torch.arange(lo, min(self.n, lo + self.G), device=device))
        self.space.begin_round()
        overflow = int(self.space.counter_table[:, self.cols["place_overflow"]].sum())
        if overflow:
            raise Failed(f"the fill overflowed: {overflow} rows not stored")
        logger.info("filled %d addresses x %d layers (%d GPU + %d CPU slots of %d B) in %.1f s",
                    self.n, args.layers, self.G, args.cpu_slots, self.row_bytes,
                    time.perf_counter() - t0)
        self.fused = self.space.groups[0].fused is not None
        self.engine = PrefetchEngine(
            self.space, PrefetchConfig(sources=("previous_layer",), fetch_cap=args.rows),
            cfg.n_groups, self.row_bytes * self.layers_per_group, device)
        self.groups = list(range(1, cfg.n_groups))  # what previous_layer prefetches
        self.hits = min(round(args.rows * args.pred_hit / (1 - args.pred_hit)), self.G)
        self.gen = torch.Generator(device=device).manual_seed(args.seed)

    def counts(self) -> torch.Tensor:
        """``int64 [groups, 3]`` prefetches, writebacks, remaps (host copy: synchronises)."""
        c = self.cols
        return self.space.counter_table[:, [c["prefetches"], c["writebacks"], c["remaps"]]].cpu()

    def _pick(self, pool: torch.Tensor, n: int) -> torch.Tensor:
        return pool[torch.randperm(pool.numel(), device=self.dev, generator=self.gen)[:n]]

    def new_step(self) -> list[torch.Tensor]:
        """Start an engine step (untimed) and draw each prefetched group's prediction from its
        mapping now: ``rows`` CPU-resident addresses and ``hits`` GPU-resident ones,
        shuffled."""
        self.engine.begin_step()
        self.space.begin_round()
        self.engine.round_started()
        preds = []
        for g in self.groups:
            loc = self.space.groups[g].loc[: self.n]
            on_cpu = torch.nonzero(loc >= self.G).view(-1)
            on_gpu = torch.nonzero((loc >= 0) & (loc < self.G)).view(-1)
            if on_cpu.numel() < self.args.rows:
                raise Failed(f"group {g} has {on_cpu.numel()} CPU-resident rows, fewer than "
                             f"--rows {self.args.rows}")
            pred = torch.cat([self._pick(on_cpu, self.args.rows), self._pick(on_gpu, self.hits)])
            preds.append(self._pick(pred, pred.numel()))
        return preds


class Bench:
    """The five timed modes of one repetition, interleaved."""

    def __init__(self, setup: Setup, attention: Attention, timer: Timer):
        self.s, self.attn, self.timer = setup, attention, timer
        dev, n = setup.dev, len(setup.groups)
        self.bytes_per_group = setup.args.rows * setup.row_bytes * setup.layers_per_group
        self.src = torch.empty((n, self.bytes_per_group), dtype=torch.uint8, pin_memory=True)
        self.src.fill_(7)
        self.dst = torch.empty((n, self.bytes_per_group), dtype=torch.uint8, device=dev)
        self.side = torch.cuda.Stream(dev)
        self.copied = [torch.cuda.Event() for _ in range(n)]
        self.times: dict[str, list[float]] = {k: [] for k in ("attention", "prefetch", "both",
                                                               "copy", "copy_both")}
        self.moved: dict[str, list[list[int]]] = {"prefetch": [], "both": []}  # [rep][group]
        self.evicted: dict[str, list[tuple[int, int]]] = {"prefetch": [], "both": []}

    # the step bodies (what is timed)
    def attention(self) -> None:
        for _ in self.s.groups:
            self.attn()

    def prefetch(self, preds, with_attention: bool) -> None:
        eng = self.s.engine
        for g, pred in zip(self.s.groups, preds):
            eng.issue(g, pred)
            if with_attention:
                self.attn()
            eng.before_access(g)

    def copy(self, with_attention: bool) -> None:
        cur = torch.cuda.current_stream()
        for i in range(len(self.s.groups)):
            self.side.wait_stream(cur)
            with torch.cuda.stream(self.side):
                self.dst[i].copy_(self.src[i], non_blocking=True)
                self.copied[i].record(self.side)
            if with_attention:
                self.attn()
            cur.wait_event(self.copied[i])

    def _prefetch_mode(self, name: str, with_attention: bool, timed: bool) -> None:
        preds = self.s.new_step()
        before = self.s.counts()
        ms = self.timer(lambda: self.prefetch(preds, with_attention))
        diff = (self.s.counts() - before)[self.s.groups]
        if not timed:
            return
        moved = diff[:, 0].tolist()
        if min(moved) <= 0:
            g = self.s.groups[moved.index(min(moved))]
            raise Failed(f"a timed prefetch moved nothing ({name} step "
                         f"{len(self.times[name])}, group {g}: {min(moved)} of "
                         f"{self.s.args.rows} rows)")
        self.times[name].append(ms)
        self.moved[name].append(moved)
        self.evicted[name].append((int(diff[:, 1].sum()), int(diff[:, 2].sum())))

    def rep(self, timed: bool) -> None:
        for name, run in (("attention", self.attention),
                          ("copy", lambda: self.copy(False)),
                          ("copy_both", lambda: self.copy(True))):
            ms = self.timer(run)
            if timed:
                self.times[name].append(ms)
        self._prefetch_mode("prefetch", False, timed)
        self._prefetch_mode("both", True, timed)


def run(args, device: torch.device) -> dict:
    """Build, warm up, measure; the result as :func:`report` assembles it."""
    _import_core()
    from ulacache.kernels import fused_access

    t0 = time.perf_counter()
    setup = Setup(args, device)
    attn = Attention(args.batch, args.heads, args.topk, device)
    timer = Timer()
    bench = Bench(setup, attn, timer)
    for i in range(args.warmup):
        bench.rep(timed=False)
        if i == args.warmup - 1:
            timer.host_ms = timer.host_ms[-5:]  # the last warm-up's five modes (no compiles)
    timer.calibrate()
    logger.info("warm-up done in %.1f s; timed steps queued behind a %.1f ms sleep",
                time.perf_counter() - t0, timer.sleep_ms)
    for _ in range(args.reps):
        bench.rep(timed=True)
    triton = getattr(fused_access, "triton", None)
    env = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "triton": getattr(triton, "__version__", None),
           "access_path": "fused" if setup.fused else "torch",
           "python": sys.version.split()[0]}
    return report(args, env, setup, attn, bench, timer, time.perf_counter() - t0)


def report(args, env: dict, setup, attn, bench, timer, seconds: float) -> dict:
    """The JSON result from the timed repetitions (medians), the rows they moved, the
    attention's size and the timer's launch check (bench/device_summary.py reads it)."""
    med = {k: statistics.median(v) for k, v in bench.times.items()}
    a, b, both = med["attention"], med["prefetch"], med["both"]
    groups = len(setup.groups)
    steps = bench.moved["prefetch"] + bench.moved["both"]  # [step][group] rows moved
    evicted = bench.evicted["prefetch"] + bench.evicted["both"]
    rows_rep = [sum(m) for m in steps]
    rows_med = statistics.median(rows_rep)
    h2d_bytes = rows_med * setup.row_bytes * setup.layers_per_group
    copy_bytes = bench.bytes_per_group * groups
    res = {
        "env": env,
        "config": {**{k: getattr(args, k) for k in ("layers", "gpu_slots", "cpu_slots", "rows",
                                                    "pred_hit", "batch", "heads", "topk",
                                                    "reps", "warmup", "seed", "quick")},
                   "addresses": setup.n, "row_bytes": setup.row_bytes,
                   "layers_per_group": setup.layers_per_group, "groups_per_step": groups,
                   "prediction_len": args.rows + setup.hits},
        "attention": {"what": attn.what, "layers": groups, "gflop_per_layer": round(attn.gflop, 3),
                      "ms": round(a, 4), "ms_per_layer": round(a / groups, 4),
                      "tflops": round(attn.gflop * groups / a, 1)},
        "prefetch": {"ms": round(b, 4), "ms_per_group": round(b / groups, 4),
                     "both_ms": round(both, 4), **overlap(a, b, both),
                     "rows_per_group": args.rows, "rows_per_step_median": rows_med,
                     "rows_per_step": rows_rep,
                     "min_rows_in_a_group": min(min(m) for m in steps),
                     "h2d_bytes_per_step": int(h2d_bytes),
                     "gbps": round(h2d_bytes / (b * 1e-3) / 1e9, 2),
                     "writebacks_per_step_median": statistics.median(w for w, _ in evicted),
                     "remaps_per_step_median": statistics.median(r for _, r in evicted)},
        "control": {"what": "torch copy_ of the same bytes from pinned memory on a side stream "
                            "(copy engine), one per group",
                    "ms": round(med["copy"], 4), "both_ms": round(med["copy_both"], 4),
                    **overlap(a, med["copy"], med["copy_both"]),
                    "bytes_per_step": copy_bytes,
                    "gbps": round(copy_bytes / (med["copy"] * 1e-3) / 1e9, 2)},
        "target_ratio": TARGET_RATIO,
        "launch_hidden": max(timer.host_ms) < timer.sleep_ms,
        "sleep_ms": round(timer.sleep_ms, 2), "host_ms_max": round(max(timer.host_ms), 3),
        "seconds": round(seconds, 1),
    }
    res["target_met"] = res["prefetch"]["ratio"] <= TARGET_RATIO
    notes = []
    if res["prefetch"]["ideal"] > TARGET_RATIO:
        notes.append(f"the ideal bound {res['prefetch']['ideal']:.2f} exceeds the target "
                     f"{TARGET_RATIO}: the two sides differ too much in length (change --rows "
                     "or --batch / --heads / --topk)")
    if not res["launch_hidden"]:
        notes.append(f"host launches ({res['host_ms_max']} ms) outlasted the {res['sleep_ms']} "
                     "ms sleep: some steps include host launch gaps")
    if rows_med < args.rows * groups:
        notes.append(f"prefetches moved {rows_med} rows per step, fewer than {args.rows} x "
                     f"{groups} groups")
    res["notes"] = notes
    return res


def format_table(res: dict) -> str:
    att, pf, ct, cfg = res["attention"], res["prefetch"], res["control"], res["config"]
    tgt = res["target_ratio"]
    lines = [f"prefetch overlap on {res['env']['device']} (torch {res['env']['torch']}, "
             f"{res['env']['access_path']} path): {att['layers']} groups per step, "
             f"{cfg['rows']} rows x {cfg['row_bytes']} B per prefetch, median of {cfg['reps']}",
             f"attention stand-in: {att['what']}: {att['ms_per_layer']:.3f} ms per layer "
             f"({att['gflop_per_layer']} GFLOP, {att['tflops']} TFLOP/s)",
             f"{'':<10}{'alone ms':>9}{'GB/s':>7}{'+attn ms':>9}{'ratio':>7}{'ideal':>7}"
             f"{'hidden':>7}"]
    for name, r in (("prefetch", pf), ("torch H2D", ct)):
        lines.append(f"{name:<10}{r['ms']:>9.3f}{r['gbps']:>7.1f}{r['both_ms']:>9.3f}"
                     f"{r['ratio']:>7.3f}{r['ideal']:>7.3f}{r['hidden']:>7.2f}")
    lines.append(f"attention alone {att['ms']:.3f} ms; prefetch rows per step "
                 f"{pf['rows_per_step_median']:.0f} (write-backs {pf['writebacks_per_step_median']}"
                 f", remaps {pf['remaps_per_step_median']}); target ratio <= {tgt}: "
                 + ("met" if res["target_met"] else "MISSED"))
    lines += [f"note: {n}" for n in res["notes"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--quick", action="store_true",
                    help=f"device-check size: {QUICK} over the defaults (< 45 s on an H200)")
    ap.add_argument("--layers", type=int, help=f"layers, one per group (default "
                                               f"{DEFAULTS['layers']})")
    ap.add_argument("--gpu-slots", type=int, help=f"default {DEFAULTS['gpu_slots']}")
    ap.add_argument("--cpu-slots", type=int, help=f"default {DEFAULTS['cpu_slots']}")
    ap.add_argument("--rows", type=int, help=f"rows each prefetch moves (fetch_cap; default "
                                             f"{DEFAULTS['rows']})")
    ap.add_argument("--pred-hit", type=float, help="share of a prediction already GPU-resident "
                                                   f"(default {DEFAULTS['pred_hit']})")
    ap.add_argument("--batch", type=int, help=f"attention batch (default {DEFAULTS['batch']})")
    ap.add_argument("--heads", type=int, help=f"query heads (default {DEFAULTS['heads']})")
    ap.add_argument("--topk", type=int, help=f"selected rows per request (default "
                                             f"{DEFAULTS['topk']})")
    ap.add_argument("--reps", type=int, help=f"timed repetitions (default {DEFAULTS['reps']})")
    ap.add_argument("--warmup", type=int, help=f"untimed repetitions first (default "
                                               f"{DEFAULTS['warmup']})")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    base = dict(DEFAULTS, **(QUICK if args.quick else {}))
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    checks = [(args.layers >= 2, "--layers must be >= 2 (group 0 is never prefetched)"),
              (args.gpu_slots >= 2, "--gpu-slots must be >= 2"),
              (1 <= args.rows <= args.gpu_slots, "--rows must lie in [1, --gpu-slots]"),
              (args.cpu_slots >= 3 * args.rows, "--cpu-slots must be >= 3 x --rows"),
              (0 <= args.pred_hit < 1, "--pred-hit must lie in [0, 1)"),
              (min(args.batch, args.heads, args.topk) >= 1,
               "--batch, --heads and --topk must be >= 1"),
              (args.reps >= 1 and args.warmup >= 1, "--reps and --warmup must be >= 1")]
    for ok, msg in checks:
        if not ok:
            ap.error(msg)
    hits = min(round(args.rows * args.pred_hit / (1 - args.pred_hit)), args.gpu_slots)
    if args.rows + hits > args.gpu_slots + 8192:  # UlaCacheConfig.call_capacity: one call
        ap.error(f"a prediction of {args.rows + hits} entries exceeds one prefetch call "
                 f"({args.gpu_slots} + 8192): lower --rows or --pred-hit")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if not torch.cuda.is_available():
        print(f"prefetch_overlap: needs CUDA (torch {torch.__version__} sees no CUDA device); "
              "nothing measured", file=sys.stderr)
        return 2
    try:
        res = run(args, torch.device("cuda"))
    except Unmeasurable as e:
        print(f"prefetch_overlap: not measured: {e}", file=sys.stderr)
        return 2
    except Failed as e:
        print(f"prefetch_overlap: FAILED: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res) if args.json else format_table(res))
    if args.json:
        logger.info("%s", format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
