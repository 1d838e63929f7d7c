"""CudaIpcPeers on a real GPU: two spawned processes on one device, handles exchanged over gloo.

Each rank allocates a pool with CudaIpcPeers, fills it with seeded bytes, opens the other's
pool by CUDA IPC and reads it through ``dispatch.gather_rows_peers`` (pool list, and a device
pointer table from ``peer_pointer_table`` when a kernel backend is present: the torch
reference cannot read device tables), compared byte for byte with the torch reference
(``peer_reference.gather_rows_peers``) run on CPU copies. Then: write visibility after a
barrier, all_gather (gloo fallback and a ``collective`` callable), and stale handles (a header
of another generation, a name one rank never allocated) named by rank on both ranks.
"""

from __future__ import annotations

import datetime
import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from ulacache import ipc
from ulacache.kernels import cuda_rows, dispatch, peer_reference

from .test_ipc import RB, L, R, _expect_handle_error, _pattern, _requests

pytestmark = pytest.mark.gpu

SIZE = 2
DST_ROWS = 150  # _requests draws destinations in [0, 150)


def _gpu_rank(rank: int, size: int, init: str, use_table: bool) -> None:
    torch.set_num_threads(1)
    torch.cuda.set_device(0)  # both ranks on one GPU
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        peers = ipc.make_peers("cuda_ipc", device="cuda:0", rank=rank, size=size)
        try:
            _check_pools(peers, use_table)
            _check_gathers(peers)
            _check_stale(peers)
        finally:
            peers.close()
        # every rank dropped its peers' mappings (pytest.raises tracebacks keep frames holding
        # opened tensors in reference cycles) before any owner frees its blocks and exits
        gc.collect()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.ipc_collect()
    finally:
        dist.destroy_process_group()


def _check_pools(peers: ipc.CudaIpcPeers, use_table: bool) -> None:
    rank, size, dev = peers.rank, peers.size, peers.device
    seed = 300
    pool = peers.alloc_shared("pool", (L, R + 1, RB), torch.uint8)
    assert pool.device == dev and pool.is_contiguous() and pool.data_ptr() % 16 == 0
    assert not bool(pool.any())
    pats = [_pattern(seed, r) for r in range(size)]
    pool.copy_(pats[rank].to(dev))
    pools = peers.open_peers("pool")
    assert len(pools) == size and pools[rank].data_ptr() == pool.data_ptr()
    for r, p in enumerate(pools):
        assert p.is_cuda and p.shape == (L, R + 1, RB) and p.dtype == torch.uint8
        assert torch.equal(p.cpu(), pats[r]), f"rank {rank} reads rank {r}'s pool wrongly"

    src_rank, src_idx, dst_idx = (v.int() for v in _requests(seed, rank, size))  # a plan's
    want = torch.zeros(L, DST_ROWS + 1, RB, dtype=torch.uint8)
    peer_reference.gather_rows_peers([p.cpu() for p in pools], src_rank, src_idx, want, dst_idx)
    assert int((src_rank == 1 - rank).logical_and(src_idx >= 0).logical_and(dst_idx >= 0).sum())
    args = (src_rank.to(dev), src_idx.to(dev))

    dst = torch.zeros(L, DST_ROWS + 1, RB, dtype=torch.uint8, device=dev)
    dispatch.gather_rows_peers(pools, *args, dst, dst_idx.to(dev))
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want), "peer gather (pool list) differs from the reference"

    if use_table:
        table = ipc.peer_pointer_table(pools, dev)
        assert table.device == dev and table.dtype == torch.int64
        assert table.tolist() == [p.data_ptr() for p in pools]
        dst2 = torch.zeros_like(dst)
        dispatch.gather_rows_peers(table, *args, dst2, dst_idx.to(dev), src_rows=R + 1)
        torch.cuda.synchronize()
        assert torch.equal(dst2.cpu(), want), "peer gather (pointer table) differs"

    # the owner's writes after open are visible to the peer once ordered by a barrier
    peers.barrier()
    pool[:, R].fill_(rank + 7)
    peers.barrier()
    for r, p in enumerate(pools):
        assert bool((p[:, R] == r + 7).all()), f"rank {rank} misses rank {r}'s write"
    peers.barrier()  # nobody reads the pools any more: they may be released


def _check_gathers(peers: ipc.CudaIpcPeers) -> None:
    rank, size, dev = peers.rank, peers.size, peers.device
    want = torch.tensor([[r, 10 * r + 1] for r in range(size)], dtype=torch.int64)
    mine = torch.tensor([rank, 10 * rank + 1], dtype=torch.int64, device=dev)
    got = peers.all_gather(mine)  # gloo over a host copy
    assert got.device == dev and torch.equal(got.cpu(), want)
    calls = []

    def collective(out: torch.Tensor, inp: torch.Tensor) -> None:
        # stands in for an NCCL all_gather_into_tensor: flat [P * n] output, flat input
        calls.append((tuple(out.shape), tuple(inp.shape)))
        parts = [torch.empty_like(inp.cpu()) for _ in range(size)]
        dist.all_gather(parts, inp.cpu(), group=peers.group)
        out.copy_(torch.cat(parts).to(out.device))

    got = peers.all_gather(mine, collective=collective)
    assert calls == [((2 * size,), (2,))]
    assert got.device == dev and torch.equal(got.cpu(), want)


def _check_stale(peers: ipc.CudaIpcPeers) -> None:
    rank, bad = peers.rank, peers.size - 1
    shape = (2, 4, 16)
    peers.alloc_shared("stale", shape, torch.uint8)
    if rank == bad:  # the owner's header says another group generation
        head = ipc._cuda_header(peers.generation ^ 0x5A5A, rank, "stale", shape, torch.uint8)
        peers._raw["stale"][:ipc.CUDA_HEADER_BYTES].copy_(
            torch.frombuffer(bytearray(head), dtype=torch.uint8))
    _expect_handle_error(peers, "stale", bad, "stale or foreign")
    if rank != bad:
        peers.alloc_shared("lonely", (8,), torch.float16)
    _expect_handle_error(peers, "lonely", bad, "never allocated")
    peers.alloc_shared("odd", (3, 5 + (rank == bad)), torch.int32)
    _expect_handle_error(peers, "odd", bad, "[3, 6]")
    # the failed opens left both ranks' collectives aligned
    got = peers.all_gather(torch.tensor([rank], device=peers.device))
    assert got.cpu().view(-1).tolist() == list(range(peers.size))


def test_cuda_ipc_two_processes_one_gpu(tmp_path):
    use_table = cuda_rows.kernels_available()
    tmp.spawn(_gpu_rank, args=(SIZE, f"file://{tmp_path}/rendezvous", use_table),
              nprocs=SIZE, join=True)
