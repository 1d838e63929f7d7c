"""Look-ahead prefetch on a real selection trace: critical-path misses and H2D rows per source
and fetch cap, each a ratio to the same replay without prefetch (issue 23's target: misses
<= 0.5x with H2D <= 1.25x).

Every run is :func:`ulacache.tools.replay.replay` (the real core, production mode) on the
bundled SmolLM2 trace (or ``--trace``), so the rows are measured, not modelled. Sources:
``previous_layer`` (layer l - 1's selection of the step predicts layer l's) and ``draft`` (the
recorded prompt-lookup draft token's selection predicts the next step's; drafts on 69.5% of
the bundled trace's steps, 13.5% of them the true next token).

What-if rows (``--acceptance``, labelled as such): the ``draft`` source where a draft is the
true next token on a share ``a`` of the steps: on those steps the recorded draft selection is
replaced by the trace's next-step selection (what an accepted draft selects, exactly), chosen
at random (seed 0) among the steps; the recorded drafts stay on the others. It shows what a
better drafter (an MTP or EAGLE head) would buy; it is not a measurement of one.

Admission (``--admission SLOTS``, a second table): ``previous_layer`` at small pools, the
issue's naive baseline (measured outside the repository: uncapped, every prefetched row
inserted as the most recent) against ulacache's (prefetched rows admitted cold, uncapped and
capped), each a ratio to the same pool without prefetch. The naive rows swap PB-LRU's cold
``admit`` for its ``touch`` inside this script only; nothing in the product inserts hot.

    python bench/prefetch_replay.py                       # markdown table on stdout
    python bench/prefetch_replay.py --steps 32 --json     # quicker, one JSON object
    python bench/prefetch_replay.py --sources '' --acceptance '' --admission 128,256,512
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ulacache.config import PREFETCH_SOURCES, PrefetchConfig  # noqa: E402
from ulacache.tools.replay import replay  # noqa: E402
from ulacache.tools.traces import Trace, load_trace  # noqa: E402

logger = logging.getLogger("bench.prefetch_replay")
TRACE = ROOT / "ulacache" / "tools" / "data" / "gpl3.trace.npz"


def with_acceptance(trace: Trace, acceptance: float, seed: int = 0) -> Trace:
    """``trace`` whose draft is the true next token on a share ``acceptance`` of the steps
    (its recorded accepted drafts kept): there its draft selection becomes the next step's
    selection. The last step has no next one and keeps its recorded draft."""
    if trace.draft_selections is None:
        raise ValueError("the what-if needs a trace with draft selections (version 2)")
    rng = np.random.default_rng(seed)
    take = (rng.random(trace.steps) < acceptance) | trace.draft_accepted.astype(bool)
    take[-1] = False
    dsel = trace.draft_selections.copy()
    dsel[:, take] = trace.selections[:, np.flatnonzero(take) + 1]
    return dataclasses.replace(trace, draft_selections=dsel)


def run(trace: Trace, sources: list[tuple[str, ...]], caps: list[int],
        acceptances: list[float], **kw) -> dict:
    """Every (sources, cap) and every what-if acceptance x cap (``draft`` only), each against
    the run without prefetch (``kw``: :func:`replay`'s own arguments)."""
    t0 = time.perf_counter()
    off = replay(trace, **kw)
    logger.info("off: %d misses (%.1f s)", off.misses, time.perf_counter() - t0)
    rows = []
    jobs = [(src, cap, None) for src in sources for cap in caps] + \
        [(("draft",), cap, a) for a in acceptances for cap in caps]
    for src, cap, a in jobs:
        t0 = time.perf_counter()
        tr = trace if a is None else with_acceptance(trace, a)
        r = replay(tr, prefetch=PrefetchConfig(sources=src, fetch_cap=cap), **kw)
        rows.append({"sources": ",".join(src), "fetch_cap": cap, "what_if_acceptance": a,
                     "critical_path_misses": r.critical_path_misses,
                     "misses_ratio": r.critical_path_misses / max(1, off.misses),
                     "h2d_rows": r.h2d_rows, "h2d_ratio": r.h2d_rows / max(1, off.h2d_rows),
                     "prefetched_rows": r.prefetched_rows, "prefetched_used": r.prefetched_used,
                     "target_met": r.critical_path_misses <= 0.5 * off.misses
                     and r.h2d_rows <= 1.25 * off.h2d_rows})
        logger.info("%s cap %d%s: misses x%.2f, H2D x%.2f (%.1f s)", rows[-1]["sources"], cap,
                    "" if a is None else f" (what-if acceptance {a})", rows[-1]["misses_ratio"],
                    rows[-1]["h2d_ratio"], time.perf_counter() - t0)
    return {"trace": trace.meta.raw.get("text_file", "?"), "layers": off.groups,
            "requests": off.requests, "steps": off.steps, "gpu_slots": off.gpu_slots,
            "k": trace.k, "off": {"critical_path_misses": off.misses, "h2d_rows": off.h2d_rows},
            "rows": rows}


UNCAPPED = 1 << 24  # PrefetchConfig's largest fetch_cap


@contextlib.contextmanager
def naive_admission():
    """Prefetched rows inserted as the most recent (PB-LRU's ``touch`` in place of its cold
    ``admit``): the naive baseline the issue reports, for this script's comparison only."""
    from ulacache.pblru import PBLRU

    saved = PBLRU.admit
    PBLRU.admit = PBLRU.touch
    try:
        yield
    finally:
        PBLRU.admit = saved


def admission(trace: Trace, slots: list[int], **kw) -> list[dict]:
    """``previous_layer`` with naive (hot, uncapped) and ulacache's (cold; uncapped, cap 64)
    admission at each GPU pool size, each against the same pool without prefetch."""
    rows = []
    for G in slots:
        off = replay(trace, gpu_slots=G, **kw)
        for name, cap, naive in (("naive: most recent, uncapped", UNCAPPED, True),
                                 ("ulacache: cold, uncapped", UNCAPPED, False),
                                 ("ulacache: cold, cap 64", 64, False)):
            try:
                with naive_admission() if naive else contextlib.nullcontext():
                    r = replay(trace, gpu_slots=G, prefetch=PrefetchConfig(
                        sources=("previous_layer",), fetch_cap=cap), **kw)
            except RuntimeError as e:  # hot prefetched rows pinned the pool: the access overflowed
                if "overflowed" not in str(e):
                    raise
                rows.append({"gpu_slots": G, "admission": name, "off_misses": off.misses,
                             "overflowed": True})
                logger.info("%d slots, %s: the access overflowed (selected rows served as "
                            "padding)", G, name)
                continue
            rows.append({"gpu_slots": G, "admission": name, "off_misses": off.misses,
                         "overflowed": False,
                         "misses_ratio": r.critical_path_misses / max(1, off.misses),
                         "h2d_ratio": r.h2d_rows / max(1, off.h2d_rows),
                         "prefetched_rows": r.prefetched_rows,
                         "prefetched_used": r.prefetched_used})
            logger.info("%d slots, %s: misses x%.2f, H2D x%.2f", G, name,
                        rows[-1]["misses_ratio"], rows[-1]["h2d_ratio"])
    return rows


def admission_markdown(rows: list[dict]) -> str:
    lines = ["previous_layer by admission (ratios to the same pool without prefetch)", "",
             "| GPU slots per layer | admission | critical-path misses | H2D rows | prefetched "
             "| of them selected |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["overflowed"]:
            lines.append(f"| {r['gpu_slots']} | {r['admission']} | overflowed: prefetched rows "
                         "pinned the pool, selected rows served as padding | | | |")
            continue
        lines.append(f"| {r['gpu_slots']} | {r['admission']} | x{r['misses_ratio']:.2f} | "
                     f"x{r['h2d_ratio']:.2f} | {r['prefetched_rows']:,} | "
                     f"{r['prefetched_used']:,} |")
    return "\n".join(lines) + "\n"


def markdown(res: dict) -> str:
    lines = [f"Prefetch replay (real core, CPU): trace {res['trace']}, {res['layers']} layers, "
             f"k = {res['k']}, {res['requests']} requests x {res['steps']} steps, "
             f"{res['gpu_slots']} GPU slots per layer; without prefetch "
             f"{res['off']['critical_path_misses']:,} critical-path misses "
             f"(= H2D rows)", "",
             "| sources | cap | critical-path misses | H2D rows | prefetched | of them "
             "selected | target (<= 0.5x, <= 1.25x) |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        name = r["sources"] if r["what_if_acceptance"] is None else \
            f"draft, what-if acceptance {r['what_if_acceptance']}"
        lines.append(f"| {name} | {r['fetch_cap']} | {r['critical_path_misses']:,} "
                     f"(x{r['misses_ratio']:.2f}) | {r['h2d_rows']:,} (x{r['h2d_ratio']:.2f}) "
                     f"| {r['prefetched_rows']:,} | {r['prefetched_used']:,} | "
                     f"{'met' if r['target_met'] else 'not met'} |")
    return "\n".join(lines) + "\n"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--gpu-slots", type=int, default=2048, help="GPU slots per layer")
    ap.add_argument("--sources", default="previous_layer;draft;previous_layer,draft",
                    help="';'-separated source sets, each comma-separated")
    ap.add_argument("--caps", default="16,64,256", help="fetch caps (rows per layer per step)")
    ap.add_argument("--acceptance", default="0.5,0.7,1.0",
                    help="what-if draft acceptances ('' for none)")
    ap.add_argument("--admission", default="",
                    help="GPU slot counts for the admission table (naive hot vs cold), e.g. "
                         "128,256,512 ('' for none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stderr)
    try:
        sources = [tuple(s.split(",")) for s in a.sources.split(";") if s]
        caps = [int(x) for x in a.caps.split(",") if x]
        slots = [int(x) for x in a.admission.split(",") if x]
        acceptances = _floats(a.acceptance)
    except ValueError as e:
        print(f"prefetch_replay: bad list: {e}", file=sys.stderr)
        return 2
    bad = [s for src in sources for s in src if s not in PREFETCH_SOURCES]
    if bad or not caps or min(caps) < 0 or any(not 0 <= x <= 1 for x in acceptances):
        print(f"prefetch_replay: sources from {PREFETCH_SOURCES}, caps >= 0 and acceptances in "
              f"[0, 1] (got unknown sources {bad})", file=sys.stderr)
        return 2
    if not Path(a.trace).is_file():
        print(f"prefetch_replay: trace {a.trace} is not a file", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    trace = load_trace(a.trace)
    try:
        res = run(trace, sources, caps, acceptances, requests=a.requests, steps=a.steps,
                  gpu_slots=a.gpu_slots) if sources or acceptances else None
        adm = admission(trace, slots, requests=a.requests, steps=a.steps) if slots else None
    except ValueError as e:
        print(f"prefetch_replay: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({**(res or {}), **({"admission": adm} if adm else {})}))
        return 0
    print((markdown(res) if res else "") + ("\n" if res and adm else "")
          + (admission_markdown(adm) if adm else ""), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
