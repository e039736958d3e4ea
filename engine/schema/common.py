"""The shared part of the patchset vocabulary: the base models every patch builds on, and enums.

Split from :mod:`engine.schema` (which re-exports every name here) to keep each module to one
job and a readable size: this file says what every patch has (kernel, optional, signature,
target or function) and the value sets several ops share; ``engine.schema`` holds the patch
of each op and the patchset. Like it, this module imports no torch.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "Activation",
    "CastOrder",
    "Device",
    "FunctionPatch",
    "GateOrder",
    "KernelName",
    "KernelSpec",
    "ModulePatch",
    "OnUnsupported",
    "PatchBase",
    "Precision",
    "Requires",
    "Scale",
    "StrictModel",
    "When",
]


class StrictModel(BaseModel):
    """Base of every schema model: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)

    def __setstate__(self, state: dict[Any, Any]) -> None:
        """Unpickling: a field added since the object was pickled takes its default.

        Why: a model patched and pickled by an earlier engine holds its patches' declarations;
        loaded by this one, a setting added since (``weight_required``) would otherwise be missing
        from the object, and the forward that reads it would fail on the first call.
        """
        super().__setstate__(state)
        values = self.__dict__
        for name, info in type(self).model_fields.items():
            if name not in values and not info.is_required():
                values[name] = info.get_default(call_default_factory=True)


class Device(StrEnum):
    """Accelerator types a kernel can be chosen for."""

    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"
    xpu = "xpu"
    mps = "mps"


class OnUnsupported(StrEnum):
    """What to do when an explicitly named kernel cannot run on the plan's device."""

    error = "error"  # raise DeviceUnsupported before anything is patched
    skip = "skip"  # leave that target unpatched, and say so in the report
    fallback = "fallback"  # use the torch reference kernel, and say so in the report


class Scale(StrEnum):
    """How a norm applies its weight. Declared, never guessed from values or names."""

    weight = "weight"  # y = w * x_hat          (llama, qwen3, mistral, olmo2, ...)
    one_plus_weight = "one_plus_weight"  # y = (1 + w) * x_hat  (gemma, qwen3_next, qwen3_5, ...)


class CastOrder(StrEnum):
    """Where a norm casts back to the input dtype relative to the weight multiply."""

    llama = "llama"  # normalize in fp32, cast to the input dtype, then multiply by the weight
    fp32 = "fp32"  # multiply by the weight in fp32, cast to the input dtype last (gemma, olmo2, gpt_oss)


class Precision(StrEnum):
    """Where the kernel's math runs."""

    native = "native"  # as the cast order says
    fp32 = "fp32"  # force every step into fp32; the output is cast back to the input dtype


class Activation(StrEnum):
    """Gate activations of SwiGLU-style MLPs and gated norms."""

    silu = "silu"
    sigmoid = "sigmoid"


class GateOrder(StrEnum):
    """Where a gated norm applies its gate relative to the normalization."""

    norm_then_gate = "norm_then_gate"  # y = norm(x) * act(gate)   (qwen3_next, qwen3_5, kimi_linear, falcon_h1)
    gate_then_norm = "gate_then_norm"  # y = norm(x * act(gate))   (mamba2, bamba, zamba2, nemotron_h)


KernelName = Annotated[
    str,
    Field(
        min_length=1,
        description="A registered kernel provider name (see `patch-engine kernels`).",
    ),
]

#: ``auto`` (the first provider that supports the device), one name for every device, or a
#: map from device to name. Devices missing from the map use ``auto``.
KernelSpec = Union[Literal["auto"], KernelName, dict[Device, KernelName]]


def _check_kernel_names(value: Any) -> Any:
    """Refuse kernel names no provider is registered under, listing the known ones.

    Checked against :mod:`engine.schema.kernel_names` (a torch-free table), so validating a file
    imports no kernel; whether the named kernel serves the op on the device is the planner's check.
    """
    from engine.schema import kernel_names

    names = [value] if isinstance(value, str) else list(value.values()) if isinstance(value, dict) else []
    known = kernel_names.known()
    for name in names:
        if name != "auto" and name not in known:
            raise ValueError(f"unknown kernel {name!r}; known kernels: auto, {', '.join(sorted(known))}")
    return value


class Requires(StrictModel):
    """Library versions the patchset was written and verified against (PEP 440 ranges)."""

    transformers: str | None = Field(default=None, description="e.g. '>=5.0,<6'")

    @field_validator("transformers")
    @classmethod
    def _valid_specifier(cls, value: str | None) -> str | None:
        if value is not None:
            from packaging.specifiers import InvalidSpecifier, SpecifierSet

            try:
                SpecifierSet(value)
            except InvalidSpecifier as exc:
                raise ValueError(f"{value!r} is not a PEP 440 version range such as '>=5.0,<6'") from exc
        return value


class When(Requires):
    """Library versions a single patch is for (PEP 440 ranges); outside them the patch is left out.

    Why per patch: a family's modeling code changes between transformers releases (its experts
    class, the function its linear attention calls, its rope function's name), so one patchset
    covers several releases with one patch per shape of the code, each saying which versions
    have that shape. A patch without ``when`` is for every version in the patchset's ``requires``.
    """

    transformers: str | None = Field(default=None, description="e.g. '<5.10' or '>=5.10,<6'")


class PatchBase(StrictModel):
    """Settings every patch has, whatever its op."""

    kernel: KernelSpec = Field(default="auto", description="auto, a kernel name, or {device: kernel name}.")
    optional: bool = Field(
        default=False,
        description="Allow the target to match nothing. Off by default: a patch that patches nothing is an error.",
    )
    when: When | None = Field(
        default=None,
        description=(
            "Only for these library versions, e.g. {transformers: '<5.10'}: outside them the patch is left out "
            "(and the plan says so). Two patches may name the same target when their `when` ranges differ."
        ),
    )
    signature: str | None = Field(
        default=None,
        description=(
            "Pin of the target's forward (or function) signature as inspect.signature prints it, e.g. "
            "'(self, hidden_states: torch.Tensor) -> torch.Tensor'. The planner refuses when the installed "
            "library's differs, and says what changed."
        ),
    )

    @field_validator("kernel")
    @classmethod
    def _known_kernels(cls, value: Any) -> Any:
        return _check_kernel_names(value)

    @field_validator("signature")
    @classmethod
    def _parsable_signature(cls, value: str | None) -> str | None:
        if value is not None:
            from engine.foundation.drift import parse_signature

            parse_signature(value)  # ValueError says what a signature looks like
        return value


class ModulePatch(PatchBase):
    """A patch that replaces the forward of every module of a class (per instance)."""

    target: str = Field(min_length=1, description="Class name, matched over model.named_modules().")


class FunctionPatch(PatchBase):
    """A patch that replaces a module-level function of the model's modeling module, for this model only."""

    function: str = Field(min_length=1, description="Name of the function in the model's modeling module.")
