"""The IPC layer (ulacache.ipc) on CPU: ThreadPeers in one process, ShmPeers in real processes.

- ThreadPeers, P in {1, 2, 4}: pools allocated and opened by every rank, read through the peer
  gather and compared with an independent per-row loop; all_gather order; barrier ordering of
  writes; a failing rank surfaces with its rank while the others leave their collectives; a
  rank that skips a collective times out instead of hanging; a name one rank never allocated,
  or of another shape, is a PeerHandleError naming that rank.
- ShmPeers, P in {2, 4} spawned processes over gloo: the same byte-for-byte checks (the
  owners' bytes are recomputed from a seed and also sent through all_gather), pointer-table
  gathers, stale handles (a header of another generation, an unlinked segment, a missing name,
  a shape mismatch) named by rank on every rank, and no /dev/shm entry left after close.
  Children re-raise in the parent through torch.multiprocessing.spawn.
"""

from __future__ import annotations

import datetime
import os
import pickle
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from ulacache import ipc
from ulacache.errors import ConfigError, ShapeError, UlaCacheError
from ulacache.kernels import dispatch

L, R, RB = 3, 40, 32  # pools uint8 [L, R + 1, RB]: R real rows and the scratch row R
SHM_DIR = "/dev/shm"


def _pattern(seed: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s pool bytes, ``uint8 [L, R + 1, RB]``, recomputable by anyone."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(0, 256, (L, R + 1, RB), generator=g, dtype=torch.uint8)


def _requests(seed: int, rank: int, size: int, n: int = 120, dst_rows: int = 150):
    """Random peer-gather requests: ``(src_rank, src_idx, dst_idx)`` int64 [n], with skips
    (-1) in each, destinations distinct."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    src_rank = torch.randint(0, size, (n,), generator=g)
    src_idx = torch.randint(0, R, (n,), generator=g)
    dst_idx = torch.randperm(dst_rows, generator=g)[:n]
    for v in (src_rank, src_idx, dst_idx):
        v[torch.rand(n, generator=g) < 0.08] = -1
    return src_rank, src_idx, dst_idx


def _expected(pats, src_rank, src_idx, dst_idx, dst_rows: int) -> torch.Tensor:
    """The gather, row by row (independent of the kernels' code)."""
    want = torch.zeros(L, dst_rows + 1, RB, dtype=torch.uint8)
    for r, s, d in zip(src_rank.tolist(), src_idx.tolist(), dst_idx.tolist()):
        if r >= 0 and s >= 0 and d >= 0:
            want[:, d] = pats[r][:, s]
    return want


def _check_sharing(peers: ipc.Peers, seed: int) -> None:
    """The byte-for-byte protocol check every backend must pass (collective)."""
    rank, size = peers.rank, peers.size
    pool = peers.alloc_shared("pool", (L, R + 1, RB), torch.uint8)
    assert pool.shape == (L, R + 1, RB) and pool.dtype == torch.uint8
    assert not pool.any(), "alloc_shared must zero-fill"
    pool.copy_(_pattern(seed, rank))
    pools = peers.open_peers("pool")
    assert len(pools) == size
    assert pools[rank].data_ptr() == pool.data_ptr()
    pats = [_pattern(seed, r) for r in range(size)]
    for r in range(size):
        assert torch.equal(pools[r], pats[r]), f"rank {rank} reads rank {r}'s pool wrongly"
    # the owners' own bytes, sent through all_gather, agree with what the mappings show
    sent = peers.all_gather(pool)
    assert sent.shape == (size, L, R + 1, RB)
    for r in range(size):
        assert torch.equal(sent[r], pools[r])

    src_rank, src_idx, dst_idx = (v.int() for v in _requests(seed, rank, size))  # a plan's
    want = _expected(pats, src_rank, src_idx, dst_idx, 150)
    dst = torch.zeros(L, 151, RB, dtype=torch.uint8)
    dispatch.gather_rows_peers(pools, src_rank, src_idx, dst, dst_idx)
    assert torch.equal(dst, want)
    table = ipc.peer_pointer_table(pools, "cpu")
    assert table.dtype == torch.int64 and table.shape == (size,)
    dst2 = torch.zeros_like(dst)
    dispatch.gather_rows_peers(table, src_rank, src_idx, dst2, dst_idx, src_rows=R + 1)
    assert torch.equal(dst2, want)

    # writes after open are visible once ordered by a barrier
    peers.barrier()  # nobody still reads the old scratch rows
    pool[:, R] = rank + 7
    peers.barrier()
    for r in range(size):
        assert (pools[r][:, R] == r + 7).all()


def _check_all_gather(peers: ipc.Peers) -> None:
    rank, size = peers.rank, peers.size
    got = peers.all_gather(torch.tensor([rank, 10 * rank + 1], dtype=torch.int64))
    want = torch.tensor([[r, 10 * r + 1] for r in range(size)], dtype=torch.int64)
    assert torch.equal(got.cpu(), want)
    flags = peers.all_gather(torch.tensor(rank % 2 == 1))
    assert flags.dtype == torch.bool and flags.tolist() == [r % 2 == 1 for r in range(size)]


def _expect_handle_error(peers: ipc.Peers, name: str, bad: int, words: str) -> None:
    with pytest.raises(ipc.PeerHandleError) as info:
        peers.open_peers(name)
    assert info.value.ranks == (bad,), str(info.value)
    assert f"rank {bad}" in str(info.value) and words in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------
# ThreadPeers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 4])
def test_thread_sharing(size):
    def fn(peers):
        assert peers.backend == "thread" and peers.device == torch.device("cpu")
        _check_sharing(peers, seed=size)
        _check_all_gather(peers)
        return peers.rank

    assert ipc.run_ranks(size, fn) == list(range(size))


@pytest.mark.parametrize("size", [2, 4])
def test_thread_stale_handles_name_the_rank(size):
    bad = size - 1

    def fn(peers):
        if peers.rank != bad:
            peers.alloc_shared("lonely", (2, 3), torch.float32)
        _expect_handle_error(peers, "lonely", bad, "never allocated")
        peers.alloc_shared("odd", (2, 3 + (peers.rank == bad)), torch.float32)
        _expect_handle_error(peers, "odd", bad, "[2, 4]")
        # same shape, another dtype (a view of it would reinterpret the owner's bytes)
        peers.alloc_shared("dtype", (2, 3), torch.float16 if peers.rank == bad else torch.float32)
        _expect_handle_error(peers, "dtype", bad, "torch.float16")
        _check_all_gather(peers)  # the failed opens left the ranks' collectives aligned
        return True

    assert ipc.run_ranks(size, fn) == [True] * size


def test_thread_failure_surfaces_with_rank_and_others_leave():
    entered = threading.Event()

    def fn(peers):
        if peers.rank == 2:
            entered.wait(5)
            raise ValueError("boom in the middle")
        entered.set()
        peers.barrier()  # would wait forever for rank 2 without the abort
        return peers.rank

    t0 = time.monotonic()
    with pytest.raises(ipc.RankError) as info:
        ipc.run_ranks(4, fn)
    assert time.monotonic() - t0 < 10
    assert info.value.rank == 2 and "rank 2" in str(info.value) and "boom" in str(info.value)
    assert isinstance(info.value.error, ValueError)
    assert isinstance(info.value.__cause__, ValueError)


def test_thread_skipped_collective_times_out():
    def fn(peers):
        if peers.rank == 1:
            return "skipped the barrier"
        peers.barrier()

    t0 = time.monotonic()
    with pytest.raises(ipc.RankError, match="barrier"):
        ipc.run_ranks(3, fn, timeout=0.3)
    assert time.monotonic() - t0 < 10


def test_thread_all_gather_shape_mismatch():
    def fn(peers):
        with pytest.raises(ShapeError, match="rank 1"):
            peers.all_gather(torch.zeros(2 + peers.rank))
        return True

    assert ipc.run_ranks(2, fn) == [True, True]


def test_thread_hub_and_lifetime():
    hub = ipc.ThreadHub(2)
    p0 = ipc.make_peers("thread", hub=hub, rank=0, size=2)
    with pytest.raises(ConfigError, match="already"):
        hub.peers(0)
    with pytest.raises(ConfigError):
        hub.peers(2)
    t = p0.alloc_shared("x", (2,), torch.int64)
    assert t.dtype == torch.int64 and t.tolist() == [0, 0]
    with pytest.raises(ConfigError, match="already allocated"):
        p0.alloc_shared("x", (2,), torch.int64)
    with pytest.raises(ShapeError):
        p0.alloc_shared("y", (2, -1), torch.int64)
    with pytest.raises(ShapeError):
        p0.alloc_shared("y", (2,), "uint8")
    with hub.peers(1) as p1:
        assert p1.generation == p0.generation
    assert p1.closed
    p1.close()  # idempotent
    with pytest.raises(UlaCacheError, match="closed"):
        p1.alloc_shared("z", (1,), torch.uint8)
    p0.close()
    assert "x" not in hub._registry or 0 not in hub._registry["x"]


def test_make_peers_errors():
    with pytest.raises(ConfigError, match="thread.*shm.*cuda_ipc"):
        ipc.make_peers("nccl")
    with pytest.raises(ConfigError, match="hub"):
        ipc.make_peers("thread", rank=0)
    with pytest.raises(ConfigError, match="size"):
        ipc.make_peers("thread", hub=ipc.ThreadHub(2), rank=0, size=3)
    if not dist.is_initialized():
        with pytest.raises(ConfigError, match="init_process_group"):
            ipc.make_peers("shm")


def test_peer_handle_error_pickles():
    e = ipc.PeerHandleError("rank 3's segment is gone", [3, 1, 3])
    assert e.ranks == (1, 3) and isinstance(e, UlaCacheError)
    back = pickle.loads(pickle.dumps(e))
    assert back.ranks == (1, 3) and str(back) == str(e)


# ---------------------------------------------------------------------------------------------
# ShmPeers in spawned processes
# ---------------------------------------------------------------------------------------------
def _shm_rank(rank: int, size: int, init: str, out_dir: str) -> None:
    """One spawned rank: every ShmPeers check, then leftovers (raises on failure)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        with ipc.make_peers("shm", rank=rank, size=size) as peers:
            prefix = peers.shm_prefix
            if rank == 0:
                with open(os.path.join(out_dir, "prefix"), "w") as f:
                    f.write(prefix)
            _check_sharing(peers, seed=100 + size)
            _check_all_gather(peers)
            _check_shm_stale(peers)
            _check_all_gather(peers)  # the failed opens left the ranks' collectives aligned
        assert peers.closed
        peers.close()
        dist.barrier()  # every rank has closed
        if os.path.isdir(SHM_DIR):
            left = [f for f in os.listdir(SHM_DIR) if f.startswith(prefix)]
            assert not left, f"rank {rank}: leftover segments {left}"
    finally:
        dist.destroy_process_group()


def _check_shm_stale(peers: ipc.ShmPeers) -> None:
    rank, bad = peers.rank, peers.size - 1
    # a segment of another group generation behind the right name
    t = peers.alloc_shared("stale", (2, 4, 16), torch.uint8)
    if rank == bad:
        seg = peers._owned["stale"]
        seg.mm[:ipc._SHM_HEADER.size] = ipc._shm_header(
            peers.generation ^ 0x5A5A, rank, peers.size, t.numel(),
            ipc._fingerprint("stale", (2, 4, 16), torch.uint8))
    _expect_handle_error(peers, "stale", bad, "generation")
    # a segment unlinked before open (the owner exited or closed)
    peers.alloc_shared("gone", (2, 4, 16), torch.uint8)
    if rank == bad:
        peers._owned["gone"].shm.unlink()
    _expect_handle_error(peers, "gone", bad, "does not exist")
    # a name the bad rank never allocated, and a shape mismatch
    if rank != bad:
        peers.alloc_shared("lonely", (8,), torch.float16)
    _expect_handle_error(peers, "lonely", bad, "never allocated")
    peers.alloc_shared("odd", (3, 5 + (rank == bad)), torch.int32)
    _expect_handle_error(peers, "odd", bad, "[3, 6]")
    peers.alloc_shared("dtype", (3, 5), torch.int16 if rank == bad else torch.int32)
    _expect_handle_error(peers, "dtype", bad, "torch.int16")


@pytest.mark.parametrize("size", [2, 4])
def test_shm_processes(size, tmp_path):
    init = f"file://{tmp_path}/rendezvous"
    tmp.spawn(_shm_rank, args=(size, init, str(tmp_path)), nprocs=size, join=True)
    prefix = (tmp_path / "prefix").read_text()
    assert prefix.startswith("ula")
    if os.path.isdir(SHM_DIR):
        assert not [f for f in os.listdir(SHM_DIR) if f.startswith(prefix)]
