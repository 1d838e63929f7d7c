"""``ulacache`` command line: replay traces through the core, record and inspect traces.

    ulacache replay [TRACE]                 # default: the bundled real trace
    ulacache trace record TEXT -o OUT       # real top-k selections of SmolLM2 over a text
    ulacache trace stats TRACE              # locality figures and LRU / PB-LRU hit rates
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from importlib import resources
from pathlib import Path

logger = logging.getLogger("ulacache")

BUNDLED_TRACE = "gpl3.trace.npz"


def bundled_trace() -> Path:
    """Path of the real trace shipped with the package (SmolLM2-135M over the GPL-3 text)."""
    return Path(str(resources.files("ulacache") / "data" / BUNDLED_TRACE))


def _replay(args: argparse.Namespace) -> int:
    from .replay import format_results, replay
    from .traces import load_trace

    path = Path(args.trace) if args.trace else bundled_trace()
    trace = load_trace(str(path))
    layers = None
    if args.layers:
        step = max(1, trace.layers // args.layers)
        layers = list(range(0, trace.layers, step))[: args.layers]
    steps = min(args.steps, trace.steps - 1)
    results = []
    for policy in ("pblru", "lru"):
        t0 = time.perf_counter()
        results.append(replay(trace, requests=args.requests, steps=steps, layers=layers,
                              gpu_slots=args.gpu_slots, cpu_slots=args.cpu_slots,
                              layout=args.layout, policy=policy, n_buckets=args.buckets,
                              progress=not args.json))
        logger.info("%s replay: %.1f s", policy, time.perf_counter() - t0)
    if args.json:
        print(json.dumps({"trace": str(path), "results": [r.to_dict() for r in results]}))
    else:
        print(format_results(trace, results))
    return 0


def _record(args: argparse.Namespace) -> int:
    from .traces import record_trace

    meta = record_trace(args.text, args.output, max_tokens=args.max_tokens, k=args.k,
                        start=args.start)
    print(f"wrote {args.output}: {meta.layers} layers x {meta.steps} steps, k={meta.k}, "
          f"{meta.n_tokens} tokens")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from .traces import format_stats, load_trace, trace_stats

    trace = load_trace(args.trace)
    kw = {}
    if args.pool_sizes:
        kw["pool_sizes"] = tuple(int(s) for s in args.pool_sizes.split(","))
    if args.hit_layers:  # evenly spaced layers: the simulation dominates the run time
        step = max(1, trace.layers // args.hit_layers)
        kw["hit_layers"] = list(range(0, trace.layers, step))[: args.hit_layers]
    stats = trace_stats(trace, **kw)
    print(json.dumps(stats) if args.json else format_stats(stats))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ulacache", description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    rp = sub.add_parser("replay", help="replay a selection trace through the core")
    rp.add_argument("trace", nargs="?", help=f"trace .npz (default: bundled {BUNDLED_TRACE})")
    rp.add_argument("--requests", type=int, default=4, help="interleaved requests")
    rp.add_argument("--steps", type=int, default=256, help="decode steps replayed per request")
    rp.add_argument("--layers", type=int, default=8,
                    help="evenly spaced trace layers to replay (0 = all)")
    rp.add_argument("--gpu-slots", type=int, default=None,
                    help="GPU slots per group (default 256 x requests)")
    rp.add_argument("--cpu-slots", type=int, default=None,
                    help="CPU slots per group (default: the rest of the live history)")
    rp.add_argument("--layout", default="fp8", choices=["fp8", "bf16"])
    rp.add_argument("--buckets", type=int, default=64, help="PB-LRU recent buckets")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=_replay)

    tr = sub.add_parser("trace", help="record or inspect selection traces")
    tsub = tr.add_subparsers(dest="tcmd", required=True)
    rec = tsub.add_parser("record", help="record real top-k selections of SmolLM2-135M")
    rec.add_argument("text", help="any UTF-8 text file")
    rec.add_argument("-o", "--output", required=True, help="output .npz")
    rec.add_argument("--max-tokens", type=int, default=2048)
    rec.add_argument("--k", type=int, default=64)
    rec.add_argument("--start", type=int, default=None, help="first query position (default k)")
    rec.set_defaults(func=_record)
    sts = tsub.add_parser("stats", help="locality figures and hit rates of a trace")
    sts.add_argument("trace")
    sts.add_argument("--pool-sizes", default=None, help="comma list of GPU slots per layer")
    sts.add_argument("--hit-layers", type=int, default=6,
                     help="evenly spaced layers to simulate for hit rates (0 = all)")
    sts.add_argument("--json", action="store_true")
    sts.set_defaults(func=_stats)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
