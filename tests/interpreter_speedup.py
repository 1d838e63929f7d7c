"""A test-time speedup of Triton's CPU interpreter (``TRITON_INTERPRET=1``), for CI only.

Triton 3.6-3.8's interpreter re-patches the whole ``triton.language`` namespace
(``_patch_lang``: ``inspect.getmembers`` over every builtin) on *every* call of a nested
``@triton.jit`` device function, although the launch already patched it and nothing restores a
nested patch. The fused kernels call small device functions in their inner loops (the PB-LRU
victim search, bucket moves), so about a third of an interpreted launch went into repeating
the same patch. :func:`install` patches each module's namespace once per launch instead: the
first device function of a module called in a launch still patches it (Triton's own library
functions, ``tl.sum`` / ``tl.cumsum``, live in other modules and still patch theirs), later
calls reuse it. Same patches, applied the same way, fewer times: results are unchanged, and
the fused-path tests compare every table and byte with the torch reference anyway.

It is installed by ``tests/conftest.py`` only when the interpreter's code is the code this was
written against (checked below); otherwise Triton runs unmodified. Never imported by the
package: serving runs compiled kernels.
"""

from __future__ import annotations

import inspect
import threading

_state = threading.local()


def install() -> bool:
    """Install the speedup; ``False`` (nothing changed) when Triton's interpreter is not the
    code it was written for."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    try:
        call_src = inspect.getsource(interp.InterpretedFunction.__call__)
        grid_src = inspect.getsource(interp.GridExecutor.__call__)
    except (AttributeError, OSError, TypeError):
        return False
    if "_patch_lang(self.fn)" not in call_src or "patch_scope = _patch_lang(self.fn)" \
            not in grid_src or getattr(interp, "_ulacache_speedup", False):
        return bool(getattr(interp, "_ulacache_speedup", False))
    launch = interp.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        outer = getattr(_state, "patched", None)
        _state.patched = set()  # module namespaces patched in this launch
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state.patched = outer

    def device_call(self, *args, **kwargs):
        patched = getattr(_state, "patched", None)
        key = id(self.fn.__globals__)
        if patched is None or key not in patched:
            interp._patch_lang(self.fn)  # what Triton does on every call
            if patched is not None:
                patched.add(key)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.GridExecutor.__call__ = grid_call
    interp.InterpretedFunction.__call__ = device_call
    interp._ulacache_speedup = True
    return True
