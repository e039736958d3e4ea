"""Self-verification on a transformers release outside a patchset's verified range, with its verdicts cached.

A patchset's ``requires.transformers`` is where the compatibility matrix verified it: evidence,
not a wall. Outside it, :func:`engine.apply` (policy ``verify``, the default) runs the planner's
structural checks as always, then verifies the patchset on the installed release itself
before patching: the same judge as ``patch-engine verify``, on the tiny model of the
patchset's type built by that release, on the plan's device, dtype, mode and kernels. The
verdict is cached on disk, so the next apply costs a file read. See docs/versions.md.

One module per job: :mod:`.key` (what a verdict depends on), :mod:`.cache` (the files, their
lock), :mod:`.self_verify` (the verification), :mod:`.gate` (the policy's answer, the
warning or the refusal).
"""

from engine.releases.cache import CACHE_ENV_VAR, VerdictStore, cache_dir
from engine.releases.gate import ReleaseGate, ReleaseVerdict, release_verdict

__all__ = ["CACHE_ENV_VAR", "ReleaseGate", "ReleaseVerdict", "VerdictStore", "cache_dir", "release_verdict"]
