"""Unique history capacity and admissible concurrency: SGLang resident, HiSparse, ulacache.

ACCOUNTING, NOT MEASUREMENT: arithmetic on stated budgets (the model, its inputs and every
system's rules: :mod:`ulacache.tools.capacity`). This script is its command line: the table
(stdout), a PNG of admissible concurrency, or one JSON object.

    python bench/capacity.py                      # table (stdout), docs/capacity.png
    python bench/capacity.py --json --png ''      # one JSON object, no PNG
    python bench/capacity.py --static-gb h200=125 --host-gb h200=256 --weights-gb glm5=89
    python bench/capacity.py --running 128        # --max-running-requests per worker: 128
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ulacache.tools.capacity import GB, LABELS, LENGTHS, MODELS, PLATFORMS, Inputs, run

logger = logging.getLogger("bench.capacity")
ROOT = Path(__file__).resolve().parents[1]


def print_table(res: dict) -> None:
    a = res["assumptions"]
    print("ACCOUNTING (arithmetic on the stated inputs, not measurement). GB = 1e9 B; 8 GPUs; "
          f"weights FP8 ~1 B/param / 8 GPUs: {a['weights_gb_per_gpu']}")
    hdr = (f"{'system':<30}{'ratio':>6}{'unique M':>10}{'GPU slots M':>12}{'CPU slots M':>12}"
           f"{'unique%':>8}{'tok/GB GPU':>11}{'tok/GB host':>12}"
           + "".join(f"{'req@' + str(S // 1024) + 'K':>9}" for S in a["lengths"])
           + f"{'unchg GB':>10}{'tables%':>8}")
    key = None
    for r in res["rows"]:
        if (r["platform"], r["model"], r["layout"]) != key:
            key = (r["platform"], r["model"], r["layout"])
            inp = Inputs(r["model"], r["layout"], r["platform"], 0, 0)
            plat = PLATFORMS[r["platform"]].label
            static = a["static_gb_per_gpu"][r["platform"]]
            w = a["weights_gb_per_gpu"][r["model"]]
            print(f"\n== {plat} | {MODELS[r['model']][0]} | {r['layout']} latent {inp.row} B x "
                  f"{inp.geometry.n_layers} layers + index-K 132 B | KV budget "
                  f"{static - w:.1f} GB/GPU ({static:.1f} static - {w:.1f} weights), host "
                  f"{a['host_gb_per_gpu'][r['platform']]:.0f} GB/GPU")
            print(hdr)
        ratio = "-" if r["ratio"] is None else str(r["ratio"])
        print(f"{LABELS[r['system']]:<30}{ratio:>6}{r['unique_tokens'] / 1e6:>10.2f}"
              f"{r['gpu_latent_slots'] / 1e6:>12.2f}{r['cpu_latent_slots'] / 1e6:>12.2f}"
              f"{100 * r['unique_fraction']:>7.1f}%{r['tokens_per_gpu_gb']:>11.0f}"
              + (f"{r['tokens_per_host_gb']:>12.0f}" if r["tokens_per_host_gb"] else f"{'-':>12}")
              + "".join(f"{r['max_requests'][str(S)]:>9}" for S in a["lengths"])
              + (f"{r['uncharged_gpu_bytes']['total'] / GB:>10.2f}" if r["uncharged_gpu_bytes"]
                 else f"{'-':>10}")
              + f"{100 * r['tables_fraction_of_cell']:>7.1f}%")
    print("\nulacache columns charge ulacache's tables and coordinator output rows as SGLang's "
          "sizing hook does (ulacache.sizing.table_bytes_per_slot, one selection group per "
          "layer; coordinator_output_bytes for --running "
          f"{a['running_requests']} + 1 request slots per worker in the capacity columns, the "
          "admitted count + 1 in the req@ columns). unchg GB: device GB per GPU SGLang does "
          "not charge (mapping, page lists; HiSparse's per-request-slot tables at SGLang's "
          "default request slots); see uncharged() and the JSON. tables%: ulacache's tables (and "
          "fused call scratch) in the bytes SGLang charges per GPU token; the JSON splits each "
          "row's GPU bytes per unique token into latent, index_k, tables and fixed.")
    pc = res["paper_checks"]
    tp, hs = pc["tp8_unique_fraction"], pc["hisparse_fig2b"]
    print("\nPaper checks (UlaCache §2.2.1, Figure 2; 8xB300, GLM-5 geometry, FP8 KV):")
    print(f"  TP8 resident unique share: computed {100 * tp['computed']:.1f}% vs paper "
          f"{100 * tp['paper']:.1f}%")
    print(f"  HiSparse: computed {hs['cpu_slots'] / 1e6:.2f}M unique (CPU) + "
          f"{hs['gpu_slots'] / 1e6:.2f}M GPU = {(hs['cpu_slots'] + hs['gpu_slots']) / 1e6:.2f}M "
          f"slots, {100 * hs['unique_fraction']:.2f}% unique "
          f"({100 * hs['unique_fraction_from_rounded_millions']:.2f}% from 0.1M-rounded counts)"
          f" vs paper 30.0M in 53.3M = 56.29%")
    print(f"    reading: host 192 GB/GPU / {hs['inputs']['latent_B_per_token']} B; GPU "
          f"(272 - {hs['inputs']['weights_gb']:.1f}) GB/GPU / "
          f"{hs['inputs']['latent_B_per_token'] + hs['inputs']['index_B_per_token']} B. "
          f"Index-K for all unique tokens on the GPU instead gives "
          f"{hs['alt_reading_gpu_slots'] / 1e6:.2f}M GPU slots (does not reproduce).")


def plot(res: dict, path: Path) -> bool:
    """Grouped bars: admissible requests per system at each length, FP8 rows, one panel per
    (platform, model). Returns False (and logs why) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no PNG written (pip install matplotlib)")
        return False
    rows = [r for r in res["rows"] if r["layout"] == "fp8"] or res["rows"]
    plats = list(dict.fromkeys(r["platform"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    lengths = res["assumptions"]["lengths"]
    fig, axes = plt.subplots(len(plats), len(models), figsize=(5.5 * len(models),
                             3.6 * len(plats) + 0.9), squeeze=False)
    for ax, (plat, model) in zip(axes.flat, [(p, m) for p in plats for m in models]):
        sel = [r for r in rows if (r["platform"], r["model"]) == (plat, model)]
        width = 0.8 / len(sel)
        for i, r in enumerate(sel):
            xs = [j + (i - (len(sel) - 1) / 2) * width for j in range(len(lengths))]
            ax.bar(xs, [r["max_requests"][str(S)] for S in lengths], width,
                   label=LABELS[r["system"]])
        ax.set_xticks(range(len(lengths)), [f"{S // 1024}K" for S in lengths])
        ax.set_title(f"{PLATFORMS[plat].label}, {MODELS[model][0]}", fontsize=9)
        ax.set_yscale("symlog", linthresh=10)
        ax.set_xlabel("history tokens per request", fontsize=8)
        ax.set_ylabel("admissible concurrent requests", fontsize=8)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("Admissible concurrency, FP8 KV rows: ACCOUNTING on stated budgets, "
                 "not measurement", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platforms", default="h200,b300", help="comma-separated: h200, b300")
    ap.add_argument("--models", default="glm5,dsv32",
                    help="comma-separated: glm5, dsv32, glm52 (GLM-5 with GLM-5.2-style top-k "
                    "sharing: index_topk_freq 4, 21 indexer layers of 78)")
    ap.add_argument("--layouts", default="fp8,bf16", help="latent rows: fp8 (656 B), bf16")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                    type=lambda s: [int(x) for x in s.split(",")],
                    help="history tokens per request for the concurrency columns")
    ap.add_argument("--static-gb", default="", help="override GB/GPU for weights + KV, "
                    "e.g. h200=125,b300=253 (defaults: h200 0.85 x 141, b300 272)")
    ap.add_argument("--host-gb", default="", help="override host GB/GPU for KV "
                    "(defaults: h200=128, b300=192)")
    ap.add_argument("--weights-gb", default="", help="override weights GB/GPU "
                    "(defaults: glm5=93.0, dsv32=85.6)")
    ap.add_argument("--device-buffer", type=int, default=4096,
                    help="HiSparse device_buffer_size (slots per request per layer)")
    ap.add_argument("--draft-tokens", type=int, default=1,
                    help="tokens per request per step (speculative decoding: draft tokens)")
    ap.add_argument("--running", "--tp-running", dest="running", type=int, default=64,
                    help="--max-running-requests per attention worker in the capacity columns: "
                    "sizes ulacache's coordinator output rows and its TP buffer")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--png", default=str(ROOT / "docs" / "capacity.png"),
                    help="PNG path ('' for none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("ulacache.tools.capacity").setLevel(logging.DEBUG)  # the budgets used
    res = run(platforms=args.platforms, models=args.models, layouts=args.layouts,
              lengths=args.lengths, static_gb=args.static_gb, host_gb=args.host_gb,
              weights_gb=args.weights_gb, device_buffer=args.device_buffer,
              draft_tokens=args.draft_tokens, running=args.running)
    if args.json:
        print(json.dumps(res))
    else:
        print_table(res)
    if args.png and plot(res, Path(args.png)):
        logger.info("wrote %s", args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
