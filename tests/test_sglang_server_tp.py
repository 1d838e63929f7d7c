"""ulacache in a real SGLang 0.5.23 server on CPU in TP mode: two ranks (``--tp-size 2``,
gloo) stripe the address space, against SGLang's stock pool serving the same model in the
same parallel layout (a file of its own so CI's server stage runs it beside the others).
See test_sglang_server_modes.py and test_sglang_server.py for the harness.

TP on SGLang's CPU engine needs one stand-in (cpu_stand_ins.py section 11: no PyNccl
communicator on CPU) and ``SGLANG_CPU_OMP_THREADS_BIND`` (one core per rank).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang")
try:  # the server packages (requirements/sglang-server.txt)
    import jsonschema  # noqa: F401
    import xgrammar  # noqa: F401
except ImportError as e:
    pytest.skip(f"SGLang's server packages are missing ({e}): pip install --no-deps -r "
                "requirements/sglang-server.txt", allow_module_level=True)

from tests.sglang_server.harness import write_model  # noqa: E402
from tests.test_sglang_server import BATCH, CPU_RATIO, LONG, generate, metric, tokens  # noqa: E402
from tests.test_sglang_server_modes import NEW_LONG, TP_ENV, _pair  # noqa: E402

# the batch's history, 304 + 4 x 128 = 816 tokens, gives each rank 408 peers' rows against its
# 260-row buffer (4 requests x 65): with 64 new tokens (280 rows) whether an evicted copy was
# selected again depended on the batch's timing, and the test was flaky
TP_BATCH = 128

pytestmark = pytest.mark.sglang_server


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang_server_tp")


@pytest.fixture(scope="module")
def tp(tmp):
    model = write_model(tmp / "dsa", "DeepseekV32ForCausalLM")
    # --max-total-tokens 384 (the last flag wins over ULA's 320) is the group's: 192 GPU
    # tokens per rank, what a rank needs for its share of a decode step of 4 requests x 65
    # rows with the margin for uneven steps (130 + 49 = 179; ulacache.striping.step_share_bound)
    ref, run = _pair(tmp, "tp", model, ["--tp-size", "2"], ["--tp-size", "2",
                     "--max-total-tokens", "384",
                     "--ulacache-config", json.dumps({"mode": "tp", "cpu_ratio": CPU_RATIO})],
                     TP_ENV, new_batch=TP_BATCH)
    yield ref, run
    run.srv.stop()
    checks, failures = run.integrity()
    assert checks > 0 and not failures, failures[:3]


def test_tp2_matches_the_stock_pool_and_moves_rows_between_ranks(tp):
    """Two ranks stripe one address space (each owns every other token); the batch's 816
    tokens of history against 192 GPU tokens per rank: promotions on each owner; the batch's
    history overflows each rank's buffer, so peers' rows are copied between ranks."""
    ref, run = tp
    assert [tokens(generate(run.srv, p, NEW_LONG)) for p in LONG[:2]] == ref["long"]
    assert tokens(generate(run.srv, BATCH, TP_BATCH)) == ref["batch"]
    text = run.metrics()
    assert metric(text, "ulacache_tp_peer_fetches") > 0
    assert metric(text, "ulacache_promotions") > 0
    for name in ("ulacache_tp_peer_missing", "ulacache_tp_buffer_overflow",
                 "ulacache_access_overflow", "ulacache_invalid"):
        assert metric(text, name) == 0, name
    assert 'rank="1"' in text  # both ranks export into SGLang's scrape
