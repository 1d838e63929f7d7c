"""ulacache in a real SGLang 0.5.23 server on CPU: ``python -m sglang.launch_server --device cpu
--kv-backend ulacache`` with tiny random-weight DSA models (DeepseekV32ForCausalLM,
GlmMoeDsaForCausalLM), through HTTP, against SGLang's stock pool serving the same model.

The GPU-only points of SGLang's DSA path run as pure-torch stand-ins
(tests/sglang_server/site/cpu_stand_ins.py, unit-tested in test_cpu_stand_ins.py); the server,
scheduler, allocator, prefill budget, ulacache's pool, allocator and coordinator are the real
ones. ulacache's GPU pool is a few pages, far below the requests' history, so rows move
between tiers on every step (its counters are read from SGLang's own ``/metrics``), and its
invariants are checked inside the scheduler after every free and every few decode steps
(tests/sglang_server/site/ulacache_probe.py).

Token identity is checked where both servers run the same batches (one request at a time, or
one ``/generate`` call carrying the whole batch, which both admit in one prefill): SGLang's CPU
kernels are not batch-invariant, so a batch split differently could differ in the last bits
on either pool. Where ulacache's admission changes the batches (aborts, retraction, the load
run) the checks are completion, counters, invariants, and a probe request whose tokens must
not change.

Marked ``sglang_server`` (CI's server stage): needs SGLang 0.5.23 and its server packages
(``pip install --no-deps -r requirements/sglang-server.txt``). Runs on CPU.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")
try:  # the server packages (SGLang's HTTP server imports them; requirements/sglang-server.txt)
    import jsonschema  # noqa: F401
    import xgrammar  # noqa: F401
except ImportError as e:
    pytest.skip(f"SGLang's server packages are missing ({e}): pip install --no-deps -r "
                "requirements/sglang-server.txt", allow_module_level=True)

from tests.sglang_server.harness import INDEX_TOPK, Server, write_model  # noqa: E402

pytestmark = pytest.mark.sglang_server

GPU_TOKENS = 320  # ulacache's GPU pool: 5 pages per layer (a request's history is several times)
CPU_RATIO = 3  # unique capacity 4 x 320 = 1280 tokens
COMMON = ["--max-running-requests", "4", "--enable-metrics"]
ULA = ["--kv-backend", "ulacache", "--disable-radix-cache", "--max-total-tokens",
       str(GPU_TOKENS)]
STOCK = ["--max-total-tokens", "4096"]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1024) for _ in range(n)]


LONG = [prompt(300, 1), prompt(230, 2), prompt(150, 3)]  # single requests, history > GPU pool
BATCH = [prompt(n, 10 + i) for i, n in enumerate((120, 90, 64, 30))]  # sum 304 <= 320
PROBE = prompt(100, 99)


def generate(srv: Server, ids, max_new: int, **extra) -> list | dict:
    status, out = srv.post("/generate", {
        "input_ids": ids, **extra,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}})
    assert status == 200, (status, out)
    return out


def tokens(out) -> list:
    return [o["output_ids"] for o in out] if isinstance(out, list) else out["output_ids"]


def metric(text: str, name: str) -> float:
    """Sum of every series of ``name`` in a Prometheus text exposition."""
    return sum(float(m.group(1)) for m in
               re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def integrity(log_prefix: Path) -> tuple[int, list[str]]:
    """(checks made, failures) of ulacache_probe.py's log files."""
    checks, failures = 0, []
    for f in log_prefix.parent.glob(log_prefix.name + ".*"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            checks += 1
            if not rec["ok"]:
                failures.append(f"{rec['event']}: {rec['error']}")
    return checks, failures


class Run:
    """A started server plus what its probe logs."""

    def __init__(self, srv: Server, log: Path | None):
        self.srv, self.log = srv, log

    def integrity(self) -> tuple[int, list[str]]:
        return integrity(self.log)

    def metrics(self) -> str:
        status, text = self.srv.get("/metrics")
        assert status == 200
        return text


def _start(tmp: Path, name: str, model: Path, flags: list[str], env: dict | None = None
           ) -> Run:
    log = tmp / f"{name}-integrity"
    env = {**(env or {}), "ULA_INTEGRITY_LOG": str(log)}
    srv = Server(model, flags, env, log_path=tmp / f"{name}.log")
    srv.start()
    try:
        srv.wait_healthy()
    except Exception:
        srv.stop()
        raise
    return Run(srv, log)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang_server")


@pytest.fixture(scope="module")
def dsa_model(tmp) -> Path:
    return write_model(tmp / "dsa", "DeepseekV32ForCausalLM")


@pytest.fixture(scope="module")
def stock(tmp, dsa_model):
    run = _start(tmp, "stock", dsa_model, COMMON + STOCK)
    yield run
    run.srv.stop()


@pytest.fixture(scope="module")
def ula(tmp, dsa_model):
    run = _start(tmp, "ula", dsa_model, COMMON + ULA + [
        "--ulacache-config", json.dumps({"cpu_ratio": CPU_RATIO})])
    yield run
    run.srv.stop()
    checks, failures = run.integrity()
    assert checks > 0 and not failures, failures[:3]


@pytest.fixture(scope="module")
def reference(stock) -> dict:
    """The stock pool's tokens for every workload compared below."""
    return {
        "long": [tokens(generate(stock.srv, p, 96)) for p in LONG],
        "batch": tokens(generate(stock.srv, BATCH, 64)),
        "probe": tokens(generate(stock.srv, PROBE, 32)),
    }


# -- token identity -------------------------------------------------------------------------
def test_single_requests_longer_than_the_gpu_pool_match_the_stock_pool(ula, reference):
    """300 + 96 tokens of history in a 320-token GPU pool: the decode spills the prompt to
    the CPU tier and every step's top-k promotes rows back."""
    before = ula.metrics()
    got = [tokens(generate(ula.srv, p, 96)) for p in LONG]
    assert got == reference["long"]
    after = ula.metrics()
    assert metric(after, "ulacache_promotions") > metric(before, "ulacache_promotions") > -1
    assert metric(after, "ulacache_spills") > 0 and metric(after, "ulacache_writebacks") > 0


def test_a_batch_of_mixed_lengths_matches_the_stock_pool(ula, reference):
    """One /generate call with four prompts (304 tokens: one prefill batch on both servers),
    64 new tokens each: 560 tokens of history in the 320-token pool."""
    assert tokens(generate(ula.srv, BATCH, 64)) == reference["batch"]


# -- refusal, abort, retraction -------------------------------------------------------------
def test_a_prompt_that_can_never_fit_is_refused_and_the_server_serves_on(ula, reference):
    """A prompt longer than the GPU pool (its prefill needs every token GPU-resident) is
    refused with SGLang's own message; the server stays healthy and serves the next one."""
    status, out = ula.srv.post("/generate", {
        "input_ids": prompt(GPU_TOKENS + 60, 5),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}})
    text = json.dumps(out)
    assert "exceeds the KV memory budget" in text, (status, out)
    assert ula.srv.get("/health_generate")[0] == 200
    assert tokens(generate(ula.srv, PROBE, 32)) == reference["probe"]


def test_abort_in_the_middle_of_generation_keeps_every_invariant(ula, reference):
    result: dict = {}

    def long_request():
        result["out"] = generate(ula.srv, prompt(200, 7), 400, rid="abort-me")

    th = threading.Thread(target=long_request)
    th.start()
    time.sleep(2.0)  # it is decoding by now
    status, _ = ula.srv.post("/abort_request", {"rid": "abort-me"})
    th.join(60)
    assert status == 200 and not th.is_alive()
    reason = result["out"]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and len(result["out"]["output_ids"]) < 400, reason
    checks, failures = ula.integrity()
    assert checks > 0 and not failures, failures[:3]
    assert tokens(generate(ula.srv, PROBE, 32)) == reference["probe"]


def test_retraction_keeps_every_invariant_and_every_request(tmp, dsa_model, reference):
    """SGLang's scheduler retracts decoding requests (frees their KV, requeues them, prefills
    prompt + generated tokens again later). SGLang's admission is conservative enough that
    this workload never fills the pool on its own, so its own test switch forces the
    retraction (``SGLANG_TEST_RETRACT``: every 10 decode steps, ``scheduler.py:4477``, the
    same ``retract_decode`` path as under memory pressure). Every request completes with all
    its tokens, at least one was retracted, the invariants hold throughout, and the probe is
    unchanged."""
    run = _start(tmp, "retract", dsa_model, COMMON + ULA + [
        "--ulacache-config", json.dumps({"cpu_ratio": CPU_RATIO})],
        env={"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "10"})
    try:
        work = [prompt(40, 20 + i) for i in range(4)]
        outs = generate(run.srv, work, 40)  # 3+ retractions at one per 10 decode steps
        assert [len(o["output_ids"]) for o in outs] == [40] * 4
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 4
        assert tokens(generate(run.srv, PROBE, 32)) == reference["probe"]
        log = Path(run.srv.log_path).read_text()
        retracted = [int(n) for n in re.findall(r"Testing retraction\. #retracted_reqs: (\d+)",
                                                log)]
        assert sum(retracted) > 0, "no request was retracted"
    finally:
        run.srv.stop()
    checks, failures = run.integrity()
    assert checks > 0 and not failures, failures[:3]


# -- load, metrics ---------------------------------------------------------------------------
def test_a_bounded_load_run_completes_every_request(ula):
    """64 requests of 20-220 tokens, 8 at a time over HTTP (the server runs 4): every one
    completes with all its tokens, and ulacache masked nothing (no overflow, no invalid)."""
    rng = random.Random(3)
    work = [(prompt(rng.randrange(20, 220), 100 + i), rng.randrange(4, 24)) for i in range(64)]
    done: list = [None] * len(work)
    lock = threading.Lock()
    todo = list(range(len(work)))

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            ids, n = work[i]
            done[i] = len(generate(ula.srv, ids, n)["output_ids"]) == n

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    assert all(done), [i for i, ok in enumerate(done) if not ok]
    text = ula.metrics()
    for name in ("ulacache_access_overflow", "ulacache_place_overflow", "ulacache_invalid"):
        assert metric(text, name) == 0, name


def test_ulacache_metrics_are_in_sglang_s_own_scrape(ula):
    text = ula.metrics()
    assert "sglang:" in text  # SGLang's registry
    for name in ("ulacache_accesses", "ulacache_gpu_hits", "ulacache_promotions",
                 "ulacache_gpu_used_slots", "ulacache_bytes_moved"):
        assert re.search(rf'^{name}{{[^}}]*group="0"[^}}]*rank="0"', text, re.M), name
    assert metric(text, "ulacache_accesses") > metric(text, "ulacache_gpu_hits") > 0


def test_the_index_topk_of_the_tiny_model_is_below_the_prompts():
    assert max(len(p) for p in LONG) > INDEX_TOPK and max(len(p) for p in BATCH) > INDEX_TOPK
