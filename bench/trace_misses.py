"""Misses of PB-LRU vs exact LRU on a recorded selection trace, through the real core.

One request decodes the trace (``ulacache.tools.residency.simulate_trace``: the prompt is placed,
then each step places its query token and accesses that step's top-k) once per policy and pool
size, layer by layer. Three policies side by side: exact LRU, PB-LRU as shipped (epochs paced by
turnover), and PB-LRU with one epoch per round (``bucket_fill=0``, the paper's rotation), so the
effect of the pacing is measured in the same run. Printed: misses summed over the layers and
PB-LRU's relative difference from exact LRU, plus the worst single layer.

    python bench/trace_misses.py                                   # bundled trace, all layers
    python bench/trace_misses.py tests/fixtures/typing-py-1024-k64.trace.npz --layers 0,10,20
    python bench/trace_misses.py --compare-buckets 32   # PB-LRU at 64 and at 32 buckets
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ulacache.pblru import DEFAULT_BUCKETS
from ulacache.tools.cli import bundled_trace
from ulacache.tools.residency import simulate_trace
from ulacache.tools.traces import load_trace

VARIANTS = {"lru": ("lru", None), "pblru": ("pblru", None), "pblru_per_round": ("pblru", 0)}


def run(trace, layers: list[int], sizes: list[int], n_buckets: int,
        variants: dict[str, tuple[str, int | None, int]] | None = None) -> dict:
    """``{variant: {pool size: [(accesses, misses) per layer]}}``; ``variants`` maps a name to
    (policy, bucket_fill, n_buckets), default :data:`VARIANTS` at ``n_buckets``."""
    variants = variants or {v: (*VARIANTS[v], n_buckets) for v in VARIANTS}
    positions = [int(p) for p in trace.positions]
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional
        def tqdm(x, **_):
            return x
    out: dict[str, dict[int, list[tuple[int, int]]]] = {v: {} for v in variants}
    jobs = [(v, s) for s in sizes for v in variants]
    for variant, size in tqdm(jobs, desc="policy x pool size", file=sys.stderr):
        name, fill, nb = variants[variant]
        runs = (simulate_trace(trace.layer_selections(layer), positions, name, size,
                               trace.meta.n_tokens, nb, bucket_fill=fill)
                for layer in layers)
        out[variant][size] = [(r.accesses, r.misses) for r in runs]
    return out


def _rel(x: int, base: int) -> str:
    return f"{100 * (x / base - 1):+.2f}%" if base else "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", help="trace .npz (default: the bundled one)")
    ap.add_argument("--layers", default="all", help="comma list of layers, or 'all'")
    ap.add_argument("--sizes", default="128,256,512,1024", help="GPU slots (comma list)")
    ap.add_argument("--buckets", type=int, default=DEFAULT_BUCKETS)
    ap.add_argument("--compare-buckets", type=int, default=None, metavar="N",
                    help="instead of the per-round column: PB-LRU with N recent buckets "
                         "(what a narrower PB-LRU state costs in misses)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    trace = load_trace(args.trace or bundled_trace())
    layers = list(range(trace.layers)) if args.layers == "all" else \
        [int(x) for x in args.layers.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    variants = {v: (*VARIANTS[v], args.buckets) for v in VARIANTS}
    third = "pblru_per_round"
    if args.compare_buckets is not None:
        del variants[third]
        third = f"pblru_{args.compare_buckets}_buckets"
        variants[third] = ("pblru", None, args.compare_buckets)
    res = run(trace, layers, sizes, args.buckets, variants)
    if args.json:
        print(json.dumps({"trace": trace.meta.raw.get("text_file"), "layers": layers,
                          "misses": {v: {s: sum(m for _, m in r) for s, r in by.items()}
                                     for v, by in res.items()}}))
        return 0
    acc = sum(a for a, _ in res["lru"][sizes[0]])
    print(f"trace {trace.meta.raw.get('text_file')}: {len(layers)} layers, k={trace.k}, "
          f"{trace.steps} steps, {acc} distinct selections per pool size; misses summed")
    label = "PB per round" if args.compare_buckets is None else \
        f"PB {args.compare_buckets} bkts"
    print(f"{'GPU slots':>9} {'exact LRU':>10} {'PB-LRU':>8} {'vs LRU':>8} {'worst layer':>12} "
          f"{label:>13} {'vs LRU':>8}   (PB-LRU: {args.buckets} buckets)")
    for s in sizes:
        lru = sum(m for _, m in res["lru"][s])
        pb = sum(m for _, m in res["pblru"][s])
        pr = sum(m for _, m in res[third][s])
        worst = max(((p - m) / m if m else 0.0) for (_, m), (_, p) in
                    zip(res["lru"][s], res["pblru"][s]))

        print(f"{s:>9} {lru:>10} {pb:>8} {_rel(pb, lru):>8} {100 * worst:>+11.1f}% {pr:>13} "
              f"{_rel(pr, lru):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
