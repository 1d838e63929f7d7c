"""The plugin's start-up errors, without SGLang: the launcher's command line read before it is
parsed, a hook target's missing dependency named (not SGLang's misleading AttributeError), and
an uncaught ulacache refusal in the launcher reported as one line with exit status 2."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ulacache.patches import plugin
from ulacache.patches.verify import ExpectedHook, HookVerificationError, unimportable, verify_hooks


@pytest.mark.parametrize("argv, want", [
    ([], None),
    (["--model-path", "m"], None),
    (["--kv-backend", "ulacache"], "ulacache"),
    (["--kv-backend=ulacache", "--port", "1"], "ulacache"),
    (["--kv-backend", "hisparse", "--kv-backend", "ulacache"], "ulacache"),
    (["--kv-backend"], None),
])
def test_the_backend_is_read_off_the_command_line(argv, want):
    assert plugin.argv_kv_backend(argv) == want


def test_a_target_behind_a_missing_dependency_names_the_dependency(tmp_path, monkeypatch):
    """SGLang reports ``module 'pkg' has no attribute 'engine'`` for a module whose import
    failed; the verifier names the dependency that is missing."""
    pkg = tmp_path / "ula_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("import ula_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    target = "ula_probe_pkg.engine.Engine.server_args_class"
    module, err = unimportable(target)
    assert module == "ula_probe_pkg.engine" and err.name == "ula_no_such_dependency"
    assert unimportable("ula_probe_pkg.no_such_attribute") is None
    with pytest.raises(HookVerificationError) as info:
        verify_hooks([ExpectedHook(target, object, "replace")])
    line = plugin.one_line(info.value)
    assert line.startswith("ulacache: error: SGLang did not apply ulacache's hook on "
                           "ula_probe_pkg.engine.Engine.server_args_class")
    assert "ula_probe_pkg.engine cannot be imported" in line
    assert "No module named 'ula_no_such_dependency'" in line and "\n" not in line


def test_an_uncaught_refusal_in_the_launcher_is_one_line_exit_2():
    """What ``python -m sglang.launch_server`` does after the plugin ran: a ConfigError
    (wrapped, as SGLang may re-raise it) ends the process as one line; anything else keeps
    Python's traceback."""
    code = textwrap.dedent("""
        import sys
        from ulacache.errors import ConfigError
        from ulacache.patches import plugin
        plugin.one_line_errors()
        plugin.one_line_errors()  # idempotent
        try:
            raise ConfigError("--kv-backend ulacache needs a DSA model;\\n got Llama")
        except ConfigError as e:
            if sys.argv[1] == "wrapped":
                raise RuntimeError("launch failed") from e
            if sys.argv[1] == "other":
                raise KeyError("not ours") from None
            raise
    """)
    for how in ("plain", "wrapped"):
        p = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2, p
        assert p.stderr == "ulacache: error: --kv-backend ulacache needs a DSA model; got " \
                           "Llama\n", p.stderr
    p = subprocess.run([sys.executable, "-c", code, "other"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "Traceback" in p.stderr and "KeyError" in p.stderr
