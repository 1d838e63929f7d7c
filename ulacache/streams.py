"""One stream for every mutation of core state.

Under SGLang's overlap scheduler the scheduler thread issues allocation and frees on its
``schedule_stream`` while the forward (which reads and, in the sparse access, mutates the same
mapping tables and pools) runs on ``forward_stream``, and a finished request is freed after the
next batch's forward was already launched. Two streams mutating the same tables would race.
So the core owns one stream, set to the forward (producer) stream, and every public mutating
call of :class:`~ulacache.space.AddressSpace` runs inside :meth:`CoreStream.scope`:

1. the core stream first waits for the caller's stream (inputs made there are ready),
2. the call's work is issued on the core stream, so it is ordered after every forward launched
   before it: a release cannot overtake an in-flight forward that still reads those rows, and a
   freed slot is not rewritten before that forward finished (design invariants 3 and 8),
3. the caller's stream then waits for the core stream (outputs are ready for it).

All of it is device-side ordering: no host synchronisation. Inside CUDA-graph capture the
scope does nothing (the captured stream already orders the work). On CPU there are no streams;
the scope still records which stream a call ran on (:func:`active_stream`), so CPU tests can
check that every mutation was issued inside it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_local = threading.local()


def capturing(device: torch.device) -> bool:
    """Whether work for ``device`` is being captured into a CUDA graph (never on CPU; asks
    CUDA nothing then, so CPU-only processes with a CUDA build of torch stay CUDA-free)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def active_stream() -> Any:
    """The core stream of the innermost :meth:`CoreStream.scope` on this thread (``None``
    outside any scope); for stream-order recorders in tests."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


class CoreStream:
    """The stream core mutations are issued on (``None``: the caller's current stream)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream: Any = None

    def set(self, stream: Any) -> None:
        """Use ``stream`` (a ``torch.cuda.Stream`` on CUDA; any token on CPU, for recording)."""
        if self.device.type == "cuda" and stream is not None and \
                not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"core stream on {self.device} must be a torch.cuda.Stream, got "
                            f"{type(stream).__name__}")
        self.stream = stream

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Issue the enclosed work on the core stream (see the module docstring)."""
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self.stream if self.stream is not None else "current")
        try:
            s = self.stream
            if self.device.type != "cuda" or s is None or capturing(self.device):
                yield
                return
            cur = torch.cuda.current_stream(self.device)
            if cur == s:
                yield
                return
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                yield
            cur.wait_stream(s)
        finally:
            stack.pop()

    def fence(self) -> None:
        """Make the caller's stream wait for everything issued on the core stream so far
        (e.g. before the engine reuses a finished request's tables)."""
        s = self.stream
        if self.device.type == "cuda" and s is not None and not capturing(self.device):
            cur = torch.cuda.current_stream(self.device)
            if cur != s:
                cur.wait_stream(s)
