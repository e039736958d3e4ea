"""Numerical verification: does the patched model compute what the original computed?

Two questions are asked of every patched module, on inputs captured from a real forward
of the model (so shapes, gates and dtypes are the ones the model really uses), run on a
copy of the module with its *own* weights:

1. **Is the declaration right?** The op's torch reference with the declared settings is
   compared with the module's original forward, in fp32 and in bf16 (where cast orders
   differ). Every alternative declaration the op knows (``scale``, ``cast``, activation,
   ...) is tried too; if the declared one misses while an alternative matches, the error
   says which one fits. This is what catches ``one_plus_weight`` declared on a ``weight``
   norm, whatever the weights' values.
2. **Does the kernel agree?** The patched forward (the chosen kernel) is compared with the
   original: bit-equal, or differing by at most ``k`` times the original's own rounding
   error, measured against the original evaluated in fp64 on the same inputs.

Then the whole model: logits, loss and every parameter gradient, patched vs unpatched, judged
the same way, on the model's own parameters (the original runs with its original forwards,
:func:`engine.patching.patcher.original_forwards`; nothing copies the model).

One module per job: :mod:`.compare` (differences, the judge), :mod:`.truth` (the fp64
evaluation), :mod:`.probes` (inputs), :mod:`.modules` (per-module and per-function checks),
:mod:`.models` (whole-model checks), :mod:`.results` (the report), :mod:`.runner` (``verify``,
which runs them all).
"""

from engine.verification.compare import FLOOR_ULPS, NOISE_FACTOR, TOLERANCES, compare, judge
from engine.verification.models import compare_models
from engine.verification.probes import probe_batch
from engine.verification.results import MODEL, Check, VerifyReport
from engine.verification.runner import sample_modules, verify
from engine.verification.truth import fp64_truth

__all__ = [
    "FLOOR_ULPS",
    "MODEL",
    "NOISE_FACTOR",
    "TOLERANCES",
    "Check",
    "VerifyReport",
    "compare",
    "compare_models",
    "fp64_truth",
    "judge",
    "probe_batch",
    "sample_modules",
    "verify",
]
