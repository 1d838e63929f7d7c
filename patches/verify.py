"""Check that the hooks ulacache registered with SGLang's ``HookRegistry`` took effect.

SGLang's ``HookRegistry.apply_hooks()`` only *logs* a target it cannot patch (a missing optional
dependency surfaces as an ``AttributeError`` on a module path, a target already patched by another
plugin is silently skipped, a typo in a dotted path is logged and forgotten). A KV-cache backend
that silently falls back to stock HiSparse would produce plausible but wrong measurements, so the
plugin records what it registered (:class:`ExpectedHook`) and this module resolves every target
again after ``apply_hooks()`` and checks that what sits there now is ours:

* class REPLACE: the attribute *is* our class;
* function REPLACE / BEFORE / AFTER / AROUND: the attribute (unwrapped from ``classmethod`` /
  ``staticmethod``) is a wrapper chain built by SGLang's ``_wrap_fn`` (each link has
  ``__wrapped__``) and one link's closure holds our hook object.

The module imports nothing from SGLang at import time; it only needs ``pkgutil``.
"""

from __future__ import annotations

import logging
import pkgutil
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ExpectedHook", "HookVerificationError", "TP_HOOK_TARGETS", "DCP_HOOK_TARGETS",
           "hook_in_place", "unimportable", "verify_hooks", "verify_tp_hooks"]

TP_HOOK_TARGETS = (
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__",
    "sglang.srt.layers.attention.dsa.dsa_indexer_metadata.DSAIndexerMetadata.topk_transform",
    "sglang.srt.layers.attention.dsa.dsa_indexer._index_k_write_targets",
    "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_paged",
)
"""Targets TP mode cannot run without: the sizing hook (without it SGLang charges the full
latent per rank and the pool's buffer is not budgeted; it also charges ulacache's tables in
both modes, verified there with every other registered hook), the sharded top-k merge, and
striped index-K's write and decode seams (``stripe_index_k``: without them the fused store
would write global slots into a rank's ``1/P`` store and decode would score its pages as if
replicated)."""
DCP_HOOK_TARGETS = (
    "sglang.srt.arg_groups.model_overrides.deepseek_v2._dsa_dcp_overrides",
    "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.__init__",
    "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend._forward_flashmla_kv",
)
"""Targets mode ``"dcp"`` adds (``sglang_dcp``): without them SGLang refuses the launch, or
FlashMLA runs the gathered queries with the local heads' padding and drops the LSE the merge
needs."""



class HookVerificationError(RuntimeError):
    """One or more hooks registered by ulacache are not in effect. ``failures``: (target,
    reason) of each; :meth:`one_line` states them for a user."""

    def __init__(self, failures: list[tuple[str, str]], message: str) -> None:
        super().__init__(message)
        self.failures = list(failures)

    def __reduce__(self):
        return type(self), (self.failures, self.args[0])

    def one_line(self) -> str:
        """The failures in one line (the first reason in full, then how many more)."""
        if not self.failures:
            return str(self).splitlines()[0]
        target, reason = self.failures[0]
        more = f" (and {len(self.failures) - 1} more hook(s))" if len(self.failures) > 1 else ""
        return f"SGLang did not apply ulacache's hook on {target}: {reason}{more}"


@dataclass(frozen=True)
class ExpectedHook:
    """A hook ulacache registered: where, what, and how (``"replace"``, ``"around"``, ...)."""

    target: str
    hook: Any
    hook_type: str

    def describe(self) -> str:
        """Short human-readable form used in error messages."""
        name = getattr(self.hook, "__qualname__", None) or repr(self.hook)
        module = getattr(self.hook, "__module__", "?")
        return f"{self.hook_type.upper()} {self.target} -> {module}.{name}"


def _resolve_current(target: str) -> Any:
    """Return the object now bound at ``target`` (raw ``__dict__`` entry for class attributes)."""
    obj_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(obj_path)
    if isinstance(owner, type):
        # Walk the MRO ourselves so that classmethod / staticmethod wrappers stay visible.
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                raw = klass.__dict__[attr]
                if isinstance(raw, (classmethod, staticmethod)):
                    return raw.__func__
                return raw
    return getattr(owner, attr)


def _chain_holds(fn: Any, hook: Any, max_depth: int = 32) -> bool:
    """True when ``hook`` is captured in the closure of ``fn`` or of a ``__wrapped__`` link."""
    seen = 0
    while fn is not None and seen < max_depth:
        if fn is hook:
            return True
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def unimportable(target: str) -> tuple[str, BaseException] | None:
    """``(module, error)`` when a module on the dotted path ``target`` fails to import (e.g.
    ``sglang.srt.entrypoints.engine`` and ``ModuleNotFoundError: No module named
    'jsonschema'``); ``None`` when every module on it imports. SGLang reports such a target as
    ``AttributeError: module 'sglang.srt.entrypoints' has no attribute 'engine'``, which hides
    the missing dependency."""
    import importlib  # noqa: PLC0415

    parts = target.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # the rest of the path are attributes, not modules
                return None
            return name, exc
        except Exception as exc:  # noqa: BLE001 - any import failure is the root cause
            return name, exc
    return None


def hook_in_place(expected: ExpectedHook) -> tuple[bool, str]:
    """Check one hook. Returns ``(ok, reason)``; ``reason`` is empty when ``ok``."""
    try:
        current = _resolve_current(expected.target)
    except Exception as exc:  # noqa: BLE001 - any resolution failure means "not in place"
        cause = unimportable(expected.target)
        if cause is not None:
            module, err = cause
            return False, (f"target cannot be resolved: {module} cannot be imported: "
                           f"{type(err).__name__}: {err}")
        return False, f"target cannot be resolved: {type(exc).__name__}: {exc}"
    if isinstance(expected.hook, type):
        if current is expected.hook:
            return True, ""
        return False, f"target is {_name(current)}, not {_name(expected.hook)}"
    if _chain_holds(current, expected.hook):
        return True, ""
    return False, f"target is {_name(current)}, whose wrapper chain does not hold the hook"


def _name(obj: Any) -> str:
    """``module.qualname`` of an object, for messages."""
    mod = getattr(obj, "__module__", "?")
    qual = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{mod}.{qual}"


def verify_hooks(expected: Iterable[ExpectedHook]) -> None:
    """Raise :class:`HookVerificationError` naming every hook of ``expected`` not in effect.

    Call it after ``HookRegistry.apply_hooks()``. The message points at SGLang's log, where
    ``apply_hooks`` wrote the original exception ("Failed to apply hooks to <target>").
    """
    failures, reasons = [], []
    for exp in expected:
        ok, reason = hook_in_place(exp)
        if not ok:
            failures.append(f"  - {exp.describe()}: {reason}")
            reasons.append((exp.target, reason))
    if failures:
        raise HookVerificationError(reasons,
            "ulacache: SGLang did not apply these plugin hooks (HookRegistry.apply_hooks only "
            "logs such failures; look for 'Failed to apply hooks to' above, typically an "
            "ImportError of an optional dependency, or another plugin patching the same "
            "target first):\n" + "\n".join(failures)
        )
    logger.debug("ulacache: all plugin hooks verified")


def verify_tp_hooks(expected: Iterable[ExpectedHook], mode: str = "tp") -> None:
    """Modes TP and DCP: raise :class:`HookVerificationError` unless every target of
    :data:`TP_HOOK_TARGETS` (DCP: and :data:`DCP_HOOK_TARGETS`) was registered
    (``expected``) and is in effect."""
    expected = list(expected)
    targets = TP_HOOK_TARGETS + (DCP_HOOK_TARGETS if mode == "dcp" else ())
    registered = {e.target for e in expected}
    missing = [t for t in targets if t not in registered]
    if missing:
        raise HookVerificationError(
            [(t, "never registered") for t in missing],
            f"ulacache: --ulacache-config mode {mode!r} needs these hooks, which were never "
            "registered (is ulacache.patches.classes.EXTRA_HOOKS out of date?):\n"
            + "\n".join(f"  - {t}" for t in missing))
    verify_hooks(e for e in expected if e.target in targets)
