"""One IPC layer for tensor-parallel ranks that read rows from each other's KV pools.

In TP mode ``P`` ranks (one process per GPU in production) each own a shard of the pools, and a
rank's gather may need rows that live in a peer's pool. :class:`Peers` is the one interface the
core uses to share such tensors; three backends implement it:

=================  =============================  ==========================================
backend            ranks                          shared memory
=================  =============================  ==========================================
``"thread"``       threads of one process         plain tensors in a :class:`ThreadHub`
``"shm"``          CPU processes, gloo group      POSIX shared memory segments
``"cuda_ipc"``     GPU processes, gloo group      CUDA IPC handles of caching-allocator blocks
=================  =============================  ==========================================

Protocol (every backend)::

    peers.alloc_shared(name, shape, dtype)   # this rank's tensor, zero-filled (local)
    ... fill it ...
    tensors = peers.open_peers(name)         # collective: index r = rank r's tensor
    table = peer_pointer_table(tensors, device)   # int64 [P] for the peer gather kernel

``open_peers`` either returns views of every rank's memory or raises :class:`PeerHandleError`
on every rank, naming the faulty rank(s): a rank that never allocated ``name``, a tensor of
another shape or dtype, a segment or handle that is missing, unreadable, or carries another
group's (generation's) header. A wrong handle is a start-up error, never a wrong read.

Collectives (``open_peers``, ``barrier``, ``all_gather``, the constructors of the process
backends) must be called by every rank in the same order. ``alloc_shared`` and ``close`` are
local.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError, ShapeError, UlaCacheError

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "CudaIpcPeers",
    "PeerHandleError",
    "Peers",
    "RankError",
    "ShmPeers",
    "ThreadHub",
    "ThreadPeers",
    "make_peers",
    "peer_pointer_table",
    "run_ranks",
]

BACKENDS = ("thread", "shm", "cuda_ipc")
"""Names :func:`make_peers` accepts."""

DEFAULT_TIMEOUT_S = 60.0
"""Barrier timeout of the thread backend: a rank that never arrives breaks the barrier instead
of hanging the process (and CI) forever."""


class PeerHandleError(UlaCacheError):
    """A peer's shared tensor cannot be opened, or is not the one this group expects.

    ``ranks`` are the faulty ranks (the owners of the bad tensors), also named in the message.
    Raised at start-up by :meth:`Peers.open_peers`, on every rank alike.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(sorted({int(r) for r in ranks}))

    def __reduce__(self):  # keep ``ranks`` across pickling (spawned ranks re-raise in parents)
        return type(self), (self.args[0], self.ranks)


class RankError(UlaCacheError):
    """A simulated rank of :func:`run_ranks` raised; ``rank`` and ``error`` say which and what
    (also chained as ``__cause__``)."""

    def __init__(self, message: str, rank: int, error: BaseException | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.error = error

    def __reduce__(self):
        return type(self), (self.args[0], self.rank)


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------
def _check_spec(name: str, shape: Sequence[int], dtype: torch.dtype) -> tuple[int, ...]:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a shared tensor needs a non-empty str name, got {name!r}")
    if not isinstance(dtype, torch.dtype):
        raise ShapeError(f"{name!r}: dtype must be a torch.dtype, got {dtype!r}")
    try:
        dims = tuple(int(s) for s in shape)
    except TypeError:
        raise ShapeError(f"{name!r}: shape must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ShapeError(f"{name!r}: negative dimension in shape {list(dims)}")
    return dims


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def _fingerprint(name: str, shape: Sequence[int], dtype: torch.dtype) -> bytes:
    """8 bytes that identify (name, shape, dtype): a header check that the segment holds the
    tensor the opener expects."""
    return hashlib.blake2b(f"{name}|{list(shape)}|{dtype}".encode(), digest_size=8).digest()


def _draw_generation() -> int:
    return secrets.randbits(63) | 1  # nonzero, fits an int64 and a u64 header field


def _summarise(name: str, reports: Sequence[tuple[int, str]]) -> str:
    lines = [f"open_peers({name!r}) failed for rank(s) {sorted({r for r, _ in reports})}:"]
    lines += [f"  {msg}" for _, msg in reports]
    return "\n".join(lines)


def _try_open(opener, r: int, meta: dict, name: str):
    """``opener(r, meta, name)``; any unexpected exception becomes a fault of rank ``r``, so a
    rank never leaves the others waiting in the agreement collective."""
    try:
        return opener(r, meta, name)
    except Exception as e:
        return None, f"rank {r}'s {name!r} cannot be opened: {type(e).__name__}: {e}"


def _check_metas(name: str, metas: Sequence[dict | None]) -> list[tuple[int, str]]:
    """Faults every rank can see in the gathered metadata (same answer on every rank)."""
    bad = [(r, f"rank {r} never allocated {name!r} (alloc_shared not called, or closed)")
           for r, m in enumerate(metas) if m is None]
    if bad:
        return bad
    ref = metas[0]
    for r, m in enumerate(metas):
        if (m["shape"], m["dtype"]) != (ref["shape"], ref["dtype"]):
            bad.append((r, f"rank {r}'s {name!r} is {m['dtype']} {list(m['shape'])}, rank 0's "
                           f"is {ref['dtype']} {list(ref['shape'])}"))
    return bad


class Peers(abc.ABC):
    """``P`` ranks sharing tensors by name. See the module docstring for the protocol.

    Attributes: ``rank`` (0..P-1), ``size`` (P), ``device`` (where this rank's tensors live),
    ``backend`` (one of :data:`BACKENDS`), ``generation`` (a random nonzero id of this group
    instance, the same on every rank: handles of another instance are stale).
    """

    rank: int
    size: int
    device: torch.device
    backend: str
    generation: int

    def __init__(self) -> None:
        self._closed = False

    # -- interface -----------------------------------------------------------------------------
    @abc.abstractmethod
    def alloc_shared(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Allocate this rank's zero-filled ``dtype [*shape]`` tensor ``name``, in memory peers
        can map. Local (not collective); each name once per rank."""

    @abc.abstractmethod
    def open_peers(self, name: str) -> list[torch.Tensor]:
        """Collective. ``P`` tensors, index ``r`` = rank ``r``'s tensor ``name`` (index
        ``rank`` is the local tensor itself), each a view of the owner's memory: writes by the
        owner are visible once ordered (barrier or the TP group's collectives).

        Raises :class:`PeerHandleError` on every rank, naming the faulty ranks, if any rank did
        not allocate ``name``, shapes or dtypes differ, or a peer's memory cannot be opened or
        is not this group generation's tensor ``name`` of ``rank r``.
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective. Returns once every rank has entered it."""

    @abc.abstractmethod
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Collective. ``[P, *t.shape]`` of ``t.dtype`` on ``self.device``; row ``r`` is rank
        ``r``'s ``t``. Every rank passes one shape and dtype."""

    def agree(self, ok: bool) -> bool:
        """Collective, host-side: whether ``ok`` is true on every rank (the same answer on
        every rank). Default: an all-gather of one host byte (no device work)."""
        self._check_open()
        return bool(self.all_gather(torch.tensor([int(bool(ok))], dtype=torch.uint8)).min())

    def fence(self) -> None:
        """Collective: work issued before it on any rank (this rank: on the current stream)
        is ordered before work issued after it on every rank. Default: :meth:`barrier`;
        :class:`CudaIpcPeers` with a stream-ordered ``collective`` needs no host sync."""
        self.barrier()

    @abc.abstractmethod
    def _release(self) -> None:
        """Backend part of :meth:`close` (runs once)."""

    # -- lifetime ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release this rank's shared segments and mappings. Local (a rank may close while
        peers still hold views: the memory lives until the last view dies), idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release()
        log.debug("%s rank %d/%d closed", self.backend, self.rank, self.size)

    def _check_open(self) -> None:
        if self._closed:
            raise UlaCacheError(f"{self.backend} peers of rank {self.rank} are closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, size={self.size}, "
                f"device={self.device}, generation={self.generation:#x}"
                f"{', closed' if self._closed else ''})")


def peer_pointer_table(tensors: Sequence[torch.Tensor], device: torch.device | str | None = None
                       ) -> torch.Tensor:
    """``int64 [P]`` base addresses of ``open_peers`` pools, on ``device`` (default: the pools'
    device), for :func:`ulacache.kernels.dispatch.gather_rows_peers`.

    The pools must be contiguous ``uint8 [L, S + 1, row_bytes]`` of one shape and ``P <= 8``
    (:func:`ulacache.kernels.dispatch.pool_ptr_table` checks). Build it once at start-up
    (outside graph capture); it stays valid as long as the ``Peers`` and the pools live.
    """
    from ulacache.kernels import dispatch

    return dispatch.pool_ptr_table(list(tensors), device)


# ---------------------------------------------------------------------------------------------
# Threads in one process
# ---------------------------------------------------------------------------------------------
class ThreadHub:
    """The shared side of ``size`` simulated ranks in one process: a registry of the ranks'
    tensors, a :class:`threading.Barrier` (with ``timeout`` seconds) and the all_gather slots.

    ``hub.peers(rank)`` makes rank ``rank``'s :class:`ThreadPeers` (once per rank); drive each
    from its own thread (torch CPU ops release the GIL). :func:`run_ranks` does it all.
    """

    def __init__(self, size: int, *, timeout: float = DEFAULT_TIMEOUT_S,
                 device: torch.device | str = "cpu") -> None:
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"ThreadHub size must be an int >= 1, got {size!r}")
        self.size = size
        self.timeout = float(timeout)
        self.device = torch.device(device)
        self.generation = _draw_generation()
        self.barrier = threading.Barrier(size, timeout=self.timeout)
        self._lock = threading.Lock()
        self._registry: dict[str, dict[int, torch.Tensor]] = {}
        self._slots: list[torch.Tensor | None] = [None] * size
        self._made: set[int] = set()

    def peers(self, rank: int) -> ThreadPeers:
        """Rank ``rank``'s peers (0 <= rank < size; once per rank)."""
        if not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ConfigError(f"rank must be an int in [0, {self.size}), got {rank!r}")
        with self._lock:
            if rank in self._made:
                raise ConfigError(f"ThreadHub: rank {rank}'s peers already made")
            self._made.add(rank)
        return ThreadPeers(self, rank)

    def abort(self) -> None:
        """Break the barrier: every rank waiting in (or later entering) a collective gets
        :class:`threading.BrokenBarrierError` instead of hanging."""
        self.barrier.abort()

    def _wait(self) -> None:
        self.barrier.wait()


class ThreadPeers(Peers):
    """Rank ``rank`` of a :class:`ThreadHub`: tensors are plain tensors on ``hub.device``,
    shared by reference; collectives meet at the hub's barrier. For tests and single-process
    simulation of the TP protocol."""

    backend = "thread"

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        super().__init__()
        self.hub = hub
        self.rank = rank
        self.size = hub.size
        self.device = hub.device
        self.generation = hub.generation
        self._mine: set[str] = set()

    def alloc_shared(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self._check_open()
        shape = _check_spec(name, shape, dtype)
        t = torch.zeros(shape, dtype=dtype, device=self.device)
        with self.hub._lock:
            slot = self.hub._registry.setdefault(name, {})
            if self.rank in slot:
                raise ConfigError(f"rank {self.rank} already allocated {name!r}")
            slot[self.rank] = t
        self._mine.add(name)
        log.debug("thread rank %d: allocated %r %s %s", self.rank, name, dtype, list(shape))
        return t

    def open_peers(self, name: str) -> list[torch.Tensor]:
        self._check_open()
        self.hub._wait()  # every rank's alloc_shared before this call is registered
        with self.hub._lock:
            slot = dict(self.hub._registry.get(name, {}))
        tensors = [slot.get(r) for r in range(self.size)]
        metas = [None if t is None else {"shape": tuple(t.shape), "dtype": str(t.dtype)}
                 for t in tensors]
        # Nobody may close (unregister) before every rank has read the registry: all ranks
        # must see the same entries to reach the same verdict.
        self.hub._wait()
        bad = _check_metas(name, metas)
        if bad:
            raise PeerHandleError(_summarise(name, bad), [r for r, _ in bad])
        return list(tensors)

    def barrier(self) -> None:
        self._check_open()
        self.hub._wait()

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        self._check_open()
        self.hub._slots[self.rank] = t
        self.hub._wait()
        parts = list(self.hub._slots)
        self.hub._wait()  # all have read the slots before any rank refills them
        ref = parts[0]
        for r, p in enumerate(parts):
            if p.shape != ref.shape or p.dtype != ref.dtype:
                raise ShapeError(f"all_gather: rank {r} passed {p.dtype} {list(p.shape)}, rank 0 "
                                 f"{ref.dtype} {list(ref.shape)}")
        return torch.stack([p.to(self.device) for p in parts])

    def _release(self) -> None:
        with self.hub._lock:
            for name in self._mine:
                self.hub._registry.get(name, {}).pop(self.rank, None)
        self._mine.clear()


def run_ranks(size: int, fn: Callable[[ThreadPeers], Any], *,
              timeout: float = DEFAULT_TIMEOUT_S, join_timeout: float = 600.0,
              device: torch.device | str = "cpu") -> list[Any]:
    """Run ``fn(peers)`` for ranks ``0..size-1``, each in its own thread over one
    :class:`ThreadHub`; returns the results in rank order.

    The first exception a rank raises aborts the hub's barrier (so the other ranks leave their
    collectives instead of hanging) and is re-raised as :class:`RankError` naming the rank
    (the original is ``.error`` and ``__cause__``). Ranks that only saw the broken barrier are
    not reported unless no rank raised anything else (then a barrier timed out: some rank
    skipped a collective). Each rank's peers are closed when ``fn`` returns or raises.
    """
    hub = ThreadHub(size, timeout=timeout, device=device)
    results: list[Any] = [None] * size
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        try:
            with hub.peers(rank) as peers:
                results[rank] = fn(peers)
        except BaseException as e:  # noqa: B036 -- report everything back to the caller
            with lock:
                failures.append((rank, e))
            hub.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"ula-rank-{r}", daemon=True)
               for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(join_timeout)
    alive = [r for r, th in enumerate(threads) if th.is_alive()]
    if alive:
        hub.abort()
        raise RankError(f"ranks {alive} still running after {join_timeout} s", alive[0])
    if failures:
        real = [(r, e) for r, e in failures if not isinstance(e, threading.BrokenBarrierError)]
        rank, err = (real or failures)[0]
        what = f"{type(err).__name__}: {err}"
        if not real:
            what = (f"barrier broken or timed out after {timeout} s (a rank skipped a "
                    f"collective?) {what}")
        raise RankError(f"rank {rank} failed: {what}", rank, err) from err
    return results


# ---------------------------------------------------------------------------------------------
# Process-group helpers (shm and CUDA IPC)
# ---------------------------------------------------------------------------------------------
def _group_setup(group, backend: str, extra: Any) -> tuple[int, int, int, list[Any]]:
    """``(rank, size, generation, infos)``: rank 0 draws the generation and broadcasts it; every
    rank's ``(hostname, pid, extra)`` is gathered. Collective."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"{backend} peers need an initialized torch.distributed process group "
                          "(dist.init_process_group('gloo', ...))")
    pg_backend = str(dist.get_backend(group)).lower()
    if "gloo" not in pg_backend:
        raise ConfigError(f"{backend} peers exchange handles over a gloo group; got a "
                          f"{pg_backend!r} group (create one with dist.new_group(backend='gloo'))")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    box = [_draw_generation() if rank == 0 else None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    infos: list[Any] = [None] * size
    dist.all_gather_object(infos, (socket.gethostname(), os.getpid(), extra), group=group)
    hosts = {h for h, _, _ in infos}
    if len(hosts) > 1:
        far = [r for r, (h, _, _) in enumerate(infos) if h != infos[rank][0]]
        raise ConfigError(f"{backend} peers need every rank on one host; ranks {far} are not on "
                          f"{infos[rank][0]!r} (hosts: {sorted(hosts)})")
    return rank, size, int(box[0]), infos


def _agree(group, name: str, local: list[tuple[int, str]]) -> None:
    """Collective: gather every rank's open faults and raise the union on every rank, so a
    fault seen by one rank never leaves the others waiting in their next collective."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    every: list[Any] = [None] * size
    dist.all_gather_object(every, local, group=group)
    bad = [(owner, f"{msg} (seen by rank {seer})")
           for seer, faults in enumerate(every) for owner, msg in faults]
    if bad:
        raise PeerHandleError(_summarise(name, bad), [r for r, _ in bad])


def _gather_bytes(t: torch.Tensor, size: int, group) -> torch.Tensor:
    """All-gather a CPU tensor over gloo as raw bytes (every dtype, bool included)."""
    import torch.distributed as dist

    t = t.detach().contiguous()
    if not t.numel():  # nothing to send (a byte view of [P, 0] cannot be re-typed)
        return torch.empty((size, *t.shape), dtype=t.dtype)
    flat = t.reshape(-1).view(torch.uint8)
    out = torch.empty((size, flat.numel()), dtype=torch.uint8)
    dist.all_gather(list(out.unbind(0)), flat, group=group)
    return out.view(t.dtype).view(size, *t.shape)


# ---------------------------------------------------------------------------------------------
# POSIX shared memory (CPU processes)
# ---------------------------------------------------------------------------------------------
_SHM_MAGIC = b"ULAIPC01"
_SHM_HEADER = struct.Struct("<8sQIIQ8s")  # magic, generation, owner rank, size, nbytes, fprint
SHM_HEADER_BYTES = 64
"""Bytes before the data of a segment (the header, padded so data stays 64-byte aligned)."""


def _shm_header(generation: int, rank: int, size: int, nbytes: int, fprint: bytes) -> bytes:
    return _SHM_HEADER.pack(_SHM_MAGIC, generation, rank, size, nbytes, fprint)


@dataclass
class _Segment:
    seg: str                 # POSIX name, without the leading slash
    mm: mmap.mmap            # our own mapping; tensors hold it, so it outlives close()
    tensor: torch.Tensor
    shm: Any = None          # the creating SharedMemory (owned segments only)


def _open_shm_fd(seg: str) -> int:
    """A read-write fd of an existing segment, without resource-tracker registration.

    ``SharedMemory(name=...)`` registers attached segments with the resource tracker on
    Python < 3.13, and spawned ranks share their parent's tracker: an opener's register +
    unregister would delete the creator's entry (KeyError noise at the creator's unlink, and
    no cleanup if the creator crashes). So openers go below SharedMemory, as it does itself.
    """
    import _posixshmem

    return _posixshmem.shm_open("/" + seg, os.O_RDWR, mode=0o600)


def _frombuffer(mm: mmap.mmap, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = _nbytes(shape, dtype) // max(dtype.itemsize, 1)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # torch.frombuffer keeps a reference to ``mm`` (not a buffer export), so the mapping lives
    # as long as any view of the tensor does; nobody calls mm.close() (a dangling tensor).
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=SHM_HEADER_BYTES).view(shape)


def _release_segments(owned: dict[str, _Segment], opened: list[_Segment]) -> None:
    for s in owned.values():
        try:
            s.shm.unlink()  # the name goes; peers' existing mappings stay valid
        except FileNotFoundError:
            pass
        except Exception as e:  # never let cleanup mask the caller's exception
            log.warning("shm: unlinking %s failed: %s", s.seg, e)
        try:
            s.shm.close()  # its own mapping only: our tensors use a separate mmap
        except Exception as e:
            log.warning("shm: closing %s failed: %s", s.seg, e)
    owned.clear()
    opened.clear()


class ShmPeers(Peers):
    """CPU processes sharing tensors through POSIX shared memory, coordinated by a gloo
    process group (``group``, default: the default group). Collective constructor.

    Each ``alloc_shared`` creates segment ``ula<generation:016x>r<rank>n<k>`` (prefix
    :attr:`shm_prefix`) of ``64 + nbytes`` bytes: a header (magic, generation, owner rank,
    group size, nbytes, fingerprint of name/shape/dtype), then the data, wrapped zero-copy with
    ``torch.frombuffer`` (64-byte aligned). ``open_peers`` gathers the names with
    ``all_gather_object``, maps each peer's segment and checks its header.

    ``close`` unlinks this rank's segments (no entry with the prefix is left in ``/dev/shm``
    once every rank closed) and drops this object's references; mappings are unmapped when the
    last tensor view of them dies, so a tensor never dangles. Crashed ranks' segments are
    unlinked by Python's resource tracker at exit.
    """

    backend = "shm"

    def __init__(self, group=None, *, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if torch.device(device).type != "cpu":
            raise ConfigError(f"ShmPeers shares host memory; device must be cpu, got {device}")
        self.group = group
        self.device = torch.device("cpu")
        self.rank, self.size, self.generation, _ = _group_setup(group, self.backend, None)
        self.shm_prefix = f"ula{self.generation:016x}"
        self._owned: dict[str, _Segment] = {}
        self._opened: list[_Segment] = []
        self._counter = 0
        self._finalizer = weakref.finalize(self, _release_segments, self._owned, self._opened)
        log.info("shm peers: rank %d/%d, generation %#x", self.rank, self.size, self.generation)

    def alloc_shared(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        from multiprocessing import shared_memory

        self._check_open()
        shape = _check_spec(name, shape, dtype)
        if name in self._owned:
            raise ConfigError(f"rank {self.rank} already allocated {name!r}")
        nbytes = _nbytes(shape, dtype)
        seg = f"{self.shm_prefix}r{self.rank}n{self._counter}"
        self._counter += 1
        # A new segment is zero-filled (ftruncate); the creator's SharedMemory registers it with
        # the resource tracker, and its unlink() unregisters it.
        shm = shared_memory.SharedMemory(name=seg, create=True, size=SHM_HEADER_BYTES + nbytes)
        try:
            mm = mmap.mmap(shm._fd, SHM_HEADER_BYTES + nbytes)
            mm[:_SHM_HEADER.size] = _shm_header(self.generation, self.rank, self.size, nbytes,
                                                _fingerprint(name, shape, dtype))
            tensor = _frombuffer(mm, shape, dtype)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        self._owned[name] = _Segment(seg, mm, tensor, shm)
        log.debug("shm rank %d: %r -> /%s (%d bytes)", self.rank, name, seg, nbytes)
        return tensor

    def _open_one(self, r: int, meta: dict, name: str) -> tuple[_Segment | None, str | None]:
        seg = meta["seg"]
        shape, dtype = tuple(meta["shape"]), getattr(torch, meta["dtype"].split(".")[-1])
        nbytes = _nbytes(shape, dtype)
        try:
            fd = _open_shm_fd(seg)
        except FileNotFoundError:
            return None, f"rank {r}'s segment /{seg} for {name!r} does not exist (unlinked: " \
                         "the rank closed or exited)"
        except OSError as e:
            return None, f"rank {r}'s segment /{seg} for {name!r} cannot be opened: {e}"
        try:
            have = os.fstat(fd).st_size
            if have < SHM_HEADER_BYTES + nbytes:
                return None, (f"rank {r}'s segment /{seg} has {have} bytes, {name!r} needs "
                              f"{SHM_HEADER_BYTES + nbytes} (stale or foreign segment)")
            mm = mmap.mmap(fd, have)
        except (OSError, ValueError) as e:
            return None, f"rank {r}'s segment /{seg} for {name!r} cannot be mapped: {e}"
        finally:
            os.close(fd)
        magic, gen, owner, size, hb, fp = _SHM_HEADER.unpack_from(mm, 0)
        want = (_SHM_MAGIC, self.generation, r, self.size, nbytes,
                _fingerprint(name, shape, dtype))
        fields = ("magic", "generation", "owner rank", "group size", "nbytes", "fingerprint")
        for field, got, exp in zip(fields, (magic, gen, owner, size, hb, fp), want):
            if got != exp:
                return None, (f"rank {r}'s segment /{seg} is stale or foreign: header {field} "
                              f"{got!r}, expected {exp!r} for {name!r} of this group")
        return _Segment(seg, mm, _frombuffer(mm, shape, dtype)), None

    def open_peers(self, name: str) -> list[torch.Tensor]:
        import torch.distributed as dist

        self._check_open()
        mine = self._owned.get(name)
        meta = None if mine is None else {"seg": mine.seg, "shape": tuple(mine.tensor.shape),
                                          "dtype": str(mine.tensor.dtype)}
        metas: list[Any] = [None] * self.size
        dist.all_gather_object(metas, meta, group=self.group)
        bad = _check_metas(name, metas)
        if bad:  # every rank sees the same metadata: all raise without another collective
            raise PeerHandleError(_summarise(name, bad), [r for r, _ in bad])
        out: list[torch.Tensor] = []
        faults: list[tuple[int, str]] = []
        opened: list[_Segment] = []
        for r, m in enumerate(metas):
            if r == self.rank:
                out.append(mine.tensor)
                continue
            s, err = _try_open(self._open_one, r, m, name)
            if err is not None:
                faults.append((r, err))
                out.append(None)
            else:
                opened.append(s)
                out.append(s.tensor)
        _agree(self.group, name, faults)
        self._opened.extend(opened)
        log.debug("shm rank %d: opened %r from %d peers", self.rank, name, self.size - 1)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        self._check_open()
        dist.barrier(group=self.group)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        self._check_open()
        return _gather_bytes(t.cpu(), self.size, self.group)

    def _release(self) -> None:
        self._finalizer()


# ---------------------------------------------------------------------------------------------
# CUDA IPC (GPU processes)
# ---------------------------------------------------------------------------------------------
_CUDA_MAGIC = b"ULA1"
CUDA_HEADER_BYTES = 16
"""Bytes before the data of a CUDA shared tensor: magic (4), owner rank (u32), digest (8) of
(generation, rank, name, shape, dtype). Keeps the data 16-byte aligned."""


def _cuda_header(generation: int, rank: int, name: str, shape: Sequence[int],
                 dtype: torch.dtype) -> bytes:
    digest = hashlib.blake2b(f"{generation}|{rank}|{name}|{list(shape)}|{dtype}".encode(),
                             digest_size=8).digest()
    return _CUDA_MAGIC + struct.pack("<I", rank) + digest


def _device_uuid(device: torch.device) -> str:
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))


def _local_index_of(uuid: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if _device_uuid(torch.device("cuda", i)) == uuid:
            return i
    return None


_REBUILD_DEVICE_ARG = 6
"""Position of the storage's device index in the args of torch's ``rebuild_cuda_tensor``
(stable since torch 1.x)."""


class CudaIpcPeers(Peers):
    """GPU processes (one GPU each, or several processes sharing a GPU) on one host, whose
    tensors are shared by CUDA IPC; ``group`` (default: the default group) is a gloo group used
    for start-up only. Collective constructor.

    ``alloc_shared`` allocates ``16 + nbytes`` bytes with the caching allocator: a 16-byte
    identity header written by the owner, then the data (the returned view). ``open_peers``
    exchanges ``torch.multiprocessing.reductions.reduce_tensor`` handles (``cudaIpcGetMemHandle``
    plus offset) with ``all_gather_object``, rebuilds the peers' tensors
    (``cudaIpcOpenMemHandle``; a process never opens its own handle: its own index is the local
    tensor) and reads each peer's header back once (a host sync, start-up only). Peers' device
    UUIDs are matched to local device indices, so ranks may see the GPUs in different orders.

    Ordering: :meth:`barrier` (stream sync + gloo barrier) is for start-up and tests. On the
    decode path ranks are ordered by the TP group's collectives (NCCL, stream-ordered), never
    by this class. :meth:`all_gather` takes ``collective``, an
    ``all_gather_into_tensor(output, input)``-style callable (e.g. SGLang's
    ``GroupCoordinator.all_gather_into_tensor`` or ``functools.partial(
    dist.all_gather_into_tensor, group=nccl_group)``), given here or to the constructor; it is
    called with the flat ``[P * numel]`` output and the flat input on ``device``, so the call
    is stream-ordered. Without one it falls back to gloo over a host copy: a device sync and
    two copies per call, not for the hot path.

    Lifetime: torch's IPC reference counting keeps an owner's block from being reused while
    peers hold it; ``close`` drops this rank's references (own and peers').
    """

    backend = "cuda_ipc"

    def __init__(self, group=None, *, device: torch.device | str | None = None,
                 collective: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise ConfigError("CudaIpcPeers needs CUDA")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if dev.type != "cuda":
            raise ConfigError(f"CudaIpcPeers needs a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.device = dev
        self.collective = collective
        self.uuid = _device_uuid(dev)
        self.rank, self.size, self.generation, infos = _group_setup(group, self.backend,
                                                                    self.uuid)
        self.peer_uuids = [u for _, _, u in infos]
        self._raw: dict[str, torch.Tensor] = {}
        self._data: dict[str, torch.Tensor] = {}
        self._opened: list[torch.Tensor] = []
        log.info("cuda_ipc peers: rank %d/%d on %s (%s), generation %#x", self.rank, self.size,
                 dev, self.uuid, self.generation)

    def alloc_shared(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self._check_open()
        shape = _check_spec(name, shape, dtype)
        if name in self._raw:
            raise ConfigError(f"rank {self.rank} already allocated {name!r}")
        nbytes = _nbytes(shape, dtype)
        raw = torch.zeros(CUDA_HEADER_BYTES + nbytes, dtype=torch.uint8, device=self.device)
        head = _cuda_header(self.generation, self.rank, name, shape, dtype)
        raw[:CUDA_HEADER_BYTES].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        self._raw[name] = raw
        self._data[name] = self._data_view(raw, shape, dtype)
        log.debug("cuda_ipc rank %d: allocated %r %s %s", self.rank, name, dtype, list(shape))
        return self._data[name]

    @staticmethod
    def _data_view(raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return raw[CUDA_HEADER_BYTES:].view(dtype).view(shape)

    def _open_one(self, r: int, meta: dict, name: str) -> tuple[torch.Tensor | None, str | None]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        rebuild = meta["rebuild"]
        if rebuild is not rebuild_cuda_tensor:
            return None, f"rank {r}'s {name!r} was not shared as a CUDA tensor ({rebuild!r})"
        shape = tuple(meta["shape"])
        dtype = getattr(torch, meta["dtype"].split(".")[-1])
        args = list(meta["args"])
        if meta["uuid"]:  # without UUIDs (old torch) trust that indices agree
            idx = _local_index_of(meta["uuid"])
            if idx is None:
                return None, f"rank {r}'s GPU {meta['uuid']} is not visible in this process"
            if len(args) > _REBUILD_DEVICE_ARG and isinstance(args[_REBUILD_DEVICE_ARG], int):
                args[_REBUILD_DEVICE_ARG] = idx  # the owner's index may differ from ours
        try:
            raw = rebuild(*args)
            head = bytes(raw[:CUDA_HEADER_BYTES].cpu().tolist())
        except Exception as e:  # cudaIpcOpenMemHandle errors, a freed or foreign block
            return None, f"rank {r}'s CUDA IPC handle for {name!r} cannot be opened: " \
                         f"{type(e).__name__}: {e}"
        want = _cuda_header(self.generation, r, name, shape, dtype)
        if head != want:
            return None, (f"rank {r}'s tensor {name!r} is stale or foreign: header "
                          f"{head.hex()}, expected {want.hex()} for this group generation")
        if raw.numel() < CUDA_HEADER_BYTES + _nbytes(shape, dtype):
            return None, f"rank {r}'s tensor {name!r} is {raw.numel()} bytes, too small"
        return self._data_view(raw, shape, dtype), None

    def open_peers(self, name: str) -> list[torch.Tensor]:
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        self._check_open()
        raw = self._raw.get(name)
        meta = None
        if raw is not None:
            # the header (and whatever the owner wrote) has landed before peers read it
            torch.cuda.current_stream(self.device).synchronize()
            data = self._data[name]
            rebuild, args = reduce_tensor(raw)  # cudaIpcGetMemHandle + offset in the block
            meta = {"rank": self.rank, "generation": self.generation, "uuid": self.uuid,
                    "shape": tuple(data.shape), "dtype": str(data.dtype),
                    "rebuild": rebuild, "args": args}
        metas: list[Any] = [None] * self.size
        dist.all_gather_object(metas, meta, group=self.group)
        bad = _check_metas(name, metas)
        if not bad:
            bad = [(r, f"rank {r}'s handle for {name!r} is from generation "
                       f"{m['generation']:#x} rank {m['rank']}, this group is "
                       f"{self.generation:#x}")
                   for r, m in enumerate(metas)
                   if m["generation"] != self.generation or m["rank"] != r]
        if bad:  # same metadata on every rank: all raise alike
            raise PeerHandleError(_summarise(name, bad), [r for r, _ in bad])
        out: list[torch.Tensor | None] = []
        faults: list[tuple[int, str]] = []
        with torch.cuda.device(self.device):
            for r, m in enumerate(metas):
                if r == self.rank:
                    out.append(self._data[name])
                    continue
                t, err = _try_open(self._open_one, r, m, name)
                if err is not None:
                    faults.append((r, err))
                out.append(t)
        _agree(self.group, name, faults)
        self._opened.extend(t for r, t in enumerate(out) if r != self.rank)
        log.debug("cuda_ipc rank %d: opened %r from %d peers", self.rank, name, self.size - 1)
        return out

    def barrier(self) -> None:
        """Stream sync, then a gloo barrier. Start-up and tests only (a host sync)."""
        import torch.distributed as dist

        self._check_open()
        torch.cuda.current_stream(self.device).synchronize()
        dist.barrier(group=self.group)

    def agree(self, ok: bool) -> bool:
        """Over gloo on the host (never the device collective: no stream sync)."""
        self._check_open()
        flags = _gather_bytes(torch.tensor([int(bool(ok))], dtype=torch.uint8), self.size,
                              self.group)
        return bool(flags.min())

    def fence(self) -> None:
        """With a stream-ordered ``collective`` (NCCL): a one-element all-gather on the current
        stream, which every rank's later kernels wait for and which waits for every rank's
        earlier kernels, with no host sync; without one: :meth:`barrier`."""
        if self.collective is None:
            self.barrier()
            return
        self.all_gather(torch.zeros(1, dtype=torch.int32, device=self.device))

    def all_gather(self, t: torch.Tensor, *,
                   collective: Callable[[torch.Tensor, torch.Tensor], Any] | None = None
                   ) -> torch.Tensor:
        """``[P, *t.shape]`` on ``self.device``. With ``collective`` (or the constructor's):
        ``collective(out.view(-1), t.view(-1))``, stream-ordered, no host sync. Without:
        gloo over a host copy (device sync), for start-up and tests."""
        self._check_open()
        fn = collective or self.collective
        if fn is not None:
            src = t.detach().to(self.device).contiguous()
            out = torch.empty((self.size, *src.shape), dtype=src.dtype, device=self.device)
            fn(out.view(-1), src.view(-1))
            return out
        return _gather_bytes(t.cpu(), self.size, self.group).to(self.device)

    def _release(self) -> None:
        self._opened.clear()
        self._data.clear()
        self._raw.clear()
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # free own blocks whose peers already let go


# ---------------------------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------------------------
def make_peers(backend: str, *, group=None, rank: int | None = None, size: int | None = None,
               hub: ThreadHub | None = None, device: torch.device | str | None = None) -> Peers:
    """The peers of ``backend`` (one of :data:`BACKENDS`).

    - ``"thread"``: needs ``hub`` (a :class:`ThreadHub`) and ``rank``; ``size``, if given, must
      equal ``hub.size``; ``device`` is ignored (the hub's).
    - ``"shm"``: :class:`ShmPeers` over ``group`` (collective).
    - ``"cuda_ipc"``: :class:`CudaIpcPeers` over ``group`` on ``device`` (collective).

    For the process backends ``rank``/``size``, if given, are checked against the group's.
    """
    if backend == "thread":
        if hub is None or rank is None:
            raise ConfigError("backend 'thread' needs hub=ThreadHub(size) and rank=")
        if size is not None and size != hub.size:
            raise ConfigError(f"size={size} but the hub has {hub.size} ranks")
        return hub.peers(rank)
    if backend == "shm":
        peers: Peers = ShmPeers(group, device="cpu" if device is None else device)
    elif backend == "cuda_ipc":
        peers = CudaIpcPeers(group, device=device)
    else:
        raise ConfigError(f"unknown peers backend {backend!r}; expected one of {list(BACKENDS)}")
    for what, want, got in (("rank", rank, peers.rank), ("size", size, peers.size)):
        if want is not None and want != got:
            peers.close()
            raise ConfigError(f"{what}={want} but the process group says {got}")
    return peers
