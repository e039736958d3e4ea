"""Nothing unverified patches by default: content not known verified on the installed release is verified there first.

What patches without a verification is content *known verified on the installed transformers*:
a bundled patchset's content as the compatibility matrix verified it on this release (the
manifest the package ships, :mod:`.manifest`), or content with a passing verdict of its own in
the user's cache. Anything else (a user's file or dict, inside its ``requires`` range or not, an
edited bundled file, a release outside the range) is verified by :func:`engine.apply` before it
patches (policy ``verify``, the default; ``unverified=``): the same judge as ``patch-engine
verify``, on a tiny model of the *user's* model type built by that release, on the plan's device,
dtype, mode and kernels. The verdict is cached on disk, so the next apply costs a file read. See
docs/verification.md and docs/versions.md.

The public entry point for any :class:`~engine.schema.Patchset`, wherever it came from (a file,
a dict, declarations measured by zero configuration): :func:`verification_path` says which way an
apply goes (changes nothing), :class:`ReleaseGate` is the ``before_install`` that acts on it.

One module per job: :mod:`.manifest` (bundled content CI verified), :mod:`.key` (what a verdict
depends on), :mod:`.cache` (the files, their lock), :mod:`.verdict` (a verdict), :mod:`.known`
(which way an apply goes), :mod:`.self_verify` (the verification), :mod:`.gate` (the policy's
answer, the warning or the refusal).
"""

from engine.releases.cache import CACHE_ENV_VAR, VerdictStore, cache_dir
from engine.releases.gate import ReleaseGate, release_verdict
from engine.releases.known import VerificationPath, verification_path
from engine.releases.verdict import ReleaseVerdict

__all__ = ["CACHE_ENV_VAR", "ReleaseGate", "ReleaseVerdict", "VerdictStore", "VerificationPath", "cache_dir",
           "release_verdict", "verification_path"]
