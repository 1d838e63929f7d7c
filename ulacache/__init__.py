"""ulacache: unified logical KV address space for sparse-attention serving."""

from pathlib import Path as _Path

# pyproject maps kernels/ -> ulacache.kernels and patches/ -> ulacache.patches. In a source
# checkout that is not installed (e.g. on a GPU machine with no registry access), let the same
# names resolve by searching the checkout root for those subpackages too.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "kernels" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821 - the package's own __path__
del _Path, _root
