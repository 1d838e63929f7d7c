"""Mutation check: do the core tests catch plausible one-line bugs, every run?

    python tests/mutants.py            # ~10 min on 2 cores; prints one line per mutant

Copies the repository to a temporary directory, applies each mutant below (one line of the core
changed the way a tired engineer might), runs the core tests there twice with the derandomized
Hypothesis examples (shrinking off: a failure is all that matters), and reports whether both runs
failed. Not collected by pytest (the file name does not start with ``test_``).

Last run (2026-12-01): all 20 mutants caught, each by both runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_core.py", "tests/test_stateful.py", "tests/test_pblru.py",
         "tests/test_boundary.py"]
G, P, L = "ulacache/group.py", "ulacache/pblru.py", "ulacache/pools.py"
MUTANTS = [  # (file, original, mutant, what it models)
    (G, "self.loc.index_put_((torch.where(ok, flat, self.n_logical),), victim)",
     "self.loc.index_put_((torch.where(ok, flat, self.n_logical - 1),), victim)",
     "access: masked writes land on the last address"),
    (G, "self.loc.index_put_((torch.where(ok, flat, self.n_logical),), slot)",
     "self.loc.index_put_((torch.where(ok, flat, self.n_logical - 1),), slot)",
     "place: masked writes land on the last address"),
    (G, "inrange = (flat >= 0) & (flat < self.n_logical)",
     "inrange = (flat >= 0) & (flat <= self.n_logical)", "the scratch entry counted in range"),
    (L, "got = want & (pos >= 0)", "got = want", "a pop from a dry CPU free stack"),
    (G, "ok = (slot >= 0) & ((owner < 0) | spill)", "ok = slot >= 0",
     "placement ignores a failed spill"),
    (G, "first = self._first(safe, inrange)\n        bad = ((flat",
     "first = inrange\n        bad = ((flat", "release without dedup"),
    (P, "recent = 2 + torch.remainder(self.epoch_t + self._ring, self.n_buckets)",
     "recent = 2 + torch.remainder(self.epoch_t - self._ring + 1, self.n_buckets)",
     "recent buckets in reverse order"),
    (L, "rank = torch.cumsum(put, 0) - 1", "rank = torch.cumsum(put, 0)", "push off by one"),
    (G, "owned = ok & (owner >= 0)", "owned = ok & (owner > 0)", "address 0 taken for free"),
    (G, "first = keep & (self._claim[safe] == pos)", "first = keep", "no dedup in access/place"),
    (G, "hit = first & (phys < G)", "hit = first & (phys <= G)", "hit boundary"),
    (P, "row = torch.where(self.epoch_t - epoch_of >= self.n_buckets, 1, recent)",
     "row = torch.where(self.epoch_t - epoch_of > self.n_buckets, 1, recent)", "cold boundary"),
    (G, "        self.policy.touch(hit_slots)\n", "", "hits not pinned"),
    (G, "cslot = self.pools.pop_cpu((slot >= 0) & (owner >= 0))",
     "cslot = self.pools.pop_cpu(slot >= 0)", "a CPU slot popped for a free victim"),
    (G, "self.pools.push_cpu(torch.where(ok & ~owned, cslot, -1))",
     "self.pools.push_cpu(torch.where(ok, cslot, -1))", "a vacated CPU slot freed after a swap"),
    (P, "go = (self.entered >= self.bucket_fill).to(torch.int64)",
     "go = (self.entered > self.bucket_fill).to(torch.int64)", "epoch threshold off by one"),
    (G, "drop = first & mapped", "drop = mapped", "release drops a duplicate twice"),
    (G, "rows = torch.where(valid & (rows >= 0) & (rows < G), rows, -1)",
     "rows = torch.where(valid & (rows >= 0), rows, -1)", "CPU slots returned as GPU rows"),
    (G, "place_overflow=(fresh & ~ok).sum(),", "", "placement overflow not counted"),
    (P, "        self.entered.add_((move if assigned else move & (old <= 1)).sum())\n", "",
     "PB-LRU turnover never counted"),
]
# Not listed: equivalent mutants (no observable change), e.g. PBLRU.touch moving a slot that is
# already in the current bucket to the current bucket again (the bit and count moves cancel).

CONFTEST = '''
from hypothesis import Phase
settings.register_profile("mutation", derandomize=True, deadline=None,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("mutation")
'''


def main() -> int:
    missed = 0
    with tempfile.TemporaryDirectory(prefix="ulacache-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache"))
        with open(copy / "tests" / "conftest.py", "a") as f:
            f.write(CONFTEST)
        env = {**os.environ, "PYTHONPATH": str(copy)}
        for path, old, new, what in MUTANTS:
            target = copy / path
            src = target.read_text()
            if src.count(old) != 1:
                print(f"STALE  {what}: the original line is not in {path} exactly once")
                missed += 1
                continue
            target.write_text(src.replace(old, new))
            t0 = time.time()
            try:
                caught = all(subprocess.run(
                    [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS],
                    cwd=copy, env=env, capture_output=True, timeout=1200).returncode != 0
                    for _ in range(2))
            finally:
                target.write_text(src)
            missed += not caught
            print(f"{'caught' if caught else 'MISSED'} {what} ({time.time() - t0:.0f} s)",
                  flush=True)
    print(f"{len(MUTANTS) - missed} of {len(MUTANTS)} mutants caught by every run")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
