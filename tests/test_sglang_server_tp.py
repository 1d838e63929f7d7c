"""ulacache in a real SGLang 0.5.23 server on CPU in TP mode: two ranks (``--tp-size 2``,
gloo) stripe the address space, against SGLang's stock pool serving the same model in the
same parallel layout (a file of its own so CI's server stage runs it beside the others).
See test_sglang_server_modes.py and test_sglang_server.py for the harness.

Both index-K layouts run against one stock reference: SGLang's replicated store, and
``stripe_index_k`` (each rank stores and scores every other page, page-classed allocation).

TP on SGLang's CPU engine needs one stand-in (cpu_stand_ins.py section 11: no PyNccl
communicator on CPU) and ``SGLANG_CPU_OMP_THREADS_BIND`` (one core per rank).
"""

from __future__ import annotations

import json
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
    LONG,
    STOCK,
    ULA,
    _start,
    generate,
    metric,
    tokens,
)
from tests.test_sglang_server_modes import NEW_LONG, TP_ENV  # noqa: E402

# the batch's history, 304 + 4 x 128 = 816 tokens, gives each rank 408 peers' rows against its
# 260-row buffer (4 requests x 65): with 64 new tokens (280 rows) whether an evicted copy was
# selected again depended on the batch's timing, and the test was flaky
TP_BATCH = 128

pytestmark = pytest.mark.sglang_server


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang_server_tp")


@pytest.fixture(scope="module")
def model(tmp):
    return write_model(tmp / "dsa", "DeepseekV32ForCausalLM")


@pytest.fixture(scope="module")
def ref(tmp, model):
    """The stock pool's tokens, TP2 (one stock run serves both ulacache layouts)."""
    stock = _start(tmp, "tp-stock", model, COMMON + STOCK + ["--tp-size", "2"], TP_ENV)
    try:
        return {"long": [tokens(generate(stock.srv, p, NEW_LONG)) for p in LONG[:2]],
                "batch": tokens(generate(stock.srv, BATCH, TP_BATCH))}
    finally:
        stock.srv.stop()


# index-K per rank: replicated (SGLang's store), or striped by page (each rank stores every
# other page and scores its own; the ranks merge their top-k candidates, issue 21)
@pytest.fixture(scope="module", params=[False, True], ids=["index_k_replicated",
                                                          "index_k_striped"])
def tp(request, tmp, model, ref):
    """A ulacache TP2 server (torn down, and its integrity log read, before the next layout's
    starts: pytest finalizes a module fixture's instance when its parameter changes).
    --max-total-tokens 384 (the last flag wins over ULA's 320) is the group's: 192 GPU
    tokens per rank, what a rank needs for its share of a decode step of 4 requests x 65
    rows with the margin for uneven steps (130 + 49 = 179; ulacache.striping.step_share_bound)."""
    striped = request.param
    config = {"mode": "tp", "cpu_ratio": CPU_RATIO, "stripe_index_k": striped}
    run = _start(tmp, f"tp-ula-{'striped' if striped else 'replicated'}", model,
                 COMMON + ULA + ["--tp-size", "2", "--max-total-tokens", "384",
                                 "--ulacache-config", json.dumps(config)], TP_ENV)
    yield striped, run
    run.srv.stop()
    checks, failures = run.integrity()
    assert checks > 0 and not failures, failures[:3]


def test_tp2_matches_the_stock_pool_and_moves_rows_between_ranks(ref, tp):
    """Two ranks stripe one address space (each owns every other token); the batch's 816
    tokens of history against 192 GPU tokens per rank: promotions on each owner; the batch's
    history overflows each rank's buffer, so peers' rows are copied between ranks. Striped
    index-K: each rank's indexer scores its own pages and the merged top-k, in the stock
    top-k's score order, gives the stock pool's tokens."""
    striped, run = tp
    assert [tokens(generate(run.srv, p, NEW_LONG)) for p in LONG[:2]] == ref["long"]
    assert tokens(generate(run.srv, BATCH, TP_BATCH)) == ref["batch"]
    text = run.metrics()
    assert metric(text, "ulacache_tp_peer_fetches") > 0
    assert metric(text, "ulacache_promotions") > 0
    for name in ("ulacache_tp_peer_missing", "ulacache_tp_buffer_overflow",
                 "ulacache_access_overflow", "ulacache_invalid"):
        assert metric(text, name) == 0, name
    assert 'rank="1"' in text  # both ranks export into SGLang's scrape
    log = Path(run.srv.log_path).read_text()
    for line in ("ulacache: index-K striped by page over 2 ranks: rank 0 stores",
                 "ulacache: index-K striped by page over 2 ranks: rank 1 stores",
                 "ulacache: logical pages drawn by page class"):
        assert (line in log) == striped, line
