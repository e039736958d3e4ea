"""Audits: the verifier run on someone else's patch (Liger, LlamaFactory v1, twinkle, HF ``kernels``, any callable).

``engine.audit(model, patch)`` measures the unpatched model first (a training step, every
module's inputs and outputs, their fp64 truth), lets the patch run on a copy, finds what it
changed (classes swapped, forwards replaced, module-level functions and class attributes rebound,
for the instance or the whole process), judges each change and the whole model with the same
rules as ``engine.verify``, names the declaration that explains a difference, and puts the
process back as it was. One module per job: :mod:`.process_state` (process-wide names, diff,
restore), :mod:`.changes` (what changed in one model), :mod:`.recording` (the original's
numbers), :mod:`.whole_model` (logits, loss, gradients), :mod:`.judging` and :mod:`.explain`
(one change), :mod:`.report`, :mod:`.run` (the order), :mod:`.adapters` (who patches).
"""

from engine.auditing.adapters import STACKS, Adapter, claims
from engine.auditing.report import AuditReport, Row
from engine.auditing.run import audit, audit_many, measure_first

__all__ = ["STACKS", "Adapter", "AuditReport", "Row", "audit", "audit_many", "claims", "measure_first"]
