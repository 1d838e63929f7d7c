"""Typed errors. Every public operation validates before it mutates: after any of these is
raised, the state is exactly what it was before the call."""

from __future__ import annotations


class UlaCacheError(Exception):
    """Base class of every error ulacache raises on bad input or exhausted capacity."""


class ConfigError(UlaCacheError, ValueError):
    """An invalid configuration; the message names the legal values or combinations."""


class AddressError(UlaCacheError, IndexError):
    """A logical address that is out of range, or not live (never allocated, or freed)."""


class DoubleFreeError(UlaCacheError):
    """Freeing something (a request, an address, a slot) that is already free."""


class CapacityExhausted(UlaCacheError):
    """Not enough unique capacity (GPU + CPU slots), logical pages, GPU victims, or memory."""


class ShapeError(UlaCacheError, ValueError):
    """A tensor with the wrong shape, dtype or device."""


class UnknownRequest(UlaCacheError, KeyError):
    """A request id that was never admitted, or was already freed."""


class StaleSelectionError(UlaCacheError):
    """A layer that shares its anchor's selection ran before the anchor did in this step: the
    rows it would get are last step's."""
