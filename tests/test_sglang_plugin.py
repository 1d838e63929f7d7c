"""The SGLang plugin: ``--kv-backend`` field, validation, hook registration and verification.

Needs sglang 0.5.23 (the module is skipped without it). Tests that go through SGLang's own plugin
discovery (``load_plugins()``, ``python -m sglang.launch_server``) also need the entry point
``[project.entry-points."sglang.srt.plugins"] ulacache = "ulacache.patches.plugin:register"``
installed; without it they call ``register()`` directly or skip.
"""

import importlib.machinery
import json
import logging
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import types
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

from ulacache.errors import ConfigError  # noqa: E402
from ulacache.patches import plugin  # noqa: E402
from ulacache.patches import server_args as ula_args  # noqa: E402
from ulacache.patches.verify import (  # noqa: E402
    ExpectedHook,
    HookVerificationError,
    verify_hooks,
)

pytestmark = pytest.mark.sglang

ENTRY_POINT = "ulacache.patches.plugin:register"


def _entry_point_installed() -> bool:
    return any(
        ep.name == "ulacache" and ep.value == ENTRY_POINT
        for ep in entry_points(group="sglang.srt.plugins")
    )


needs_entry_point = pytest.mark.skipif(
    not _entry_point_installed(),
    reason="entry point sglang.srt.plugins:ulacache not installed (pip install -e .)",
)


@pytest.fixture(autouse=True)
def _restore_backend_env(monkeypatch):
    """``UlaServerArgs.__post_init__`` exports the backend; undo it after each test."""
    monkeypatch.delenv(ula_args.ENV_KV_BACKEND, raising=False)


@pytest.fixture(scope="module")
def registered():
    """Run the plugin's entry point once in this process (as load_plugins() would)."""
    from sglang.srt.plugins import load_plugins

    if _entry_point_installed():
        load_plugins()
    plugin.register()  # idempotent; covers the no-entry-point case
    return plugin


def _parse(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", "dummy", "--device", "cpu", *argv])


# --------------------------------------------------------------------------- CLI and field


@needs_entry_point
def test_flag_in_launch_server_help(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--kv-backend {default,hisparse,ulacache}" in out.stdout
    assert "--ulacache-config" in out.stdout


def test_ulacache_config_help_names_every_key():
    """The --ulacache-config help lists every key SGLangOptions accepts (it omitted
    access_path), and each choice-valued key's choices."""
    import msgspec

    from ulacache.config import SGLangOptions
    from ulacache.patches.server_args import _ULACACHE_CONFIG_HELP as text

    for f in msgspec.structs.fields(SGLangOptions):
        assert f.name in text, f.name
    for choices in ("dp|tp", "pblru|lru", "auto|torch|fused"):
        assert choices in text, choices


def test_parse_kv_backend_ulacache(registered):
    args = _parse(
        ["--kv-backend", "ulacache", "--ulacache-config", '{"mode": "dp", "n_buckets": 4}']
    )
    assert type(args) is ula_args.UlaServerArgs
    assert args.kv_backend == "ulacache"
    assert args.enable_hisparse is True
    assert args.ulacache_settings() == {"mode": "dp", "n_buckets": 4}
    assert os.environ[ula_args.ENV_KV_BACKEND] == "ulacache"


def test_default_backend_leaves_hisparse_off(registered):
    args = _parse([])
    assert args.kv_backend == "default"
    assert args.enable_hisparse is False
    assert args.ulacache_config is None


def test_hisparse_backend_turns_on_hisparse(registered):
    args = _parse(["--kv-backend", "hisparse"])
    assert args.enable_hisparse is True


def test_bad_choice_exits_2_and_names_choices(registered, capsys):
    with pytest.raises(SystemExit) as info:
        _parse(["--kv-backend", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-backend" in err
    assert "'default', 'hisparse', 'ulacache'" in err


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [("{not json", "not valid JSON"), ("[1, 2]", "got a JSON list"), ('"tp"', "got a JSON str")],
)
def test_ulacache_config_must_be_json_object(registered, raw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _parse(["--kv-backend", "ulacache", "--ulacache-config", raw])


def test_ulacache_config_content_checked_by_ulacache_config(registered):
    """Key names and values are ulacache.config's business; the field hands them over."""
    config = pytest.importorskip("ulacache.config")
    if not hasattr(config, "validate_sglang_config"):
        pytest.skip("ulacache.config.validate_sglang_config not written yet")
    with pytest.raises(ConfigError):
        _parse(["--kv-backend", "ulacache", "--ulacache-config", '{"no_such_key": 1}'])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--ulacache-config", "{}"], "--ulacache-config is only read with --kv-backend ulacache"),
        (["--kv-backend", "hisparse", "--ulacache-config", "{}"], "only read with"),
        (["--kv-backend", "ulacache", "--dcp-size", "2"], "--dcp-size 2"),
        (["--kv-backend", "ulacache", "--enable-kv-cache-sharding"], "kv-cache-sharding"),
        (["--kv-backend", "ulacache", "--use-ray"], "--use-ray"),
    ],
)
def test_illegal_combinations_rejected_with_legal_ones_named(registered, argv, fragment):
    with pytest.raises(ConfigError) as info:
        _parse(argv)
    assert fragment in str(info.value)
    assert "Legal:" in str(info.value)


def test_engine_server_args_class_replaced(registered):
    from sglang.srt.entrypoints.engine import Engine

    assert Engine.server_args_class is ula_args.UlaServerArgs
    args = Engine.server_args_class(model_path="dummy", kv_backend="ulacache")
    assert args.kv_backend == "ulacache" and args.enable_hisparse is True
    with pytest.raises(ConfigError, match="must be one of default, hisparse, ulacache"):
        Engine.server_args_class(model_path="dummy", kv_backend="bogus")


def test_engine_kwarg_dict_config_is_stored_as_json(registered):
    args = ula_args.UlaServerArgs(
        model_path="dummy", kv_backend="ulacache", ulacache_config={"mode": "dp", "n_buckets": 3}
    )
    assert json.loads(args.ulacache_config) == {"mode": "dp", "n_buckets": 3}


def test_field_survives_pickle_and_is_published(registered):
    args = _parse(["--kv-backend", "ulacache", "--ulacache-config", '{"mode": "dp"}'])
    clone = pickle.loads(pickle.dumps(args))
    assert type(clone) is ula_args.UlaServerArgs
    assert (clone.kv_backend, clone.enable_hisparse, clone.ulacache_config) == (
        "ulacache",
        True,
        '{"mode": "dp"}',
    )
    from sglang.srt.arg_groups.arg_utils import namespace_of

    ns = namespace_of(ula_args.UlaServerArgs)
    assert ns["kv_backend"] == "memory" and ns["ulacache_config"] == "memory"


# --------------------------------------------------------------------------- spawned child


def _install_fake_classes_module():
    """Stand-in for ``ulacache.patches.classes`` (lead-owned) so the swap path runs."""
    import pkgutil

    module = types.ModuleType(plugin.CLASSES_MODULE)
    module.__spec__ = importlib.machinery.ModuleSpec(plugin.CLASSES_MODULE, None)
    for target, name in plugin.CLASS_TARGETS.items():
        stock = pkgutil.resolve_name(target)
        setattr(module, name, type(name, (stock,), {"__module__": plugin.CLASSES_MODULE}))
    sys.modules[plugin.CLASSES_MODULE] = module


def _child(server_args, use_entry_point, fake_classes, queue):
    """Runs in a spawned process, like SGLang's ``run_scheduler_process``."""
    try:
        import importlib.util
        import pkgutil

        real_classes = importlib.util.find_spec(plugin.CLASSES_MODULE) is not None
        if fake_classes and not real_classes:
            _install_fake_classes_module()
        if use_entry_point:
            from sglang.srt.plugins import load_plugins

            load_plugins()
        else:
            plugin.register()
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.managers import scheduler
        from sglang.srt.mem_cache import kv_cache_configurator as kvc

        swaps = {t: pkgutil.resolve_name(t).__name__ for t in plugin.CLASS_TARGETS}
        plugin.verify()
        queue.put(
            {
                "type": type(server_args).__name__,
                "kv_backend": server_args.kv_backend,
                "enable_hisparse": server_args.enable_hisparse,
                "config": server_args.ulacache_config,
                "ServerArgs": pkgutil.resolve_name(plugin.SERVER_ARGS_TARGET).__name__,
                "Engine.server_args_class": Engine.server_args_class.__name__,
                "swaps": swaps,
                "scheduler.HiSparseCoordinator": scheduler.HiSparseCoordinator.__name__,
                # the sites that build the pool and allocator, and the model runner's lazy
                # import of the coordinator (model_runner.py:1032-1042)
                "kvc.HiSparseDSATokenToKVPool": kvc.HiSparseDSATokenToKVPool.__name__,
                "kvc.HiSparseTokenToKVPoolAllocator": kvc.HiSparseTokenToKVPoolAllocator.__name__,
                "model_runner.lazy HiSparseCoordinator": importlib.import_module(
                    "sglang.srt.managers.hisparse_coordinator").HiSparseCoordinator.__name__,
                "real_classes": real_classes,
                "env": os.environ.get(ula_args.ENV_KV_BACKEND),
            }
        )
    except BaseException as exc:  # report everything, including SystemExit
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def _run_child(server_args, *, use_entry_point, fake_classes):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(server_args, use_entry_point, fake_classes, queue))
    proc.start()
    try:
        result = queue.get(timeout=300)
    finally:
        proc.join(timeout=60)
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize(
    "use_entry_point",
    [
        pytest.param(True, marks=needs_entry_point, id="load_plugins"),
        pytest.param(False, id="register"),
    ],
)
def test_spawned_child_sees_field_and_class_swaps(registered, use_entry_point):
    args = _parse(["--kv-backend", "ulacache", "--ulacache-config", '{"mode": "dp"}'])
    result = _run_child(args, use_entry_point=use_entry_point, fake_classes=True)
    assert result["type"] == "UlaServerArgs"
    assert (result["kv_backend"], result["enable_hisparse"]) == ("ulacache", True)
    assert result["config"] == '{"mode": "dp"}'
    assert result["ServerArgs"] == "UlaServerArgs"
    assert result["Engine.server_args_class"] == "UlaServerArgs"
    assert result["env"] == "ulacache"
    assert result["swaps"] == dict(plugin.CLASS_TARGETS)
    assert result["scheduler.HiSparseCoordinator"] == "UlaCacheCoordinator"
    assert result["kvc.HiSparseDSATokenToKVPool"] == "UlaCacheDSATokenToKVPool"
    assert result["kvc.HiSparseTokenToKVPoolAllocator"] == "UlaCacheTokenToKVPoolAllocator"
    assert result["model_runner.lazy HiSparseCoordinator"] == "UlaCacheCoordinator"


def test_spawned_child_keeps_stock_classes_for_hisparse(registered):
    args = _parse(["--kv-backend", "hisparse"])
    result = _run_child(args, use_entry_point=False, fake_classes=True)
    assert result["kv_backend"] == "hisparse" and result["enable_hisparse"] is True
    assert result["swaps"] == {t: t.rsplit(".", 1)[1] for t in plugin.CLASS_TARGETS}


def test_broken_classes_module_exits_when_ulacache_selected(registered, monkeypatch):
    def broken():
        raise ImportError("ulacache.patches.classes has no class UlaCacheCoordinator")

    monkeypatch.setattr(plugin, "register_class_swaps", broken)
    monkeypatch.setenv(ula_args.ENV_KV_BACKEND, "ulacache")
    with pytest.raises(SystemExit, match="is unusable"):
        plugin.register()


def test_missing_classes_module_warns(registered, caplog, monkeypatch):
    monkeypatch.setattr(plugin, "CLASSES_MODULE", "ulacache.patches.no_such_module")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.register_class_swaps() is False
    assert "does not exist yet" in caplog.text


# --------------------------------------------------------------------------- verifier


def test_our_hooks_verify(registered):
    targets = {h.target for h in plugin.expected_hooks()}
    assert {plugin.SERVER_ARGS_TARGET, plugin.ENGINE_ARGS_TARGET} <= targets
    assert plugin.VALIDATE_HISPARSE_TARGET in targets
    plugin.verify()


def test_verifier_raises_on_unresolvable_target():
    def hook(original_fn, *a, **kw):
        return original_fn(*a, **kw)

    with pytest.raises(HookVerificationError, match="cannot be resolved"):
        verify_hooks([ExpectedHook("sglang.srt.server_args.no_such_function", hook, "around")])


def test_verifier_raises_on_class_not_replaced():
    class NotInstalled:
        pass

    with pytest.raises(HookVerificationError, match=", not "):
        verify_hooks([ExpectedHook("sglang.srt.server_args.ServerArgs", NotInstalled, "replace")])


def test_verifier_raises_when_target_was_patched_first():
    """A second hook on an already-patched target is skipped by SGLang (only logged)."""
    target = "sglang.srt.server_args.compute_world_size"

    def first(original_fn, *a, **kw):
        return original_fn(*a, **kw)

    def second(original_fn, *a, **kw):
        return original_fn(*a, **kw)

    HookRegistry.register(target, first, HookType.AROUND)
    HookRegistry.apply_hooks()
    verify_hooks([ExpectedHook(target, first, "around")])
    HookRegistry.register(target, second, HookType.AROUND)
    HookRegistry.apply_hooks()
    with pytest.raises(HookVerificationError, match="does not hold the hook"):
        verify_hooks([ExpectedHook(target, second, "around")])


def test_register_exits_when_ulacache_hooks_fail(registered, monkeypatch, capsys):
    """With ulacache selected, a hook failure must stop the process (one line, exit 2), not
    just log; selected on the launcher's command line too (plugins run before parsing)."""
    broken = ExpectedHook("sglang.srt.server_args.no_such_function", lambda *a: None, "around")
    monkeypatch.setattr(plugin, "_expected", [*plugin.expected_hooks(), broken])
    monkeypatch.setenv(ula_args.ENV_KV_BACKEND, "ulacache")
    monkeypatch.setattr(plugin, "register_class_swaps", lambda: False)
    with pytest.raises(SystemExit) as info:
        plugin.register()
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("ulacache: error: SGLang did not apply")
    assert "sglang.srt.server_args.no_such_function" in err[0]
    monkeypatch.setenv(ula_args.ENV_KV_BACKEND, "")
    monkeypatch.setattr(plugin.sys, "argv", ["launch_server.py", "--kv-backend", "ulacache"])
    with pytest.raises(SystemExit) as info:
        plugin.register()
    assert info.value.code == 2
    monkeypatch.setattr(plugin.sys, "argv", ["launch_server.py", "--kv-backend", "hisparse"])
    with pytest.raises(HookVerificationError):
        plugin.register()


# --------------------------------------------------------------------------- model validation


def _view(arch, *, index_topk=2048, backend="ulacache"):
    hf = SimpleNamespace(architectures=[arch], index_topk=index_topk, model_type="x")
    return SimpleNamespace(
        kv_backend=backend, enable_hisparse=True, _model_config=SimpleNamespace(hf_config=hf)
    )


def test_validate_rejects_non_dsa_model():
    with pytest.raises(ConfigError, match="needs a DSA"):
        ula_args.validate_hisparse_around(lambda v: None, _view("LlamaForCausalLM"))
    with pytest.raises(ConfigError, match="needs a DSA"):
        ula_args.validate_hisparse_around(
            lambda v: None, _view("DeepseekV3ForCausalLM", index_topk=None)
        )


def test_validate_rejects_hybrid_dsa_model():
    with pytest.raises(ConfigError, match="does not support Glm5Next"):
        ula_args.validate_hisparse_around(lambda v: None, _view("Glm5NextForConditionalGeneration"))


def test_validate_rewrites_hisparse_assertions():
    def stock(view):
        raise AssertionError(
            "Hierarchical sparse attention currently requires --disable-radix-cache."
        )

    with pytest.raises(ConfigError, match="ulacache.*--disable-radix-cache.*Legal combination"):
        ula_args.validate_hisparse_around(stock, _view("DeepseekV32ForCausalLM"))


def test_validate_passes_dsa_and_leaves_other_backends_alone():
    calls = []
    ula_args.validate_hisparse_around(calls.append, _view("GlmMoeDsaForCausalLM"))
    assert len(calls) == 1

    def stock(view):
        raise AssertionError("stock message")

    with pytest.raises(AssertionError, match="^stock message$"):
        ula_args.validate_hisparse_around(stock, _view("LlamaForCausalLM", backend="hisparse"))


def test_non_dsa_model_rejected_by_real_resolution(registered, tmp_path):
    """End to end on CPU: SGLang's post-process pass reaches our AROUND hook."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(
        [
            "--model-path",
            str(tmp_path),
            "--device",
            "cpu",
            "--skip-tokenizer-init",
            "--kv-backend",
            "ulacache",
            "--disable-radix-cache",
        ]
    )
    args.resolve_once()
    with pytest.raises(ConfigError, match="needs a DSA .* got LlamaForCausalLM"):
        args.check_server_args()


def test_replacement_classes_must_subclass_stock(monkeypatch):
    module = types.ModuleType(plugin.CLASSES_MODULE)
    module.__spec__ = importlib.machinery.ModuleSpec(plugin.CLASSES_MODULE, None)
    for name in plugin.CLASS_TARGETS.values():
        setattr(module, name, type(name, (), {}))
    monkeypatch.setitem(sys.modules, plugin.CLASSES_MODULE, module)
    with pytest.raises(TypeError, match="must subclass"):
        plugin.load_replacement_classes()
    delattr(module, next(iter(plugin.CLASS_TARGETS.values())))
    with pytest.raises(ImportError, match="has no class"):
        plugin.load_replacement_classes()
