"""Decode-step simulator: a concurrency sweep with Mooncake arrivals and lengths, three KV policies
drawing from ONE memory budget (ulacache's shared tiered pool, HiSparse's per-request buffers,
fully resident), with a modelled step time.

SIMULATION + COST MODEL, NOT A GPU MEASUREMENT. What is real and what is modelled:

- **Requests** (real): arrival times, input and output lengths from the Mooncake conversation
  trace (bundled: its first 2,000 requests, ``bench/data/``); arrivals are compressed by
  ``--arrival-speedup`` (default 100x: a saturated queue, so each policy runs as many requests as
  its concurrency limit and memory allow). Prefill is not timed: an admitted request's prompt is
  placed, and it decodes from the next step; prefix sharing (``hash_ids``) is ignored.
- **Selections** (synthetic, calibrated on real traces): a locality generator whose parameters
  come from the real top-64 SmolLM2 selections (``ulacache/tools/data/gpl3.trace.npz``): the
  share of picks inside the recent window of ``k`` tokens, the chance that position 0 (the sink)
  is picked, the step-to-step overlap ``|S_t & S_t-1| / k`` and the normalised-position histogram
  of fresh picks older than the window. Scaling k=64 over 2K to k=2048 over 32K-128K: the shares
  are kept as shares of k, the recent window stays ``k`` tokens wide (64 -> 2048), fresh old picks
  keep their position histogram relative to the history length. One generator stream per
  request (seeded by the request id), used for every layer (one layer's selections stand for all
  ``--layers``: bytes and launches are multiplied by the layer count).
- **Policies** (real code): ulacache is the real ``SelectionGroup`` through
  :class:`ulacache.tools.residency.Residency` (zero-byte rows, ``validate=False``, PB-LRU):
  placement, spills, promotions and swaps as in serving. HiSparse is
  :class:`ulacache.tools.hisparse.HiSparseBuffer` (SGLang's swap-in kernel, exact LRU, one per
  request). Fully resident: every row on the GPU, no PCIe traffic.
- **Memory** (one budget, latent rows only, index-K not counted): ``G`` GPU rows and ``Hh`` host
  rows per layer. Resident: unique tokens <= G. ulacache (exclusive tiers): unique <= G + Hh and
  R x (k + 1) <= G. HiSparse (inclusive host mirror): unique <= Hh and R x (H + 64) <= G. A
  request reserves input + output tokens; admission is FCFS, head of line blocks.
- **Step time** (model) = control plane + PCIe + attention (+ ``--other-ms`` per step):
  control plane: per-launch cost model, ``--launch-us`` (default 2 us, an assumed CUDA-graph
  node cost) x launches per step; ulacache's launches are COUNTED on the real core
  (:func:`count_launches`): one round start (all groups), then per group the placement of the
  new tokens and the access, plus a release on steps where requests finished, each counted once
  on a small real group on the path ``--ula-path`` runs: ``fused`` (the default on CUDA, and
  here: Triton launches, run by the interpreter, plus any op outside them) or ``torch`` (aten
  ops at the dispatcher, views excluded). Both are shape-independent (fixed-shape code), so a
  small group counts what a large one issues; the other path's figures are reported too.
  HiSparse ``--hs-launches`` (2: its swap-in kernel and the previous-token backup); resident 0.
  ``--control measured`` uses this machine's measured CPU time of the policy's access instead,
  x layers (a CPU figure, not a GPU one); PCIe: max(H2D, D2H) bytes /
  ``--pcie-gbs`` (full duplex; default 50 GB/s, the H200 copy-engine figure rounded down);
  attention: a roofline cost model of sparse MLA over the gathered rows (max of FLOPs at
  ``--attn-tflops`` and row bytes at ``--hbm-tbs``), no torch kernel is run.

    python bench/decode_sweep.py                       # default sweep, temp dir output
    python bench/decode_sweep.py --out docs --json     # CSV, markdown, PNG into docs/, JSON out
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import logging
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):  # the core; decode_rows beside this file
    if _p not in sys.path:
        sys.path.insert(0, _p)

from ulacache.group import COUNTERS  # noqa: E402
from ulacache.tools.hisparse import RESERVED_SLOTS, HiSparseBuffer  # noqa: E402
from ulacache.tools.launches import count_launches, fused_countable, step_launches  # noqa: E402
from ulacache.tools.residency import Residency  # noqa: E402
from ulacache.tools.traces import Trace, load_trace  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - optional
    tqdm = None

logger = logging.getLogger("bench.decode_sweep")

# bundled: the first 2,000 requests of the Mooncake conversation trace (bench/data/README.md)
MOONCAKE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_head2000.jsonl.gz"
TRACE = ROOT / "ulacache" / "tools" / "data" / "gpl3.trace.npz"
POLICIES = ("ulacache", "hisparse", "resident")
CSV_COLUMNS = ("concurrency", "policy", "admitted_mean", "admitted_max", "steps",
               "gpu_hit_rate", "h2d_mb_per_step", "d2h_mb_per_step", "pcie_mb_per_step",
               "control_ms", "pcie_ms", "attn_ms", "step_ms", "tokens_per_s",
               "cpu_ctl_ms_per_step", "overflow", "finished", "ula_launches_per_step",
               "step_ms_other_path", "tokens_per_s_other_path", "tokens_per_s_pcie_hidden",
               "measured_layer_ms", "tokens_per_s_measured")
HIST_BINS = 20


# -- locality generator -------------------------------------------------------------------
@dataclass
class LocalityModel:
    """Calibrated selection locality (shares are of k; the window is ``window_ratio x k``)."""

    recent_share: float  # picks with distance < window
    sink_prob: float  # P(position 0 picked) per step
    overlap: float  # target mean |S_t & S_t-1| / k
    keep_prob: float  # generator knob: P(a previous pick is kept), calibrated to ``overlap``
    old_hist: list[float] = field(default_factory=list)  # fresh old picks: pos / (p - W + 1)
    window_ratio: float = 1.0

    def to_dict(self) -> dict:
        return asdict(self)


def trace_targets(sel: np.ndarray, pos: np.ndarray, k: int, window_ratio: float = 1.0) -> dict:
    """Locality figures of selections ``sel`` int ``[layers, steps, k]`` (-1 padded) at query
    positions ``pos``: recent share, sink probability, overlap, fresh-old-pick histogram."""
    w = max(1, round(window_ratio * k))
    valid = sel >= 0
    dist = pos[None, :, None] - sel
    recent = float((valid & (dist < w)).sum() / valid.sum())
    sink = float((sel == 0).any(-1).mean())
    overlaps, fresh = [], []
    for layer in range(sel.shape[0]):
        prev = None
        for s in range(sel.shape[1]):
            row = sel[layer, s]
            row = row[row >= 0]
            p = int(pos[s])
            if prev is not None:
                overlaps.append(np.intersect1d(row, prev, assume_unique=True).size / k)
                old = row[(p - row >= w) & (row > 0)]
                old = old[~np.isin(old, prev)]
                if old.size and p - w + 1 > 0:
                    fresh.append(old / (p - w + 1))
            prev = row
    fresh_all = np.concatenate(fresh) if fresh else np.zeros(1)
    hist, _ = np.histogram(np.clip(fresh_all, 0, 1 - 1e-9), bins=HIST_BINS, range=(0, 1))
    return {"recent_share": recent, "sink_prob": sink, "overlap": float(np.mean(overlaps)),
            "old_hist": (hist / max(1, hist.sum())).tolist()}


class SelectionGen:
    """One request's selections: ``step(p)`` -> sorted unique positions in ``[0, p]``, ``k`` of
    them (all ``p + 1`` while ``p < k``). Previous picks kept with ``keep_prob`` (the sink
    excluded), the recent window topped up to its share (always the newest token), the sink
    (position 0) with ``sink_prob``, then fresh old picks in ``[1, p - W]`` from the histogram
    of normalised positions."""

    def __init__(self, model: LocalityModel, k: int, rng: np.random.Generator):
        self.m, self.k, self.rng = model, k, rng
        self.w = max(1, round(model.window_ratio * k))
        self.n_recent = min(k, max(1, round(model.recent_share * k)))
        self.cdf = np.cumsum(np.asarray(model.old_hist, dtype=np.float64))
        if self.cdf.size == 0 or self.cdf[-1] <= 0:
            self.cdf = np.linspace(1 / HIST_BINS, 1, HIST_BINS)
        self.cdf /= self.cdf[-1]
        self.prev = np.empty(0, dtype=np.int64)

    def _fill(self, chosen: np.ndarray, lo: int, hi: int, n: int, hist: bool) -> np.ndarray:
        """``n`` new positions in ``[lo, hi)`` not in ``chosen`` (uniform, or by the histogram)."""
        if n <= 0 or hi <= lo:
            return np.empty(0, dtype=np.int64)
        span = hi - lo
        free = span - int(((chosen >= lo) & (chosen < hi)).sum())
        n = min(n, free)
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        if free <= 2 * n:  # dense: exact draw without replacement
            cand = np.setdiff1d(np.arange(lo, hi), chosen, assume_unique=False)
            return self.rng.choice(cand, n, replace=False)
        out = np.empty(0, dtype=np.int64)
        for _ in range(8):
            m = 2 * (n - out.size) + 8
            if hist:
                b = np.searchsorted(self.cdf, self.rng.random(m), side="right")
                u = (np.minimum(b, HIST_BINS - 1) + self.rng.random(m)) / HIST_BINS
                cand = lo + np.minimum((u * span).astype(np.int64), span - 1)
            else:
                cand = self.rng.integers(lo, hi, m)
            cand = np.unique(cand)
            cand = cand[~np.isin(cand, chosen) & ~np.isin(cand, out)]
            self.rng.shuffle(cand)
            out = np.concatenate([out, cand[: n - out.size]])
            if out.size >= n:
                break
        if out.size < n:  # fall back to uniform fill
            rest = np.setdiff1d(np.arange(lo, hi), np.concatenate([chosen, out]))
            out = np.concatenate([out, self.rng.choice(rest, n - out.size, replace=False)])
        return out

    def step(self, p: int) -> np.ndarray:
        k = self.k
        if p + 1 <= k:
            self.prev = np.arange(p + 1, dtype=np.int64)
            return self.prev
        w_lo = max(0, p - self.w + 1)  # recent window [w_lo, p]
        prev = self.prev[self.prev > 0]  # the sink (position 0) has its own probability
        kept = prev[self.rng.random(prev.size) < self.m.keep_prob]
        chosen = np.union1d(kept, [p])
        n_rec_have = int((chosen >= w_lo).sum())
        chosen = np.union1d(chosen, self._fill(chosen, w_lo, p + 1,
                                               self.n_recent - n_rec_have, hist=False))
        if w_lo > 0 and self.rng.random() < self.m.sink_prob:
            chosen = np.union1d(chosen, [0])
        n_old = k - chosen.size
        if n_old > 0:
            chosen = np.union1d(chosen, self._fill(chosen, 1, w_lo, n_old, hist=True))
        if chosen.size < k:  # short old region: top up from the window
            chosen = np.union1d(chosen, self._fill(chosen, w_lo, p + 1, k - chosen.size, False))
        if chosen.size > k:  # too many kept: drop random entries (not the newest, not the sink)
            drop = self.rng.choice(np.flatnonzero((chosen != p) & (chosen != 0)),
                                   chosen.size - k, replace=False)
            chosen = np.delete(chosen, drop)
        self.prev = chosen.astype(np.int64)
        return self.prev


def generate(model: LocalityModel, k: int, positions: np.ndarray, seed: int) -> np.ndarray:
    """Selections ``[steps, k]`` (-1 padded) of one generator over ``positions``."""
    gen = SelectionGen(model, k, np.random.default_rng(seed))
    out = np.full((positions.size, k), -1, dtype=np.int64)
    for i, p in enumerate(positions):
        s = gen.step(int(p))
        out[i, : s.size] = s
    return out


def calibrate(trace: Trace, window_ratio: float = 1.0, layers: int = 8, iters: int = 4,
              seed: int = 0) -> LocalityModel:
    """Targets from ``layers`` evenly spaced layers of the real ``trace``; ``keep_prob`` is
    fitted so that the generator at the trace's own scale hits the overlap target."""
    idx = np.unique(np.linspace(0, trace.layers - 1, min(layers, trace.layers)).astype(int))
    sel, pos = trace.selections[idx].astype(np.int64), trace.positions.astype(np.int64)
    t = trace_targets(sel, pos, trace.k, window_ratio)
    m = LocalityModel(t["recent_share"], t["sink_prob"], t["overlap"], t["overlap"],
                      t["old_hist"], window_ratio)
    for i in range(iters):
        g = generate(m, trace.k, pos, seed + i)
        got = trace_targets(g[None], pos, trace.k, window_ratio)["overlap"]
        m.keep_prob = float(np.clip(m.keep_prob + (m.overlap - got), 0.0, 1.0))
    return m


# -- requests -------------------------------------------------------------------------------
@dataclass
class Request:
    rid: int
    arrival_s: float
    input_len: int
    output_len: int


def load_requests(path: Path, n: int, speedup: float, max_input: int | None = None,
                  max_output: int | None = None) -> list[Request]:
    """The first ``n`` Mooncake requests; arrivals / ``speedup``; lengths optionally capped."""
    out = []
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            d = json.loads(line)
            inp, o = int(d["input_length"]), max(1, int(d["output_length"]))
            if max_input:
                inp = min(inp, max_input)
            if max_output:
                o = min(o, max_output)
            out.append(Request(i, d["timestamp"] / 1000.0 / speedup, max(1, inp), o))
    return out


# -- policies -------------------------------------------------------------------------------
@dataclass
class Config:
    k: int = 2048
    layers: int = 61  # DeepSeek-V3.2
    row_bytes: int = 656  # FP8 FlashMLA row
    gpu_rows: int = 300_000  # G: GPU latent rows per layer (the one budget)
    host_rows: int = 3_000_000  # Hh: host rows per layer
    h_slots: int = 4096  # HiSparse device_buffer_size (2 x top_k)
    buckets: int = 64
    steps: int = 128
    pcie_gbs: float = 50.0
    launch_us: float = 2.0  # per kernel node in a CUDA-graph replay (assumed)
    ula_path: str = "fused"  # whose launches are counted: "fused" (CUDA default) | "torch"
    hs_launches: int = 2  # swap-in kernel + previous-token backup
    control: str = "launch"  # or "measured"
    heads: int = 128
    d_qk: int = 576
    d_v: int = 512
    attn_tflops: float = 400.0  # sustained sparse-MLA FLOP rate (H200 bf16 989 peak x ~0.4)
    hbm_tbs: float = 4.0
    other_ms: float = 20.0  # fixed per-step time outside attention (weights, MoE; assumed)
    real_rows: bool = False  # also move and read one layer of real rows, timed (decode_rows)
    device: str = "cpu"  # where --real-rows runs (cuda when available)
    seed: int = 0


def capacity_ok(policy: str, cfg: Config, running: int, reserved: int, req: Request) -> bool:
    """Can ``req`` join ``running`` requests holding ``reserved`` tokens under ``policy``?"""
    need = reserved + req.input_len + req.output_len
    if policy == "resident":
        return need <= cfg.gpu_rows
    if policy == "ulacache":
        return need <= cfg.gpu_rows + cfg.host_rows and (running + 1) * (cfg.k + 1) <= cfg.gpu_rows
    if policy == "hisparse":
        return (need <= cfg.host_rows
                and (running + 1) * (cfg.h_slots + RESERVED_SLOTS) <= cfg.gpu_rows)
    raise ValueError(policy)


@dataclass
class _Live:
    req: Request
    pos: int  # position of the next token (= current length)
    left: int
    gen: SelectionGen
    addrs: np.ndarray | None = None  # row per position (ulacache; --real-rows: all policies)
    buf: HiSparseBuffer | None = None
    buffer: int = 0  # --real-rows: HiSparse device buffer index


def attention_seconds(cfg: Config, n_selected: int) -> float:
    """Roofline of sparse MLA over ``n_selected`` gathered rows per layer, all layers."""
    flops = 2.0 * cfg.heads * n_selected * (cfg.d_qk + cfg.d_v) * cfg.layers
    rbytes = n_selected * cfg.row_bytes * cfg.layers
    return max(flops / (cfg.attn_tflops * 1e12), rbytes / (cfg.hbm_tbs * 1e12))


def ula_control_seconds(cfg: Config, counts: dict[str, int], finished: bool) -> float:
    """Modelled control-plane time of one ulacache decode step from launch ``counts``
    (:func:`ulacache.tools.launches.count_launches`): a round start, placement + access per
    group (one group per layer), a release per group when requests finished."""
    return step_launches(counts, cfg.layers, finished) * cfg.launch_us * 1e-6


def launch_counts(cfg: Config) -> dict[str, dict[str, int]]:
    """ulacache's launch counts per path (:func:`count_launches`); without Triton the fused
    path is not counted (logged) and the sweep times the torch path."""
    paths = ["torch"]
    if fused_countable():
        paths.insert(0, "fused")
    else:
        logger.warning("Triton is not installed: the fused path's launches were not counted "
                       "and the sweep times ulacache on the torch path (pip install "
                       "'ulacache[cuda]' to count the fused kernels)")
    return {path: count_launches(path, cfg.layers) for path in paths}


def timed_path(cfg: Config, counts: dict[str, dict[str, int]]) -> Config:
    """``cfg``, on the torch path where its ``ula_path`` was not counted (no Triton)."""
    return replace(cfg, ula_path="torch") if counts and cfg.ula_path not in counts else cfg


def run_level(policy: str, concurrency: int, cfg: Config, requests: list[Request],
              model: LocalityModel, counts: dict[str, dict[str, int]] | None = None) -> dict:
    """Simulate ``cfg.steps`` decode steps of ``policy`` with at most ``concurrency`` running.
    ``counts``: ulacache's launch counts per path (``{"fused": ..., "torch": ...}``, from
    :func:`count_launches`; the path ``cfg.ula_path`` times the step, the other is reported)."""
    pending = deque(requests)
    waiting: deque[Request] = deque()
    running: list[_Live] = []
    reserved = 0
    now = 0.0
    ula = None
    free_addrs = None
    real = None  # --real-rows: decode_rows.RealRows of this level
    if policy == "ulacache":
        counts = counts or launch_counts(cfg)
        cfg = timed_path(cfg, counts)
        if cfg.real_rows:  # one layer of real rows on the device, the serving access path
            ula = Residency("pblru", cfg.gpu_rows, cfg.gpu_rows + cfg.host_rows, cfg.buckets,
                            device=cfg.device, layers=1, row_bytes=cfg.row_bytes)
        else:
            ula = Residency("pblru", cfg.gpu_rows, cfg.gpu_rows + cfg.host_rows, cfg.buckets)
        free_addrs = list(range(cfg.gpu_rows + cfg.host_rows - 1, -1, -1))
    if cfg.real_rows:
        from decode_rows import RealRows

        real = RealRows(policy, torch.device(cfg.device), cfg.gpu_rows, cfg.host_rows,
                        cfg.h_slots, RESERVED_SLOTS, cfg.heads, cfg.k, ula)
        # rows of each request: HiSparse's host mirror and device buffer, resident's pool
        free_rows = list(range((cfg.host_rows if policy == "hisparse" else cfg.gpu_rows) - 1,
                               -1, -1))
        free_buffers = list(range(cfg.gpu_rows // (cfg.h_slots + RESERVED_SLOTS) - 1, -1, -1))
    tot = dict(acc=0, hit=0, h2d=0, d2h=0, ctl=0.0, pcie=0.0, attn=0.0, step=0.0, tokens=0,
               cpu=0.0, overflow=0, finished=0, admitted=[], steps=0, launches=0,
               step_other=0.0)
    other_path = next((p for p in (counts or {}) if p != cfg.ula_path), None)
    for _ in range(cfg.steps):
        while pending and pending[0].arrival_s <= now:
            waiting.append(pending.popleft())
        if not running and not waiting and pending:  # idle: jump to the next arrival
            now = pending[0].arrival_s
            waiting.append(pending.popleft())
        while (waiting and len(running) < concurrency
               and capacity_ok(policy, cfg, len(running), reserved, waiting[0])):
            r = waiting.popleft()
            reserved += r.input_len + r.output_len
            live = _Live(r, r.input_len, r.output_len,
                         SelectionGen(model, cfg.k, np.random.default_rng([cfg.seed, r.rid])))
            if ula is not None:
                n = r.input_len + r.output_len
                live.addrs = np.array(free_addrs[-n:][::-1], dtype=np.int64)
                del free_addrs[-n:]
                ula.place(torch.from_numpy(live.addrs[: r.input_len]))
            elif policy == "hisparse":
                live.buf = HiSparseBuffer(cfg.h_slots)
            if real is not None and ula is None:  # rows for its tokens (+ a HiSparse buffer)
                n = r.input_len + r.output_len
                live.addrs = np.array(free_rows[-n:][::-1], dtype=np.int64)
                del free_rows[-n:]
                if policy == "hisparse":
                    live.buffer = free_buffers.pop()
                    real.hisparse_admit(live.buffer, live.addrs)
            running.append(live)
        if not running:
            break
        sels = [lv.gen.step(lv.pos) for lv in running]
        n_sel = sum(s.size for s in sels)
        acc = hit = h2d_rows = d2h_rows = 0
        t0 = time.perf_counter()
        if ula is not None:
            before = ula.group.counters.clone()
            batch = torch.full((len(running), cfg.k), -1, dtype=torch.int64)
            for i, (lv, s) in enumerate(zip(running, sels)):
                batch[i, : s.size] = torch.from_numpy(lv.addrs[s])
            new = torch.from_numpy(np.array([lv.addrs[lv.pos] for lv in running]))
            if real is not None:
                real.ulacache_step(new, batch)
            else:
                ula.step(new, batch, timed=False)
            d = dict(zip(COUNTERS, (ula.group.counters - before).tolist()))
            acc, hit = d["accesses"], d["gpu_hits"]
            h2d_rows = d["promotions"]
            d2h_rows = d["writebacks"] + d["spills"]
            tot["overflow"] += d["access_overflow"] + d["place_overflow"]
        elif policy == "hisparse":
            for lv, s in zip(running, sels):
                h, m = lv.buf.step(s, lv.pos)
                acc += h + m
                hit += h
                h2d_rows += m
            d2h_rows = len(running)  # the previous newest token's backup, per request
            if real is not None:
                real.hisparse_step([lv.buffer for lv in running], [lv.addrs for lv in running],
                                   sels, [lv.buf for lv in running],
                                   [lv.pos - 1 if lv.pos > lv.req.input_len else -1
                                    for lv in running])  # the prompt's rows are mirrored
        else:
            acc = hit = n_sel
            if real is not None:
                rows = np.full((len(running), cfg.k), -1, dtype=np.int64)
                for i, (lv, sel) in enumerate(zip(running, sels)):
                    rows[i, : sel.size] = lv.addrs[sel]
                real.resident_step(rows)
        cpu = time.perf_counter() - t0
        # this step's finished requests are released at the next round start (below)
        finishing = any(lv.left <= 1 for lv in running)
        ctl_other = 0.0
        if ula is not None:
            ctl = ula_control_seconds(cfg, counts[cfg.ula_path], finishing)
            ctl_other = ula_control_seconds(cfg, counts[other_path], finishing) \
                if other_path else ctl
            tot["launches"] += round(ctl / (cfg.launch_us * 1e-6))
        else:
            ctl = cfg.layers * (cfg.hs_launches if policy == "hisparse" else 0) \
                * cfg.launch_us * 1e-6
        if cfg.control == "measured":
            ctl = ctl_other = cpu * cfg.layers
        h2d = h2d_rows * cfg.row_bytes * cfg.layers
        d2h = d2h_rows * cfg.row_bytes * cfg.layers
        pcie = max(h2d, d2h) / (cfg.pcie_gbs * 1e9)
        attn = attention_seconds(cfg, n_sel)
        step = ctl + pcie + attn + cfg.other_ms * 1e-3
        now += step
        tot["admitted"].append(len(running))
        for key, v in (("acc", acc), ("hit", hit), ("h2d", h2d), ("d2h", d2h), ("ctl", ctl),
                       ("pcie", pcie), ("attn", attn), ("step", step), ("cpu", cpu),
                       ("tokens", len(running))):
            tot[key] += v
        tot["steps"] += 1
        tot["step_other"] += step - ctl + (ctl_other if ula is not None else ctl)
        still, done = [], []
        for lv in running:
            lv.pos += 1
            lv.left -= 1
            if lv.left > 0:
                still.append(lv)
                continue
            tot["finished"] += 1
            reserved -= lv.req.input_len + lv.req.output_len
            if ula is not None:
                done.append(lv.addrs)
            elif real is not None:
                free_rows.extend(lv.addrs[::-1].tolist())
                if policy == "hisparse":
                    free_buffers.append(lv.buffer)
        if done:  # finished requests free their rows at the round boundary
            ula.new_round()
            ula.group.release(torch.from_numpy(np.concatenate(done)))
            for a in done:
                free_addrs.extend(a[::-1].tolist())
        running = still
    s = max(1, tot["steps"])
    measured = {"measured_layer_ms": 0.0, "tokens_per_s_measured": 0.0}
    if real is not None and real.seconds:
        # one layer measured x layers + the fixed time; HiSparse's swap-in decisions ran on
        # the host, so its modelled control time is added
        warm = min(2, len(real.seconds) - 1)  # first steps: allocation, compilation
        secs, admitted = real.seconds[warm:], tot["admitted"][warm:]
        steps_s = [x * cfg.layers + cfg.other_ms * 1e-3 for x in secs]
        if policy == "hisparse":
            steps_s = [x + cfg.layers * cfg.hs_launches * cfg.launch_us * 1e-6 for x in steps_s]
        measured = {"measured_layer_ms": float(np.mean(secs)) * 1e3,
                    "tokens_per_s_measured": sum(admitted) / sum(steps_s)}
    return {**measured,
        "concurrency": concurrency, "policy": policy,
        "admitted_mean": float(np.mean(tot["admitted"])) if tot["admitted"] else 0.0,
        "admitted_max": int(max(tot["admitted"], default=0)), "steps": tot["steps"],
        "gpu_hit_rate": tot["hit"] / max(1, tot["acc"]),
        "h2d_mb_per_step": tot["h2d"] / s / 1e6, "d2h_mb_per_step": tot["d2h"] / s / 1e6,
        "pcie_mb_per_step": (tot["h2d"] + tot["d2h"]) / s / 1e6,
        "control_ms": tot["ctl"] / s * 1e3, "pcie_ms": tot["pcie"] / s * 1e3,
        "attn_ms": tot["attn"] / s * 1e3, "step_ms": tot["step"] / s * 1e3,
        "tokens_per_s": tot["tokens"] / max(1e-12, tot["step"]),
        "cpu_ctl_ms_per_step": tot["cpu"] / s * 1e3, "overflow": tot["overflow"],
        "finished": tot["finished"],
        "ula_launches_per_step": tot["launches"] / s if ula is not None else 0.0,
        "step_ms_other_path": tot["step_other"] / s * 1e3,
        "tokens_per_s_other_path": tot["tokens"] / max(1e-12, tot["step_other"]),
        # bound: every transfer hidden behind compute (no policy here prefetches; see docs)
        "tokens_per_s_pcie_hidden": tot["tokens"] / max(1e-12, tot["step"] - tot["pcie"]),
    }


def sweep(cfg: Config, levels: list[int], requests: list[Request], model: LocalityModel,
          policies=POLICIES, progress: bool = True) -> dict:
    counts = launch_counts(cfg) if "ulacache" in policies else {}
    cfg = timed_path(cfg, counts)
    for path, c in counts.items():
        logger.info("ulacache launches on the %s path: %s", path, c)
    jobs = [(c, p) for c in levels for p in policies]
    bar = tqdm(jobs, desc="decode sweep", disable=not progress) if tqdm else jobs
    rows = []
    for c, p in bar:
        t0 = time.perf_counter()
        rows.append(run_level(p, c, cfg, requests, model, counts))
        logger.info("concurrency %d %s: %.1f s", c, p, time.perf_counter() - t0)
    peak = {p: max((r["tokens_per_s"] for r in rows if r["policy"] == p), default=0.0)
            for p in policies}
    ratios = {}
    if cfg.real_rows:  # measured: one layer of real rows per step, x layers + the fixed time
        meas = {p: max((r["tokens_per_s_measured"] for r in rows if r["policy"] == p),
                       default=0.0) for p in policies}
        for other in ("hisparse", "resident"):
            if meas.get("ulacache") and meas.get(other):
                ratios[f"measured ulacache/{other}"] = meas["ulacache"] / meas[other]
    if "ulacache" in peak:
        for other in ("hisparse", "resident"):
            if peak.get(other):
                ratios[f"ulacache/{other}"] = peak["ulacache"] / peak[other]
    hidden = {p: max((r["tokens_per_s_pcie_hidden"] for r in rows if r["policy"] == p),
                     default=0.0) for p in policies}
    if "ulacache" in hidden:  # an upper bound, for both policies alike (see the column)
        for other in ("hisparse", "resident"):
            if hidden.get(other):
                ratios[f"ulacache_pcie_hidden/{other}"] = hidden["ulacache"] / hidden[other]
    if "ulacache" in peak and len(counts) > 1:  # timed with the other path's launch counts
        alt = max(r["tokens_per_s_other_path"] for r in rows if r["policy"] == "ulacache")
        for other in ("hisparse", "resident"):
            if peak.get(other):
                ratios[f"ulacache_other_path/{other}"] = alt / peak[other]
    return {"config": asdict(cfg), "locality": model.to_dict(), "levels": levels, "rows": rows,
            "peak_tokens_per_s": peak, "peak_ratios": ratios, "ula_launch_counts": counts}


# -- output -------------------------------------------------------------------------------
def markdown(res: dict) -> str:
    cfg = res["config"]
    loc = res["locality"]
    lines = [
        f"Decode sweep (simulation + cost model): k={cfg['k']}, {cfg['layers']} layers, "
        f"{cfg['row_bytes']} B rows, budget G={cfg['gpu_rows']:,} GPU + {cfg['host_rows']:,} host "
        f"rows per layer, {cfg['steps']} steps per level, PCIe {cfg['pcie_gbs']} GB/s, "
        f"control plane: {cfg['control']}",
        "",
        f"Locality (calibrated on the real trace): recent share {loc['recent_share']:.3f} "
        f"(window {loc['window_ratio']} x k), sink {loc['sink_prob']:.3f}, overlap target "
        f"{loc['overlap']:.3f} (keep prob {loc['keep_prob']:.3f})",
        "",
        "| concurrency | policy | admitted (mean/max) | GPU hit | PCIe MB/step | step ms "
        "(ctl + pcie + attn) | tokens/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['concurrency']} | {r['policy']} | {r['admitted_mean']:.1f} / "
            f"{r['admitted_max']} | {r['gpu_hit_rate']:.4f} | {r['pcie_mb_per_step']:.1f} | "
            f"{r['step_ms']:.2f} ({r['control_ms']:.2f} + {r['pcie_ms']:.2f} + "
            f"{r['attn_ms']:.2f}) | {r['tokens_per_s']:,.0f} |")
    lines.append("")
    peak = ", ".join(f"{p} {v:,.0f}" for p, v in res["peak_tokens_per_s"].items())
    lines.append(f"Peak decode tokens/s: {peak}")
    rat = ", ".join(f"{k} x{v:.2f}" for k, v in res["peak_ratios"].items()
                    if "_" not in k.split("/")[0] and not k.startswith("measured"))
    lines.append(f"Peak-throughput ratios: {rat}")
    hid = ", ".join(f"{k.split('/')[1]} x{v:.2f}" for k, v in res["peak_ratios"].items()
                    if k.startswith("ulacache_pcie_hidden"))
    if hid:
        lines.append(f"Bound if every PCIe transfer hid behind compute, for every policy alike "
                     f"(nothing here prefetches; lookahead prefetch is not built): ulacache/{hid}")
    if cfg.get("real_rows"):
        lines += ["", f"Measured with real rows on {cfg['device']} (one layer of "
                  f"{cfg['row_bytes']} B rows per step: ulacache's real access, HiSparse's data "
                  "movement with its decisions modelled, torch sparse-MLA stand-in; x layers + "
                  "other ms; the first 2 steps of a level are warm-up):", "",
                  "| concurrency | policy | layer ms | tokens/s |", "|---:|---|---:|---:|"]
        lines += [f"| {r['concurrency']} | {r['policy']} | {r['measured_layer_ms']:.3f} | "
                  f"{r['tokens_per_s_measured']:,.0f} |" for r in res["rows"]]
        mr = ", ".join(f"{k.split(' ')[1]} x{v:.2f}" for k, v in res["peak_ratios"].items()
                       if k.startswith("measured"))
        lines += ["", f"Measured peak ratios: {mr}"]
    counts = res.get("ula_launch_counts") or {}
    if counts:
        path = cfg["ula_path"]
        other = next((p for p in counts if p != path), None)

        def desc(c: dict) -> str:
            return (f"round start {c['round']} (all {cfg['layers']} groups), per group: place "
                    f"{c['place']}, access {c['access']}, release {c['release']}"
                    + (f"; {c['syncs']} host-syncing ops" if c["syncs"] else ""))

        lines.append(f"ulacache control plane, {path} path (counted on the real core, "
                     f"{cfg['launch_us']} us per launch): {desc(counts[path])}")
        alt = ", ".join(f"{k.split('/')[1]} x{v:.2f}" for k, v in res["peak_ratios"].items()
                        if k.startswith("ulacache_other_path"))
        if other:
            lines.append(f"The same sweep on the {other} path ({desc(counts[other])}): "
                         f"ulacache/{alt}")
        else:
            lines.append("The fused path's launches were not counted (Triton is not "
                         "installed: pip install 'ulacache[cuda]').")
    return "\n".join(lines) + "\n"


def write_outputs(res: dict, out: Path, png: bool = True) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": str(out / "decode_sweep.csv"), "md": str(out / "decode_sweep.md")}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in res["rows"]:
            w.writerow({c: r[c] for c in CSV_COLUMNS})
    Path(paths["md"]).write_text(markdown(res))
    if png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:  # pragma: no cover
            return paths
        fig, axes = plt.subplots(1, 4, figsize=(18, 4))
        metrics = (("tokens_per_s", "decode tokens/s"), ("gpu_hit_rate", "GPU hit rate"),
                   ("pcie_mb_per_step", "PCIe MB/step"), ("admitted_mean", "admitted (mean)"))
        for ax, (key, label) in zip(axes, metrics):
            for p in POLICIES:
                rows = [r for r in res["rows"] if r["policy"] == p]
                if rows:
                    ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], "o-",
                            label=p)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency limit")
            ax.set_title(label)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle("decode sweep (simulation + cost model, equal memory budget)")
        fig.tight_layout()
        paths["png"] = str(out / "decode_sweep.png")
        fig.savefig(paths["png"], dpi=100)
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    d = Config()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="8,16,32,64,96,128", help="concurrency limits")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--requests", type=int, default=2000, help="first N Mooncake requests")
    ap.add_argument("--mooncake", default=str(MOONCAKE))
    ap.add_argument("--trace", default=str(TRACE), help="selection trace for calibration")
    ap.add_argument("--arrival-speedup", type=float, default=100.0)
    ap.add_argument("--max-input", type=int, default=None, help="cap input lengths")
    ap.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    for name in ("k", "layers", "row_bytes", "gpu_rows", "host_rows", "h_slots", "buckets",
                 "steps", "hs_launches", "heads", "d_qk", "d_v", "seed"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("pcie_gbs", "launch_us", "attn_tflops", "hbm_tbs", "other_ms"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    ap.add_argument("--control", choices=("launch", "measured"), default=d.control)
    ap.add_argument("--ula-path", choices=("fused", "torch"), default=d.ula_path,
                    help="whose counted launches time ulacache's steps (the other is reported)")
    ap.add_argument("--real-rows", action="store_true",
                    help="also move and read one layer of real rows per step, timed "
                         "(bench/decode_rows.py; GLM-5-shaped FP8 rows; meant for a GPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device of --real-rows")
    ap.add_argument("--out", default=None, help="output dir (default: a new temp dir)")
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO,
                        format="%(name)s %(message)s", stream=sys.stderr)
    levels = [int(x) for x in a.levels.split(",") if x]
    policies = tuple(p for p in a.policies.split(",") if p)
    if not levels or min(levels) < 1:
        ap.error("--levels must be positive integers")
    if any(p not in POLICIES for p in policies):
        ap.error(f"--policies must be among {POLICIES}")
    cfg = Config(**{f: getattr(a, f) for f in Config.__dataclass_fields__})
    if cfg.h_slots < cfg.k:
        ap.error("--h-slots must be >= --k")
    t0 = time.perf_counter()
    model = calibrate(load_trace(a.trace), seed=cfg.seed)
    logger.info("calibrated in %.1f s: %s", time.perf_counter() - t0,
                {k: round(v, 4) for k, v in model.to_dict().items() if isinstance(v, float)})
    reqs = load_requests(Path(a.mooncake), a.requests, a.arrival_speedup, a.max_input,
                         a.max_output)
    res = sweep(cfg, levels, reqs, model, policies, progress=not a.quiet and not a.json)
    res["wall_s"] = time.perf_counter() - t0
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="decode_sweep-"))
    res["files"] = write_outputs(res, out, png=not a.no_png)
    if a.json:
        print(json.dumps(res))
    else:
        print(markdown(res), end="")
        print(f"files: {', '.join(res['files'].values())}; {res['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
