"""Test-only stand-in (see flash_mla/__init__.py)."""


class FlashMLASchedMeta:  # imported by name only; never used on the flashmla_sparse path
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("flash_mla.FlashMLASchedMeta is a test stand-in")
