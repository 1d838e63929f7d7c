"""ulacache: unified logical KV address space for sparse-attention serving.

The package is the product's core; it imports neither SGLang nor numpy and runs on CPU tensors:

====================  ==========================================================================
``config``            typed, validated settings (msgspec)
``layout``            row formats: the one place row sizes are defined
``errors``            typed errors
``address``           logical pages, owner / local-position math (TP striping)
``pools``             GPU and CPU row pools, the CPU free stack, checked allocation
``pblru``             replacement policies: PB-LRU and exact LRU, the policy registry
``group``             one selection group: mapping, reverse maps, place / access / release
``space``             ``AddressSpace``: the address-level core the SGLang plugin calls
``cache``             ``UlaCache``: a request ledger (admission, pages) over an address space
``streams``           one stream for every core mutation
``health``            counters off the device without sync; overflow warnings
``metrics``           Prometheus collector
====================  ==========================================================================

Beside it: ``ulacache.kernels`` (data-movement kernels, from ``kernels/``), ``ulacache.patches``
(the SGLang plugin, from ``patches/``), ``ulacache.oracle`` (the reference DSA-MLA model that
proves decoding through the core is exact) and ``ulacache.tools`` (selection traces, replay,
the ``ulacache`` command line).
"""

from pathlib import Path as _Path

# pyproject maps kernels/ -> ulacache.kernels and patches/ -> ulacache.patches. In a source
# checkout that is not installed (e.g. on a GPU machine with no registry access), let the same
# names resolve by searching the checkout root for those subpackages too.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "kernels" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821 - the package's own __path__
del _Path, _root
