"""What page-classed allocation buys striped index-K at decode (docs/index-stripe.md).

Index-K striped by page stores logical page ``l`` on rank ``l mod P``. Each rank scores its own
pages of every request and ranks its logits for top-k candidates. Two allocation orders:

* **plain**: SGLang's paged allocator after churn hands a request's pages out in an arbitrary
  order (modelled as a random permutation of the free pages). A rank's share of a request's
  ``W`` pages is then binomial, so its decode table and logits must be ``W`` pages wide to be
  safe, and the rank with the most own pages in the batch sets the step;
* **classed**: ulacache's allocator (``patches/sglang_page_classes.py``) draws the page at
  position ``k`` from class ``k mod P``: each rank holds exactly every ``P``-th page, tables and
  logits are ``ceil(W / P)`` pages wide.

Per decode step of ``R`` requests of ``W`` pages on ``P`` ranks, from the same tables, this
reports: the per-rank logits bytes (fp32, what the paged MQA-logits kernel writes), the
slowest rank's own pages of the batch over the balanced share (the scoring work's
imbalance), and the
measured CPU time of one rank's candidate selection (``ulacache.index_stripe.
local_candidates``: the top-k scan over its logits) at each width. Ratios are classed / plain
from the same run. Beside them, the exact merge's cost, the same for both orders: the bytes of
the per-layer all-gather of candidates (``ulacache.indexer.exchange_cost``: rows x top-k x 8 B
per rank) and the measured CPU time of the merge. Not measured: NCCL's all-gather, DeepGEMM's
kernel on a GPU (its work follows the local context lengths, so the width matters through the
output and the scan, and the imbalance through the slowest rank).

    python bench/index_stripe_width.py            # GLM-5: 64 requests x 128K, P = 8
    python bench/index_stripe_width.py --json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from ulacache.index_stripe import PageStripe, local_candidates
from ulacache.indexer import exchange_cost, merge_candidates

logger = logging.getLogger("bench.index_stripe_width")
PAGE = 64


def tables(requests: int, pages: int, P: int, classed: bool, gen: torch.Generator
           ) -> torch.Tensor:
    """``int64 [requests, pages]`` page ids of requests of ``pages`` pages each, from a pool of
    ``2 x requests x pages`` pages (page 0 the padding page)."""
    total = 2 * requests * pages
    if not classed:
        free = torch.randperm(total, generator=gen) + 1
        return free[: requests * pages].view(requests, pages)
    # class c's free list: the pages == c (mod P), shuffled (churn); position k from class k % P
    lists = [torch.arange(c if c else P, total + 1, P) for c in range(P)]
    lists = [lst[torch.randperm(lst.numel(), generator=gen)] for lst in lists]
    taken = [0] * P
    out = torch.empty(requests, pages, dtype=torch.int64)
    for i in range(requests):
        for k in range(pages):
            c = k % P
            out[i, k] = lists[c][taken[c]]
            taken[c] += 1
    return out


def measure(requests: int, pages: int, P: int, top_k: int, repeats: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.full((requests,), pages * PAGE, dtype=torch.int64)
    row = {}
    for kind in ("plain", "classed"):
        real = tables(requests, pages, P, kind == "classed", gen)
        own = torch.stack([(real % P == r).sum(1) for r in range(P)])  # [P, requests]
        stripe = PageStripe(P, 0, PAGE)
        view = stripe.view(real, lengths, width=None if kind == "classed" else pages)
        width = view.table.shape[1]
        logits = torch.randn(requests, width * PAGE, generator=gen)
        local_candidates(logits, view.positions, lengths, top_k)  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            local_candidates(logits, view.positions, lengths, top_k)
        ms = (time.perf_counter() - t0) / repeats * 1e3
        row[kind] = {"table_pages": width, "logits_bytes_per_rank": requests * width * PAGE * 4,
                     # the step waits for the rank with the most pages to score, batch-wide
                     "slowest_rank_pages_over_share": float(own.sum(1).max()
                                                            / (requests * pages / P)),
                     "rank_candidates_ms": ms}
        logger.info("%s: table %d pages, logits %.1f MiB per rank per layer, slowest rank %.3f x"
                    " its share, candidates %.1f ms", kind, width,
                    row[kind]["logits_bytes_per_rank"] / 2**20,
                    row[kind]["slowest_rank_pages_over_share"], ms)
    # the exact merge's exchange, on the decode critical path either way: one all-gather of
    # every rank's candidates (rows x top-k x 8 B) per indexer layer, then the merge
    cost = exchange_cost(requests, top_k, P)
    gathered = torch.stack([local_candidates(torch.randn(requests, 2 * top_k, generator=gen),
                                             torch.arange(r, 2 * top_k * P, P), lengths, top_k)
                            for r in range(P)])
    merge_candidates(gathered, top_k)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        merge_candidates(gathered, top_k)
    row["exchange"] = {"payload_bytes_per_rank": cost.payload_bytes,
                       "recv_bytes_per_rank": cost.recv_bytes,
                       "merge_ms": (time.perf_counter() - t0) / repeats * 1e3}
    logger.info("exchange per rank and layer: %.2f MiB sent, %.2f MiB received; merge %.1f ms",
                cost.send_bytes / 2**20, cost.recv_bytes / 2**20, row["exchange"]["merge_ms"])
    p, c = row["plain"], row["classed"]
    row["ratios"] = {"logits_bytes": c["logits_bytes_per_rank"] / p["logits_bytes_per_rank"],
                     "slowest_rank": c["slowest_rank_pages_over_share"]
                     / p["slowest_rank_pages_over_share"],
                     "candidates_ms": c["rank_candidates_ms"] / p["rank_candidates_ms"]}
    row["config"] = dict(requests=requests, pages=pages, P=P, top_k=top_k, repeats=repeats,
                         seed=seed)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--pages", type=int, default=2048, help="pages per request (128K: 2048)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO,
                        format="%(message)s")
    if min(args.requests, args.pages, args.ranks - 1, args.top_k, args.repeats) < 1:
        print("index_stripe_width: requests, pages, top-k and repeats must be >= 1 and ranks "
              ">= 2", file=sys.stderr)
        return 2
    row = measure(args.requests, args.pages, args.ranks, args.top_k, args.repeats, args.seed)
    if args.json:
        print(json.dumps(row, indent=1))
        return 0
    r = row["ratios"]
    print(f"{args.requests} requests x {args.pages} pages on {args.ranks} ranks, top-k "
          f"{args.top_k} (classed / plain, same run): logits per rank x{r['logits_bytes']:.3f}; "
          f"slowest rank's pages x{r['slowest_rank']:.3f}; a rank's candidate scan (CPU) "
          f"x{r['candidates_ms']:.3f}; the merge's all-gather "
          f"{row['exchange']['recv_bytes_per_rank'] / 2**20:.2f} MiB received per rank and "
          f"layer, merge {row['exchange']['merge_ms']:.1f} ms (CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
