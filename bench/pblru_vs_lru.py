"""Scheduling time per decode step: PB-LRU vs exact LRU under replacement pressure.

Both policies run side by side on the same selection stream (``bench/workload.py``: batch 64 x
top-k 2048 with temporal locality), over GPU pools of 2^18 .. 2^22 slots that start full (the
history is placed first, so the pool holds the tail of every request). Each step runs what a
serving engine runs for one selection group, through the real core
(:class:`ulacache.tools.residency.Residency`: a selection group with zero-byte rows): a new
round, the batch's new tokens placed, the sparse access of the batch's selections.

Printed per pool size: the whole step's time (ms, median) of each policy and their ratio, the
policy's own share (touch, victims, advance) and its ratio, hit rates and misses.

    python bench/pblru_vs_lru.py            # table
    python bench/pblru_vs_lru.py --json     # {"rows": [{"slots", "pblru_ms_per_step", ...}]}
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import LocalityWorkload  # noqa: E402

from ulacache.pblru import DEFAULT_BUCKETS, POLICIES  # noqa: E402
from ulacache.tools.residency import Residency  # noqa: E402

logger = logging.getLogger("pblru_vs_lru")


def _median_ms(xs: list[float]) -> float:
    return 1e3 * sorted(xs)[len(xs) // 2]


def run_size(slots: int, args: argparse.Namespace) -> dict:
    work = LocalityWorkload(bs=args.batch, k=args.topk, history=args.history, keep=args.keep,
                            seed=args.seed)
    n_logical = args.batch * work.stride
    sims = {p: Residency(p, slots, n_logical, args.buckets) for p in POLICIES}
    # prefill: every request's history, oldest positions first, so the pool ends up holding
    # the tail of every request
    history = (torch.arange(args.history).view(-1, 1) + work.base.view(1, -1)).reshape(-1)
    for sim in sims.values():
        sim.place(history)
    for i in range(args.warmup + args.steps):
        new = work.length + work.base  # the token each request appends this step
        sel = work.step().view(args.batch, args.topk)
        for sim in sims.values():  # interleaved: both see the same machine state
            sim.step(new, sel, timed=i >= args.warmup)
    row = {"slots": slots}
    for p, sim in sims.items():
        r = sim.result
        assert r.overflow == 0, "the step did not fit the pool"
        row[f"{p}_ms_per_step"] = _median_ms(r.step_seconds)
        row[f"{p}_policy_ms_per_step"] = _median_ms(r.policy_seconds)
        row[f"{p}_hit_rate"] = r.hit_rate
        row[f"{p}_misses"] = r.misses
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="18,19,20,21,22",
                    help="log2 pool sizes (comma list); one step (batch x top-k) must fit")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--history", type=int, default=131072, help="tokens per request")
    ap.add_argument("--keep", type=float, default=0.85, help="consecutive-step overlap")
    ap.add_argument("--buckets", type=int, default=DEFAULT_BUCKETS,
                    help="PB-LRU recent buckets n_b")
    ap.add_argument("--steps", type=int, default=96,
                    help="timed steps per size (more than n_b, so buckets age into cold)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", type=Path, help="also write a PNG of ms/step vs pool size")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [1 << int(s) for s in args.sizes.split(",")]
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional
        def tqdm(x, **_):
            return x
    rows = [run_size(s, args) for s in tqdm(sizes, desc="pool sizes", file=sys.stderr)]
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(f"batch {args.batch} x top-k {args.topk}, history {args.history}/request, "
              f"overlap {args.keep}, n_b {args.buckets}, torch threads "
              f"{torch.get_num_threads()}, median of {args.steps} steps; step = new round + "
              "placement + access (the real core, zero-byte rows)")
        print(f"{'slots':>9} {'PB step ms':>11} {'LRU step ms':>12} {'LRU/PB':>7} "
              f"{'PB pol ms':>10} {'LRU pol ms':>11} {'LRU/PB':>7} {'PB hit':>8} {'LRU hit':>8} "
              f"{'misses PB/LRU':>14}")
        for r in rows:
            print(f"{r['slots']:>9} {r['pblru_ms_per_step']:>11.2f} {r['lru_ms_per_step']:>12.2f} "
                  f"{r['lru_ms_per_step'] / r['pblru_ms_per_step']:>7.2f} "
                  f"{r['pblru_policy_ms_per_step']:>10.2f} {r['lru_policy_ms_per_step']:>11.2f} "
                  f"{r['lru_policy_ms_per_step'] / r['pblru_policy_ms_per_step']:>7.2f} "
                  f"{r['pblru_hit_rate']:>8.4f} {r['lru_hit_rate']:>8.4f} "
                  f"{r['pblru_misses'] / max(1, r['lru_misses']):>14.4f}")
        first, last = rows[0], rows[-1]
        print(f"step time growth {first['slots']} -> {last['slots']} slots: PB-LRU "
              f"{last['pblru_ms_per_step'] / first['pblru_ms_per_step']:.2f}x, exact LRU "
              f"{last['lru_ms_per_step'] / first['lru_ms_per_step']:.2f}x")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        xs = [r["slots"] for r in rows]
        for p, label in (("pblru", "PB-LRU"), ("lru", "exact LRU")):
            ax.plot(xs, [r[f"{p}_ms_per_step"] for r in rows], marker="o", label=f"{label} step")
            ax.plot(xs, [r[f"{p}_policy_ms_per_step"] for r in rows], marker="x", ls="--",
                    label=f"{label} policy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPU pool slots")
        ax.set_ylabel("ms / decode step (one group)")
        ax.set_title(f"batch {args.batch} x top-k {args.topk}, CPU")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
