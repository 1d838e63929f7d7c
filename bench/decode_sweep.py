"""Decode sweep at equal bytes: ulacache, SGLang 0.5.23's HiSparse and fully resident SGLang,
each given the same per-GPU device and host budget, each tuned, over concurrency limits, seeds
and a stated step-time model.

SIMULATION + COST MODEL, NOT A GPU MEASUREMENT. What is real and what is modelled:

- **Memory** (accounting, :mod:`ulacache.tools.capacity`, what SGLang's sizing charges): one
  GPU of a DP8 launch on H200 (default) or B300, ``static - weights`` of device memory for KV
  and the platform's host budget. Each system's pools are what SGLang's configurator gives it
  from those bytes: HiSparse ``S`` device slots at its cell ``latent + index-K x`` and a host
  mirror of ``x S``; ulacache ``G`` GPU + ``c G`` CPU slots at the sizing hook's cell (index-K
  of every logical token, its tables) after its fixed charges (output rows for the level's
  requests); resident its pool. HiSparse's uncharged device maps are reported beside.
- **Tuning**: HiSparse ``device_buffer_size`` H and ``host_to_device_ratio`` x, ulacache
  ``cpu_ratio`` c, each over a grid on seed 0; each system's best (peak serial tokens/s over
  the levels) is rerun on the other seeds; the peak ratios are printed with their spread.
- **Admission** (SGLang 0.5.23's, the same code path for both; :class:`Memory`): the prefill
  budget charges a new request's prompt + min(output, 4096) + a page against the free room less
  the running requests' remaining output x the new-token ratio (0.7 decaying to 0.098 over 600
  steps); free room is HiSparse's ``min(logical, device)`` (the device holds every request's
  buffer, ``min(pages(len), H)`` or ``H + page``, and a prefilling prompt), ulacache's unique
  capacity (its GPU pool must hold the prompt and one step's selections). A decode step needs
  a page for every request starting one, else the newest requests are retracted.
- **Requests** (real): arrivals and lengths from the Mooncake conversation trace (bundled: its
  first 2,000 requests, ``bench/data/``), arrivals compressed ``--arrival-speedup`` (100x: a
  saturated queue). Prefill is not timed; prefix sharing is ignored.
- **Selections** (synthetic, calibrated on real traces; ``bench/locality.py``): one stream per
  request, generated once per seed and shared by every tuning and level.
- **Policies** (real code): ulacache is the real ``SelectionGroup`` (zero-byte rows, PB-LRU,
  :class:`ulacache.tools.residency.Residency`); HiSparse is :class:`ulacache.tools.hisparse.
  HiSparseBuffer` (SGLang's swap-in kernel, exact LRU per request) plus its previous-token
  backup; resident moves nothing.
- **Step time** (model) = control plane (2 us per launch, ulacache's COUNTED on the real core)
  + sparse-MLA attention roofline + non-attention roofline ``max(weights / HBM, batch x 2 x
  active params / FLOP rate)`` + PCIe. PCIe serial ``(H2D + D2H) / 50 GB/s`` is the headline;
  duplex ``max(H2D, D2H)`` is printed but not claimed until ``bench/device_check.sh`` measures
  duplex ``swap_rows``; the overlap bound ``max(compute, PCIe)`` hides every transfer.
- **Scale** (``--scale``, default 8 so that the default run fits a 2-core CPU in minutes): k,
  H, the page, every pool and every request's lengths divided by it; bytes and attention rows
  multiplied back. ``--scale 1`` runs the full size.

Each assumption and whom it favours is printed with the results (:data:`ASSUMPTIONS`).

    python bench/decode_sweep.py                       # default sweep, temp dir output
    python bench/decode_sweep.py --out docs --json     # CSV, markdown, PNG into docs/, JSON out
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):  # the core; decode_rows beside this file
    if _p not in sys.path:
        sys.path.insert(0, _p)

from locality import (  # noqa: E402,F401  (re-exported: tests and hisparse_head_to_head)
    HIST_BINS,
    LocalityModel,
    SelectionCache,
    SelectionGen,
    calibrate,
    generate,
    trace_targets,
)

from ulacache.group import COUNTERS  # noqa: E402
from ulacache.prefetch import rank_order  # noqa: E402
from ulacache.tools import capacity  # noqa: E402
from ulacache.tools.hisparse import HiSparseBuffer  # noqa: E402
from ulacache.tools.launches import count_launches, fused_countable, step_launches  # noqa: E402
from ulacache.tools.residency import Residency  # noqa: E402
from ulacache.tools.traces import load_trace  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - optional
    tqdm = None

logger = logging.getLogger("bench.decode_sweep")

# bundled: the first 2,000 requests of the Mooncake conversation trace (bench/data/README.md)
MOONCAKE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_head2000.jsonl.gz"
TRACE = ROOT / "ulacache" / "tools" / "data" / "gpl3.trace.npz"
CSV_COLUMNS = ("seed", "tuning", "concurrency", "policy", "gpu_rows", "host_rows",
               "admitted_mean", "admitted_max", "steps", "gpu_hit_rate", "h2d_mb_per_step",
               "d2h_mb_per_step", "d2h_evict_mb_per_step", "d2h_backup_mb_per_step",
               "prefetch_mb_per_step", "prefetch_excess_ms",
               "control_ms", "attn_ms", "other_ms", "pcie_serial_ms",
               "pcie_duplex_ms", "step_ms", "tokens_per_s", "tokens_per_s_duplex",
               "tokens_per_s_overlap", "tokens_per_s_other_path", "retracted", "overflow",
               "finished", "ula_launches_per_step", "uncharged_gpu_bytes", "cpu_ctl_ms_per_step",
               "measured_layer_ms", "tokens_per_s_measured")


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
# SGLang 0.5.23's admission constants (srt/environ.py:646-650): the running requests' remaining
# output is charged at new_token_ratio x min(left, 4096), the ratio decaying from 0.7 to
# 0.7 x 0.14 over 600 decode steps and reset when a decode step has to retract requests.
CLIP_NEW_TOKENS = 4096
RATIO_INIT, RATIO_MIN_FACTOR, RATIO_DECAY_STEPS = 0.7, 0.14, 600


@dataclass
class Config:
    """One simulated launch. ``gpu_rows`` and ``host_rows`` are the policy's own pools, per
    layer (:func:`equal_bytes` derives them from one per-GPU byte budget): ulacache ``G`` GPU
    slots and ``c G`` CPU slots; HiSparse ``S`` device slots and a host mirror / logical pool of
    ``x S``; resident ``G``. ``scale`` divides k, H, the page, every pool and every request's
    lengths (a CPU-sized run); bytes and attention rows are multiplied back."""

    k: int = 2048
    layers: int = 61  # DeepSeek-V3.2
    row_bytes: int = 656  # FP8 FlashMLA row
    gpu_rows: int = 300_000
    host_rows: int = 3_000_000
    h_slots: int = 4096  # HiSparse device_buffer_size (2 x top_k)
    page: int = 64  # SGLang's DSA page
    buckets: int = 64
    steps: int = 256  # measured steps, after the warm-up
    warmup: int = 64  # steps run before measuring (admission ramp)
    pcie_gbs: float = 50.0
    duplex_factor: float | None = None  # measured by bench/bandwidth.py; None: ideal duplex
    launch_us: float = 2.0  # per kernel node in a CUDA-graph replay (assumed)
    ula_path: str = "fused"  # whose launches are counted: "fused" (CUDA default) | "torch"
    hs_launches: int = 2  # swap-in kernel + previous-token backup
    control: str = "launch"  # or "measured"
    heads: int = 128
    d_qk: int = 576
    d_v: int = 512
    attn_tflops: float = 400.0  # sustained sparse-MLA FLOP rate (H200 bf16 989 peak x ~0.4)
    hbm_tbs: float = 4.0
    other_ms: float | None = None  # fixed non-attention time per step; None: other_seconds()
    weights_gb: float = 685 / 8  # weights read per step per GPU (DeepSeek-V3.2 FP8 / 8 GPUs)
    active_params_b: float = 37.0  # activated parameters per token (DeepSeek-V3.2)
    mlp_tflops: float = 400.0  # sustained dense/MoE FLOP rate (H200 fp8 1979 peak x ~0.2)
    scale: int = 1
    real_rows: bool = False  # also move and read one layer of real rows, timed (decode_rows)
    device: str = "cpu"  # where --real-rows runs (cuda when available)
    seed: int = 0
    shadows: bool = True  # ulacache: evictions of promoted rows remap to their CPU copy
    # ulacache_pf: the draft source's look-ahead prefetch (see draft_prediction)
    prefetch: bool = False
    acceptance: float = 0.8  # share of steps whose draft was the true next token (assumed)
    fetch_cap: int = 1 << 24  # rows prefetched per layer per step, full size (the link caps)
    free_draft: bool = False  # what-if: the draft query's compute is not charged

    def scaled(self, s: int) -> Config:
        """This launch at ``1/s`` size (k, H, page and pools divided; see the class)."""
        if s == 1:
            return self
        return replace(self, k=self.k // s, h_slots=self.h_slots // s, page=max(1, self.page // s),
                       gpu_rows=self.gpu_rows // s, host_rows=self.host_rows // s, scale=s,
                       fetch_cap=max(1, self.fetch_cap // s))


def other_seconds(cfg: Config, batch: int) -> float:
    """Non-attention time of a decode step with ``batch`` requests per GPU (DP attention, EP
    MoE): a roofline, ``max(weights / HBM, batch x 2 x active params / FLOP rate)``: reading the
    GPU's share of the weights once per step (all experts are hit at these batch sizes) or the
    dense and expert FLOPs of the batch, whichever is longer. ``other_ms`` fixes it instead."""
    if cfg.other_ms is not None:
        return cfg.other_ms * 1e-3
    weights = cfg.weights_gb * 1e9 / (cfg.hbm_tbs * 1e12)
    flops = batch * 2.0 * cfg.active_params_b * 1e9 / (cfg.mlp_tflops * 1e12)
    return max(weights, flops)


def duplex_seconds(cfg: Config, h2d: float, d2h: float) -> float:
    """PCIe time of ``h2d`` and ``d2h`` bytes when the two directions overlap: the paired part
    ``min(h2d, d2h)`` each way at ``--duplex-factor`` F (``bench/bandwidth.py``: (H2D + D2H
    time) / swap time; 2.0 full duplex, 1.0 serial), the rest one way; without a measured F,
    the ideal ``max(h2d, d2h)`` (F = 2)."""
    f = cfg.duplex_factor or 2.0
    both = min(h2d, d2h)
    return (2.0 * both / f + (max(h2d, d2h) - both)) / (cfg.pcie_gbs * 1e9)


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


def pages(n: int, page: int) -> int:
    """``n`` tokens rounded up to whole pages (SGLang's paged allocators)."""
    return -(-n // page) * page


@dataclass
class _Live:
    req: Request
    pos: int  # current length = position of the next token
    left: int  # output tokens still to decode
    start: int  # length at (re)admission: HiSparse's buffer restarts there
    addrs: np.ndarray | None = None  # ulacache: address of each position (first ``pos`` set)
    buf: HiSparseBuffer | None = None  # --real-rows only (else HiSparseCache)
    buffer: int = 0  # --real-rows: HiSparse device buffer index
    host: np.ndarray | None = None  # --real-rows: row of each position (mirror / pool)
    last_sel: np.ndarray | None = None  # ulacache_pf: the previous step's selection


def draft_prediction(cfg: Config, lv: _Live, sel: np.ndarray) -> np.ndarray | None:
    """The positions the ``draft`` source predicted, at the previous step, for ``lv``'s step
    selecting ``sel`` (OasisKV's look-ahead: the draft token's query at the next position).
    With probability ``cfg.acceptance`` (drawn per request and position, reproducible) the draft
    was the true next token, so its selection is this step's exactly (as in the recorded
    trace: an accepted draft's top-k is the next step's); otherwise it predicts like the
    previous step's selection (on the bundled trace a rejected draft's top-64 holds 71.7% of
    the next step's, the current step's 70.7%: ``ulacache trace stats``). ``None`` on a
    request's first step after (re)admission: no draft ran yet."""
    prev, lv.last_sel = lv.last_sel, sel
    if prev is None:
        return None
    u = np.random.default_rng([cfg.seed, lv.req.rid, lv.pos, 23]).random()
    return sel if u < cfg.acceptance else prev


class HiSparseCache:
    """Per-request HiSparse swap-in outcomes ``(hits, misses)`` of each step, computed once per
    (buffer size, request, start length) and shared by every run of a seed: a HiSparse buffer
    is private to its request, so its hits depend on the request's own selections only (never
    on the batch, the pools or the concurrency level)."""

    def __init__(self, selections: SelectionCache):
        self.sel = selections
        self._runs: dict[tuple[int, int, int], tuple[HiSparseBuffer, list[tuple[int, int]]]] = {}

    def get(self, h_slots: int, rid: int, start: int, pos: int) -> tuple[int, int]:
        key = (h_slots, rid, start)
        if key not in self._runs:
            self._runs[key] = (HiSparseBuffer(h_slots), [])
        buf, out = self._runs[key]
        while len(out) <= pos - start:
            p = start + len(out)
            out.append(buf.step(self.sel.get(rid, p), p))
        return out[pos - start]


class Memory:
    """SGLang 0.5.23's admission and decode-room checks for one policy, in tokens.

    Admission (``schedule_policy.py:1407-1427`` via ``prefill_budget.py:126-129``): a request
    joins when ``prompt + min(output, 4096) + page < free - sum(min(left_i, 4096)) x ratio``
    over the running requests. ``free``: HiSparse ``min(logical free, device free)``
    (``allocator/hisparse.py:113-117``; the device holds every running request's buffer,
    ``min(pages(len), H)``, or ``H + page`` once it reaches H, ``hisparse_coordinator.py:946-
    1058``, and the whole prompt while it prefills); ulacache its unique capacity, GPU + CPU
    (exclusive tiers), with the prompt on the GPU (``prefill_fits``) and a step's selections
    in the GPU pool (``check_step_capacity``: ``level x (k + 1) <= G``, refused at start-up
    otherwise); resident the pool. Decode (``allocator/base.py:171-185``): every request
    starting a page needs one page free, else requests are retracted."""

    def __init__(self, policy: str, cfg: Config):
        self.policy, self.cfg = policy, cfg

    def buffer(self, length: int) -> int:
        """HiSparse device slots of a running request of ``length`` tokens."""
        c = self.cfg
        n = min(pages(length, c.page), c.h_slots)
        return c.h_slots + c.page if n >= c.h_slots else n

    def free(self, running: list[_Live]) -> int:
        c = self.cfg
        logical = sum(pages(lv.pos, c.page) for lv in running)
        if self.policy == "hisparse":
            device = sum(self.buffer(lv.pos) for lv in running)
            return min(c.host_rows - logical, c.gpu_rows - device)
        return (c.gpu_rows + c.host_rows if self.policy == "ulacache" else c.gpu_rows) - logical

    def admits(self, running: list[_Live], prompt: int, output: int, ratio: float) -> bool:
        c = self.cfg
        if self.policy == "ulacache" and prompt > c.gpu_rows:  # prefill_fits
            return False
        reserve = sum(min(lv.left, CLIP_NEW_TOKENS // c.scale) for lv in running) * ratio
        need = prompt + min(output, CLIP_NEW_TOKENS // c.scale) + c.page
        return need < self.free(running) - reserve

    def decode_room(self, running: list[_Live]) -> bool:
        """Every request whose next token starts a page gets one (``check_decode_capacity``)."""
        starting = sum(1 for lv in running if lv.pos % self.cfg.page == 0)
        return self.free(running) >= self.cfg.page * starting


def level_refused(policy: str, cfg: Config, level: int) -> str | None:
    """Why a launch with ``--max-running-requests level`` does not start, or ``None``."""
    if policy == "ulacache" and level * (cfg.k + 1) > cfg.gpu_rows:
        return (f"ulacache refuses --max-running-requests {level}: a step's selections "
                f"{level} x {cfg.k + 1} exceed the GPU pool ({cfg.gpu_rows} slots)")
    return None


def run_level(policy: str, concurrency: int, cfg: Config, requests: list[Request],
              model: LocalityModel, counts: dict[str, dict[str, int]] | None = None,
              selections: SelectionCache | None = None,
              hisparse: HiSparseCache | None = None) -> dict:
    """Simulate ``cfg.warmup + cfg.steps`` decode steps of ``policy`` with at most
    ``concurrency`` running (``--max-running-requests``), measuring the last ``cfg.steps``.
    ``cfg`` is already at its simulated scale. ``counts``: ulacache's launch counts per path
    (:func:`count_launches`; ``cfg.ula_path`` times the step, the other is reported).
    ``selections`` / ``hisparse``: the seed's shared caches (made here when absent)."""
    system, policy = policy, POLICY[policy]
    cfg = replace(cfg, shadows=system != "ulacache_wb",  # ulacache_wb: shadows off
                  prefetch=system == "ulacache_pf")
    if cfg.prefetch and cfg.real_rows:
        raise ValueError("ulacache_pf is simulated only (--real-rows does not prefetch)")
    selections = selections or SelectionCache(model, cfg.k, cfg.seed)
    hisparse = hisparse or HiSparseCache(selections)
    mem = Memory(policy, cfg)
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    waiting: deque[_Live | Request] = deque()
    running: list[_Live] = []
    now, ratio = 0.0, RATIO_INIT
    ratio_min = RATIO_INIT * RATIO_MIN_FACTOR
    s = cfg.scale
    ula = real = None
    free_addrs: list[int] = []
    if policy == "ulacache":
        counts = counts or launch_counts(cfg)
        cfg = timed_path(cfg, counts)
        unique = cfg.gpu_rows + cfg.host_rows
        ula = Residency("pblru", cfg.gpu_rows, unique, cfg.buckets, device=cfg.device,
                        layers=1, row_bytes=cfg.row_bytes, shadows=cfg.shadows,
                        cpu_slots=cfg.host_rows) if cfg.real_rows else \
            Residency("pblru", cfg.gpu_rows, unique, cfg.buckets, shadows=cfg.shadows,
                      cpu_slots=cfg.host_rows)
        free_addrs = list(range(unique - 1, -1, -1))
    if cfg.real_rows:
        from decode_rows import RealRows

        real = RealRows(policy, torch.device(cfg.device), cfg.gpu_rows, cfg.host_rows,
                        cfg.h_slots, cfg.page, cfg.heads, cfg.k, ula)
        free_rows = list(range((cfg.host_rows if policy == "hisparse" else cfg.gpu_rows) - 1,
                               -1, -1))
        free_buffers = list(range(cfg.gpu_rows // (cfg.h_slots + cfg.page) - 1, -1, -1))
    other_path = next((p for p in (counts or {}) if p != cfg.ula_path), None)
    keys = ("acc", "hit", "h2d", "d2h", "d2h_evict", "ctl", "ctl_other", "attn", "other",
            "tokens", "cpu", "pf", "pf_excess",
            "serial", "duplex", "overlap", "pcie_dx", "other_path")
    tot = dict.fromkeys(keys, 0.0) | dict(overflow=0, finished=0, retracted=0, admitted=[],
                                         steps=0, launches=0)
    pending_release: list[np.ndarray] = []

    def flush() -> None:
        """Rows of finished and retracted requests released (no round start: a server frees
        whenever SGLang does), then their addresses are free for new tokens."""
        if pending_release:
            freed = np.concatenate(pending_release)
            ula.group.release(torch.from_numpy(freed))
            free_addrs.extend(freed[::-1].tolist())
            pending_release.clear()

    def admit(item) -> _Live:
        if isinstance(item, _Live):  # a retracted request: re-prefilled at its length
            lv = item
            lv.start, lv.last_sel = lv.pos, None
        else:
            lv = _Live(item, item.input_len, item.output_len, item.input_len)
        if ula is not None:  # placed with the step's other prompts (one prefill round)
            lv.addrs = np.empty(lv.req.input_len + lv.req.output_len, dtype=np.int64)
            lv.addrs[: lv.pos] = [free_addrs.pop() for _ in range(lv.pos)]
        if real is not None and ula is None:
            n = lv.req.input_len + lv.req.output_len
            lv.host = np.array(free_rows[-n:][::-1], dtype=np.int64)
            del free_rows[-n:]
            if policy == "hisparse":
                lv.buffer, lv.buf = free_buffers.pop(), HiSparseBuffer(cfg.h_slots)
                real.hisparse_admit(lv.buffer, lv.host)
        return lv

    def drop(lv: _Live) -> None:
        if ula is not None:
            pending_release.append(lv.addrs[: lv.pos].copy())
        if real is not None and ula is None:
            free_rows.extend(lv.host[::-1].tolist())
            if policy == "hisparse":
                free_buffers.append(lv.buffer)

    for step in range(cfg.warmup + cfg.steps):
        in_window = step >= cfg.warmup
        if ula is not None:
            flush()
        while pending and pending[0].arrival_s <= now:
            waiting.append(pending.popleft())
        if not running and not waiting and pending:  # idle: jump to the next arrival
            now = pending[0].arrival_s
            waiting.append(pending.popleft())
        batch: list[_Live] = []  # this step's prefill batch
        while waiting and len(running) + len(batch) < concurrency:
            head = waiting[0]
            prompt = head.pos if isinstance(head, _Live) else head.input_len
            left = head.left if isinstance(head, _Live) else head.output_len
            if not mem.admits(running + batch, prompt, left, ratio):
                break
            if policy == "ulacache" and sum(lv.pos for lv in batch) + prompt > cfg.gpu_rows:
                break  # prefill_fits: the batch's prompts together on the GPU
            if real is not None and ula is None:  # --real-rows: its fixed row layout
                req = head.req if isinstance(head, _Live) else head
                if len(free_rows) < req.input_len + req.output_len or \
                        (policy == "hisparse" and not free_buffers):
                    break
            batch.append(admit(waiting.popleft()))
        running += batch
        # The prefill's own transfers, timed in this step like every other copy (prefill
        # compute is not): HiSparse stages a backup of each whole prompt into its host mirror;
        # ulacache spills the victims its prompts displace from the GPU pool
        pre_d2h = pre_evict = 0
        if ula is not None and batch:
            before = ula.group.counters.clone()
            ula.place(torch.from_numpy(np.concatenate([lv.addrs[: lv.pos] for lv in batch])))
            d = dict(zip(COUNTERS, (ula.group.counters - before).tolist()))
            pre_d2h, pre_evict = d["spills"] + d["writebacks"], d["rewrites"]
        elif policy == "hisparse":
            pre_d2h = sum(lv.pos for lv in batch)
        while running and not mem.decode_room(running):  # retract the newest first
            lv = running.pop()
            drop(lv)
            waiting.appendleft(lv)
            tot["retracted"] += in_window
            ratio = RATIO_INIT
        if not running:
            break
        if ula is not None:
            flush()
        sels = [selections.get(lv.req.rid, lv.pos) for lv in running]
        n_sel = sum(x.size for x in sels)
        acc = hit = h2d_rows = d2h_rows = evict_rows = pf_rows = 0  # (+ prefill D2H below)
        t0 = time.perf_counter()
        if ula is not None:
            before = ula.group.counters.clone()
            for lv in running:
                lv.addrs[lv.pos] = free_addrs.pop()  # the new token's address
            batch = torch.full((len(running), cfg.k), -1, dtype=torch.int64)
            for i, (lv, x) in enumerate(zip(running, sels)):
                batch[i, : x.size] = torch.from_numpy(lv.addrs[x])
            new = torch.tensor([lv.addrs[lv.pos] for lv in running], dtype=torch.int64)
            predicted = None
            if cfg.prefetch:  # the draft source: last step's draft, rank order over requests
                guess = torch.full((len(running), cfg.k), -1, dtype=torch.int64)
                for i, (lv, x) in enumerate(zip(running, sels)):
                    p = draft_prediction(cfg, lv, x)
                    if p is not None:
                        guess[i, : p.size] = torch.from_numpy(lv.addrs[p])
                predicted = rank_order(guess)
            if real is not None:
                real.ulacache_step(new, batch)
            else:
                ula.step(new, batch, timed=False, predicted=predicted, budget=cfg.fetch_cap)
            d = dict(zip(COUNTERS, (ula.group.counters - before).tolist()))
            acc, hit, h2d_rows = d["accesses"], d["gpu_hits"], d["promotions"]
            pf_rows = d["prefetches"]
            d2h_rows = d["writebacks"] + d["spills"]
            evict_rows = d["rewrites"]  # rows written back a second time; the rest: births
            tot["overflow"] += (d["access_overflow"] + d["place_overflow"]) * in_window
        elif policy == "hisparse":
            for lv, x in zip(running, sels):
                h, m = lv.buf.step(x, lv.pos) if lv.buf is not None else \
                    hisparse.get(cfg.h_slots, lv.req.rid, lv.start, lv.pos)
                acc, hit, h2d_rows = acc + h + m, hit + h, h2d_rows + m
            # the previous newest token's backup, skipped on the first step after staging
            d2h_rows = sum(1 for lv in running if lv.pos > lv.start)
            if real is not None:
                real.hisparse_step([lv.buffer for lv in running], [lv.host for lv in running],
                                   sels, [lv.buf for lv in running],
                                   [lv.pos - 1 if lv.pos > lv.start else -1 for lv in running])
        else:
            acc = hit = n_sel
            if real is not None:
                rows = np.full((len(running), cfg.k), -1, dtype=np.int64)
                for i, (lv, x) in enumerate(zip(running, sels)):
                    rows[i, : x.size] = lv.host[x]
                real.resident_step(rows)
        cpu = time.perf_counter() - t0
        d2h_rows, evict_rows = d2h_rows + pre_d2h, evict_rows + pre_evict
        finishing = any(lv.left <= 1 for lv in running)
        ctl = ctl_other = 0.0
        if ula is not None:
            ctl = ula_control_seconds(cfg, counts[cfg.ula_path], finishing)
            ctl_other = ula_control_seconds(cfg, counts[other_path], finishing) \
                if other_path else ctl
            if cfg.prefetch:  # one prefetch per layer per step
                ctl += cfg.layers * counts[cfg.ula_path]["prefetch"] * cfg.launch_us * 1e-6
                if other_path:
                    ctl_other += cfg.layers * counts[other_path]["prefetch"] * cfg.launch_us \
                        * 1e-6
        elif policy == "hisparse":
            ctl = ctl_other = cfg.layers * cfg.hs_launches * cfg.launch_us * 1e-6
        if cfg.control == "measured":
            ctl = ctl_other = cpu * cfg.layers
        row = cfg.row_bytes * cfg.layers * s  # one simulated row stands for s real rows
        h2d, d2h, pf = h2d_rows * row, d2h_rows * row, pf_rows * row
        bw = cfg.pcie_gbs * 1e9
        # the draft token's query rides in the batch (its layers' hidden states feed its
        # indexer): twice the queries in attention and in the batch-bound non-attention term
        queries = 2 if cfg.prefetch and not cfg.free_draft else 1
        attn = attention_seconds(cfg, n_sel * s * queries)
        other = other_seconds(cfg, len(running) * queries)
        compute = ctl + attn + other
        # overlap model: prefetches run on their own stream while the step computes (the
        # draft's prediction for a layer is known a whole step before that layer's access);
        # the link moves them at full rate then, and what does not fit is on the step
        pf_excess = max(0.0, pf / bw - compute)
        serial = compute + (h2d + d2h) / bw + pf_excess
        pcie_dx = duplex_seconds(cfg, h2d, d2h) + pf_excess
        now += serial
        if in_window:
            tot["admitted"].append(len(running))
            for key, v in (("acc", acc), ("hit", hit), ("h2d", h2d), ("d2h", d2h), ("pf", pf),
                           ("pf_excess", pf_excess),
                           ("d2h_evict", evict_rows * row),
                           ("ctl", ctl), ("ctl_other", ctl_other), ("attn", attn),
                           ("other", other), ("cpu", cpu), ("tokens", len(running)),
                           ("serial", serial),
                           ("duplex", compute + pcie_dx),
                           ("overlap", max(compute, (h2d + d2h + pf) / bw)),
                           ("pcie_dx", pcie_dx),
                           ("other_path", serial - ctl + ctl_other)):
                tot[key] += v
            tot["steps"] += 1
            if ula is not None:
                tot["launches"] += round(ctl / (cfg.launch_us * 1e-6))
        ratio = max(ratio - (RATIO_INIT - ratio_min) / RATIO_DECAY_STEPS, ratio_min)
        still = []
        for lv in running:
            lv.pos += 1
            lv.left -= 1
            if lv.left > 0:
                still.append(lv)
                continue
            if in_window:
                tot["finished"] += 1
            drop(lv)
        running = still
    n = max(1, tot["steps"])
    measured = {"measured_layer_ms": 0.0, "tokens_per_s_measured": 0.0}
    if real is not None and len(real.seconds) > 1:
        # one layer measured x layers + the non-attention time (HiSparse's swap-in decisions
        # ran on the host: its modelled control time is added)
        secs = real.seconds[-tot["steps"]:] if tot["steps"] else real.seconds
        steps_s = [x * cfg.layers + other_seconds(cfg, b) for x, b in
                   zip(secs, tot["admitted"][-len(secs):])]
        if policy == "hisparse":
            steps_s = [x + cfg.layers * cfg.hs_launches * cfg.launch_us * 1e-6 for x in steps_s]
        measured = {"measured_layer_ms": float(np.mean(secs)) * 1e3,
                    "tokens_per_s_measured": sum(tot["admitted"][-len(secs):]) / sum(steps_s)}
    per = lambda key: tot[key] / n * 1e3  # noqa: E731  ms per measured step
    rate = lambda key: tot["tokens"] / max(1e-12, tot[key])  # noqa: E731
    return {**measured,
            "concurrency": concurrency, "policy": system,
            "gpu_rows": cfg.gpu_rows * s, "host_rows": cfg.host_rows * s,
            "admitted_mean": float(np.mean(tot["admitted"])) if tot["admitted"] else 0.0,
            "admitted_max": int(max(tot["admitted"], default=0)), "steps": tot["steps"],
            "gpu_hit_rate": tot["hit"] / max(1, tot["acc"]),
            "h2d_mb_per_step": tot["h2d"] / n / 1e6, "d2h_mb_per_step": tot["d2h"] / n / 1e6,
            "prefetch_mb_per_step": tot["pf"] / n / 1e6,
            "prefetch_excess_ms": per("pf_excess"),
            "d2h_evict_mb_per_step": tot["d2h_evict"] / n / 1e6,
            "d2h_backup_mb_per_step": (tot["d2h"] - tot["d2h_evict"]) / n / 1e6,
            "control_ms": per("ctl"), "attn_ms": per("attn"), "other_ms": per("other"),
            "pcie_serial_ms": (tot["h2d"] + tot["d2h"]) / n / (cfg.pcie_gbs * 1e9) * 1e3
            + per("pf_excess"),
            "pcie_duplex_ms": per("pcie_dx"),
            "step_ms": per("serial"), "tokens_per_s": rate("serial"),
            "tokens_per_s_duplex": rate("duplex"), "tokens_per_s_overlap": rate("overlap"),
            "cpu_ctl_ms_per_step": per("cpu"), "overflow": tot["overflow"],
            "finished": tot["finished"], "retracted": tot["retracted"],
            "ula_launches_per_step": tot["launches"] / n if ula is not None else 0.0,
            "tokens_per_s_other_path": rate("other_path")}


# -- equal bytes, tuning, seeds ----------------------------------------------------------------
ACTIVE_PARAMS_B = {"dsv32": 37.0, "glm5": 40.0}  # activated parameters per token (model cards)
SYSTEMS = ("ulacache", "ulacache_wb", "ulacache_pf", "hisparse", "resident")
"""``ulacache_wb``: ulacache with shadows off (``--ulacache-config '{"shadows": false}'``):
every eviction of a row writes it back, as the paper's exclusive tiers do. ``ulacache_pf``:
ulacache with the ``draft`` source's look-ahead prefetch (:func:`draft_prediction`)."""
POLICY = {"ulacache": "ulacache", "ulacache_wb": "ulacache", "ulacache_pf": "ulacache",
          "hisparse": "hisparse", "resident": "resident"}  # the simulated system behind each


@dataclass(frozen=True)
class Tuning:
    """One system's knobs: HiSparse ``device_buffer_size`` H and ``host_to_device_ratio`` x;
    ulacache ``cpu_ratio`` c (with or without shadows); resident none."""

    system: str
    ratio: int = 0
    h_slots: int = 0

    @property
    def label(self) -> str:
        if self.system == "hisparse":
            return f"hisparse H={self.h_slots} x={self.ratio}"
        if self.system == "ulacache_wb":
            return f"ulacache-wb c={self.ratio}"
        if self.system == "ulacache_pf":
            return f"ulacache+prefetch c={self.ratio}"
        return f"ulacache c={self.ratio}" if self.system == "ulacache" else "resident"


def budget_inputs(platform: str, model: str, h_slots: int = 4096) -> capacity.Inputs:
    """Per-GPU budgets of :mod:`ulacache.tools.capacity` (what SGLang's sizing charges):
    ``static - weights`` of device memory for KV, the platform's host memory for the tier."""
    p = capacity.PLATFORMS[platform]
    return capacity.Inputs(model, "fp8", platform,
                           int((p.static_gb - capacity.WEIGHTS_GB[model]) * capacity.GB),
                           int(p.host_gb * capacity.GB), device_buffer=h_slots)


def equal_bytes(base: Config, platform: str, model: str, tuning: Tuning, level: int
                ) -> tuple[Config, dict]:
    """The launch of ``tuning`` on one GPU's budget, at full size, and what it charges: the
    pools SGLang's configurator gives each system from the same device and host bytes (index-K
    of every logical token and ulacache's tables and output rows for ``level`` requests
    included; :mod:`ulacache.tools.capacity`), and HiSparse's uncharged device maps beside."""
    inp = budget_inputs(platform, model, tuning.h_slots or 4096)
    geo = dict(k=inp.top_k, layers=inp.layers, row_bytes=inp.row,
               weights_gb=capacity.WEIGHTS_GB[model], active_params_b=ACTIVE_PARAMS_B[model])
    if tuning.system == "hisparse":
        g = capacity.hisparse_pool(inp, tuning.ratio)
        cfg = replace(base, **geo, gpu_rows=g, host_rows=tuning.ratio * g,
                      h_slots=tuning.h_slots)
        extra = capacity.uncharged(inp, "hisparse_dp", tuning.ratio, g)
        # per request slot: the launch's --max-running-requests level (+ SGLang's padding slot)
        extra = {"total": extra["fixed"] + extra["per_request_slot"] * (level + 1)}
    elif POLICY[tuning.system] == "ulacache":
        g = capacity.ulacache_dp_pool(inp, tuning.ratio, running=level)
        cfg = replace(base, **geo, gpu_rows=g, host_rows=tuning.ratio * g)
        extra = capacity.uncharged(replace(inp, running=level), "ulacache_dp", tuning.ratio, g)
    else:
        g = capacity.resident_pool(inp)
        cfg = replace(base, **geo, gpu_rows=g, host_rows=0)
        extra = None
    return cfg, {"kv_bytes": inp.kv_bytes, "host_bytes": inp.host_bytes,
                 "uncharged_gpu_bytes": (extra or {}).get("total", 0)}


def level_rows(tuning: Tuning, base: Config, platform: str, model: str, levels: list[int],
               requests: list[Request], model_loc: LocalityModel, counts: dict, seed: int,
               caches: tuple[SelectionCache, HiSparseCache]) -> list[dict]:
    """Every concurrency level of one tuning and seed, lowest first; stops after the first
    level whose admission never reached it (memory binds: higher limits admit no more)."""
    out = []
    for level in levels:
        full, charge = equal_bytes(base, platform, model, tuning, level)
        cfg = replace(full.scaled(base.scale), seed=seed)
        why = level_refused(POLICY[tuning.system], cfg, level)
        if why:
            logger.info("%s: %s", tuning.label, why)
            break
        t0 = time.perf_counter()
        row = run_level(tuning.system, level, cfg, requests, model_loc, counts, *caches)
        row.update(tuning=tuning.label, seed=seed, **charge)
        logger.info("%s level %d seed %d: %.0f tok/s (%.1f s)", tuning.label, level, seed,
                    row["tokens_per_s"], time.perf_counter() - t0)
        out.append(row)
        if row["admitted_max"] < level:
            break
    return out


def peak(rows: list[dict], key: str = "tokens_per_s") -> float:
    return max((r[key] for r in rows), default=0.0)


METRICS = ("tokens_per_s", "tokens_per_s_duplex", "tokens_per_s_overlap")


# The sweep's runs are independent (one tuning and seed each); ``--jobs`` runs them in forked
# worker processes. A worker inherits the run's inputs (fork: nothing pickled but the job and
# its rows) and generates the selections it needs itself: a request's stream depends only on
# (seed, request), so every worker sees the same selections as a serial run would.
_WORK: dict = {}


def _run_job(job: tuple[int, Tuning]) -> list[dict]:
    seed, t = job
    w = _WORK
    return level_rows(t, w["base"], w["platform"], w["model"], w["levels"], w["requests"],
                      w["model_loc"], w["counts"], seed, w["caches"][seed])


def _worker_init() -> None:
    torch.set_num_threads(1)  # one core per worker: the workers are the parallelism
    logging.getLogger().setLevel(logging.WARNING)  # per-level logs interleave across workers


def run_jobs(jobs: list[tuple[int, Tuning]], work: dict, n_jobs: int, bar=None
             ) -> list[list[dict]]:
    """``level_rows`` of each ``(seed, tuning)`` job, in job order, over ``n_jobs`` forked
    processes (1: in this process)."""
    global _WORK
    _WORK = work
    try:
        # a forked child cannot use a CUDA context its parent holds (--real-rows on a GPU)
        if n_jobs <= 1 or len(jobs) <= 1 or (torch.cuda.is_available()
                                            and torch.cuda.is_initialized()):
            out = []
            for job in jobs:
                out.append(_run_job(job))
                if bar:
                    bar.update()
            return out
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(min(n_jobs, len(jobs)), initializer=_worker_init) as pool:
            out = []
            for rows in pool.imap(_run_job, jobs):
                out.append(rows)
                if bar:
                    bar.update()
            return out
    finally:
        _WORK = {}


def fair_sweep(base: Config, platform: str, model: str, levels: list[int],
               requests: list[Request], model_loc: LocalityModel, grids: dict[str, list],
               seeds: int, progress: bool = True, jobs: int = 1) -> dict:
    """Each system tuned on seed 0 (every tuning x level) for each metric's peak (serial,
    duplex, overlap) apart; each metric's best tuning then runs on seeds ``1 .. seeds - 1``;
    the peak ratios per seed and their spread, per metric. ``jobs``: worker processes (the
    figures do not depend on it)."""
    counts = launch_counts(base) if {"ulacache", "ulacache_wb", "ulacache_pf"} & set(grids) \
        else {}
    base = timed_path(base, counts)
    rows: list[dict] = []
    todo = [(0, t) for ts in grids.values() for t in ts]
    bar = tqdm(total=len(todo), desc="decode sweep", disable=not progress) if tqdm else None
    caches = {0: _caches(model_loc, base, 0)}
    work = dict(base=base, platform=platform, model=model, levels=levels, requests=requests,
                model_loc=model_loc, counts=counts, caches=caches)
    by_tuning: dict[Tuning, list[dict]] = {}
    for (_, t), got in zip(todo, run_jobs(todo, work, jobs, bar)):
        by_tuning[t] = got
        rows += got
    if bar:
        bar.close()
    # best[s][m]: system s's tuning with the highest seed-0 peak of metric m
    best_by = {s: {m: max(ts, key=lambda t, m=m: peak(by_tuning[t], m)) for m in METRICS}
               for s, ts in grids.items()}
    best = {s: b["tokens_per_s"] for s, b in best_by.items()}
    seed_rows = {0: dict(by_tuning)}
    for seed in range(1, seeds):
        caches[seed] = _caches(model_loc, base, seed)
        caches.pop(seed - 1, None)  # one seed's selections in memory at a time
        seed_rows[seed] = {}
        again = [(seed, t) for t in dict.fromkeys(t for b in best_by.values()
                                                   for t in b.values())]
        for (_, t), got in zip(again, run_jobs(again, work, jobs)):
            rows += got
            seed_rows[seed][t] = got
    peaks = {s: [{m: peak(seed_rows[seed][best_by[s][m]], m) for m in METRICS}
                 for seed in range(seeds)] for s in grids}
    ratios = {}
    for ula, other in (("ulacache", "hisparse"), ("ulacache", "resident"),
                       ("ulacache_wb", "hisparse"), ("ulacache", "ulacache_wb"),
                       ("ulacache_pf", "hisparse"), ("ulacache_pf", "ulacache")):
        if ula in peaks and other in peaks:
            for m in METRICS:
                per_seed = [a[m] / b[m] if b[m] else 0.0
                            for a, b in zip(peaks[ula], peaks[other])]
                ratios[f"{ula}/{other} {m}"] = {"mean": float(np.mean(per_seed)),
                                                "min": min(per_seed), "max": max(per_seed),
                                                "per_seed": per_seed}
    if base.real_rows:  # one layer of real rows measured (bench/device_summary.py reads it)
        meas = {s: peak(by_tuning[t], "tokens_per_s_measured") for s, t in best.items()}
        for other in ("hisparse", "resident"):
            if meas.get("ulacache") and meas.get(other):
                ratios[f"measured ulacache/{other}"] = meas["ulacache"] / meas[other]
    tunings = [{"tuning": t.label, "system": t.system,
                "peak_tokens_per_s": peak(r), "best": best[t.system] == t,
                "gpu_rows": r[0]["gpu_rows"] if r else 0,
                "host_rows": r[0]["host_rows"] if r else 0,
                "max_admitted": max((x["admitted_max"] for x in r), default=0),
                "uncharged_gpu_bytes": r[0]["uncharged_gpu_bytes"] if r else 0}
               for t, r in by_tuning.items()]
    return {"config": asdict(base), "platform": platform, "model": model, "levels": levels,
            "seeds": seeds, "locality": model_loc.to_dict(), "rows": rows,
            "tunings": tunings, "best": {s: t.label for s, t in best.items()},
            "best_by_metric": {s: {m: t.label for m, t in b.items()}
                               for s, b in best_by.items()},
            "peaks": peaks, "peak_ratios": ratios, "ula_launch_counts": counts}


def _caches(model_loc: LocalityModel, cfg: Config, seed: int
            ) -> tuple[SelectionCache, HiSparseCache]:
    sel = SelectionCache(model_loc, cfg.k // cfg.scale, seed)
    return sel, HiSparseCache(sel)


def scaled_requests(requests: list[Request], s: int) -> list[Request]:
    """Every request's lengths divided by ``s`` (at least 1 token each)."""
    return [replace(r, input_len=max(1, r.input_len // s), output_len=max(1, r.output_len // s))
            for r in requests] if s > 1 else requests


# -- output -------------------------------------------------------------------------------
ASSUMPTIONS = [
    ("Pools from one per-GPU byte budget (ulacache.tools.capacity: latent, index-K of every "
     "logical token, ulacache's tables and output rows, HiSparse's cell)", "neither: equal bytes"
     "; HiSparse's uncharged maps (printed) come out of the headroom, which favours HiSparse"),
    ("Each side tuned on seed 0 (HiSparse H and x, ulacache c), its best tuning rerun on the "
     "other seeds", "neither"),
    ("ulacache's pool is charged its prefill stage (what ships: one layer of context_len rows), "
     "but admission still holds a prefill batch's prompts to the GPU pool, as without a stage "
     "(a batch past the pool waits instead of being staged)", "HiSparse"),
    ("Admission: SGLang 0.5.23's prefill budget and decode-room check for both (new-token ratio "
     "0.7 decaying to 0.098 over 600 steps, reset by a retraction); a retracted request "
     "re-queues with its progress and its re-prefill is not timed (the `retracted` column "
     "counts them)", "whoever retracts more, since its re-prefills are free here"),
    ("Prefill compute is not timed; its transfers are, in the step that admits the request: "
     "HiSparse's staging backup of the whole prompt into its host mirror, ulacache's spills of "
     "the victims its prompt displaces (a prompt row evicted later is timed when it is)",
     "ulacache slightly: it copies only the prompt rows that leave the GPU, HiSparse every one, "
     "as the two really do"),
    ("PCIe serial (H2D + D2H) / 50 GB/s is the headline; duplex max(H2D, D2H) is printed, not "
     "claimed: bench/device_check.sh has not measured duplex swap_rows", "HiSparse "
     "(its D2H is one backup row per request; ulacache writes back rows born on the GPU when "
     "first evicted, and with shadows off every evicted row)"),
    ("ulacache's shadows live in CPU slots no row holds, reclaimed when a placement needs "
     "them; ulacache-wb is the same launch with shadows off. D2H is split into eviction "
     "(rows written back a second time) and backup (a row's first copy to the CPU)",
     "neither: same pools, same bytes"),
    ("Overlap bound max(compute, PCIe): every transfer hidden behind compute, for both alike",
     "ulacache, whose PCIe share is larger"),
    ("ulacache+prefetch (ulacache_pf): the draft source (OasisKV) on the real core's "
     "SelectionGroup.prefetch, between the step's placement and its access; a draft is the true "
     "next token on --acceptance of the steps (ASSUMED, not measured: the bundled trace's "
     "n-gram drafts reach 0.135, an MTP/EAGLE head more) and then predicts the step exactly, "
     "otherwise it predicts like the previous step's selection (measured on the bundled "
     "trace: a rejected draft's top-64 holds 71.7% of the next step's, the current step's "
     "70.7%)", "ulacache_pf when the real acceptance is lower"),
    ("Prefetch overlap model: prefetch copies move at full link rate while the step computes "
     "(control + attention + non-attention) and only their excess over it is on the step; "
     "critical-path transfers stay serial. The draft token's query is charged: twice the "
     "attention and twice the batch in the non-attention roofline, and 4 launches per layer "
     "(counted). HiSparse's own prefetch (SGLang 0.5.23, shared-index models only) does "
     "nothing for DeepSeek-V3.2 / GLM-5 (one indexer per layer): its figures are unchanged",
     "ulacache_pf in the overlap (not measured yet: bench/prefetch_overlap.py on a GPU); "
     "HiSparse in the draft's cost, which speculative verification would turn into accepted "
     "tokens for both"),
    ("Step = control (2 us per counted launch) + sparse-MLA roofline + non-attention roofline "
     "max(weights / HBM, batch x 2 x active params / 400 TFLOP/s)", "neither in the rooflines "
     "(the same for both; the batch-dependent term penalises whoever admits more); the control "
     "plane omits kernel run time (ulacache's access scans its pools) and HiSparse's host-side "
     "coordinator work, which leans each way"),
    ("Each side is tuned for each column apart (serial, duplex, overlap: its best tuning on "
     "seed 0 for that pricing, rerun on the other seeds)", "neither"),
    ("Seeds vary the selection streams only (the Mooncake arrivals and lengths are fixed); a "
     "retraction takes the newest request and resets the ratio to 0.7 (SGLang estimates it and "
     "picks by fewest outputs)", "neither: the same for both; the spread understates variance"),
    ("Selections: the locality generator calibrated on the real SmolLM2 trace, one stream per "
     "request; one layer stands for all", "neither: identical selections for both"),
    ("--scale s divides k, H, the page, every pool and every request's lengths by s (bytes and "
     "attention rows multiplied back); a new token is then s x a larger share of a step's "
     "selections, and requests live s x fewer steps, so admissions and their cold starts "
     "(HiSparse's first misses, ulacache's promotions of rows a prompt displaced) come s x "
     "as often", "HiSparse slightly: the full-size check puts ulacache's ratio 3% higher"),
]


def markdown(res: dict) -> str:
    cfg, spread = res["config"], res["peak_ratios"]
    lines = [
        f"Decode sweep at equal bytes (simulation + cost model, not a GPU measurement): "
        f"{res['model']} on one {res['platform'].upper()} of a DP8 launch, k={cfg['k']}, "
        f"{cfg['layers']} layers, {cfg['row_bytes']} B rows, {cfg['warmup']} + {cfg['steps']} "
        f"steps per level (the last {cfg['steps']} measured), {res['seeds']} seeds, scale "
        f"1/{cfg['scale']}, PCIe {cfg['pcie_gbs']} GB/s",
        "",
        "Tunings (seed 0; pools per GPU at full size, peak serial tokens/s over the levels; "
        "uncharged: device bytes SGLang's sizing does not charge, out of the headroom):",
        "",
        "| tuning | GPU rows | host rows | admitted max | peak tokens/s | uncharged GB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for t in res["tunings"]:
        mark = " **(best)**" if t["best"] else ""
        lines.append(f"| {t['tuning']}{mark} | {t['gpu_rows']:,} | {t['host_rows']:,} | "
                     f"{t['max_admitted']} | {t['peak_tokens_per_s']:,.0f} | "
                     f"{t['uncharged_gpu_bytes'] / 1e9:.2f} |")
    lines += ["", "Best tunings, per level (seed 0):", "",
              "| level | tuning | admitted | GPU hit | H2D / D2H (eviction + backup) MB | step ms "
              "(ctl + attn + other "
              "+ PCIe serial) | tok/s serial | duplex | overlap |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    best = set(res["best"].values()) | {t for b in (res.get("best_by_metric") or {}).values()
                                        for t in b.values()}
    for r in res["rows"]:
        if r["seed"] == 0 and r["tuning"] in best:
            lines.append(
                f"| {r['concurrency']} | {r['tuning']} | {r['admitted_mean']:.1f} | "
                f"{r['gpu_hit_rate']:.3f} | {r['h2d_mb_per_step']:.0f} / "
                f"{r['d2h_evict_mb_per_step']:.0f} + {r['d2h_backup_mb_per_step']:.0f} | "
                f"{r['step_ms']:.1f} ({r['control_ms']:.1f} + "
                f"{r['attn_ms']:.1f} + {r['other_ms']:.1f} + {r['pcie_serial_ms']:.1f}) | "
                f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_duplex']:,.0f} | "
                f"{r['tokens_per_s_overlap']:,.0f} |")
    bbm = res.get("best_by_metric") or {}
    if bbm:
        lines += ["", "Best tuning per column: " + "; ".join(
            f"{s}: " + ", ".join(f"{m.replace('tokens_per_s', 'serial').replace('serial_', '')}"
                                 f" {t.split(' ', 1)[1] if ' ' in t else t}"
                                 for m, t in b.items()) for s, b in bbm.items())]
    lines += ["", "Peak ratios over seeds (mean, min - max):", ""]
    dx = cfg.get("duplex_factor")
    names = {"tokens_per_s": "serial PCIe (headline)",
             "tokens_per_s_duplex": f"duplex PCIe at the measured factor {dx}" if dx else
             "duplex PCIe, ideal (not measured: not claimed)",
             "tokens_per_s_overlap": "overlap bound max(compute, PCIe)"}
    for key, v in spread.items():
        if key.startswith("measured"):
            lines.append(f"- {key} (one layer of real rows on {cfg['device']}): x{v:.2f}")
            continue
        pair, metric = key.split(" ")
        lines.append(f"- {pair}, {names[metric]}: x{v['mean']:.2f} ({v['min']:.2f} - "
                     f"{v['max']:.2f})")
    with_pf, without = (spread.get(f"{u}/hisparse tokens_per_s") for u in ("ulacache_pf",
                                                                          "ulacache"))
    if with_pf and without:
        free = ", WHAT-IF: the draft query's compute not charged" if cfg.get("free_draft") \
            else ""
        lines += ["", f"**Prefetch** (draft source, acceptance {cfg['acceptance']} assumed, "
                  f"overlap model{free}): peak decode tokens/s vs HiSparse with prefetch "
                  f"x{with_pf['mean']:.2f} ({with_pf['min']:.2f} - {with_pf['max']:.2f}), "
                  f"without x{without['mean']:.2f} ({without['min']:.2f} - "
                  f"{without['max']:.2f}), in the same run (serial PCIe; goal x1.3)"]
    lines += ["", "Assumptions, and whom each favours:", ""]
    lines += [f"- {a}. Favours: {who}." for a, who in ASSUMPTIONS]
    counts = res.get("ula_launch_counts") or {}
    if counts:
        c = counts.get(cfg["ula_path"]) or next(iter(counts.values()))
        lines += ["", f"ulacache control plane, {cfg['ula_path']} path (counted on the real "
                  f"core): round start {c['round']}, per group place {c['place']}, access "
                  f"{c['access']}, release {c['release']}"]
        if "fused" not in counts:
            lines.append("The fused path's launches were not counted (Triton is not installed: "
                         "pip install 'ulacache[cuda]').")
    return "\n".join(lines) + "\n"


def write_outputs(res: dict, out: Path, png: bool = True) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": str(out / "decode_sweep.csv"), "md": str(out / "decode_sweep.md")}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in res["rows"]:
            w.writerow({c: r.get(c, "") for c in CSV_COLUMNS})
    Path(paths["md"]).write_text(markdown(res))
    if png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:  # pragma: no cover
            return paths
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        best = set(res["best"].values()) | {
            t for b in (res.get("best_by_metric") or {}).values() for t in b.values()}
        metrics = (("tokens_per_s", "decode tokens/s (serial PCIe)"),
                   ("gpu_hit_rate", "GPU hit rate"), ("admitted_mean", "admitted (mean)"))
        for ax, (key, label) in zip(axes, metrics):
            for t in sorted(best):
                rows = [r for r in res["rows"] if r["tuning"] == t and r["seed"] == 0]
                ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], "o-", label=t)
            ax.set_xlabel("--max-running-requests")
            ax.set_title(label)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"decode sweep at equal bytes, {res['model']} on {res['platform']} "
                     "(simulation + cost model; best tunings, seed 0)")
        fig.tight_layout()
        paths["png"] = str(out / "decode_sweep.png")
        fig.savefig(paths["png"], dpi=100)
        plt.close(fig)
    return paths


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    d = Config()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--platform", choices=sorted(capacity.PLATFORMS), default="h200")
    ap.add_argument("--model", choices=sorted(capacity.MODELS), default="dsv32")
    ap.add_argument("--levels", default="32,64,96,128,160,192,256",
                    help="--max-running-requests per GPU to try, lowest first")
    ap.add_argument("--policies", default=None,
                    help=f"systems to sweep (default {','.join(SYSTEMS)}; with --real-rows "
                         "ulacache_pf is left out: it is simulated only)")
    ap.add_argument("--hs-buffers", default="2560,3072,4096",
                    help="HiSparse device_buffer_size values to tune over")
    ap.add_argument("--hs-ratios", default="1,2,3,4,6,8",
                    help="HiSparse host_to_device_ratio values to tune over")
    ap.add_argument("--ula-ratios", default="1,2,3,4,6,8",
                    help="ulacache cpu_ratio values to tune over")
    ap.add_argument("--wb-ratios", default="1,2,4",
                    help="cpu_ratio values for ulacache with shadows off (ulacache_wb); its "
                         "peaks fall past c = 2 in every column, as ulacache's do")
    ap.add_argument("--pf-ratios", default="1",
                    help="cpu_ratio values for ulacache with the draft prefetch "
                         "(ulacache_pf); c = 1 was its best in the 2026-12-05 run over 1,4 "
                         "(docs/decode_sweep.md)")
    ap.add_argument("--acceptance", type=float, default=d.acceptance,
                    help="ulacache_pf: share of steps whose draft was the true next token "
                         "(assumed; the bundled trace's n-gram drafts: 0.135)")
    ap.add_argument("--fetch-cap", type=int, default=d.fetch_cap,
                    help="ulacache_pf: rows prefetched per layer per step (full size)")
    ap.add_argument("--free-draft", action="store_true",
                    help="ulacache_pf what-if: the draft query's compute is not charged (as "
                         "if a speculative decoder already ran it); labelled in the output")
    ap.add_argument("--no-tune", action="store_true",
                    help="use the first value of each tuning list only")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="worker processes (default: one per CPU; the figures do not depend "
                    "on it)")
    ap.add_argument("--scale", type=int, default=8,
                    help="simulate at 1/s size (k, H, page, pools, lengths); 1 = full size")
    ap.add_argument("--requests", type=int, default=2000, help="first N Mooncake requests")
    ap.add_argument("--mooncake", default=str(MOONCAKE))
    ap.add_argument("--trace", default=str(TRACE), help="selection trace for calibration")
    ap.add_argument("--arrival-speedup", type=float, default=100.0)
    ap.add_argument("--max-input", type=int, default=None, help="cap input lengths")
    ap.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    for name in ("buckets", "steps", "warmup", "hs_launches", "heads", "d_qk", "d_v"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("pcie_gbs", "launch_us", "attn_tflops", "hbm_tbs", "mlp_tflops"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    ap.add_argument("--duplex-factor", type=float, default=None,
                    help="(H2D + D2H) / swap time measured by bench/bandwidth.py (1.0 serial .. "
                         "2.0 full duplex); default: the duplex column is the ideal bound")
    ap.add_argument("--other-ms", type=float, default=None,
                    help="fixed non-attention ms per step (default: the roofline model)")
    ap.add_argument("--control", choices=("launch", "measured"), default=d.control)
    ap.add_argument("--ula-path", choices=("fused", "torch"), default=d.ula_path,
                    help="whose counted launches time ulacache's steps (the other is reported)")
    ap.add_argument("--real-rows", action="store_true",
                    help="also move and read one layer of real rows per step, timed "
                         "(bench/decode_rows.py; meant for a GPU; use with --no-tune)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device of --real-rows")
    ap.add_argument("--out", default=None, help="output dir (default: a new temp dir)")
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO,
                        format="%(name)s %(message)s", stream=sys.stderr)
    try:
        levels = _ints(a.levels)
        policies = tuple(p for p in (a.policies or ",".join(SYSTEMS)).split(",") if p)
        grids = {"hisparse": [Tuning("hisparse", x, h) for h in _ints(a.hs_buffers)
                              for x in _ints(a.hs_ratios)],
                 "ulacache": [Tuning("ulacache", c) for c in _ints(a.ula_ratios)],
                 "ulacache_wb": [Tuning("ulacache_wb", c) for c in _ints(a.wb_ratios)],
                 "ulacache_pf": [Tuning("ulacache_pf", c) for c in _ints(a.pf_ratios)],
                 "resident": [Tuning("resident")]}
    except ValueError as e:
        ap.error(f"lists are comma-separated integers: {e}")
    if not levels or min(levels) < 1 or a.seeds < 1 or a.scale < 1 or a.steps < 1 \
            or a.jobs < 1:
        ap.error("--levels, --seeds, --scale, --steps and --jobs must be positive")
    if a.duplex_factor is not None and not 1.0 <= a.duplex_factor <= 2.0:
        ap.error("--duplex-factor must be in [1, 2] (1.0: serial, 2.0: full duplex)")
    if not 0.0 <= a.acceptance <= 1.0 or a.fetch_cap < 0:
        ap.error("--acceptance must be in [0, 1] and --fetch-cap >= 0")
    if a.policies is None and a.real_rows:
        policies = tuple(p for p in policies if p != "ulacache_pf")
    elif a.real_rows and "ulacache_pf" in policies:
        ap.error("--real-rows does not prefetch: leave ulacache_pf out of --policies")
    if any(p not in SYSTEMS for p in policies):
        ap.error(f"--policies must be among {SYSTEMS}")
    if any(not g for g in grids.values()):
        ap.error("every tuning list needs at least one value")
    grids = {p: (g[:1] if a.no_tune else g) for p, g in grids.items() if p in policies}
    cfg = Config(**{f: getattr(a, f) for f in Config.__dataclass_fields__
                    if hasattr(a, f) and f not in ("k", "layers", "row_bytes")})
    if any(t.h_slots < cfg.k for t in grids.get("hisparse", [])):
        ap.error(f"--hs-buffers must be >= top-k ({cfg.k})")
    t0 = time.perf_counter()
    model = calibrate(load_trace(a.trace), seed=0)
    reqs = scaled_requests(load_requests(Path(a.mooncake), a.requests, a.arrival_speedup,
                                         a.max_input, a.max_output), a.scale)
    res = fair_sweep(cfg, a.platform, a.model, levels, reqs, model, grids, a.seeds,
                     progress=not a.quiet and not a.json,
                     jobs=1 if a.real_rows else a.jobs)  # real rows: timed on one device
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
