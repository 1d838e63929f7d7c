"""TP mode on a real GPU: two spawned processes on one device stripe one address space, their
pools shared by CUDA IPC (:class:`ulacache.ipc.CudaIpcPeers`, handles exchanged over gloo).
The same sequence runs on CPU processes over shared memory (:class:`ulacache.ipc.ShmPeers`)
in every CI run, so the GPU test's logic is exercised where no GPU is.

Both ranks run the same sequence (rounds of new tokens placed and written, sparse accesses of
random selections with duplicates and padding, releases); after every access each rank's
attention rows (own pool read in place, peers' rows through its buffer: promotions on the
owner, then a peer gather from the owner's GPU pool) must hold exactly the bytes written for
each selected address, in every layer of the group; integrity (buffered copies against their
owners' bytes included) holds at the end, and peer reads, promotions and buffer evictions all
happened.
"""

from __future__ import annotations

import datetime
import gc
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

SIZE, STEPS, NEW, BS, K, N = 2, 40, 16, 4, 24, 1024


def _check(space, truth, sel, rows) -> None:
    for li, layer in enumerate(space.groups[0].layers):
        got = space.attn_rows(layer)[rows.clamp(min=0).long()].cpu()
        for b in range(BS):
            for j in range(K):
                a = int(sel[b, j])
                if a >= 0:
                    assert torch.equal(got[b, j], truth[a][li]), (
                        f"rank {space.rank}: address {a} layer {layer} read wrong bytes")
                else:
                    assert int(rows[b, j]) == -1


def _rank_main(rank: int, init: str, backend: str, device: str) -> None:
    from ulacache import ipc
    from ulacache.config import UlaCacheConfig
    from ulacache.tp import TPAddressSpace

    torch.set_num_threads(1)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(0)  # both ranks on one GPU
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=SIZE,
                            timeout=datetime.timedelta(seconds=120))
    try:
        peers = ipc.make_peers(backend, device=device, rank=rank, size=SIZE)
        try:
            cfg = UlaCacheConfig(layout="fp8", n_layers=2, layers_per_group=2, gpu_slots=64,
                                 cpu_slots=192, page_size=64, tp_size=SIZE, buffer_slots=96,
                                 n_buckets=4)
            space = TPAddressSpace(cfg, peers, n_logical=N)
            rb = cfg.row_layout.row_bytes
            gen = torch.Generator().manual_seed(7)  # the same draws on both ranks (SPMD)
            truth: dict[int, list[torch.Tensor]] = {}
            order: list[int] = []
            free = list(range(N))
            for step in range(STEPS):
                space.begin_round()
                if step % 5 == 4:  # a request finishes: its rows leave every rank
                    gone, order = order[:32], order[32:]
                    space.release(torch.tensor(gone, device=device))
                    for a in gone:
                        del truth[a]
                    free += gone
                new, free = free[:NEW], free[NEW:]
                addrs = torch.tensor(new, device=device)
                space.place(addrs)
                rows = [torch.randint(0, 256, (NEW, rb), dtype=torch.uint8, generator=gen)
                        for _ in range(2)]
                for layer in (0, 1):
                    space.write(layer, addrs, rows[layer].to(device))
                for i, a in enumerate(new):
                    truth[a] = [rows[0][i], rows[1][i]]
                order += new
                live = torch.tensor(order)
                pick = torch.randint(0, live.numel(), (BS, K), generator=gen)
                sel = torch.where(torch.rand(BS, K, generator=gen) < 0.1, -1, live[pick])
                rows_idx = space.access(0, sel.to(device))
                if cuda:
                    torch.cuda.synchronize()
                _check(space, truth, sel, rows_idx)
            mask = torch.zeros(N, dtype=torch.bool)
            mask[order] = True
            space.check_integrity(mask)
            c = space.counters()[0]
            assert c["peer_fetches"] > 0 and c["promotions"] > 0 and c["buffer_evictions"] > 0, c
            assert c["buffer_overflow"] == c["peer_missing"] == c["access_overflow"] == 0, c
            del space
        finally:
            peers.close()
        gc.collect()
        if cuda:  # every rank dropped its peers' mappings before any owner frees its blocks
            torch.cuda.synchronize()
        dist.barrier()
        if cuda:
            torch.cuda.ipc_collect()
    finally:
        dist.destroy_process_group()


def _spawn(backend: str, device: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_rank_main, args=(f"tcp://127.0.0.1:{port}", backend, device), nprocs=SIZE,
              join=True)


@pytest.mark.gpu
def test_tp_two_processes_one_gpu_cuda_ipc():
    _spawn("cuda_ipc", "cuda:0")


def test_tp_two_processes_shared_memory_same_sequence():
    _spawn("shm", "cpu")
