"""The prefill stage under SGLang 0.5.23's classes (DP; issue 21 item 3): a request several
times longer than the GPU pool is prefilled in chunks, each chunk's attention reading its
selections from the stage (the key buffer the DSA backend gets while the forward_extend hook
marks the batch staged), then decodes with its spilled rows promoted back; every row read holds
the bytes written for its token (the contract harness's checks). The hook's decision, the
allocator's admission and refusals, and the stage's charge are checked beside it."""

from __future__ import annotations

import types

import pytest
import torch

from .test_sglang_contract import Harness, published_args  # noqa: F401  (module fixture)

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

POOL, STAGE = 320, 1500


@pytest.fixture
def staged_harness(monkeypatch):
    """A harness whose pool has a stage: SGLang's resolved --chunked-prefill-size (published
    for this module: the CPU default) is set to 128 <= the pool, as a launch must have it."""
    from ulacache.patches import sglang_pool

    monkeypatch.setattr(sglang_pool, "chunked_prefill_size", lambda: 128)
    return lambda **kw: Harness(False, n_slots=POOL, cpu_ratio=7, prefill_stage=STAGE, **kw)


@pytest.mark.parametrize("validate", [True, False], ids=["checks-on", "production"])
def test_a_request_four_times_the_pool_prefills_through_the_stage_and_decodes(validate,
                                                                              staged_harness):
    h = staged_harness(validate=validate)
    assert h.pool.usable_stage() is not None and h.pool.ula_stage.capacity == STAGE
    h.prefill(1, 1300, chunk=128)  # 4x the pool: from the third chunk on, staged
    assert h.staged_chunks == 11 - 2
    promoted = h.pool.core.counters()[0]["promotions"]
    h.prefill(2, 150, chunk=150)  # beside it, a short one: one round of the pool
    assert h.staged_chunks == 9
    assert h.pool.ula_stage.staged_from_cpu > 0  # earlier chunks' rows came from the CPU tier
    h.coord.collect_ready_reqs()
    for _ in range(4):
        h.decode_step([1, 2])  # the long request's spilled rows come back through the access
    assert h.pool.core.counters()[0]["promotions"] > promoted
    h.finish(1, "finish")
    h.finish(2, "finish")
    assert h.alloc.available_size() == h.alloc.size_full
    h.coord.destroy()


def test_admission_counts_the_stage_and_refuses_what_it_cannot_hold(staged_harness):
    h = staged_harness()
    a = h.alloc
    assert a.prefill_fits([POOL]) and a.prefill_fits([STAGE]) and a.prefill_fits([900, 600])
    assert not a.prefill_fits([STAGE + 1]) and not a.prefill_fits([900, 601])
    z = torch.zeros(1, dtype=torch.int64)
    before = a.available_size()
    n = STAGE + 1  # more than the stage holds
    assert a.alloc_extend(z, z, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]),
                          n) is None
    n = POOL + 64  # fits the stage, but its new tokens would not fit the pool
    assert a.alloc_extend(z, z, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]),
                          n) is None
    assert a.available_size() == before
    h.check()
    assert a.max_new_tokens_for_memory(STAGE + 1, 16, token_capacity=a.size_full,
                                       sliding_window_size=None, chunk_size=None) is None


def test_without_a_stage_the_long_request_is_refused_as_before():
    h = Harness(False, n_slots=POOL)  # a pool built outside SGLang's call site: no stage
    assert h.pool.ula_stage is None and h.pool.usable_stage() is None
    assert not h.alloc.prefill_fits([POOL + 1])


def test_the_forward_extend_hook_stages_long_batches_only_and_always_resets(staged_harness):
    from ulacache.patches import classes

    h = staged_harness()
    hook = classes.EXTRA_HOOKS[
        "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend"][0]
    backend = types.SimpleNamespace(token_to_kv_pool=h.pool)

    def batch(lens, verify=False):
        mode = types.SimpleNamespace(is_target_verify=lambda: verify)
        return types.SimpleNamespace(forward_mode=mode, seq_lens_cpu=torch.tensor(lens))

    def seen(self, q, k, v, layer, forward_batch, **kw):
        pool = self.token_to_kv_pool
        return pool.staging, pool.get_key_buffer(layer.layer_id).data_ptr()

    layer = types.SimpleNamespace(layer_id=2)
    stage_ptr = h.pool.ula_stage.storage.data_ptr()
    assert hook(seen, backend, "q", "k", "v", layer, batch([POOL + 1])) == (True, stage_ptr)
    assert not h.pool.staging
    pool_ptr = h.pool.kv_buffer[2].data_ptr()
    assert hook(seen, backend, "q", "k", "v", layer, batch([POOL])) == (False, pool_ptr)
    assert hook(seen, backend, "q", "k", "v", layer, forward_batch=batch([POOL + 1], True)) \
        == (False, pool_ptr)  # a verify batch takes the coordinator's path

    def boom(self, *a, **k):
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError):
        hook(boom, backend, "q", "k", "v", layer, batch([POOL + 1]))
    assert not h.pool.staging


def test_tp_mode_has_no_stage_and_a_dcp_rank_stages_its_share():
    from ulacache.config import SGLangOptions
    from ulacache.errors import ConfigError
    from ulacache.patches.launch import stage_tokens

    with pytest.raises(ConfigError, match="only for modes 'dp' and 'dcp'"):
        SGLangOptions(mode="tp", prefill_stage=100)
    assert stage_tokens(SGLangOptions(mode="tp"), 4096, 4) == 0
    # DCP: a rank's own share of the longest request, ceil(tokens / P)
    assert stage_tokens(SGLangOptions(mode="dcp"), 202_752, 8) == 25_344
    assert stage_tokens(SGLangOptions(mode="dcp", prefill_stage=101), 4096, 4) == 26
    assert stage_tokens(SGLangOptions(mode="dcp", prefill_stage=0), 4096, 4) == 0
    assert stage_tokens(SGLangOptions(), 4096) == 4096  # null: the context length
    assert stage_tokens(SGLangOptions(prefill_stage=0), 4096) == 0
    assert stage_tokens(SGLangOptions(), None) == 0


@pytest.mark.parametrize("chunk", [POOL + 1, POOL - 32, None],
                         ids=["larger-than-the-pool", "no-page-of-slack", "off"])
def test_a_chunk_the_pool_may_not_hold_turns_the_stage_off(monkeypatch, caplog, chunk):
    """Without a chunk bound the pool holds, a staged batch's new tokens could outgrow the
    pool after admission (SGLang's "Prefill out of memory"): no stage, the old rule."""
    from ulacache.patches import sglang_pool

    monkeypatch.setattr(sglang_pool, "chunked_prefill_size", lambda: chunk)
    h = Harness(False, n_slots=POOL, prefill_stage=STAGE)
    assert h.pool.usable_stage() is None and not h.alloc.prefill_fits([POOL + 1])
    assert ("prefill stage off" if chunk else "prefill stage unused") in caplog.text
    if chunk is None:  # known later (a launch resolves it after the pool is built): used
        monkeypatch.setattr(sglang_pool, "chunked_prefill_size", lambda: 128)
        assert h.pool.usable_stage() is h.pool.ula_stage and h.alloc.prefill_fits([POOL + 1])
