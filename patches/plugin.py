"""SGLang plugin entry point: ``register()`` for the ``sglang.srt.plugins`` entry-point group.

pyproject.toml::

    [project.entry-points."sglang.srt.plugins"]
    ulacache = "ulacache.patches.plugin:register"

SGLang's ``load_plugins()`` calls :func:`register` once per process (launcher before argument
parsing, ``Engine.__init__``, every scheduler/TP worker, the DP controller, the detokenizer), then
``HookRegistry.apply_hooks()``. :func:`register` installs:

* always: ``--kv-backend`` / ``--ulacache-config`` (REPLACE ``ServerArgs`` and
  ``Engine.server_args_class`` with :class:`~ulacache.patches.server_args.UlaServerArgs`) and the
  ulacache checks around ``validate_hisparse``;
* when the ulacache backend is selected in this process (see :func:`selected_kv_backend`): REPLACE
  of the three HiSparse leaf classes with the classes of ``ulacache.patches.classes``, if that
  module exists (a warning otherwise, and stock HiSparse runs).

It then applies the hooks itself and verifies them (:mod:`ulacache.patches.verify`). SGLang logs
and swallows ``Exception`` from a plugin, so a verification failure while the ulacache backend is
selected is raised as ``SystemExit`` (which ``load_plugins`` does not catch): a process that was
asked for ulacache stops instead of silently serving with stock HiSparse. The launcher runs
``load_plugins()`` before it parses its arguments, so there the choice is read off the command
line itself (:func:`argv_kv_backend`); the stop is one line naming the module that failed to
import (e.g. a server dependency SGLang needs), exit status 2.

In the launcher process (``python -m sglang.launch_server``, ``sglang serve``) :func:`register`
also installs :func:`one_line_errors`: a start-up refusal of ulacache's (a
:class:`~ulacache.errors.UlaCacheError`, e.g. ``--kv-backend ulacache`` on a model without
sparse attention) ends the launch as one line ``ulacache: error: ...`` and exit status 2
instead of a traceback (the traceback is logged at DEBUG).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading

from ulacache.patches.verify import ExpectedHook, HookVerificationError, verify_hooks

logger = logging.getLogger(__name__)

SERVER_ARGS_TARGET = "sglang.srt.server_args.ServerArgs"
ENGINE_ARGS_TARGET = "sglang.srt.entrypoints.engine.Engine.server_args_class"
VALIDATE_HISPARSE_TARGET = "sglang.srt.arg_groups.hisparse_hook.validate_hisparse"

CLASSES_MODULE = "ulacache.patches.classes"
"""Module (lead-owned) holding the replacement classes; optional until it exists."""

CLASS_TARGETS: dict[str, str] = {
    "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool": (
        "UlaCacheDSATokenToKVPool"
    ),
    "sglang.srt.mem_cache.allocator.hisparse.HiSparseTokenToKVPoolAllocator": (
        "UlaCacheTokenToKVPoolAllocator"
    ),
    "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator": "UlaCacheCoordinator",
}
"""SGLang target -> name of the replacement class in :data:`CLASSES_MODULE`.

Each replacement must subclass the class it replaces (``isinstance`` checks in SGLang, e.g.
``hisparse_coordinator.py:702`` and ``kv_cache_configurator.py:729``, see the replaced name).
"""

_lock = threading.Lock()
_expected: list[ExpectedHook] = []
_registered: set[str] = set()


def selected_kv_backend() -> str | None:
    """The ``--kv-backend`` chosen for this launch, or ``None`` when not known yet.

    Read from the process-wide published ``ServerArgs`` when SGLang has one, else from the
    ``ULACACHE_KV_BACKEND`` environment variable that ``UlaServerArgs.__post_init__`` exports
    (inherited by every process SGLang spawns after parsing).
    """
    try:
        from sglang.srt.runtime_context import get_server_args  # noqa: PLC0415

        value = getattr(get_server_args(), "kv_backend", None)
        if value:
            return value
    except Exception:  # noqa: BLE001 - nothing published yet (ValueError) or older layout
        pass
    from ulacache.patches.server_args import ENV_KV_BACKEND  # noqa: PLC0415

    return os.environ.get(ENV_KV_BACKEND) or None


def argv_kv_backend(argv: list[str] | None = None) -> str | None:
    """``--kv-backend`` as written on this process's command line (``--kv-backend X`` or
    ``--kv-backend=X``; the last one wins, as argparse does), or ``None``."""
    argv = sys.argv[1:] if argv is None else argv
    value = None
    for i, arg in enumerate(argv):
        if arg == "--kv-backend" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--kv-backend="):
            value = arg.split("=", 1)[1]
    return value


EXIT_STATUS = 2  # a refused start-up, as argparse exits for a bad command line


def is_launcher() -> bool:
    """Whether this process is SGLang's launcher (the one that parses the command line)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return name in ("sglang.launch_server", "sglang.cli.main", "sglang.cli") or \
        os.path.basename(sys.argv[0] if sys.argv else "") in ("launch_server.py", "sglang")


def _refusal(exc: BaseException) -> BaseException | None:
    """The ulacache start-up refusal in ``exc``'s cause / context chain, if any."""
    from ulacache.errors import UlaCacheError  # noqa: PLC0415

    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, (UlaCacheError, HookVerificationError)):
            return exc
        # the chain Python prints: an explicit cause, else the context unless suppressed
        exc = exc.__cause__ if exc.__cause__ is not None else \
            (None if exc.__suppress_context__ else exc.__context__)
        seen += 1
    return None


def one_line(exc: BaseException) -> str:
    """``ulacache: error: <message>`` on one line."""
    text = exc.one_line() if isinstance(exc, HookVerificationError) else str(exc)
    return "ulacache: error: " + (" ".join(text.split()) or type(exc).__name__)


def one_line_errors() -> None:
    """Report an uncaught ulacache refusal of this process as one line, exit status 2 (see the
    module docstring); anything else goes to the previous ``sys.excepthook``. Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "_ulacache", False):
        return

    def hook(exc_type, exc, tb):
        refusal = _refusal(exc)
        if refusal is None:
            return previous(exc_type, exc, tb)
        logger.debug("ulacache: start-up refused", exc_info=(exc_type, exc, tb))
        print(one_line(refusal), file=sys.stderr, flush=True)
        logging.shutdown()
        # the launcher's own ``finally`` already stopped its children; exit as a refusal
        os._exit(EXIT_STATUS)

    hook._ulacache = True
    sys.excepthook = hook


def expected_hooks() -> list[ExpectedHook]:
    """The hooks :func:`register` registered in this process so far (a copy)."""
    with _lock:
        return list(_expected)


def _register(target: str, hook, hook_type_name: str) -> None:
    """Register one hook with SGLang's registry and remember it for verification."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: PLC0415

    with _lock:
        if target in _registered:
            return
        HookRegistry.register(target, hook, HookType[hook_type_name.upper()])
        _registered.add(target)
        _expected.append(ExpectedHook(target, hook, hook_type_name.lower()))


def register_cli_hooks() -> None:
    """``--kv-backend`` / ``--ulacache-config`` and the validation wrapper."""
    from ulacache.patches.server_args import (  # noqa: PLC0415
        UlaServerArgs,
        validate_hisparse_around,
    )

    _register(SERVER_ARGS_TARGET, UlaServerArgs, "replace")
    _register(ENGINE_ARGS_TARGET, UlaServerArgs, "replace")
    _register(VALIDATE_HISPARSE_TARGET, validate_hisparse_around, "around")


def load_replacement_classes() -> dict[str, type] | None:
    """Import :data:`CLASSES_MODULE` and map each SGLang target to its replacement class.

    Returns ``None`` when the module does not exist. Raises ``ImportError`` when it exists but
    lacks a class, and ``TypeError`` when a class does not subclass the one it replaces.
    """
    if importlib.util.find_spec(CLASSES_MODULE) is None:
        return None
    module = importlib.import_module(CLASSES_MODULE)
    import pkgutil  # noqa: PLC0415

    out = {}
    for target, name in CLASS_TARGETS.items():
        cls = getattr(module, name, None)
        if not isinstance(cls, type):
            raise ImportError(f"{CLASSES_MODULE} has no class {name} (replaces {target})")
        stock = pkgutil.resolve_name(target)
        if stock is not cls and not issubclass(cls, stock):
            raise TypeError(
                f"{CLASSES_MODULE}.{name} must subclass {target}: SGLang checks isinstance "
                "against the replaced name"
            )
        out[target] = cls
    return out


def register_class_swaps() -> bool:
    """Register the REPLACE hooks for the HiSparse leaf classes. Returns whether it did.

    Called by :func:`register` when the ulacache backend is selected; callable directly (then
    call ``HookRegistry.apply_hooks()`` and :func:`verify`) by code that builds SGLang pools in
    a process where the choice is not known yet, e.g. tests.
    """
    classes = load_replacement_classes()
    if classes is None:
        logger.warning(
            "ulacache: --kv-backend ulacache is selected but %s does not exist yet; SGLang "
            "keeps its stock HiSparse pool, allocator and coordinator classes",
            CLASSES_MODULE,
        )
        return False
    for target, cls in classes.items():
        _register(target, cls, "replace")
    # Hooks the classes need beside the swaps (the prefill layer tracker, the sizing of the
    # logical space from cpu_ratio), verified like the rest.
    module = importlib.import_module(CLASSES_MODULE)
    for target, (hook, hook_type) in getattr(module, "EXTRA_HOOKS", {}).items():
        _register(target, hook, hook_type)
    return True


def verify() -> None:
    """Raise ``HookVerificationError`` unless every hook registered here is in effect."""
    verify_hooks(expected_hooks())


def verify_tp(mode: str = "tp") -> None:
    """Modes TP and DCP's start-up check (called by the pool): when the plugin installed the
    class swaps in this process, the mode's hooks must be registered and in effect, else
    ``HookVerificationError``. Classes built directly (tests, tools) skip it."""
    from ulacache.patches.verify import verify_tp_hooks  # noqa: PLC0415

    hooks = expected_hooks()
    if not any(h.target in CLASS_TARGETS for h in hooks):
        logger.debug("ulacache: TP classes built without the plugin's class swaps")
        return
    verify_tp_hooks(hooks, mode)


def register() -> None:
    """Entry point run by SGLang's ``load_plugins()``: register, apply and verify the hooks."""
    from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: PLC0415

    if is_launcher():
        one_line_errors()
    register_cli_hooks()
    # the launcher runs plugins before it parses: there the command line says what was asked
    backend = selected_kv_backend() or argv_kv_backend()
    if backend == "ulacache":
        try:
            register_class_swaps()
        except (ImportError, TypeError) as exc:
            logger.critical("ulacache: cannot install the replacement classes: %s", exc)
            raise SystemExit(f"ulacache plugin: {CLASSES_MODULE} is unusable: {exc}") from exc
    # load_plugins() applies hooks after every plugin ran; applying here as well lets us verify
    # now (apply_hooks is idempotent: patched targets are skipped).
    HookRegistry.apply_hooks()
    try:
        verify()
    except HookVerificationError as exc:
        if backend == "ulacache":
            logger.debug("%s", exc)
            # one line, naming what failed to import; SystemExit: load_plugins() would log and
            # swallow an Exception, and SGLang would start without ulacache
            print(one_line(exc) + " (--kv-backend ulacache cannot start without it; "
                  "docs/sglang-install.md lists the server packages)", file=sys.stderr,
                  flush=True)
            raise SystemExit(EXIT_STATUS) from exc
        raise
    logger.info(
        "ulacache: plugin registered %d hook(s) (kv_backend=%s)",
        len(expected_hooks()),
        backend or "not chosen yet",
    )
