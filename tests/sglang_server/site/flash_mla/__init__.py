"""Test-only stand-in for the CUDA-only ``sgl-flash-mla`` wheel (module ``flash_mla``).

Only ``flash_mla_sparse_fwd`` has a body (pure torch, cpu_stand_ins.py section 6): it is what
``sglang/kernels/ops/attention/flash_mla_interface.py:158`` calls for the DSA backend's
``flashmla_sparse`` prefill and decode. Every other attribute raises when called.
"""
from cpu_stand_ins import flash_mla_sparse_fwd_torch as flash_mla_sparse_fwd  # noqa: F401


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def op(*args, **kwargs):
        raise NotImplementedError(f"flash_mla.{name} is a test stand-in")

    op.__name__ = name
    return op
