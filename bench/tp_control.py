"""TP mode's cross-rank ordering: owner-held metadata vs replicated control metadata, on CPU.

Every rank holds the same top-k; what differs is who resolves each row's place.

- **owner-held** (what ulacache ships, :mod:`ulacache.tp`): each rank runs the access of its own
  shard only (one mapping table, one policy), then one all-gather of the owners' slot tables
  ``int32 [bs, k]`` tells every rank where each row is; the same collective orders every
  owner's promotions before any peer's read.
- **replicated**: every rank keeps a replica of *every* rank's mapping and policy and runs all
  P accesses itself (deterministic, so every replica agrees with its owner); nothing but a
  data-ready fence (one 8-byte all-reduce) is exchanged, since the owner's copies must still
  complete before a peer reads.

Both drive the real core (:class:`ulacache.group.SelectionGroup`, residency only: no row bytes,
so only the control work is counted) with one rank's view of a real selection trace: 4
interleaved requests, one token each per step, the trace's top-k per step, addresses striped
``t mod P``. Measured per step of one selection group, for rank 0 (ranks are symmetric):
aten ops (each one a kernel launch on a GPU), CPU time, control metadata bytes held, bytes
exchanged. Ratios replicated / owner-held are printed for each P.

    python bench/tp_control.py                # bundled trace, P = 2, 4, 8
    python bench/tp_control.py --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ulacache.group import SelectionGroup
from ulacache.tools.cli import bundled_trace
from ulacache.tools.replay import plan_requests
from ulacache.tools.traces import load_trace

logger = logging.getLogger("bench.tp_control")


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _metadata_bytes(g: SelectionGroup) -> int:
    tensors = [g.loc, g.gpu_owner, g.shadow, g.claim_table, g.pools.cpu_free]
    tensors += [v for v in vars(g.policy).values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def run(P: int, trace, *, requests: int, steps: int, gpu_slots: int, n_buckets: int,
        layer: int) -> dict:
    """Rank 0's control work per step under both schemes (see the module docstring)."""
    starts = plan_requests(trace, requests, steps + 1)
    pos = trace.positions
    k = trace.k
    stride = int(pos[-1]) + 2  # request r's position p is address r * stride + p
    n_logical = requests * stride
    n_local = -(-n_logical // P)
    sel = torch.from_numpy(trace.selections[layer]).to(torch.int64)

    def group():
        return SelectionGroup([], n_local, gpu_slots, n_local, 16, "cpu", "pblru", n_buckets,
                              validate=False)
    own = group()
    replicas = [own] + [group() for _ in range(P - 1)]  # replicas[r]: rank r's shard

    def split(addrs: torch.Tensor, r: int) -> torch.Tensor:
        return torch.where((addrs >= 0) & (addrs % P == r), addrs // P, -1)

    def place(addrs: torch.Tensor, groups) -> None:
        for r, g in enumerate(groups):
            g.policy.advance()
            g.place(split(addrs, r))

    for r, s in enumerate(starts):  # prefill, in rounds that fit the pools
        prompt = torch.arange(int(pos[s])) + r * stride
        for i in range(0, prompt.numel(), gpu_slots // 2):
            place(prompt[i: i + gpu_slots // 2], replicas)
    rows = {"owner": [], "replicated": []}
    for t in range(steps + 1):
        new = torch.tensor([r * stride + int(pos[starts[r] + t]) for r in range(requests)])
        addrs = torch.stack([torch.where(sel[starts[r] + t] >= 0,
                                         sel[starts[r] + t] + r * stride, -1)
                             for r in range(requests)])
        # owner-held: this rank's access; the slot table all-gather is counted in bytes
        # (the code is fixed-shape: the op count of every step is the first step's, which is
        # counted under a dispatch mode; the other steps are timed without it)
        place(new, [own])
        counter = OpCounter() if t == 0 else contextlib.nullcontext()
        t0 = time.perf_counter()
        with counter:
            own.access(split(addrs, 0))
        if t == 0:
            ops_own = counter.ops
        else:
            rows["owner"].append((ops_own, time.perf_counter() - t0))
        # replicated: the other ranks' replicas run the same steps (rank 0's part above is
        # shared, the replicas add P - 1 accesses)
        place(new, replicas[1:])
        counter = OpCounter() if t == 0 else contextlib.nullcontext()
        t0 = time.perf_counter()
        with counter:
            for r in range(1, P):
                replicas[r].access(split(addrs, r))
        if t == 0:
            ops_rep = ops_own + counter.ops
        else:
            rows["replicated"].append((ops_rep, time.perf_counter() - t0 + rows["owner"][-1][1]))
    table = requests * k * 4  # int32 slot table per rank
    out = {"P": P, "bs": requests, "k": k, "steps": steps, "gpu_slots": gpu_slots}
    for name, per_step in rows.items():
        out[name] = {
            "ops_per_step": statistics.median(o for o, _ in per_step),
            "ms_per_step": 1e3 * statistics.median(s for _, s in per_step),
            "metadata_bytes": _metadata_bytes(own) * (P if name == "replicated" else 1),
            # bytes this rank sends + receives per step per group
            "exchange_bytes": 2 * (P - 1) * table if name == "owner" else 2 * (P - 1) * 8,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", help="trace .npz (default: the bundled one)")
    ap.add_argument("--tp", default="2,4,8", help="comma-separated P values")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64, help="steps timed (after one counted)")
    ap.add_argument("--gpu-slots", type=int, default=512, help="per rank")
    ap.add_argument("--buckets", type=int, default=16)
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    trace = load_trace(args.trace or bundled_trace())
    results = [run(int(p), trace, requests=args.requests, steps=args.steps,
                   gpu_slots=args.gpu_slots, n_buckets=args.buckets, layer=args.layer)
               for p in args.tp.split(",")]
    if args.json:
        print(json.dumps({"rows": results}))
        return 0
    print(f"per step of one selection group, rank 0; bs {args.requests}, k {trace.k}, "
          f"{args.steps} steps of trace layer {args.layer}; GPU slots {args.gpu_slots}/rank")
    print(f"{'P':>2} {'scheme':<11} {'aten ops':>9} {'CPU ms':>8} {'metadata KB':>12} "
          f"{'exchange B':>11}")
    for r in results:
        for name in ("owner", "replicated"):
            m = r[name]
            print(f"{r['P']:>2} {name:<11} {m['ops_per_step']:>9.0f} {m['ms_per_step']:>8.2f} "
                  f"{m['metadata_bytes'] / 1024:>12.1f} {m['exchange_bytes']:>11}")
        o, p = r["owner"], r["replicated"]
        print(f"   replicated / owner-held: ops x{p['ops_per_step'] / o['ops_per_step']:.2f}, "
              f"CPU time x{p['ms_per_step'] / o['ms_per_step']:.2f}, metadata "
              f"x{p['metadata_bytes'] / o['metadata_bytes']:.0f}, exchange bytes "
              f"x{p['exchange_bytes'] / o['exchange_bytes']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
