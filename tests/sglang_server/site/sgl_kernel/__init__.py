"""Test-only stand-in for ``sgl_kernel``: SGLang's CPU engine imports it at module load
(``sglang/kernels/ops/kvcache/cache_move.py:10``), but PyPI's wheels hold CUDA objects only and
its CPU build is source-only. Every attribute is a function that raises when called; the tiny
DSA models the harness serves never call one (the stand-ins in cpu_stand_ins.py cover the ops
they do reach)."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is a test stand-in")

    op.__name__ = name
    return op
