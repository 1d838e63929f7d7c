"""Shared test helpers: deterministic row bytes, full-state snapshots of the core, growth."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ulacache.cache import UlaCache
from ulacache.space import AddressSpace
from ulacache.streams import active_stream


def row_bytes_for(addrs: torch.Tensor, layer: int, version: int, row_bytes: int) -> torch.Tensor:
    """``uint8 [n, row_bytes]`` rows that identify (address, layer, version)."""
    a = addrs.to(torch.int64).view(-1, 1)
    j = torch.arange(row_bytes, dtype=torch.int64).view(1, -1)
    return ((a * 131 + layer * 31 + version * 7 + j * 13) % 251).to(torch.uint8)


def fill(space: AddressSpace, addrs: torch.Tensor, version: int = 0) -> None:
    """Write the identifying rows of ``addrs`` in every layer."""
    rb = space.config.row_layout.row_bytes
    for layer in range(space.config.n_layers):
        space.write(layer, addrs, row_bytes_for(addrs, layer, version, rb))


def grow(cache: UlaCache, rid, rounds: int, per_round: int) -> None:
    """Extend ``rid`` by ``per_round`` written tokens in each of ``rounds`` scheduling rounds."""
    for _ in range(rounds):
        cache.space.begin_round()
        fill(cache.space, cache.extend(rid, per_round))


def space_snapshot(space: AddressSpace) -> dict:
    """Every piece of mutable state of an address space, cloned."""
    snap = {"round_serial": space.round_serial}
    for i, g in enumerate(space.groups):
        pol = g.policy
        for name, t in [("loc", g.loc), ("gown", g.gpu_owner), ("shadow", g.shadow),
                        ("gpu", g.pools.gpu), ("cpu", g.pools.cpu), ("free", g.pools.cpu_free),
                        ("top", g.pools.cpu_top), ("claim", g.claim_table), ("ctr", g.counters)]:
            snap[f"{i}.{name}"] = t.clone()
        for name, t in vars(pol).items():
            if isinstance(t, torch.Tensor):
                snap[f"{i}.pol.{name}"] = t.clone()
    return snap


def snapshot(cache: UlaCache | AddressSpace) -> dict:
    """Every piece of mutable state (ledger included), cloned, for 'unchanged after an error'."""
    if isinstance(cache, AddressSpace):
        return space_snapshot(cache)
    snap = space_snapshot(cache.space)
    snap.update({
        "requests": copy.deepcopy(cache.requests),
        "reserved": cache.reserved_total,
        "pages_free": list(cache.pages._free),
        "pages_used": bytes(cache.pages._used),
    })
    return snap


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"state {k} changed"
        else:
            assert a[k] == b[k], f"state {k} changed"


class WriteLog(TorchDispatchMode):
    """Records every tensor an op writes, in issue order, as ``(op, storage pointer, active core
    stream)`` (for data-then-map order and stream-order checks); ``on_write(ptr)`` runs after
    each such write."""

    def __init__(self, on_write=None):
        super().__init__()
        self.events: list[tuple[str, int, object]] = []
        self.on_write = on_write

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    self.events.append((str(func.overloadpacket), ptr, active_stream()))
                    if self.on_write:
                        self.on_write(ptr)
        return out


def sglang_alloc_decode(h, idxs: list[int]):
    """A decode step's allocation as SGLang's scheduler does it, on a contract-test harness
    ``h`` (``rtp``, ``alloc``, ``lens``): one new logical loc per request, recorded in
    ``req_to_token``. Returns ``(req rows int64 [bs], seq lens int64 [bs], new locs)``."""
    ri = torch.tensor(idxs)
    last = torch.stack([h.rtp.req_to_token[i, h.lens[i] - 1].long() for i in idxs])
    seq = torch.tensor([h.lens[i] + 1 for i in idxs])
    out = h.alloc.alloc_decode(seq, seq, last)
    for i, loc in zip(idxs, out.tolist()):
        h.rtp.req_to_token[i, h.lens[i]] = loc
        h.lens[i] += 1
    return ri, seq, out


def sglang_alloc_verify(h, idxs: list[int], steps: int):
    """A speculative verify step's allocation (``steps`` draft tokens per request, lengths not
    advanced), recorded in ``req_to_token``. Returns ``(req rows int64 [bs], prefix lengths
    int64 [bs], locs)``."""
    bs = len(idxs)
    ri = torch.tensor(idxs)
    prefix = torch.tensor([h.lens[i] for i in idxs])
    last = torch.stack([h.rtp.req_to_token[i, h.lens[i] - 1].long() for i in idxs])
    locs = h.alloc.alloc_logical_only(prefix, prefix, prefix + steps, prefix + steps, last,
                                      bs * steps)
    for b, i in enumerate(idxs):
        h.rtp.req_to_token[i, h.lens[i]: h.lens[i] + steps] = \
            locs[b * steps: (b + 1) * steps].to(torch.int32)
    return ri, prefix, locs


def sglang_verify_topk(h, idxs: list[int], steps: int, k: int) -> torch.Tensor:
    """``int32 [bs, steps, k]``: per request and draft step, distinct positions up to that
    step's own token, ``-1`` padded."""
    topk = torch.full((len(idxs), steps, k), -1, dtype=torch.int32)
    for b, i in enumerate(idxs):
        for s in range(steps):
            pos = torch.randperm(h.lens[i] + s + 1, generator=h.gen)[:k]
            topk[b, s, : pos.numel()] = pos.to(torch.int32)
    return topk


def sglang_topk(h, idxs: list[int], k: int, pad: int):
    """The indexer's output for a decode step: per request distinct positions (always the
    newest), ``-1`` padded, plus ``pad`` CUDA-graph padding rows of garbage; and the padded
    request rows and lengths the backend passes. Returns ``(topk int32 [bs + pad, k],
    req rows, seq lens)``."""
    bs = len(idxs)
    topk = torch.full((bs + pad, k), -1, dtype=torch.int32)
    for b, i in enumerate(idxs):
        n = h.lens[i]
        pos = torch.randperm(n - 1, generator=h.gen)[: k - 4]
        topk[b, : pos.numel() + 1] = torch.cat([pos, torch.tensor([n - 1])]).to(torch.int32)
    topk[bs:] = torch.arange(k, dtype=torch.int32)  # garbage in padded rows
    ri_pad = torch.cat([torch.tensor(idxs), torch.zeros(pad, dtype=torch.int64)])
    seq_pad = torch.cat([torch.tensor([h.lens[i] for i in idxs]),
                         torch.ones(pad, dtype=torch.int64)])
    return topk, ri_pad, seq_pad


def device_table_bytes(root, rows: list[torch.Tensor], skip_attrs: tuple[str, ...] = (),
                       modules: tuple[str, ...] = ("ulacache",)) -> dict[str, int]:
    """Bytes of every tensor storage reachable from ``root`` (through the attributes of
    objects of the packages in ``modules``, lists, tuples and dicts), by the path it was first
    reached at, except the storages of ``rows`` (the row pools: KV data, not tables), counter
    monitors' host mirrors, peers and attributes named in ``skip_attrs``. Views count once, as
    their whole storage: what was allocated, not what is viewed."""
    from ulacache.health import CounterMonitor
    from ulacache.ipc import Peers
    from ulacache.tools.ledger import reachable_storages

    skip = {t.untyped_storage()._cdata for t in rows}
    found = reachable_storages({"root": root}, modules=modules, stop=(CounterMonitor, Peers),
                               skip_attrs=skip_attrs)
    return {path: t.untyped_storage().nbytes() for key, (path, t) in found.items()
            if key not in skip and t.untyped_storage().nbytes()}


def load_bench(name: str):
    """``bench/<name>.py`` imported as module ``name`` (the bench scripts are not a package;
    registered in ``sys.modules`` so dataclasses and pickling resolve it)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def prefetch_test_config(geom, **kw):
    """The small DP geometry the prefetch tests decode with (160 GPU + 640 CPU slots per
    group, 4 buckets): prompts outgrow the GPU pool, so every step promotes and evicts."""
    from ulacache.config import UlaCacheConfig

    base = dict(layout="tiny", row_bytes=geom.row_bytes, n_layers=geom.n_layers,
                layers_per_group=geom.layers_per_indexer, gpu_slots=160, cpu_slots=640,
                page_size=64, max_requests=8, n_buckets=4)
    return UlaCacheConfig(**{**base, **kw})


def random_drafts(cfg, seed: int = 1):
    """A stand-in for a draft token's selections (the reference model does not speculate):
    random addresses anywhere in the logical space (other requests' rows, unplaced and freed
    addresses included) and ``-1`` padding, fresh every call, reproducible."""
    gen = torch.Generator().manual_seed(seed)
    n_logical = cfg.n_logical_pages * cfg.page_size
    return lambda group, addrs: torch.randint(-1, n_logical, tuple(addrs.shape), generator=gen)


def logged_decode_step(geom, cfg, prefetch):
    """Two requests prefilled (70 and 50 tokens), then one decode step, with the prefetch
    engine's stream log cleared before it: ``(store, log)`` (the log as the step left it)."""
    from ulacache.oracle.driver import UlaCacheStore
    from ulacache.oracle.refmodel import DSAMLAModel

    store = UlaCacheStore(UlaCache(cfg, layer_groups=geom.selection_groups()),
                          prefetch=prefetch)
    model = DSAMLAModel(geom, 0)
    store.prefilling = True
    for r, n in enumerate([70, 50]):
        model.prefill(r, torch.arange(n) % geom.vocab, store)
    store.prefilling = False
    log = store.prefetch.stream_log
    log.clear()
    model.decode_step([0, 1], torch.tensor([1, 2]), store)
    return store, log


def sglang_tp_ranks_init(rank: int, size: int, port: int) -> None:
    """SGLang's distributed set-up for TP rank ``rank`` of ``size`` spawned CPU processes, as
    a launch does it: args published with ``--tp size``, the world over gloo on ``port``, the
    model-parallel groups without pynccl or custom all-reduce (CUDA only)."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", "dummy", "--device", "cpu", "--tp", str(size)])
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=rank))
    ps.init_distributed_environment(world_size=size, rank=rank, local_rank=rank,
                                    backend="gloo", timeout=120,
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    orig = ps.init_model_parallel_group
    ps.init_model_parallel_group = lambda *a, **kw: orig(
        *a, **{**kw, "use_pynccl": False, "use_custom_allreduce": False})
    ps.initialize_model_parallel(backend="gloo")  # TP size from the published args


def spawn_ranks(target, size: int, out_dir, timeout_s: float, *extra) -> list[dict]:
    """Run ``target(rank, port, out_dir, *extra)`` in ``size`` spawned processes (ranks
    ``0..size-1`` of one gloo world on a free port), each writing ``out_dir/rank{r}.json``;
    return the ranks' JSON results, failing with every rank's reported ``error``."""
    import json
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, port, str(out_dir), *extra))
             for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = []
    for r in range(size):
        f = Path(out_dir) / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {"error": "no result"})
    errors = [(r, res["error"]) for r, res in enumerate(results) if "error" in res]
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors)
    return results
