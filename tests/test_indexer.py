"""Exact indexer top-k (:mod:`ulacache.indexer`): the reference equals ``refmodel.select_topk``;
the fast key path and the sharded path (shard -> local candidates -> all-gather -> merge) equal
the reference bit for bit, ties, ``-inf``, NaN, ``-0.0``, short and empty rows included; the
device path is sync-free with data-independent shapes; the exchange-cost helper's numbers."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from ulacache import indexer as ix
from ulacache.errors import ShapeError
from ulacache.oracle.refmodel import ModelGeometry, select_topk
from ulacache.tools import traces

from .test_graph_safety import OpLog

TYPING_TRACE = os.path.join(os.path.dirname(__file__), "fixtures", "typing-py-1024-k64.trace.npz")
TP_SIZES = (1, 2, 3, 4, 8)
NAN = float("nan")
ONE_UP = float(np.nextafter(np.float32(1), np.float32(2)))  # 1 + 1 ulp: a near-tie
TINY = float(np.float32(1e-45))  # smallest positive float32 denormal
# heavy ties, both zeros, both infinities, both NaN signs, near-ties and denormals
ALPHABET = [-math.inf, -2.0, -1.0, -TINY, -0.0, 0.0, TINY, 1.0, ONE_UP, 2.0, math.inf, NAN,
            -NAN]


def sharded(scores, lengths, k, tp):
    """Every rank's answer from the striped shards (stacking stands in for the all-gather)."""
    shards = [ix.shard_columns(scores, r, tp) for r in range(tp)]
    cands = [ix.local_candidates(s, p, lengths, k) for s, p in shards]

    def gather_for(rank):
        def all_gather(t):
            assert torch.equal(t, cands[rank])
            return torch.stack(cands)
        return all_gather

    outs = [ix.sharded_topk(s, p, lengths, k, gather_for(r)) for r, (s, p) in enumerate(shards)]
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), "ranks disagree"
    return outs[0]


def check_all(scores, lengths, k, tps=TP_SIZES):
    want = select_topk(scores, lengths, k)
    assert want.shape == (scores.shape[0], k)
    assert torch.equal(ix.topk_reference(scores, lengths, k), want)
    assert torch.equal(ix.topk_exact(scores, lengths, k), want)
    for tp in tps:
        got = sharded(scores, lengths, k, tp)
        assert torch.equal(got, want), f"P={tp} k={k} lengths={lengths.tolist()}"
    return want


@st.composite
def cases(draw, alphabet=ALPHABET, max_len=24):
    bs = draw(st.integers(1, 4))
    width = draw(st.integers(0, max_len))
    k = draw(st.integers(0, max_len + 6))
    vals = draw(st.lists(st.sampled_from(alphabet), min_size=bs * width, max_size=bs * width))
    lengths = draw(st.lists(st.integers(-1, width + 2), min_size=bs, max_size=bs))
    scores = torch.tensor(vals, dtype=torch.float32).reshape(bs, width)
    return scores, torch.tensor(lengths, dtype=torch.int64), k


# ---- reference and fast path -----------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_all_paths_equal_select_topk(case):
    check_all(*case)


@settings(max_examples=60, deadline=None)
@given(case=cases(alphabet=[-1.0, 0.0, 1.0], max_len=40), tp=st.sampled_from(TP_SIZES))
def test_massive_ties(case, tp):
    """Three values only: nearly every choice is decided by the tie-break."""
    check_all(*case, tps=(tp,))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_fixed_seed_sweep(tp):
    """Random integer scores in a tiny range (ties everywhere) with -inf and NaN sprinkled in, L
    never a multiple of P (for P > 1), every length regime: 0, < k, == L, > L."""
    g = torch.Generator().manual_seed(1000 + tp)
    for width in (1, 7, 13, 50, 97):
        if tp > 1 and width % tp == 0:
            width += 1
        scores = torch.randint(-2, 3, (6, width), generator=g).float()
        scores[torch.rand(6, width, generator=g) < 0.15] = -math.inf
        scores[torch.rand(6, width, generator=g) < 0.03] = NAN
        lengths = torch.tensor([0, 1, width // 2, width - 1, width, width + 3])
        for k in (1, 3, 16, width, width + 5):
            check_all(scores, lengths, k, tps=(tp,))


def test_continuous_scores_long_rows():
    """Distinct float32 scores (no ties) and quantised ones (ties) on longer rows."""
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(5, 1001, generator=g)
    lengths = torch.tensor([1001, 1000, 777, 64, 3])
    for s in (scores, torch.round(scores * 4) / 4):
        for k in (1, 64, 256):
            check_all(s, lengths, k)


def test_reference_on_other_dtypes():
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(-3, 4, (4, 33), generator=g).double() / 3
    lengths = torch.tensor([33, 20, 0, 5])
    for dt in (torch.float64, torch.float16, torch.bfloat16):
        s = scores.to(dt)
        want = select_topk(s, lengths, 9)
        assert torch.equal(ix.topk_reference(s, lengths, 9), want)
        if dt != torch.float64:  # fp16/bf16 widen to float32 exactly
            assert torch.equal(ix.topk_exact(s, lengths, 9), want)
            assert torch.equal(sharded(s, lengths, 9, 3), want)
    with pytest.raises(ShapeError, match="float64"):
        ix.topk_exact(scores, lengths, 9)


def test_edge_semantics():
    """The documented corner cases, spelled out."""
    inf = math.inf
    full = torch.tensor
    cases_ = [  # scores row, length, k, want
        ([0.0, -0.0], 2, 1, [0]),  # -0.0 ties with 0.0: earlier wins
        ([-0.0, 0.0], 2, 1, [0]),
        ([1.0, NAN, inf, NAN], 4, 2, [1, 3]),  # NaN above +inf, NaN ties to earlier
        ([1.0, -NAN, inf], 3, 1, [1]),  # the sign of NaN does not matter
        ([NAN, 5.0, 1.0], 1, 3, [0, -1, -1]),  # NaN past nothing; length 1
        ([1.0, 2.0, NAN], 2, 2, [0, 1]),  # masked NaN is ignored
        ([-inf, -inf, 9.0, 9.0], 2, 4, [0, 1, -1, -1]),  # eligible -inf chosen, masked never
        ([3.0, 3.0, 3.0], 3, 2, [0, 1]),  # plain ties to the earlier positions
        ([1.0, 2.0, 3.0], 0, 2, [-1, -1]),  # empty row
        ([1.0, 2.0, 3.0], -5, 1, [-1]),  # negative length
        ([1.0, 2.0, 3.0], 99, 5, [0, 1, 2, -1, -1]),  # length > L and k > L
        ([-TINY, 0.0, TINY], 3, 1, [2]),  # denormals order
    ]
    for row, length, k, want in cases_:
        s, ln = full([row]), full([length])
        assert check_all(s, ln, k).tolist() == [want], (row, length, k)


def test_order_keys_sort_like_the_reference():
    """Descending key order decodes to exactly the stable-sort order of the eligible columns,
    eligible keys are unique, and every ineligible column holds MASKED_KEY."""
    g = torch.Generator().manual_seed(11)
    scores = torch.tensor(ALPHABET)[torch.randint(len(ALPHABET), (8, 40), generator=g)]
    lengths = torch.tensor([0, 1, 5, 17, 39, 40, 41, 20])
    keys = ix.order_keys(scores, torch.arange(40), lengths)
    for b in range(8):
        n = min(max(int(lengths[b]), 0), 40)
        ref = torch.sort(scores[b, :n], descending=True, stable=True).indices
        got = ix.decode_keys(torch.sort(keys[b], descending=True).values)
        assert torch.equal(got[:n], ref)
        assert (got[n:] == -1).all() and (keys[b, n:] == ix.MASKED_KEY).all()
        assert keys[b, :n].unique().numel() == n


# ---- sharding --------------------------------------------------------------------------------

def test_shard_columns_layout():
    scores = torch.arange(14.0).reshape(2, 7)
    got = [ix.shard_columns(scores, r, 3) for r in range(3)]
    assert [p.tolist() for _, p in got] == [[0, 3, 6], [1, 4, -1], [2, 5, -1]]
    assert got[0][0].tolist() == [[0, 3, 6], [7, 10, 13]]
    assert got[1][0].tolist() == [[1, 4, -math.inf], [8, 11, -math.inf]]
    assert all(s.dtype == torch.float32 and p.dtype == torch.int64 for s, p in got)
    for width in (0, 1, 5, 16, 17):  # every column owned exactly once, at j % P
        for tp in TP_SIZES:
            pos = torch.cat([ix.shard_columns(torch.zeros(1, width), r, tp)[1] for r in range(tp)])
            owned = pos[pos >= 0]
            assert sorted(owned.tolist()) == list(range(width))
            assert all((ix.shard_columns(torch.zeros(1, width), r, tp)[1][:-1] % tp == r).all()
                       for r in range(tp))
            assert pos.numel() == tp * -(-width // tp)


def test_any_disjoint_partition_merges_exactly():
    """Exactness needs only disjoint ownership: random owners, unequal local widths, shuffled
    local column order and shuffled rank order in the gathered tensor."""
    g = torch.Generator().manual_seed(5)
    for trial in range(20):
        width, tp, k = 61, 1 + trial % 6, (1, 8, 30, 70)[trial % 4]
        scores = torch.randint(-2, 3, (3, width), generator=g).float()
        lengths = torch.tensor([width, 40, 9])
        owner = torch.randint(tp, (width,), generator=g)
        cands = []
        for r in range(tp):
            cols = (owner == r).nonzero().flatten()
            cols = cols[torch.randperm(cols.numel(), generator=g)]
            cands.append(ix.local_candidates(scores[:, cols], cols, lengths, k))
        gathered = torch.stack(cands)[torch.randperm(tp, generator=g)]
        assert torch.equal(ix.merge_candidates(gathered, k), select_topk(scores, lengths, k))


def test_merge_by_score_orders_the_same_positions_as_torch_topk_sorted():
    """``by_score``: the winners in descending score, a tie to the earlier position, ``-1``
    last. Equal to a stable sort's order with ties (the reference) and to ``torch.topk``'s
    sorted indices on distinct scores (what SGLang's torch top-k hands its attention)."""
    g = torch.Generator().manual_seed(8)
    for trial in range(20):
        width, tp, k = 53, 1 + trial % 5, (1, 9, 40, 60)[trial % 4]
        tied = trial % 2 == 0
        scores = (torch.randint(-2, 3, (3, width), generator=g).float() if tied
                  else torch.randn(3, width, generator=g))
        lengths = torch.tensor([width, 31, 4])
        owner = torch.randint(tp, (width,), generator=g)
        cands = []
        for r in range(tp):
            cols = (owner == r).nonzero().flatten()
            cands.append(ix.local_candidates(scores[:, cols], cols, lengths, k))
        got = ix.merge_candidates(torch.stack(cands), k, by_score=True)
        for b in range(3):
            n = int(lengths[b])
            order = sorted(range(n), key=lambda j: (-float(scores[b, j]), j))[:k]
            assert got[b].tolist() == order + [-1] * (k - len(order))
            if not tied:
                masked = scores[b].masked_fill(torch.arange(width) >= n, -math.inf)
                top = torch.topk(masked, min(k, width)).indices[:min(k, n)]
                assert got[b, :top.numel()].tolist() == top.tolist()
        assert torch.equal(ix.merge_candidates(torch.stack(cands), k),
                           select_topk(scores, lengths, k))  # the default order unchanged


def test_candidates_payload_and_merge_with_smaller_k():
    scores = torch.randint(-2, 3, (4, 50), generator=torch.Generator().manual_seed(2)).float()
    lengths = torch.tensor([50, 30, 3, 0])
    cands = torch.stack([ix.local_candidates(*ix.shard_columns(scores, r, 4), lengths, 20)
                         for r in range(4)])
    assert cands.shape == (4, 4, 20) and cands.dtype == torch.int64
    assert cands[0].element_size() * cands.shape[2] == ix.CANDIDATE_BYTES * 20  # 8k per row
    for k in (0, 1, 7, 20):  # fewer winners than gathered per rank: still exact
        assert torch.equal(ix.merge_candidates(cands, k), select_topk(scores, lengths, k))


# ---- real-trace scores -----------------------------------------------------------------------

def test_real_trace_scores():
    """"Real-trace scores" here: the fixtures store only selections (SmolLM2-135M over typing.py,
    top-64 per layer and step, no indexer scores), so scores are derived from them:

    - ``binary``: 1.0 on the positions the real selector chose, 0.0 on every other key ``j <= t``
      (massive ties: 64 ones and up to 960 zeros per row);
    - ``noisy``: ``4 * selected + u``, ``u`` uniform in {0, 1, 2, 3} (quantised noise: the real
      selection still wins, with ties inside and outside it), in float32 and bfloat16.

    Rows are 96 real (layer, step) pairs over 3 layers, ``L = 1024``, ``lengths = t + 1``. Both
    variants reproduce the real selection at ``k = 64``; ``k = 32`` and ``k = 100`` make the merge
    break ties inside / past the selected set. Every path must equal the reference for every P.
    """
    tr = traces.load_trace(TYPING_TRACE)
    steps = np.linspace(0, tr.positions.size - 1, 32).astype(np.int64)
    layers = (0, tr.meta.layers // 2, tr.meta.layers - 1)
    sel = torch.from_numpy(np.concatenate([tr.selections[lay, steps] for lay in layers])).long()
    lengths = torch.from_numpy(np.tile(tr.positions[steps], len(layers))).long() + 1
    width = tr.meta.n_tokens
    binary = torch.zeros(sel.shape[0], width).scatter_(1, sel.clamp(min=0), 1.0)
    noise = torch.randint(4, binary.shape, generator=torch.Generator().manual_seed(9)).float()
    for scores in (binary, 4 * binary + noise, (4 * binary + noise).bfloat16()):
        want = check_all(scores, lengths, 64)
        assert torch.equal(want, sel), "derived scores must reproduce the real selection"
        for k in (32, 100):
            check_all(scores, lengths, k)


# ---- graph safety ----------------------------------------------------------------------------

BANNED_FUNCS = {"item", "tolist", "nonzero", "argwhere", "masked_select", "unique",
                "__bool__", "equal", "numpy", "cpu", "__index__", "__int__", "__float__"}
SYNCING_OPS = {"aten.nonzero", "aten._local_scalar_dense", "aten.item", "aten.unique",
               "aten._unique2", "aten.unique_consecutive", "aten.masked_select", "aten.equal",
               "aten.is_nonzero", "aten.repeat_interleave.Tensor", "aten.argwhere"}


class FuncLog(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.names.append(name)
        if name in BANNED_FUNCS:
            raise AssertionError(f"host-syncing call {name} on the device path")
        if name in ("__getitem__", "__setitem__") and any(  # boolean-mask indexing: nonzero
                isinstance(a, torch.Tensor) and a.dtype == torch.bool
                for a in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            raise AssertionError(f"boolean-mask {name} on the device path")
        return func(*args, **(kwargs or {}))


def test_device_path_is_sync_free_and_fixed_shape():
    """No syncing call or op in topk_exact / shard / local candidates / merge / sharded_topk, and
    the same op sequence with the same output shapes for two inputs with different data (so the
    path can be captured in a CUDA graph)."""
    k, tp = 12, 3
    logs = []
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        scores = torch.randint(-2, 3, (4, 29), generator=g).float()
        scores[0, seed] = -math.inf
        scores[1, 3 + seed] = NAN
        lengths = torch.randint(0, 35, (4,), generator=g)
        others = torch.stack([ix.local_candidates(*ix.shard_columns(scores, r, tp), lengths, k)
                              for r in range(tp)])
        flog, olog = FuncLog(), OpLog()
        with flog, olog:
            exact = ix.topk_exact(scores, lengths, k)
            local, pos = ix.shard_columns(scores, 1, tp)
            got = ix.sharded_topk(local, pos, lengths, k,
                                  lambda t, o=others: torch.stack((o[0], t, o[2])))
        assert torch.equal(exact, select_topk(scores, lengths, k))
        assert torch.equal(got, exact)
        assert {"topk", "sort"} <= set(flog.names)
        assert not {op for op, _ in olog.ops} & SYNCING_OPS
        logs.append(olog.ops)
    assert logs[0] == logs[1], "op sequence or output shapes depend on the data"


# ---- cost and errors -------------------------------------------------------------------------

def test_exchange_cost():
    c = ix.exchange_cost(bs=4, k=2048, tp_size=8)
    assert c.payload_bytes == 4 * 2048 * 8 == 65536
    assert c.send_bytes == c.recv_bytes == 7 * 65536
    assert c.gathered_bytes == 8 * 65536
    assert (c.key_bytes_replicated, c.key_bytes_sharded, c.key_bytes_saved) == (132, 16.5, 115.5)
    one = ix.exchange_cost(1, 64, 1)
    assert (one.send_bytes, one.recv_bytes, one.key_bytes_saved) == (0, 0, 0)
    assert ix.exchange_cost(2, 10, 3, index_key_bytes=100).key_bytes_sharded == 100 / 3
    assert ix.INDEX_KEY_BYTES == ModelGeometry.glm5().index_key_bytes \
        == ModelGeometry.deepseek_v32().index_key_bytes
    for bad in ((-1, 4, 2), (1, -1, 2), (1, 4, 0), (1, 4, 1.5)):
        with pytest.raises(ShapeError):
            ix.exchange_cost(*bad)


def test_bad_arguments_raise_shape_error():
    s, ln = torch.zeros(2, 5), torch.tensor([5, 5])
    pos = torch.arange(5)
    bad_calls = [
        lambda: ix.topk_exact(torch.zeros(5), ln, 1),
        lambda: ix.topk_exact(torch.zeros(2, 5, dtype=torch.int64), ln, 1),
        lambda: ix.topk_exact(s, torch.tensor([5]), 1),
        lambda: ix.topk_exact(s, torch.tensor([5.0, 5.0]), 1),
        lambda: ix.topk_exact(s, ln, -1),
        lambda: ix.topk_reference(s, ln, 1.0),
        lambda: ix.shard_columns(s, 3, 3),
        lambda: ix.shard_columns(s, -1, 3),
        lambda: ix.shard_columns(s, 0, 0),
        lambda: ix.local_candidates(s, torch.arange(4), ln, 2),
        lambda: ix.local_candidates(s, pos.float(), ln, 2),
        lambda: ix.merge_candidates(torch.zeros(2, 2, 3, dtype=torch.int32), 2),
        lambda: ix.merge_candidates(torch.zeros(2, 3, dtype=torch.int64), 2),
        lambda: ix.merge_candidates(torch.zeros(2, 2, 3, dtype=torch.int64), 4),
        lambda: ix.sharded_topk(s, pos, ln, 2, lambda t: t),
    ]
    for call in bad_calls:
        with pytest.raises(ShapeError):
            call()
