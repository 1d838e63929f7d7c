"""Scheduling time per decode step: PB-LRU vs exact LRU under replacement pressure.

Both policies run side by side on the same selection stream (``bench/workload.py``: batch 64 x
top-k 2048 with temporal locality), over GPU pools of 2^16 .. 2^22 slots that start full.
Timed: the policy's own work per step (touch, victim choice, advance); the residency
bookkeeping around it is identical for both and not counted. Printed: ms/step of each, the
LRU/PB-LRU time ratio, hit rates and their difference in percentage points.

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

from ulacache.policy_sim import ResidencySim  # noqa: E402

logger = logging.getLogger("pblru_vs_lru")


def run_size(slots: int, args: argparse.Namespace) -> dict:
    work = LocalityWorkload(bs=args.batch, k=args.topk, history=args.history, keep=args.keep,
                            seed=args.seed)
    sims = {p: ResidencySim(p, slots, args.buckets) for p in ("pblru", "lru")}
    hot = work.resident_set(slots)
    for sim in sims.values():
        sim.preload(hot)
    steps = [work.step() for _ in range(args.warmup + args.steps)]
    for i, addrs in enumerate(steps):
        for sim in sims.values():  # interleaved: both see the same machine state
            sim.step(addrs, timed=i >= args.warmup)
    row = {"slots": slots}
    for p, sim in sims.items():
        r = sim.result
        times = sorted(r.step_seconds)
        row[f"{p}_ms_per_step"] = 1e3 * times[len(times) // 2]  # median
        row[f"{p}_hit_rate"] = r.hit_rate
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,18,20,22", help="log2 pool sizes (comma list)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--history", type=int, default=131072, help="tokens per request")
    ap.add_argument("--keep", type=float, default=0.85, help="consecutive-step overlap")
    ap.add_argument("--buckets", type=int, default=64, help="PB-LRU recent buckets n_b")
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
              f"{torch.get_num_threads()}, median of {args.steps} steps")
        print(f"{'slots':>9} {'PB-LRU ms':>10} {'LRU ms':>9} {'LRU/PB':>7} {'PB hit':>8} "
              f"{'LRU hit':>8} {'diff pp':>8}")
        for r in rows:
            print(f"{r['slots']:>9} {r['pblru_ms_per_step']:>10.2f} {r['lru_ms_per_step']:>9.2f} "
                  f"{r['lru_ms_per_step'] / r['pblru_ms_per_step']:>7.2f} "
                  f"{r['pblru_hit_rate']:>8.4f} {r['lru_hit_rate']:>8.4f} "
                  f"{100 * (r['pblru_hit_rate'] - r['lru_hit_rate']):>+8.3f}")
        first, last = rows[0], rows[-1]
        print(f"PB-LRU growth {first['slots']} -> {last['slots']} slots: "
              f"{last['pblru_ms_per_step'] / first['pblru_ms_per_step']:.2f}x; "
              f"LRU growth: {last['lru_ms_per_step'] / first['lru_ms_per_step']:.2f}x")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = [r["slots"] for r in rows]
        for p, label in (("pblru", "PB-LRU"), ("lru", "exact LRU")):
            ax.plot(xs, [r[f"{p}_ms_per_step"] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPU pool slots")
        ax.set_ylabel("policy ms / decode step")
        ax.set_title(f"batch {args.batch} x top-k {args.topk}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
