"""The DSA-MLA reference model: determinism, top-k selection, selection groups, pluggable stores."""

from __future__ import annotations

import math

import pytest
import torch

from ulacache.errors import AddressError, ConfigError, ShapeError, UnknownRequest
from ulacache.oracle.refmodel import (
    DSAMLAModel,
    LatentStore,
    ModelGeometry,
    ResidentStore,
    indexer_scores,
    select_topk,
)

K = ModelGeometry.tiny().index_topk  # 32


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _brute_topk(scores: list[float], k: int) -> list[int]:
    best = sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:k]
    return sorted(best) + [-1] * (k - len(best))


class RecordingStore:
    """Resident rows in a dict; records every read and checks nothing on its own."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int, int], torch.Tensor] = {}
        self.reads: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.steps = 0

    def write(self, layer: int, req: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        for p, row in zip(positions.tolist(), rows, strict=True):
            self.rows[(layer, req, p)] = row.clone()

    def read_selected(self, layer: int, reqs: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        some = next(iter(self.rows.values()))
        out = torch.zeros(*topk.shape, some.numel(), dtype=torch.uint8)
        for b, req in enumerate(reqs.tolist()):
            for i, p in enumerate(topk[b].tolist()):
                if p >= 0:
                    out[b, i] = self.rows[(layer, req, p)]
        self.reads.append((layer, reqs.clone(), topk.clone(), out.clone()))
        return out

    def begin_step(self) -> None:
        self.steps += 1


class ScatteredStore:
    """Rows at shuffled physical slots of one shared pool, NaN bytes in padding: same bytes."""

    def __init__(self, row_bytes: int, capacity: int = 4096, seed: int = 0) -> None:
        self.pool = torch.zeros(capacity, row_bytes, dtype=torch.uint8)
        self.free = torch.randperm(capacity, generator=torch.Generator().manual_seed(seed)).tolist()
        self.slot: dict[tuple[int, int, int], int] = {}

    def write(self, layer: int, req: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        for p, row in zip(positions.tolist(), rows, strict=True):
            s = self.slot.setdefault((layer, req, p), self.free.pop())
            self.pool[s] = row

    def read_selected(self, layer: int, reqs: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor([[self.slot[(layer, r, p)] if p >= 0 else 0 for p in row]
                            for r, row in zip(reqs.tolist(), topk.tolist(), strict=True)])
        out = self.pool[idx]
        out[topk < 0] = 0xFF  # bf16 NaN / fp8 NaN: padding must never leak into attention
        return out

    def begin_step(self) -> None:
        pass


def _run(model: DSAMLAModel, store: LatentStore, steps: int = 6) -> list:
    """Three requests of different lengths (one shorter than top-k), then batched decode."""
    model.prefill(0, _tokens(45, 1), store=store)
    model.prefill(1, _tokens(7, 2), store=store)
    model.prefill(2, _tokens(33, 3), store=store)
    outs = []
    for t in range(steps):
        reqs = [0, 1, 2] if t % 2 == 0 else [2, 0]  # batch composition changes too
        outs.append(model.decode_step(reqs, _tokens(len(reqs), 100 + t), store=store))
    return outs


# ---- geometry --------------------------------------------------------------------------------
def test_presets_and_sizes() -> None:
    assert ModelGeometry.glm5().row_bytes == 656
    assert ModelGeometry.glm5(layout="bf16").row_bytes == 1152
    ds = ModelGeometry.deepseek_v32()
    assert (ds.row_bytes, ds.latent_dim, ds.index_key_bytes, ds.n_groups) == (656, 576, 132, 61)
    glm52 = ModelGeometry.glm5(layers_per_indexer=4)
    groups = glm52.selection_groups()
    assert len(groups) == glm52.n_groups == 20 and groups[-1] == [76, 77]
    assert [x for grp in groups for x in grp] == list(range(78))
    assert all(glm52.group_of(layer) == gi for gi, grp in enumerate(groups) for layer in grp)
    assert ModelGeometry.tiny().selection_groups() == [[0], [1], [2], [3]]
    assert ModelGeometry.tiny(layers_per_indexer=4).selection_groups() == [[0, 1, 2, 3]]
    assert ModelGeometry.tiny(layout="fp8").row_bytes == 104


def test_invalid_geometry_and_large_model_are_refused() -> None:
    with pytest.raises(ConfigError):
        ModelGeometry.tiny(layout="fp16")
    with pytest.raises(ConfigError):
        ModelGeometry.tiny(layers_per_indexer=0)
    with pytest.raises(ConfigError):  # rank 64 is not a multiple of 128
        ModelGeometry(**{**ModelGeometry.tiny(layout="fp8").__dict__, "fp8_block": 128})
    with pytest.raises(ConfigError):
        DSAMLAModel(ModelGeometry.deepseek_v32())


# ---- pure pieces against brute force ---------------------------------------------------------
def test_indexer_scores_match_the_formula() -> None:
    g = torch.Generator().manual_seed(0)
    q, w, keys = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, generator=g), torch.randn(
        5, 8, generator=g)
    got = indexer_scores(q, w, keys)
    for b in range(3):
        for j in range(5):
            want = sum(float(w[b, h]) * max(0.0, float(q[b, h] @ keys[j])) for h in range(2))
            assert math.isclose(float(got[b, j]), want, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_select_topk_matches_brute_force_with_ties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (6, 50), generator=g).float()  # many exact ties
    lengths = torch.tensor([1, 5, 8, 9, 30, 50])
    got = select_topk(scores, lengths, 8)
    assert got.dtype == torch.int64 and got.shape == (6, 8)
    for b in range(6):
        assert got[b].tolist() == _brute_topk(scores[b, : lengths[b]].tolist(), 8)


# ---- the model -------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_deterministic_from_seed(layout: str) -> None:
    geom = ModelGeometry.tiny(layout=layout)
    a = _run(DSAMLAModel(geom, seed=7), ResidentStore(geom.row_bytes), steps=2)
    b = _run(DSAMLAModel(geom, seed=7), ResidentStore(geom.row_bytes), steps=2)
    c = _run(DSAMLAModel(geom, seed=8), ResidentStore(geom.row_bytes), steps=2)
    for x, y, z in zip(a, b, c, strict=True):
        assert torch.equal(x.logits, y.logits) and torch.equal(x.topk, y.topk)
        assert not torch.equal(x.logits, z.logits)


@pytest.mark.parametrize("lpi", [1, 2, 4])
def test_topk_is_brute_force_of_index_scores_and_store_returns_those_rows(lpi: int) -> None:
    geom = ModelGeometry.tiny(layers_per_indexer=lpi)
    model, store = DSAMLAModel(geom, seed=3), RecordingStore()
    out = _run(model, store, steps=2)[-1]  # last step: reqs [2, 0]
    lengths = [model.length(2), model.length(0)]
    assert out.topk.shape == (geom.n_groups, 2, K) and out.attn_out.shape == (4, 2, geom.hidden)
    for gi in range(geom.n_groups):
        scores = out.index_scores[gi]
        for b, n in enumerate(lengths):
            assert bool(torch.isfinite(scores[b, :n]).all())
            assert bool(torch.isinf(scores[b, n:]).all())
            assert out.topk[gi, b].tolist() == _brute_topk(scores[b, :n].tolist(), K)
            assert len(model.index_keys([2, 0][b], gi)) == n
    # every layer of a group read exactly its group's selection, and got exactly those rows
    reads = store.reads[-geom.n_layers:]
    for layer, reqs, topk, rows in reads:
        assert reqs.tolist() == [2, 0]
        assert torch.equal(topk, out.topk[geom.group_of(layer)])
        for b, req in enumerate(reqs.tolist()):
            for i, p in enumerate(topk[b].tolist()):
                if p >= 0:
                    assert torch.equal(rows[b, i], store.rows[(layer, req, p)])


def test_shared_selection_groups() -> None:
    per_layer = _run(DSAMLAModel(ModelGeometry.tiny(), seed=5), RecordingStore(), 1)[0]
    shared_store = RecordingStore()
    model = DSAMLAModel(ModelGeometry.tiny(layers_per_indexer=4), seed=5)
    shared = _run(model, shared_store, 1)[0]
    assert shared.topk.shape[0] == 1 and per_layer.topk.shape[0] == 4
    # request 0 has 46 > 32 tokens: independent indexers pick different sets somewhere
    assert any(not torch.equal(per_layer.topk[0, 0], per_layer.topk[g, 0]) for g in range(1, 4))
    last = shared_store.reads[-4:]
    assert all(torch.equal(t, shared.topk[0]) for _, _, t, _ in last)
    # only group leaders carry indexer weights
    assert [w.index_q is not None for w in model.layers] == [True, False, False, False]


def test_padding_when_history_is_shorter_than_k() -> None:
    model = DSAMLAModel(ModelGeometry.tiny(), seed=0)
    model.prefill(9, _tokens(40, 1))
    model.prefill(4, _tokens(5, 2))
    out = model.decode_step([4, 9], torch.tensor([1, 2]))
    # request 4: six tokens (five prompt + the current one) -> all of them, then -1
    assert torch.equal(out.topk[:, 0], torch.tensor([*range(6), *[-1] * (K - 6)]).expand(4, -1))
    assert bool((out.topk[:, 1] >= 0).all()) and int(out.topk[:, 1].max()) <= 40
    assert (model.length(4), model.length(9)) == (6, 41)


@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_same_bytes_from_another_store_give_identical_outputs(layout: str) -> None:
    geom = ModelGeometry.tiny(layout=layout, layers_per_indexer=2)
    a = _run(DSAMLAModel(geom, seed=11), ResidentStore(geom.row_bytes))
    b = _run(DSAMLAModel(geom, seed=11), ScatteredStore(geom.row_bytes))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.logits, y.logits)
        assert torch.equal(x.attn_out, y.attn_out)
        assert torch.equal(x.topk, y.topk)
        assert bool(torch.isfinite(x.logits).all())


def test_prefill_is_causal_and_consistent_with_decode() -> None:
    geom = ModelGeometry.tiny()
    prompt = _tokens(40, 4)
    whole = DSAMLAModel(geom, seed=2).prefill(0, prompt)
    stepwise = DSAMLAModel(geom, seed=2)
    stepwise.prefill(0, prompt[:30])
    for t in prompt[30:-1].tolist():
        stepwise.decode_step([0], torch.tensor([t]))
    last = stepwise.decode_step([0], prompt[-1:]).logits[0]
    chunked = DSAMLAModel(geom, seed=2)
    chunked.prefill(0, prompt[:17])
    torch.testing.assert_close(chunked.prefill(0, prompt[17:]), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, whole, rtol=1e-4, atol=1e-4)


def test_batching_does_not_change_a_request() -> None:
    geom = ModelGeometry.tiny(layout="fp8")
    alone, batched = DSAMLAModel(geom, seed=6), DSAMLAModel(geom, seed=6)
    alone.prefill(1, _tokens(20, 1))
    for r, n in ((1, 20), (2, 50), (3, 3)):
        batched.prefill(r, _tokens(n, r))
    for t in range(3):
        a = alone.decode_step([1], torch.tensor([t]))
        b = batched.decode_step([3, 1, 2], torch.tensor([9, t, 9]))
        assert torch.equal(a.topk[:, 0], b.topk[:, 1])
        torch.testing.assert_close(a.logits[0], b.logits[1], rtol=1e-4, atol=1e-4)


def test_store_protocol_steps_and_errors() -> None:
    geom = ModelGeometry.tiny()
    store = ResidentStore(geom.row_bytes)
    assert isinstance(store, LatentStore)
    model = DSAMLAModel(geom, seed=0, store=store)
    model.prefill(0, _tokens(3, 0))
    model.decode_step([0], torch.tensor([5]))
    assert store.steps == 2  # begin_step once per call
    assert store.nbytes() == 4 * 4 * geom.row_bytes
    with pytest.raises(UnknownRequest):
        model.decode_step([1], torch.tensor([5]))
    with pytest.raises(ShapeError):
        model.decode_step([0, 0], torch.tensor([5, 6]))
    with pytest.raises(AddressError):
        store.read_selected(0, torch.tensor([0]), torch.tensor([[0, 7]]))
    model.free(0)
    store.free(0)
    assert model.length(0) == 0 and store.nbytes() == 0


def test_indexer_scores_of_a_key_shard_are_bit_identical_to_the_full_columns() -> None:
    """A TP rank scoring only its own keys (``j mod P == rank``) must get exactly the values
    of those columns of the full scores: the sharded top-k is then exact."""
    g = torch.Generator().manual_seed(1)
    for length in (5, 37, 300, 1001):
        q, w = torch.randn(4, 3, 16, generator=g), torch.randn(4, 3, generator=g)
        keys = torch.randn(length, 16, generator=g)
        full = indexer_scores(q, w, keys)
        for P in (2, 4, 8):
            for rank in range(P):
                assert torch.equal(indexer_scores(q, w, keys[rank::P].contiguous()),
                                   full[:, rank::P])
