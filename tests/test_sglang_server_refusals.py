"""Start-up refusals of ``python -m sglang.launch_server --kv-backend ulacache`` on CPU, through
the launcher itself: each must stop before serving with one ``ulacache: error: ...`` line on
stderr and exit status 2 (no traceback). A file of its own so CI's server stage runs these
launches beside the serving tests (test_sglang_server.py has the harness notes).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")
try:  # the server packages (requirements/sglang-server.txt)
    import jsonschema  # noqa: F401
    import xgrammar  # noqa: F401
except ImportError as e:
    pytest.skip(f"SGLang's server packages are missing ({e}): pip install --no-deps -r "
                "requirements/sglang-server.txt", allow_module_level=True)

from tests.sglang_server.harness import run_launch, write_model  # noqa: E402
from tests.test_sglang_server import ULA  # noqa: E402

pytestmark = pytest.mark.sglang_server


@pytest.fixture(scope="module")
def dsa_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("sglang_refusals") / "dsa",
                       "DeepseekV32ForCausalLM")


# -- start-up refusals through launch_server itself -----------------------------------------
@pytest.fixture(scope="module")
def refusals(dsa_model) -> dict:
    """Launches that must refuse before serving, run at once (each is mostly SGLang's import
    time): a bad --ulacache-config, a model without sparse attention, a server dependency
    missing (uvloop: SGLang cannot import its engine module and only logs that its hooks
    failed), deployments not built (PD decode, pipeline stages, context-parallel attention,
    NGRAM's tree drafts: one launch, one line naming all four) and the radix cache left on."""
    from concurrent.futures import ThreadPoolExecutor

    llama = write_model(dsa_model.parent / "llama", "LlamaForCausalLM")
    launches = {
        "config": lambda: run_launch(dsa_model, ULA + ["--ulacache-config", '{"cpu_ratio": -1}']),
        "model": lambda: run_launch(llama, ["--kv-backend", "ulacache", "--disable-radix-cache"],
                                    dsa=False),
        "dependency": lambda: run_launch(dsa_model, ULA,
                                         env={"ULA_TEST_BLOCK_MODULES": "uvloop"}),
        "not built": lambda: run_launch(dsa_model, ULA + [
            "--disaggregation-mode", "decode", "--pp-size", "2", "--attn-cp-size", "2",
            "--speculative-algorithm", "NGRAM"]),
        "radix": lambda: run_launch(dsa_model, ["--kv-backend", "ulacache"]),
    }
    with ThreadPoolExecutor(len(launches)) as ex:
        futures = {name: ex.submit(fn) for name, fn in launches.items()}
        return {name: f.result() for name, f in futures.items()}


def _one_line(p) -> str:
    """The launch's last stderr line (SGLang logs before it), which must be the whole error."""
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert lines, p
    return lines[-1]


def test_a_bad_ulacache_config_exits_with_one_line(refusals):
    p = refusals["config"]
    line = _one_line(p)
    assert p.returncode == 2 and line.startswith("ulacache: error: "), (p.returncode, line)
    assert "cpu_ratio" in line and "Traceback" not in p.stderr


def test_a_model_without_sparse_attention_is_refused_with_one_line(refusals):
    p = refusals["model"]
    line = _one_line(p)
    assert p.returncode == 2 and line.startswith("ulacache: error: --kv-backend ulacache "
                                                 "needs a DSA"), (p.returncode, line)
    assert "Traceback" not in p.stderr


def test_a_missing_server_dependency_stops_a_ulacache_launch(refusals):
    """It used to start without ulacache (SGLang logs and swallows a plugin's Exception)."""
    p = refusals["dependency"]
    line = _one_line(p)
    assert p.returncode == 2 and line.startswith("ulacache: error: "), (p.returncode, line)
    assert "sglang.srt.entrypoints.engine cannot be imported" in line and "uvloop" in line


def test_deployments_not_built_are_refused_at_launch_with_one_line(refusals):
    """--disaggregation-mode decode used to start and then crash at disaggregation/decode.py
    reading mem_pool_host; pipeline stages, context-parallel attention and NGRAM's tree
    drafts are not built."""
    p = refusals["not built"]
    line = _one_line(p)
    assert p.returncode == 2 and line.startswith("ulacache: error: "), (p.returncode, line)
    for flag in ("--disaggregation-mode decode", "--pp-size 2", "--attn-cp-size 2",
                 "--speculative-algorithm NGRAM"):
        assert flag in line, (flag, line)
    assert "Traceback" not in p.stderr


def test_the_radix_cache_left_on_is_refused_with_one_line(refusals):
    p = refusals["radix"]
    line = _one_line(p)
    assert p.returncode == 2 and line.startswith("ulacache: error: "), (p.returncode, line)
    assert "--disable-radix-cache" in line and "Traceback" not in p.stderr
