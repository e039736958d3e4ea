"""Each patched class checked on one of the user's own instances, at its size, before the patch stays live.

Why: every other check runs on other modules than the user's: a verdict made on a tiny model of
the type (64 wide), CI's manifest, a cached verdict. A class whose forward depends on what only
the real model has (a branch on ``hidden_states.shape[-1] >= 256``, a width that crosses a
kernel's tile, trained weights far from the tiny model's) passes all of them and computes
something else at the user's size. Here, right after ``engine.apply`` installs a plan, one
instance per patched class (per distinct parameter shapes: a norm used at the hidden width and
at the head width is two) runs its original forward against its patched forward on the user's
own weights, width, dtype and device, at :data:`LENGTHS` rows, forward and (in training)
backward, with the judge every module check uses (:func:`~engine.verification.modules.verify_module_inputs`:
the declaration bit-exact, the kernel within the original's own rounding error).

What it checks: ops whose forward takes plain hidden states (:data:`HIDDEN_OPS`). Others take
structured inputs (rope: positions and a cache layout; linear attention: a recurrent state; MoE
experts: routing; the fused head: labels and the whole model; function patches): they are named
in the record as not checked here, covered by the tiny model's verification.

What it skips, and says so: a module on the meta device, parameters partitioned by DeepSpeed
ZeRO-3 (``ds_*`` attributes, or none of their elements here) or DTensors (FSDP2, tensor
parallelism), and a module whose cast copy would cost more than :data:`MEMORY_SHARE` of the
model's parameter memory (:func:`_budget`).

What it costs: the model's own dtype runs in place (no copy); the other dtype on one cast copy
of the module, released before the next. An outcome is kept for the process
(:data:`_CACHE`, keyed by the class object and its forward, the patch, the kernel, the parameter
shapes, dtype, device and mode), so a second model of the same kind checks nothing again.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from engine.runtime.wrappers import unwrap
from engine.verification.compare import DTYPE_NAMES
from engine.verification.modules import verify_module_inputs
from engine.verification.results import Check
from engine.verification.truth import _BIG

__all__ = ["HIDDEN_OPS", "LENGTHS", "MEMORY_SHARE", "ModuleChecked", "RealModules", "check_real_modules",
           "clear_cache"]

#: Ops whose forward takes hidden states ``(batch, rows, width)`` (and a gate of that shape): checked here.
HIDDEN_OPS = frozenset({"rms_norm", "layer_norm", "gated_rms_norm", "swiglu", "geglu", "mlp"})

#: Rows per check: one (decode), and two that cross the tiles kernels block rows in (16, 32, 64, 128).
LENGTHS = (1, 17, 129)
#: Rows whose backward is compared too (in training): the middle length, past a 16-row tile; the
#: backward at 129 rows would cost three times the forward checks on a 0.6B-sized MLP on a CPU.
BACKWARD_LENGTHS = (17,)

#: The most a module's cast copy may cost, as a share of the model's parameter memory ...
MEMORY_SHARE = 0.10
#: ... or this many bytes, whichever is more: on a model of a few MiB, 10% is nothing worth refusing over.
MEMORY_FLOOR = 16 << 20

STRUCTURED = "structured inputs; covered by the tiny model's verification"

#: In-process outcomes: key (see :func:`_key`) -> the checks of one instance (with its path then).
_CACHE: dict[tuple[Any, ...], list[Check]] = {}


def clear_cache() -> None:
    """Forget every outcome (tests, benchmarks timing a cold check)."""
    _CACHE.clear()


@dataclass
class ModuleChecked:
    """One instance checked: which, at which lengths and dtypes, how long, and what was found."""

    path: str
    cls: str
    op: str
    kernel: str
    patch_index: int
    instances: int  # the instances of the model this one stands for (same class, patch, kernel, shapes)
    width: int
    lengths: tuple[int, ...]
    dtypes: tuple[str, ...]
    backward: bool
    seconds: float
    cached: bool
    checks: list[Check] = field(default_factory=list, repr=False)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed and c.counted]

    @property
    def passed(self) -> bool:
        return not self.failures

    def finding(self) -> str:
        """The worst failing check as one line: the dtype, the length, the difference and the judge's note."""
        forward = [c for c in self.failures if c.what != "backward"]  # the forward's, where it fails: the plainer
        worst = max(forward or self.failures, key=lambda c: c.max_abs)
        note = worst.note.split("] ", 1)[1] if worst.note.startswith("[") and "] " in worst.note else ""
        return (f"{self.path} ({self.cls}, patch {self.patch_index}: {self.op}, kernel {self.kernel}): {worst.what} "
                f"in {worst.dtype} at {_length(worst)} (width {self.width}) differs from the original's by max "
                f"abs {worst.max_abs:.3g} (max rel {worst.max_rel:.3g})" + (f": {note}" if note else ""))


@dataclass
class RealModules:
    """What the real-module check did for one apply (``Report.real_modules``): checked, not checked, and why."""

    checked: list[ModuleChecked] = field(default_factory=list)
    not_checked: list[tuple[str, str]] = field(default_factory=list)  # (what: "Class (op) at path", why)
    skipped: str = ""  # the whole check was not run, and why (unverified="trust", check_modules=False)
    seconds: float = 0.0
    #: patches left unpatched by zero configuration after a failure here: "Class (op): finding"
    left_unpatched: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[ModuleChecked]:
        return [m for m in self.checked if not m.passed]

    @property
    def passed(self) -> bool:
        return not self.failed

    def failed_patches(self) -> set[int]:
        return {m.patch_index for m in self.failed}

    def message(self) -> str:
        """The refusal: each failing instance with its path, class, patch, dtype, length and difference."""
        lines = [m.finding() for m in self.failed]
        return ("patch-engine: a patched module computes other numbers than its original forward on your own "
                f"module (checked at {', '.join(map(str, LENGTHS))} rows with its own weights, width, dtype and "
                "device), so nothing was patched; the model is as it was before this call:\n  " + "\n  ".join(lines))

    def summary(self) -> str:
        """One line: ``checked on your own modules: 3 passed (1, 17, 129 rows; fp32; 0.12 s); not checked: 1 (...)``."""
        if self.skipped:
            return f"not checked on your own modules: {self.skipped}"
        failed = len(self.failed)
        text = f"checked on your own modules: {len(self.checked) - failed} passed"
        text += f", {failed} FAILED" if failed else ""
        if self.checked:
            cached = sum(m.cached for m in self.checked)
            dtypes = ", ".join(sorted({t for m in self.checked for t in m.dtypes}))
            text += (f" ({', '.join(map(str, LENGTHS))} rows; {dtypes}; {self.seconds:.2f} s"
                     + (f"; {cached} cached" if cached else "") + ")")
        if self.left_unpatched:
            text += f"; left unpatched: {', '.join(line.split(': not patched')[0] for line in self.left_unpatched)}"
        if self.not_checked:
            whys = sorted({why.split(";")[0].split(" (")[0] for _, why in self.not_checked})
            text += f"; not checked: {len(self.not_checked)} ({'; '.join(whys)})"
        return text

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": [{k: v for k, v in asdict(m).items() if k != "checks"} | {"passed": m.passed}
                        for m in self.checked],
            "failures": [m.finding() for m in self.failed],
            "not_checked": [{"what": what, "why": why} for what, why in self.not_checked],
            "skipped": self.skipped, "seconds": self.seconds, "left_unpatched": list(self.left_unpatched),
        }


def _length(check: Check) -> str:
    """``1 row``, ``17 rows``: the length a check ran at, from its note (:func:`_at`)."""
    rows = check.note.split(" rows]", 1)[0].rsplit("[", 1)[-1] if " rows]" in check.note else "?"
    return f"{rows} row" + ("" if rows == "1" else "s")


def check_real_modules(model: nn.Module, report: Any, *, cache: bool = True) -> RealModules:
    """Check one instance per patched class and shape of ``model`` (patched by ``report``); see the module docstring."""
    started = time.perf_counter()
    inner = unwrap(model)
    named = dict(inner.named_modules())
    record = RealModules()
    budget = _budget(inner)
    training = getattr(report, "mode", "training") == "training"
    chosen: dict[tuple[Any, ...], tuple[Any, nn.Module, int]] = {}
    structured: dict[tuple[str, str], list[str]] = {}
    for d in report.decisions:
        if d.action != "patch":
            continue
        if d.op not in HIDDEN_OPS or d.site is not None or d.path not in named:
            structured.setdefault((d.cls, d.op), []).append(d.path)
            continue
        module = named[d.path]
        params = _parameters(module)  # once per instance: this loop is the whole cost of a warm check
        why = _unfit([p for _, p in params], budget)
        if why:
            record.not_checked.append((f"{d.cls} ({d.op}) at {d.path}", why))
            continue
        group = (type(module), d.patch_index, d.kernel, tuple((n, tuple(p.shape)) for n, p in params))
        if group in chosen:
            first, mod, n = chosen[group]
            chosen[group] = (first, mod, n + 1)
        else:
            chosen[group] = (d, module, 1)
    for (cls, op), paths in structured.items():
        where = paths[0] + (f" and {len(paths) - 1} more" if len(paths) > 1 else "")
        record.not_checked.append((f"{cls} ({op}) at {where}", STRUCTURED))
    for d, module, instances in chosen.values():
        done = _check_one(d, module, instances, training, cache, inner)
        if isinstance(done, str):
            record.not_checked.append((f"{d.cls} ({d.op}) at {d.path}", done))
        else:
            record.checked.append(done)
    record.seconds = round(time.perf_counter() - started, 4)
    return record


def _check_one(d: Any, module: nn.Module, instances: int, training: bool, cache: bool,
               model: nn.Module) -> ModuleChecked | str:
    """The checks of one instance (read from :data:`_CACHE` where they were made), or why it was not checked."""
    started = time.perf_counter()
    dtypes = (_dtype(module),)
    width = _width(module, model, getattr(d.patch, "weight_attr", None) or "weight")
    backward = training and any(p.requires_grad for p in module.parameters())
    key = _key(module, d, dtypes, backward)
    found = _CACHE.get(key) if cache else None
    cached = found is not None
    if found is None:
        inputs = _inputs(d.op, width, module, _trailing(module, getattr(d.patch, "weight_attr", None) or "weight"))
        on = {LENGTHS.index(n) for n in BACKWARD_LENGTHS} if backward else set()
        try:
            per_length = verify_module_inputs(d, module, inputs, dtypes, in_place=True, at_scale=False, lean=True,
                                              backward_on=on)
        except Exception as exc:  # noqa: BLE001 - the original refusing our input is ours; the patch raising is its
            why = _refused(d, module, inputs[0], exc)
            if why:
                return why
            raised = Check(d.path, d.cls, d.op, "kernel", DTYPE_NAMES.get(dtypes[0], "-"), float("inf"), float("inf"),
                           False, f"the patched module raised where the original did not: {type(exc).__name__}: "
                           f"{str(exc)[:200]}", d.kernel or "-")
            per_length = [[raised]] + [[] for _ in LENGTHS[1:]]
        found = [_at(c, length) for length, checks in zip(LENGTHS, per_length, strict=True) for c in checks]
        if cache:
            _CACHE[key] = found
    # this instance's path, with the numbers of the outcome (perhaps cached from another model's instance)
    checks = [Check(d.path, d.cls, c.op, c.what, c.dtype, c.max_abs, c.max_rel, c.passed, c.note, c.kernel,
                    limit=c.limit, counted=c.counted) for c in found]
    return ModuleChecked(d.path, d.cls, d.op, d.kernel or "-", d.patch_index, instances, width, LENGTHS,
                         tuple(DTYPE_NAMES.get(t, str(t)) for t in dtypes), backward,
                         round(time.perf_counter() - started, 4), cached, checks)


def _refused(d: Any, module: nn.Module, first: tuple[Any, Any], exc: Exception) -> str:
    """Why the check could not run (the original forward refuses the hidden states it was given), or ``""``."""
    from engine.ops.base import ModuleOp, get_op

    op = get_op(d.op)
    assert isinstance(op, ModuleOp)
    args, kwargs = first
    try:
        with torch.no_grad():
            op.ground_truth(module)(module, *args, **kwargs)
    except Exception as own:  # noqa: BLE001 - any refusal of the original's is reported, not raised
        return f"its original forward does not take hidden states (1, L, width): {type(own).__name__}: {str(own)[:160]}"
    return ""


def _at(check: Check, length: int) -> Check:
    """``check`` with its length in the note (``[129 rows]``), where a message finds it."""
    check.note = f"[{length} rows] {check.note}".rstrip()
    return check


def _key(module: nn.Module, d: Any, dtypes: tuple[torch.dtype, ...], training: bool) -> tuple[Any, ...]:
    """What an outcome depends on, short of the weights' values: the code, the patch, the kernel, the shapes.

    The class object and its ``forward`` function (a forward rebound on the class is other code),
    the patch's content, the kernel, parameter shapes, the dtypes, the device and the mode.
    """
    cls = type(module)
    content = d.patch.model_dump_json() if hasattr(d.patch, "model_dump_json") else repr(d.patch)
    device = next(module.parameters(), torch.empty(0)).device
    return (cls, cls.__dict__.get("forward", getattr(cls, "forward", None)), content, d.kernel, _shapes(module),
            dtypes, str(device), training)


def _parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``named_parameters()`` without its generators, prefixes and de-duplication: a warm check walks ~100 modules."""
    found: list[tuple[str, torch.Tensor]] = []
    stack = [("", module)]
    while stack:
        prefix, here = stack.pop()
        found += [(prefix + n, p) for n, p in here._parameters.items() if p is not None]
        stack += [(f"{prefix}{n}.", child) for n, child in here._modules.items() if child is not None]
    return found


def _shapes(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in _parameters(module))


def _dtype(module: nn.Module) -> torch.dtype:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def _budget(model: nn.Module) -> int:
    """The most bytes one check may hold: :data:`MEMORY_SHARE` of the model's parameter memory, or the floor."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(int(MEMORY_SHARE * total), MEMORY_FLOOR)


def _unfit(params: list[torch.Tensor], budget: int) -> str:
    """Why a module of these parameters cannot be checked here cheaply (``""``: it can).

    The check copies no parameter (its dtype runs in place); what it may hold is the fp64 truth's
    upcast of one parameter at a time (of a row block past ``truth._BIG`` elements), and hidden states.
    """
    if any(p.device.type == "meta" for p in params):
        return "its parameters are on the meta device (nothing to compute with until they are materialized)"
    if any(hasattr(p, "ds_id") or hasattr(p, "ds_numel") for p in params) or any(p.numel() == 0 for p in params):
        return "its parameters are partitioned (DeepSpeed ZeRO-3): gathering them to check would cost a step"
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none exists unless imported
    if dtensor is not None and any(isinstance(p, dtensor) for p in params):
        return "its parameters are DTensors (FSDP2 / tensor parallelism): a shard is not the module"
    held = 8 * min(max((p.numel() for p in params), default=0), _BIG)
    if held > budget:
        return (f"its fp64 truth would hold {held / 2**20:.0f} MiB, over the check's budget of {budget / 2**20:.0f} "
                f"MiB ({MEMORY_SHARE:.0%} of the model's parameter memory)")
    return ""


def _width(module: nn.Module, model: nn.Module, weight_attr: str = "weight") -> int:
    """The hidden width the module takes: a norm's weight's last dim, the first linear's inputs, or the config's."""
    weight = module._parameters.get(weight_attr)
    if weight is not None and weight.dim() >= 1:
        return int(weight.shape[-1])
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and shape:
        return int(shape[-1])
    linear = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    if linear is not None:
        return int(linear.in_features)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "hidden_size", 0) or 0)


def _trailing(module: nn.Module, weight_attr: str = "weight") -> tuple[int, ...] | None:
    """A weight of more than one dimension (Cohere's per-head LayerNorm, ``(heads, head_dim)``): the input's last
    dimensions are its shape; ``None`` for the usual 1-D weight (the input ends in its width)."""
    weight = module._parameters.get(weight_attr)
    return tuple(int(n) for n in weight.shape) if weight is not None and weight.dim() > 1 else None


def _inputs(op: str, width: int, module: nn.Module,
            trailing: tuple[int, ...] | None = None) -> list[tuple[tuple[torch.Tensor, ...], dict[str, Any]]]:
    """Hidden states ``(1, L, width)`` for each of :data:`LENGTHS` (and a gate for a gated norm), seeded.

    Drawn from a generator of their own, so no random state of the caller moves; in fp32 on the
    module's device (each dtype's check casts them).
    """
    device = next(module.parameters(), torch.empty(0)).device
    gen = torch.Generator().manual_seed(0)
    sets = []
    for length in LENGTHS:
        shape = (1, length, *(trailing or (width,)))
        x = torch.randn(*shape, generator=gen).to(device)
        args: tuple[torch.Tensor, ...] = (x,)
        if op == "gated_rms_norm":
            args = (x, torch.randn(*shape, generator=gen).to(device))
        sets.append((args, {}))
    return sets
