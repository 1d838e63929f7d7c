"""Test-only: installs the CPU stand-ins for SGLang 0.5.23's GPU-only DSA code points in every
process that has this directory on PYTHONPATH (the harness's servers and every subprocess they
spawn: scheduler, detokenizer). Nothing SGLang is imported eagerly: cpu_stand_ins registers a
post-import hook that patches each SGLang module right after it executes.

ULA_CPU_STAND_INS=0 disables them; ULA_INTEGRITY_LOG=<prefix> also loads ulacache_probe.py
(ulacache's invariants checked in the scheduler after every free and every few decode steps);
ULA_TEST_BLOCK_MODULES=a,b makes those modules unimportable (a missing server dependency).
"""
import os
import sys

# test-only: make these modules unimportable (a server dependency missing), e.g. uvloop
for _name in filter(None, os.environ.get("ULA_TEST_BLOCK_MODULES", "").split(",")):
    sys.modules[_name] = None

if os.environ.get("ULA_CPU_STAND_INS", "1") == "1":
    try:
        import cpu_stand_ins

        cpu_stand_ins.install()
        if os.environ.get("ULA_INTEGRITY_LOG"):  # test-only: ulacache's invariants, live
            import ulacache_probe  # noqa: F401
    except Exception as e:  # never break an unrelated interpreter
        print(f"[cpu_stand_ins] install failed: {e!r}", file=sys.stderr)
