"""ulacache in a real SGLang 0.5.23 server on CPU, the other modes: GLM-5's architecture
(GlmMoeDsaForCausalLM) with ``validate: true`` (host checks on every step), against SGLang's
stock pool serving the same model; the DP prefill stage (a prompt 2.5x the GPU pool, served
in 64-token chunks, against the stock pool at the same chunk size); TP mode is in
test_sglang_server_tp.py (it uses this file's ``TP_ENV``). See
test_sglang_server.py for the harness, the stand-ins and why token identity is checked on
batches both servers run alike.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")
try:  # the server packages (requirements/sglang-server.txt)
    import jsonschema  # noqa: F401
    import xgrammar  # noqa: F401
except ImportError as e:
    pytest.skip(f"SGLang's server packages are missing ({e}): pip install --no-deps -r "
                "requirements/sglang-server.txt", allow_module_level=True)

from tests.sglang_server.harness import write_model  # noqa: E402
from tests.test_sglang_server import (  # noqa: E402
    BATCH,
    COMMON,
    CPU_RATIO,
    GPU_TOKENS,
    LONG,
    STOCK,
    ULA,
    _start,
    generate,
    metric,
    prompt,
    tokens,
)

pytestmark = pytest.mark.sglang_server

# new tokens per request: CI's server stage is CPU-bound (2 cores for two servers' ranks). The
# long prompts alone are past each GPU pool (rows move between tiers on every step); the batch's
# history, 304 + 4 x 64 = 560 tokens, gives each TP rank 280 peers' rows, past its 260-row
# buffer (4 requests x 65), so peers' rows are fetched (with 32 new tokens they all stay
# buffered and nothing crosses ranks)
NEW_LONG, NEW_BATCH = 48, 64

TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank (2 cores here)
          "SGLANG_DSA_TOPK_BROADCAST": "1"}  # every rank selects rank 0's top-k (TP mode's rule)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang_server_modes")


def _pair(tmp, name, model, stock_flags, ula_flags, env=None, new_batch=NEW_BATCH):
    """(stock tokens, ulacache run) for the same workloads; the stock server is stopped
    before ulacache's starts (two cores)."""
    stock = _start(tmp, f"{name}-stock", model, COMMON + STOCK + stock_flags, env)
    try:
        ref = {"long": [tokens(generate(stock.srv, p, NEW_LONG)) for p in LONG[:2]],
               "batch": tokens(generate(stock.srv, BATCH, new_batch))}
    finally:
        stock.srv.stop()
    return ref, _start(tmp, f"{name}-ula", model, COMMON + ULA + ula_flags, env)


@pytest.fixture(scope="module")
def glm(tmp):
    model = write_model(tmp / "glm", "GlmMoeDsaForCausalLM")
    ref, run = _pair(tmp, "glm", model, [], ["--ulacache-config", json.dumps(
        {"cpu_ratio": CPU_RATIO, "validate": True})])
    yield ref, run
    run.srv.stop()
    checks, failures = run.integrity()
    assert checks > 0 and not failures, failures[:3]


def test_glm5_with_validate_matches_the_stock_pool(glm):
    """GlmMoeDsaForCausalLM (interleaved rope, indexer too) with every host check on."""
    ref, run = glm
    assert [tokens(generate(run.srv, p, NEW_LONG)) for p in LONG[:2]] == ref["long"]
    assert tokens(generate(run.srv, BATCH, NEW_BATCH)) == ref["batch"]
    text = run.metrics()
    assert metric(text, "ulacache_promotions") > 0 and metric(text, "ulacache_invalid") == 0


STAGED_PROMPT = prompt(800, 31)  # 2.5x the 320-token GPU pool; the stage holds 4,096 (context)


@pytest.fixture(scope="module")
def staged(tmp):
    """The DSA model, both servers at --chunked-prefill-size 64 (the same chunks: the same
    arithmetic); ulacache's pool of 320 tokens can hold such a chunk, so its prefill stage is
    on (the model's context length, 4,096 tokens)."""
    model = write_model(tmp / "staged", "DeepseekV32ForCausalLM")
    chunk = ["--chunked-prefill-size", "64"]
    stock = _start(tmp, "staged-stock", model, COMMON + STOCK + chunk)
    try:
        ref = tokens(generate(stock.srv, STAGED_PROMPT, 24))
    finally:
        stock.srv.stop()
    run = _start(tmp, "staged-ula", model, COMMON + ULA + chunk + [
        "--ulacache-config", json.dumps({"cpu_ratio": CPU_RATIO, "validate": True})])
    yield ref, run
    run.srv.stop()
    checks, failures = run.integrity()
    assert checks > 0 and not failures, failures[:3]


def test_a_prompt_longer_than_the_gpu_pool_is_served_through_the_prefill_stage(staged):
    """Without the stage this prompt is refused ("exceeds the KV memory budget",
    test_sglang_server.py); with it, the chunks past the pool read their selections from the
    stage and the decode promotes the spilled rows: the stock pool's tokens."""
    ref, run = staged
    assert len(STAGED_PROMPT) > 2 * GPU_TOKENS
    assert "ulacache: prefill stage of 4096 rows" in Path(run.srv.log_path).read_text()
    assert tokens(generate(run.srv, STAGED_PROMPT, 24)) == ref
    time.sleep(1.2)  # the metrics bridge exports at most once a second, during a step:
    generate(run.srv, STAGED_PROMPT[:40], 2)  # a later step publishes the decode's counters
    text = run.metrics()
    assert metric(text, "ulacache_spills") > 0 and metric(text, "ulacache_promotions") > 0
    assert metric(text, "ulacache_invalid") == 0
