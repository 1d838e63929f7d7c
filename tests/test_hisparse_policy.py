"""The HiSparse model (``ulacache.tools.hisparse``) against SGLang 0.5.23's HiSparse, and
``ulacache replay`` (its comparison at equal GPU memory).

Oracles (``sglang``-marked part, CPU only):

* SGLang's own ``HiSparseCoordinator``, constructed on CPU with the one test-only patch the
  seams doc names (``MLATokenToKVPoolHost`` with ``pin_memory=False``), supplies the state a
  request starts from (``alloc_device_buffer``: ``req_device_buffer_tokens``, ``lru_slots``,
  ``req_device_buffer_token_locs``), grows the buffers and pins the newest token's slot
  (``map_last_loc_to_buffer``, its host backup stubbed: it needs the copy kernels) and runs its
  loop reference ``naive_load_topk`` every step.
* ``naive_load_topk`` keeps no LRU state: for ``seq_len > H`` it reloads every selected token
  but the newest into the first buffer slots each step, so it cannot decide hits and misses of
  the swap-in kernel. It is the exact oracle of the short-sequence path (positions map straight
  to device slots) and of the newest token's reserved slot; for long sequences the test checks
  only that the model's misses are among the tokens it loads.
* The LRU decisions (hits, misses, which slot each miss takes, the new LRU order) are checked
  against ``_kernel_swap_in``, a line-by-line transcription of the CUDA kernel
  ``load_cache_to_device_buffer_kernel`` (``kernels/jit/csrc/kvcacheio/hisparse.cuh:343-722``,
  token top-k, one request) that reads and writes the coordinator's own state tensors, so the
  comparison runs on SGLang's tables. The kernel itself needs a GPU and is not run here.
"""

from __future__ import annotations

import functools
import json
import os
import types

import numpy as np
import pytest

from ulacache.tools import cli
from ulacache.tools.hisparse import HiSparseBuffer, hisparse_gpu_rows, replay_hisparse
from ulacache.tools.traces import load_trace

FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "fixtures")
TYPING_TRACE = os.path.join(FIXTURE_DIR, "typing-py-1024-k64.trace.npz")  # 30 x 960, k=64

TOKEN_HIT = -1  # hisparse.cuh:27, 0xFFFFFFFF as int32 (equal to HASH_EMPTY)


def _kernel_swap_in(lru: list[int], tokens: list[int], locs: list[int], top_k: list[int],
                    seq_len: int, h: int) -> tuple[list[int], int]:
    """``load_cache_to_device_buffer_kernel`` for one request, in order (line numbers of
    hisparse.cuh). Mutates ``lru`` (lru_slots row) and ``tokens`` (device_buffer_tokens row)
    as the kernel does; returns (top_k_device_locs, misses)."""
    out = [-1] * len(top_k)
    if seq_len <= h:  # :419-440 fast path
        count = min(seq_len, len(top_k))
        for i, p in enumerate(top_k):
            out[i] = locs[p] if i < count and p >= 0 else -1
        return out, 0
    newest = seq_len - 1  # :481-482
    s_top = list(top_k)
    table: dict[int, int] = {}  # the shared-memory hash: token -> top-k index (:484-510)
    for i, p in enumerate(top_k):
        if p == newest:
            s_top[i] = TOKEN_HIT
            out[i] = locs[h]  # reserved slot H
        else:
            table[p] = i
    hits, evictable = [], []  # :513-595, both in LRU order (ballot + prefix sums are stable)
    for idx in range(h):
        slot = lru[idx]
        tok = tokens[slot] if slot >= 0 else -1
        found = table.get(tok, -1) if tok >= 0 else -1
        if found >= 0:
            s_top[found] = TOKEN_HIT
            out[found] = locs[slot]
            hits.append(slot)
        else:
            evictable.append(slot)
    s_lru_out = [0] * h  # hits forward from 0, evictables backward from H-1
    for j, slot in enumerate(hits):
        s_lru_out[j] = slot
    for e, slot in enumerate(evictable):
        s_lru_out[h - 1 - e] = slot
    misses = 0  # :603-663, misses in top-k index order
    for i, p in enumerate(s_top):
        if p != TOKEN_HIT:
            slot = s_lru_out[h - 1 - misses]
            out[i] = locs[slot]
            tokens[slot] = p
            misses += 1
    n_evict = h - len(hits)  # :673-707 write-back of the LRU order
    new = [0] * h
    for i in range(h):
        if i < misses:
            new[n_evict - misses + i] = s_lru_out[h - 1 - i]
        elif i < n_evict:
            new[i - misses] = s_lru_out[h - 1 - i]
        else:
            new[i] = s_lru_out[i - n_evict]
    lru[:] = new
    return out, misses


def _local_selection(rng: np.random.Generator, seq_len: int, k: int, hot: np.ndarray) -> np.ndarray:
    """k unique positions < seq_len with locality: a recent window, a persistent hot set, some
    random ones, the newest token half the time; shuffled (misses load in top-k order)."""
    newest = seq_len - 1
    pool = [np.arange(max(0, newest - 24), newest), hot[hot < newest],
            rng.integers(0, newest, size=k)]
    if rng.random() < 0.5:
        pool.insert(0, np.array([newest]))
    cand = np.concatenate(pool)
    _, first = np.unique(cand, return_index=True)
    uniq = cand[np.sort(first)]
    if uniq.size < k:
        rest = np.setdiff1d(np.arange(seq_len), uniq)
        uniq = np.concatenate([uniq, rng.choice(rest, k - uniq.size, replace=False)])
    sel = uniq[:k] if rng.random() < 0.7 else rng.choice(uniq, k, replace=False)
    return rng.permutation(sel)


# ---- plain CPU tests of the model (no SGLang) ---------------------------------------------


def test_worked_example_lru_order_and_slots():
    b = HiSparseBuffer(4)
    assert b.step([1, 0, 3], 3) == (3, 0)  # seq_len 4 <= H: slot = position, LRU untouched
    assert b.last_slots.tolist() == [1, 0, 3] and b.lru.tolist() == [0, 1, 2, 3]
    # seq_len 7: newest 6 -> reserved slot 4; token 1 hit (slot 1); 5 misses into the LRU slot 0
    assert b.step([5, 1, 6], 6) == (2, 1)
    assert b.last_slots.tolist() == [0, 1, 4]
    assert b.tokens.tolist() == [5, 1, 2, 3] and b.lru.tolist() == [2, 3, 0, 1]
    # token 2 hits; 7 and 8 take the two least recent evictables (3, then 0); stale 1 goes first
    assert b.step([7, 2, 8], 9) == (1, 2)
    assert b.last_slots.tolist() == [3, 2, 0] and b.last_misses.tolist() == [7, 8]
    assert b.tokens.tolist() == [8, 1, 2, 7] and b.lru.tolist() == [1, 3, 0, 2]


def test_matches_kernel_transcription_and_invariants():
    """Random local selections over the short -> long transition: decisions, slots and LRU
    order equal the kernel transcription; the buffer never holds more than H tokens, each
    at most once; the newest token is never in the H slots; misses were not resident."""
    rng = np.random.default_rng(0)
    h, k = 96, 40
    hot = rng.choice(600, 12, replace=False)
    b = HiSparseBuffer(h)
    lru, tokens, locs = list(range(h)), list(range(h)), list(range(1000, 1000 + h + 1))
    for seq_len in range(k + 1, 600):
        sel = _local_selection(rng, seq_len, k, hot)
        before = set(b.tokens.tolist())
        hits, misses = b.step(sel, seq_len - 1)
        out, m = _kernel_swap_in(lru, tokens, locs, sel.tolist(), seq_len, h)
        assert (hits, misses) == (k - m, m)
        assert [locs[s] for s in b.last_slots] == out
        assert b.lru.tolist() == lru and b.tokens.tolist() == tokens
        assert sorted(b.lru.tolist()) == list(range(h))
        assert b.tokens.size == h and np.unique(b.tokens).size == h
        if seq_len > h:
            newest = seq_len - 1
            assert newest not in b.tokens
            assert b.last_slots[sel == newest].tolist() == [h] * int((sel == newest).sum())
            assert set(b.last_misses.tolist()).isdisjoint(before)
            # the hits (newest aside) are the most recent end of the LRU order, the slots
            # just loaded come right before them
            hit = (sel != newest) & ~np.isin(sel, b.last_misses)
            n_hit, n_miss = int(hit.sum()), b.last_misses.size
            assert set(b.lru[h - n_hit:].tolist()) == set(b.last_slots[hit].tolist())
            loaded = b.last_slots[np.isin(sel, b.last_misses)]  # in top-k (= load) order
            assert b.lru[h - n_hit - n_miss:h - n_hit].tolist() == loaded.tolist()
        for p, s in zip(sel.tolist(), b.last_slots.tolist()):
            assert s == h or b.tokens[s] == p or seq_len <= h


def test_refuses_bad_selections():
    b = HiSparseBuffer(8)
    for sel, newest in (([1, 1], 20), ([21], 20), ([-1], 20), (list(range(9)), 20)):
        with pytest.raises(ValueError):
            b.step(sel, newest)
    with pytest.raises(ValueError):
        HiSparseBuffer(0)


def test_replay_hisparse_on_a_fixture():
    trace = load_trace(TYPING_TRACE)
    res = replay_hisparse(trace, requests=2, steps=40, layers=[0, 7], h_slots=128)
    assert res.accesses == 2 * 40 * 2 * trace.k
    assert res.gpu_slots == hisparse_gpu_rows(2, 128) == 2 * (128 + 64)
    assert res.h2d_bytes_per_step == res.misses * res.row_bytes / 40 and res.row_bytes == 656
    assert res.d2h_bytes_per_step == 2 * 2 * 656  # one newest-token backup per request, layer
    assert 0 < res.misses < res.accesses
    whole = replay_hisparse(trace, requests=2, steps=40, layers=[0], h_slots=1024)
    assert whole.misses == 0 and whole.hit_rate == 1.0  # everything fits: the fast path
    with pytest.raises(ValueError, match="h_slots"):
        replay_hisparse(trace, requests=1, steps=4, layers=[0], h_slots=32)


def _run(argv, capsys):
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err.splitlines()


def test_cli_compares_with_hisparse_at_equal_gpu_rows(capsys):
    base = ["replay", TYPING_TRACE, "--steps", "6", "--layers", "2", "--requests", "2",
            "--no-capacity"]
    rc, out, _ = _run([*base, "--json"], capsys)
    assert rc == 0
    doc = json.loads(out)
    assert [r["policy"] for r in doc["results"]] == ["pblru"]
    hs = doc["hisparse"]
    assert hs["policy"] == "hisparse" and hs["h_slots"] == 128 and hs["gpu_slots"] == 384
    assert all(r["gpu_slots"] == hs["gpu_slots"] for r in doc["results"])  # equal GPU rows
    assert set(doc["pcie_bytes_per_step_ratio_hisparse_over"]) == {"pblru"}
    rc, out, _ = _run([*base, "--hisparse-slots", "96"], capsys)
    assert rc == 0 and "HiSparse 2 requests x (H 96 + 64 reserved) = 320" in out
    rc, out, _ = _run([*base, "--policy", "lru", "--compare-lru", "--json"], capsys)
    assert rc == 0 and [r["policy"] for r in json.loads(out)["results"]] == ["lru", "pblru"]
    for argv, needle in (([*base, "--gpu-slots", "512"], "--gpu-slots"),
                         ([*base, "--hisparse-slots", "8"], "k = 64"),
                         ([*base, "--mode", "tp", "--tp-size", "2", "--compare-lru"],
                          "--mode dp")):
        rc, out, err = _run(argv, capsys)
        assert rc == 2 and out == "" and len(err) == 1 and needle in err[0], (argv, err)


# ---- against SGLang's own coordinator (CPU) ------------------------------------------------

H, TOP_K, PAGE, LAYERS = 128, 64, 64, 2


@pytest.fixture(scope="module")
def sgl():
    """SGLang's HiSparseCoordinator on CPU (the seams doc's one patch: pin_memory=False)."""
    pytest.importorskip("sglang")
    import torch
    import torch.distributed as dist
    from sglang.srt.managers import hisparse_coordinator as hc
    from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", "dummy", "--device", "cpu"])
    sa.resolve_once()
    publish(sa, role="scheduler")
    own_pg = not dist.is_initialized()
    if own_pg:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mp = pytest.MonkeyPatch()
    mp.setattr(hc, "MLATokenToKVPoolHost",
               functools.partial(hc.MLATokenToKVPoolHost, pin_memory=False))
    size = 2048
    rtp = ReqToTokenPool(size=4, max_context_len=1088, device="cpu", enable_memory_saver=False)
    pool = HiSparseDSATokenToKVPool(
        size, page_size=PAGE, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=16,
        layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False,
        kv_cache_dim=80, host_to_device_ratio=2)
    alloc = HiSparseTokenToKVPoolAllocator(size, page_size=PAGE, dtype=torch.bfloat16,
                                           device="cpu", kvcache=pool, need_sort=False,
                                           host_to_device_ratio=2)
    coord = hc.HiSparseCoordinator(req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                                   top_k=TOP_K, device_buffer_size=H, device="cpu",
                                   tp_group=dist.group.WORLD)
    loads: list[tuple[list[int], list[int], int]] = []
    # stand-ins for the two copy kernels (CPU has none): record the host loads, skip backups
    coord.mem_pool_host.load_to_device_per_layer = (
        lambda device_pool, host_locs, buffer_locs, layer_id, io_backend="kernel":
        loads.append((host_locs.tolist(), buffer_locs.tolist(), layer_id)))
    coord._eager_backup_previous_token = lambda *a, **kw: None
    yield types.SimpleNamespace(torch=torch, coord=coord, alloc=alloc, rtp=rtp, loads=loads)
    mp.undo()
    if own_pg:
        dist.destroy_process_group()


def _admit(sgl, idx: int, prompt: int, total: int):
    """A staged request: logical locs for the whole run, device rows for the prompt, the
    host mirror for every position, then SGLang's alloc_device_buffer."""
    coord, alloc = sgl.coord, sgl.alloc
    pages = -(-total // PAGE) * PAGE
    logical = alloc.logical_attn_allocator.alloc(pages)[:total]
    device = alloc.hisparse_attn_allocator.alloc(-(-prompt // PAGE) * PAGE)[:prompt]
    alloc.full_to_hisparse_device_index_mapping[logical[:prompt]] = device
    sgl.rtp.req_to_token[idx, :total] = logical.to(sgl.rtp.req_to_token.dtype)
    coord.mem_pool_host.alloc_paged_token_slots(
        coord.req_to_host_pool, coord.req_to_host_pool_allocated_len, idx, 0, total)
    req = types.SimpleNamespace(rid=f"r{idx}", extend_end=prompt,
                                kv=types.SimpleNamespace(kv_allocated_len=prompt,
                                                         req_pool_idx=idx))
    coord.alloc_device_buffer(req)
    for layer in range(LAYERS):  # the state HiSparseBuffer starts from
        assert coord.req_device_buffer_tokens[layer, idx, :H].tolist() == list(range(H))
        assert coord.lru_slots[layer, idx].tolist() == list(range(H))
    return req


def _drive(sgl, idx: int, prompt: int, selections) -> dict:
    """Decode steps of one request: SGLang's map_last_loc_to_buffer, naive_load_topk and the
    kernel transcription on the coordinator's tables, against HiSparseBuffer per layer."""
    torch, coord = sgl.torch, sgl.coord
    bufs = [HiSparseBuffer(H) for _ in range(LAYERS)]
    n = {"steps": 0, "short": 0, "long": 0, "hits": 0, "misses": 0, "naive_loads": 0}
    for t, per_layer in enumerate(selections):
        seq_len = prompt + t + 1
        q = seq_len - 1
        ridx = torch.tensor([idx])
        lens = torch.tensor([seq_len])
        coord.map_last_loc_to_buffer(lens, sgl.rtp.req_to_token[idx, q:q + 1].to(torch.int64),
                                     ridx, lens.clone(), ridx.clone())
        for layer in range(LAYERS):
            sel = np.asarray(per_layer[layer], dtype=np.int64)
            top_k = torch.from_numpy(sel).to(torch.int32)[None]
            sgl.loads.clear()
            naive = coord.naive_load_topk(ridx, lens, top_k, layer)[0].tolist()
            locs = coord.req_device_buffer_token_locs[layer, idx].tolist()
            lru = coord.lru_slots[layer, idx].tolist()
            tokens = coord.req_device_buffer_tokens[layer, idx].tolist()
            kernel, m = _kernel_swap_in(lru, tokens, locs, sel.tolist(), seq_len, H)
            coord.lru_slots[layer, idx] = torch.tensor(lru, dtype=torch.int16)
            coord.req_device_buffer_tokens[layer, idx] = torch.tensor(tokens, dtype=torch.int32)
            b = bufs[layer]
            hits, misses = b.step(sel, q)
            # decisions, slot assignment and LRU state equal the kernel's on SGLang's tables
            assert (hits, misses) == (TOP_K - m, m), (t, layer)
            assert [locs[s] for s in b.last_slots] == kernel, (t, layer)
            assert b.lru.tolist() == coord.lru_slots[layer, idx].tolist()
            assert b.tokens.tolist() == coord.req_device_buffer_tokens[layer, idx, :H].tolist()
            if seq_len <= H:  # naive_load_topk is exact here: position p -> device slot p
                assert naive == kernel and not sgl.loads and misses == 0
                n["short"] += 1
            else:
                newest = sel == q
                reserved = int(coord.req_to_device_buffer[idx, H])
                assert [naive[i] for i in np.flatnonzero(newest)] == [reserved] * int(newest.sum())
                assert locs[H] == reserved  # the model's slot H is SGLang's reserved row
                loaded = sgl.loads[0][0] if sgl.loads else []
                host = coord.req_to_host_pool[idx].tolist()
                assert loaded == [host[p] for p in sel[~newest]]  # no cache: every one reloads
                assert {host[p] for p in b.last_misses} <= set(loaded)
                n["long"] += 1
                n["naive_loads"] += len(loaded)
            n["hits"] += hits
            n["misses"] += misses
        n["steps"] += 1
    return n


@pytest.mark.sglang
def test_equals_sglang_on_random_local_selections(sgl):
    rng = np.random.default_rng(1)
    prompt, steps = TOP_K + 1, 200  # crosses seq_len = H at step 63
    _admit(sgl, 1, prompt, prompt + steps)
    hot = rng.choice(prompt + steps, 10, replace=False)
    sels = [[_local_selection(rng, prompt + t + 1, TOP_K, hot) for _ in range(LAYERS)]
            for t in range(steps)]
    n = _drive(sgl, 1, prompt, sels)
    assert n["short"] > 0 and n["long"] > 0 and n["misses"] > 0 and n["hits"] > n["misses"]
    assert n["naive_loads"] > n["misses"]  # the stateless reference reloads what LRU kept


@pytest.mark.sglang
def test_equals_sglang_on_a_real_trace(sgl):
    trace = load_trace(TYPING_TRACE)  # positions 64.., k = 64 = TOP_K
    assert trace.k == TOP_K
    start, steps = 40, 160  # prompt 104 < H: the short path, then 136 long steps
    prompt = int(trace.positions[start])
    _admit(sgl, 2, prompt, prompt + steps)
    layers = [0, 15]
    sels = [[trace.selections[lay, start + t] for lay in layers] for t in range(steps)]
    assert all(int(trace.positions[start + t]) == prompt + t for t in range(steps))
    n = _drive(sgl, 2, prompt, sels)
    assert n["short"] > 0 and n["long"] > 0 and 0 < n["misses"] < n["hits"]
