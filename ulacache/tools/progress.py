"""Progress bars for the long-running tools (tqdm on stderr when installed, else nothing)."""

from __future__ import annotations


class _NoBar:
    """What :func:`bar` returns when no bar is shown: ``update`` and ``close`` do nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def bar(show: bool, **kw):
    """A tqdm bar (``kw``: its ``total``, ``desc``, ``unit``, ...) that clears itself when done,
    when ``show`` and tqdm (the ``trace`` / ``bench`` extras) is installed."""
    if show:
        try:
            from tqdm import tqdm

            return tqdm(leave=False, **kw)
        except ImportError:
            pass
    return _NoBar()
