"""Row-kernel bandwidth against the copy ceilings measured in the same run (CUDA only).

Measures, in one process:

- ``h2d_copy_gbps``: pinned host -> device contiguous copy (copy engine), 1 GiB;
- ``d2d_copy_gbps``: device -> device contiguous copy, 512 MiB, read + write counted;
- each kernel on 656- and 1152-byte rows at 2K, 16K and 131K rows per launch (L = 1):

  ============== ============================== =================== ===============
  kernel         what                           bytes counted       ratio against
  ============== ============================== =================== ===============
  host_gather    pinned host pool -> GPU rows,  rows x row_bytes    h2d_copy_gbps
                 row list sorted by source
  device_gather  GPU pool -> GPU rows           2 x rows x row_bytes d2d_copy_gbps
  peer_gather    4 GPU pools via a pointer      2 x rows x row_bytes d2d_copy_gbps
                 table -> GPU rows
  swap           GPU rows <-> pinned host rows  2 x rows x row_bytes h2d_copy_gbps
                 (both PCIe directions)
  d2h_gather     GPU rows -> pinned host rows   rows x row_bytes    h2d_copy_gbps
  ============== ============================== =================== ===============

Duplex: for each size, ``duplex_factor = (host_gather ms + d2h_gather ms) / swap ms``, the
same rows moved each way in one launch against the two directions one after the other: 2.0
is a full-duplex link, 1.0 a serial one. ``bench/decode_sweep.py --duplex-factor F`` prices
its swaps with it (its duplex column is claimed only with a measured factor).

Sources are random rows over a ``--pool-gib`` pool (default 3 GiB, like a real CPU tier).
Timing: CUDA events around ``--inner`` back-to-back launches queued behind a ``_sleep`` kernel
(so host launch overhead is hidden), median of ``--reps`` repetitions.

``--json`` writes one JSON object to stdout::

    {"h2d_copy_gbps": float, "d2d_copy_gbps": float,
     "rows": [{"kernel": str, "row_bytes": int, "rows": int, "gbps": float, "ratio": float}],
     "duplex": [{"row_bytes": int, "rows": int, "serial_ms": float, "swap_ms": float,
                 "duplex_factor": float}]}

The readable table, and with ``--sweep`` every rows-per-warp variant, the other gather load
flavour (``nc``), the unsorted host gather and torch's index_select go to the log (stderr).
Without CUDA or a kernel backend the script exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch

log = logging.getLogger("ulacache.bench.bandwidth")

ROW_SIZES = (656, 1152)
ROW_COUNTS = (2048, 16384, 131072)
PEERS = 4


def timed_ms(fn, reps: int, inner: int) -> float:
    """Median milliseconds per ``fn()`` call (GPU time between CUDA events)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda._sleep(4_000_000)  # ~2 ms: keeps the queue ahead of the host
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9



def measure_ceilings(dev: torch.device, reps: int, pinned_empty) -> tuple[float, float]:
    """(pinned H2D copy GB/s of 1 GiB, D2D copy GB/s of 512 MiB counting read + write)."""
    t0 = time.perf_counter()
    h2d_bytes = 1 << 30
    host_buf = pinned_empty((h2d_bytes,))
    log.info("pinned 1 GiB (exact size) in %.2f s", time.perf_counter() - t0)
    dev_buf = torch.empty(h2d_bytes, dtype=torch.uint8, device=dev)
    h2d = gbps(h2d_bytes, timed_ms(lambda: dev_buf.copy_(host_buf, non_blocking=True), reps, 1))
    d2d_bytes = 512 << 20
    a, b = dev_buf[:d2d_bytes], dev_buf[d2d_bytes:]
    d2d = gbps(2 * d2d_bytes, timed_ms(lambda: b.copy_(a), reps, 3))
    return h2d, d2d


def duplex_row(row_bytes: int, rows: int, h2d_ms: float, d2h_ms: float, swap_ms: float
               ) -> dict:
    """The duplex factor of one size: the two directions one after the other over the swap
    that moves the same rows both ways at once (2.0: full duplex; 1.0: serial)."""
    return {"row_bytes": row_bytes, "rows": rows, "serial_ms": round(h2d_ms + d2h_ms, 5),
            "swap_ms": round(swap_ms, 5),
            "duplex_factor": round((h2d_ms + d2h_ms) / swap_ms, 4)}


class Bench:
    """Runs every kernel at every row count for one row size; collects result rows."""

    def __init__(self, h2d: float, d2d: float, reps: int, sweep: bool) -> None:
        from ulacache.kernels import cuda_rows, dispatch
        from ulacache.kernels.peer_reference import pool_ptr_table

        self.cr, self.dispatch, self.pool_ptr_table = cuda_rows, dispatch, pool_ptr_table
        self.h2d, self.d2d, self.reps, self.sweep_on = h2d, d2d, reps, sweep
        self.results: list[dict] = []
        self.duplex: list[dict] = []
        self.extra: list[tuple[str, int, int, str, float, float]] = []

    def record(self, kernel, row_bytes, rows, nbytes, ms, ceiling) -> float:
        g = gbps(nbytes, ms)
        self.results.append({"kernel": kernel, "row_bytes": row_bytes, "rows": rows,
                             "gbps": round(g, 3), "ratio": round(g / ceiling, 4)})
        log.info("%-14s %5d B %7d rows  %8.1f us  %8.1f GB/s  %.3fx", kernel, row_bytes, rows,
                 ms * 1e3, g, g / ceiling)
        return ms

    def note(self, label, row_bytes, rows, variant, nbytes, ms, ceiling) -> None:
        g = gbps(nbytes, ms)
        self.extra.append((label, row_bytes, rows, variant, g, g / ceiling))

    def row_size(self, row_bytes: int, host_flat, dev_flat, gen) -> None:
        n_src = host_flat.numel() // row_bytes - 1
        host = host_flat[: (n_src + 1) * row_bytes].view(1, n_src + 1, row_bytes)
        dpool = dev_flat[: (n_src + 1) * row_bytes].view(1, n_src + 1, row_bytes)
        per = n_src // PEERS - 1
        peers = [dev_flat[k * (per + 1) * row_bytes: (k + 1) * (per + 1) * row_bytes]
                 .view(1, per + 1, row_bytes) for k in range(PEERS)]
        table = self.pool_ptr_table(peers, dev_flat.device)
        max_rows = max(ROW_COUNTS)
        dst = torch.zeros(1, max_rows + 1, row_bytes, dtype=torch.uint8, device=dev_flat.device)
        for rows in ROW_COUNTS:
            self.case(row_bytes, rows, host, dpool, table, per, dst, gen)

    def case(self, row_bytes, rows, host, dpool, table, per, dst, gen) -> None:
        cr, reps, dev = self.cr, self.reps, dst.device
        inner = 10 if rows <= 16384 else 3
        nbytes = rows * row_bytes
        n_src = host.shape[1] - 1
        src_idx = torch.randint(0, n_src, (rows,), device=dev, generator=gen)
        dst_idx = torch.randperm(dst.shape[1] - 1, device=dev, generator=gen)[:rows]
        s_sorted, d_sorted = self.dispatch.sort_by_source(src_idx, dst_idx)

        def host_gather(rpw=None, nc=None, s=s_sorted, d=d_sorted):
            return lambda: cr.gather(host, s, dst, d, rows_per_warp=rpw, nc=nc)

        def device_gather(rpw=None, nc=None):
            return lambda: cr.gather(dpool, src_idx, dst, dst_idx, rows_per_warp=rpw, nc=nc)

        rank = torch.randint(0, PEERS, (rows,), device=dev, generator=gen)
        p_idx = torch.randint(0, per, (rows,), device=dev, generator=gen)

        def peer_gather(rpw=None, nc=None):
            return lambda: cr.gather_peers(table, rank, p_idx, dst, dst_idx, src_rows=per + 1,
                                           rows_per_warp=rpw, nc=nc)

        c_idx = torch.randperm(n_src, device=dev, generator=gen)[:rows]
        c_idx, g_idx = self.dispatch.sort_by_source(c_idx, dst_idx)

        def swap(rpw=None, nc=None):
            return lambda: cr.swap(dst, g_idx, host, c_idx, rows_per_warp=rpw)

        def d2h_gather(rpw=None, nc=None):  # the swap's GPU -> host half alone
            return lambda: cr.gather(dst, g_idx, host, c_idx, rows_per_warp=rpw, nc=nc)

        cases = [("host_gather", host_gather, nbytes, self.h2d),
                 ("device_gather", device_gather, 2 * nbytes, self.d2d),
                 ("peer_gather", peer_gather, 2 * nbytes, self.d2d),
                 ("swap", swap, 2 * nbytes, self.h2d),
                 ("d2h_gather", d2h_gather, nbytes, self.h2d)]
        ms: dict[str, float] = {}
        for name, make, nb, ceiling in cases:
            ms[name] = self.record(name, row_bytes, rows, nb, timed_ms(make(), reps, inner),
                                   ceiling)
            if not self.sweep_on or name == "d2h_gather":  # the duplex figure needs one
                continue
            for rpw in cr.ROWS_CHOICES:
                self.note(name, row_bytes, rows, f"rpw={rpw}", nb,
                          timed_ms(make(rpw), reps, inner), ceiling)
            if name != "swap":
                nc = not cr.GATHER_NC_DEFAULT
                self.note(name, row_bytes, rows, f"nc={int(nc)}", nb,
                          timed_ms(make(None, nc), reps, inner), ceiling)
        self.duplex.append(duplex_row(row_bytes, rows, ms["host_gather"], ms["d2h_gather"],
                                      ms["swap"]))
        log.info("duplex %5d B %7d rows: (H2D %.1f + D2H %.1f us) / swap %.1f us = %.2f",
                 row_bytes, rows, ms["host_gather"] * 1e3, ms["d2h_gather"] * 1e3,
                 ms["swap"] * 1e3, self.duplex[-1]["duplex_factor"])
        if self.sweep_on:
            ms = timed_ms(host_gather(s=src_idx, d=dst_idx), reps, inner)
            self.note("host_gather", row_bytes, rows, "unsorted", nbytes, ms, self.h2d)
            out = dst[:, :rows]
            ms = timed_ms(lambda: out.copy_(dpool.index_select(1, src_idx)), reps, inner)
            self.note("device_gather", row_bytes, rows, "torch.index_select", 2 * nbytes, ms,
                      self.d2d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pool-gib", type=float, default=3.0, help="source pool size (GiB)")
    ap.add_argument("--sweep", action="store_true",
                    help="also log every rows-per-warp variant, unsorted host gathers and torch")
    ap.add_argument("--quick", action="store_true", help="small pool and few reps (smoke run)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")

    if not torch.cuda.is_available():
        log.error("bench/bandwidth.py needs a CUDA device; none is available")
        return 2
    from ulacache.kernels import cuda_rows
    from ulacache.kernels.pinned import pinned_empty

    if not cuda_rows.kernels_available():
        log.error("no CUDA kernel backend (install CuPy, or use a torch with "
                  "torch.cuda._compile_kernel)")
        return 2
    if args.quick:
        args.reps, args.pool_gib = min(args.reps, 5), min(args.pool_gib, 0.5)
    reps = args.reps
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    log.info("device: %s, %d SMs; torch %s; kernel backend %s", props.name,
             props.multi_processor_count, torch.__version__, cuda_rows.backend_name())

    h2d, d2d = measure_ceilings(dev, reps, pinned_empty)
    log.info("ceilings: pinned H2D copy %.1f GB/s, D2D copy %.1f GB/s (read + write)", h2d, d2d)

    # ---- pools ------------------------------------------------------------------------------
    pool_bytes = int(args.pool_gib * (1 << 30)) // 4096 * 4096
    t0 = time.perf_counter()
    host_flat = pinned_empty((pool_bytes,))
    log.info("pinned %.2f GiB pool in %.2f s", pool_bytes / (1 << 30), time.perf_counter() - t0)
    dev_flat = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8, device=dev)
    host_flat.copy_(dev_flat)
    gen = torch.Generator(device=dev).manual_seed(0)
    bench = Bench(h2d, d2d, reps, args.sweep)
    for row_bytes in ROW_SIZES:
        bench.row_size(row_bytes, host_flat, dev_flat, gen)
        torch.cuda.synchronize()
    results, extra = bench.results, bench.extra

    if extra:
        log.info("--- sweep (ratio against the same ceilings) ---")
        for label, rb, rows, variant, g, ratio in extra:
            log.info("%-14s %5d B %7d rows  %-20s %8.1f GB/s  %.3fx", label, rb, rows, variant,
                     g, ratio)
    log.info("--- summary: ratio to the ceiling measured in this run ---")
    log.info("h2d_copy %.1f GB/s, d2d_copy %.1f GB/s", h2d, d2d)
    for r in results:
        log.info("%-14s %5d B %7d rows %8.1f GB/s %6.3fx", r["kernel"], r["row_bytes"],
                 r["rows"], r["gbps"], r["ratio"])
    if args.json:
        out = {"h2d_copy_gbps": round(h2d, 3), "d2d_copy_gbps": round(d2d, 3), "rows": results,
               "duplex": bench.duplex}
        sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
