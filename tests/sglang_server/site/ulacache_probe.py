"""Test-only probe: every ulacache invariant checked inside a live server's scheduler.

Installed by sitecustomize.py when ``ULA_INTEGRITY_LOG`` names a file prefix. It runs the
allocator's ``check_integrity()`` (the core's invariants, liveness taken from SGLang's own
allocator) at points where every placed row has been written:

* at the start of every ``ULA_INTEGRITY_EVERY``-th decode step (default 4), before the
  coordinator places the step's new tokens (``map_last_loc_to_buffer``): the previous step's
  forward wrote every row placed so far. In TP mode the check is collective (it reads every
  buffered copy back from its owner) and every rank reaches it at the same step;
* DP mode also after every ``free`` / ``free_segment`` (a request finished, was aborted or
  retracted). Not in TP mode: a free can fall between a prefill batch's placement and its
  forward, when the new rows' owner slots and buffer copies do not hold their bytes yet, and
  a byte comparison there would fail (DP's check compares no bytes).

Each check appends one JSON line to ``<prefix>.<pid>``: ``{"event", "ok", "error"}``; the
tests read those files.
"""

from __future__ import annotations

import json
import os
import traceback

import cpu_stand_ins


def _record(event: str, error: str | None) -> None:
    path = f"{os.environ['ULA_INTEGRITY_LOG']}.{os.getpid()}"
    with open(path, "a") as f:
        f.write(json.dumps({"event": event, "ok": error is None, "error": error}) + "\n")


def _check(alloc, event: str) -> None:
    try:
        alloc.check_integrity()
    except Exception as e:  # noqa: BLE001 - an AssertionError names the broken invariant
        _record(event, f"{type(e).__name__}: {e} | {traceback.format_exc(limit=3)}")
        return
    _record(event, None)


@cpu_stand_ins._on_import("ulacache.patches.sglang_allocator")
def _wrap_free(mod):
    cls = mod.UlaCacheTokenToKVPoolAllocator
    orig = cls.free

    def free(self, free_index):
        out = orig(self, free_index)
        if getattr(self.core, "P", 1) == 1:  # DP only (see the module docstring)
            _check(self, "free")
        return out

    cls.free = free
    orig_segment = cls.free_segment

    def free_segment(self, free_index, *, start_pos):  # SGLang's finish/retract path
        out = orig_segment(self, free_index, start_pos=start_pos)
        if getattr(self.core, "P", 1) == 1:
            _check(self, "free_segment")
        return out

    cls.free_segment = free_segment


@cpu_stand_ins._on_import("ulacache.patches.sglang_coordinator")
def _wrap_decode(mod):
    cls = mod.UlaCacheCoordinator
    every = int(os.environ.get("ULA_INTEGRITY_EVERY", "4"))

    def wrap(orig):
        def map_last_loc_to_buffer(self, *args, **kwargs):
            self._probe_steps = getattr(self, "_probe_steps", 0) + 1
            if self._probe_steps % every == 0:  # before this step places its new tokens
                _check(self.token_to_kv_pool_allocator, "decode")
            return orig(self, *args, **kwargs)
        return map_last_loc_to_buffer

    cls.map_last_loc_to_buffer = wrap(cls.map_last_loc_to_buffer)


def install() -> None:
    """Nothing to do beyond importing this module: its post-import patches are registered with
    the stand-ins' hook (``cpu_stand_ins.install`` runs first)."""
