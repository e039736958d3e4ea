"""The patchset vocabulary: pydantic models of what a YAML patchset may say.

Nothing but data shapes live here. Every model forbids unknown keys, so a typo such as
``scael: weight`` is an error instead of a silently dropped setting. Wherever the set of
values is known, the field is an enumeration, so the JSON Schema (``schemas/``) and the
error messages can list the valid choices.

Each op has one patch model, selected by the ``op`` key (a discriminated union). Module
ops name a ``target`` class; function ops name a module-level ``function``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from engine.schema.common import (
    Activation,
    CastOrder,
    Device,
    FunctionPatch,
    GateOrder,
    KernelName,
    KernelSpec,
    ModulePatch,
    OnUnsupported,
    PatchBase,
    Precision,
    Requires,
    Scale,
    StrictModel,
    When,
    _check_kernel_names,
)

__all__ = [
    "Activation",
    "CastOrder",
    "DeltaRule",
    "DeltaRuleForm",
    "ExpertsActivation",
    "ExpertsLayout",
    "Device",
    "FunctionPatch",
    "FusedCrossEntropy",
    "FusedLinearCrossEntropyPatch",
    "GateOrder",
    "GatedMlpPatch",
    "GatedRmsNormPatch",
    "GateUpOrder",
    "GegluPatch",
    "GeluApproximate",
    "LayerNormForm",
    "LayerNormPatch",
    "MlpActivation",
    "MlpPatch",
    "KernelSpec",
    "LinearAttentionPatch",
    "ModulePatch",
    "MoeExpertsPatch",
    "OnUnsupported",
    "Patch",
    "Patchset",
    "Precision",
    "Requires",
    "RmsNormPatch",
    "RopeLayout",
    "RopePatch",
    "Scale",
    "SwigluPatch",
    "When",
]




class RmsNormPatch(ModulePatch):
    """RMSNorm: ``x_hat = x * rsqrt(mean(x^2) + eps)``, then the weight, per ``scale`` and ``cast``."""

    op: Literal["rms_norm"]
    scale: Scale = Field(description="weight or one_plus_weight: declared, never guessed.")
    eps_attr: str = Field(default="variance_epsilon", description="Attribute of the module holding eps.")
    weight_attr: str = Field(default="weight", description="Attribute of the module holding the weight.")
    cast: CastOrder = Field(default=CastOrder.llama, description="Where the cast back to the input dtype happens.")
    precision: Precision = Precision.native
    weight_required: bool = Field(
        default=True,
        description=("false: an instance without the weight normalizes only (Gemma 3n's value norm, "
                     "with_scale=False: x_hat cast to the input dtype), as if its weight were 1 (or 1 + w with w = 0)."),
    )


class GatedRmsNormPatch(ModulePatch):
    """Gated RMSNorm: an RMSNorm whose output (or input) is multiplied by ``act(gate)``.

    Every setting that changes the numbers is required: the same hub name ("RMSNormGated")
    covers three different computations in transformers, and the activation is only
    visible in an instance attribute.
    """

    op: Literal["gated_rms_norm"]
    scale: Scale = Field(description="weight or one_plus_weight: declared, never guessed.")
    activation: Activation = Field(description="silu or sigmoid: the activation applied to the gate, in fp32.")
    order: GateOrder = Field(description="norm_then_gate (qwen3_next, kimi_linear) or gate_then_norm (mamba2).")
    cast: CastOrder = Field(description="llama: cast before the weight multiply; fp32: weight in fp32, cast last.")
    eps_attr: str = Field(default="variance_epsilon", description="Attribute of the module holding eps.")
    weight_attr: str = Field(default="weight", description="Attribute of the module holding the weight.")
    precision: Precision = Precision.native
    gate_required: bool = Field(
        default=True,
        description="A call without a gate raises ValueError; false: gate=None means no gating (mamba2, falcon_h1).",
    )
    group_size: int | None = Field(default=None, gt=0, description="Normalize over groups of this many features.")
    group_size_attr: str | None = Field(default=None, description="Module attribute holding the group size (mamba2).")
    num_groups_attr: str | None = Field(
        default=None, description="Module attribute holding the number of groups (falcon_h1: n_groups)."
    )

    @model_validator(mode="after")
    def _one_group_setting(self) -> GatedRmsNormPatch:
        given = [k for k in ("group_size", "group_size_attr", "num_groups_attr") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"set at most one of group_size, group_size_attr, num_groups_attr (got {', '.join(given)})")
        return self


class GateUpOrder(StrEnum):
    """Which half of a fused ``gate_up_proj`` output is the gate: ``a, b = out.chunk(2, -1)``."""

    gate_up = "gate_up"  # first half gate, second half up (Phi-3, GLM, GLM-4)
    up_gate = "up_gate"  # first half up, second half gate


class GatedMlpPatch(ModulePatch):
    """Gated MLPs ``down(act(gate(x)) * up(x))``: gate_proj and up_proj, or one fused gate_up_proj."""

    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    gate_up_proj: str | None = Field(default=None, description="A fused [gate, up] projection (Phi-3, GLM-4).")
    chunk_order: GateUpOrder = Field(default=GateUpOrder.gate_up, description="With gate_up_proj: the gate's half.")
    act_attr: str = Field(default="act_fn", description="Attribute holding the activation module; checked numerically.")

    @model_validator(mode="after")
    def _fused_or_split(self) -> GatedMlpPatch:
        # Judged by values, not by which keys were written, so a dumped patch reloads unchanged.
        if self.gate_up_proj is None:
            if self.chunk_order is not GateUpOrder.gate_up:
                raise ValueError("chunk_order applies only with gate_up_proj (a fused gate and up projection)")
            return self
        split = [k for k in ("gate_proj", "up_proj") if getattr(self, k) != k]  # each defaults to its own name
        if split:
            raise ValueError(f"set either gate_up_proj (one fused projection) or {' and '.join(split)}, not both")
        return self


class SwigluPatch(GatedMlpPatch):
    """Gated MLP: ``down(silu(gate(x)) * up(x))``."""

    op: Literal["swiglu"]
    activation: Literal[Activation.silu] = Activation.silu


class GeluApproximate(StrEnum):
    """Which GELU a GeGLU MLP's gate goes through (as ``torch.nn.functional.gelu`` names it)."""

    tanh = "tanh"  # gelu_pytorch_tanh (Gemma 1/2/3/4)
    none = "none"  # the exact erf GELU ("gelu")


class GegluPatch(GatedMlpPatch):
    """GeGLU MLP: ``down(gelu(gate(x)) * up(x))`` (Gemma's ``gelu_pytorch_tanh``)."""

    op: Literal["geglu"]
    approximate: GeluApproximate = Field(default=GeluApproximate.tanh, description="tanh (gelu_pytorch_tanh) or none.")


class LayerNormForm(StrEnum):
    """How a LayerNorm computes its statistics: the expression its forward is written with."""

    functional = "functional"  # F.layer_norm (nn.LayerNorm, Nemotron, OLMo 1)
    centered = "centered"  # x - mean, mean of its square, rsqrt, weight in fp32, cast last (Cohere, Cohere 2)


class LayerNormPatch(ModulePatch):
    """LayerNorm over the last dimension, weight and bias optional (vision towers: ``target: LayerNorm``;
    Nemotron: 1 + w; OLMo 1: no parameters, eps a literal; Cohere: centered, per-head weight)."""

    op: Literal["layer_norm"]
    scale: Scale = Field(default=Scale.weight, description="weight or one_plus_weight (Nemotron's LayerNorm1P).")
    eps_attr: str = Field(default="eps", description="Attribute of the module holding eps.")
    eps: float | None = Field(
        default=None, gt=0, lt=1,
        description="eps written as a literal in the forward (OLMo 1: 1e-5), when no attribute holds it; wins over eps_attr.",
    )
    weight_attr: str | None = Field(default="weight", description="Attribute holding the weight; null: no weight (OLMo 1).")
    bias_attr: str = Field(default="bias", description="Attribute holding the bias (None there: no bias).")
    form: LayerNormForm = Field(default=LayerNormForm.functional, description="functional (F.layer_norm) or centered (Cohere).")
    precision: Precision = Field(
        default=Precision.native, description="fp32: the input upcast first and the result cast back (OLMo 1).",
    )


class MlpActivation(StrEnum):
    """The activation of an MLP without a gate, as transformers' ``ACT2FN`` computes it (checked bit for bit)."""

    gelu = "gelu"  # exact erf GELU (GPT-NeoX / Pythia, Falcon, BERT)
    gelu_tanh = "gelu_tanh"  # F.gelu(approximate="tanh"): gelu_pytorch_tanh (StarCoder2, SigLIP)
    gelu_new = "gelu_new"  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) written out (Phi-1/2, GPT-2)
    quick_gelu = "quick_gelu"  # x * sigmoid(1.702 x) (CLIP)
    relu = "relu"
    relu2 = "relu2"  # square(relu(x)) (Nemotron, Nemotron-H)
    silu = "silu"


class MlpPatch(ModulePatch):
    """An MLP without a gate: ``down(act(up(x)))``, biases in the projections (GPT-NeoX, Phi-1/2, StarCoder2, Falcon)."""

    op: Literal["mlp"]
    activation: MlpActivation = Field(description="The activation, checked bit for bit against the module's own.")
    up_proj: str = Field(default="up_proj", description="The first projection (fc1, c_fc, dense_h_to_4h).")
    down_proj: str = Field(default="down_proj", description="The second projection (fc2, c_proj, dense_4h_to_h).")
    act_attr: str = Field(default="act_fn", description="Attribute holding the activation module.")
    dropout_attr: str | None = Field(
        default=None,
        description="Float attribute: dropout probability the forward applies to its output in training (StarCoder2).",
    )


class RopeLayout(StrEnum):
    """How a rotary function pairs the features it rotates."""

    half = "half"  # x * cos + rotate_half(x) * sin: feature i pairs with i + d/2 (llama, qwen, Qwen-VL mrope)
    interleaved = "interleaved"  # pairs (x0, x1), (x2, x3), ... rotated in place (GLM, GLM-4)
    interleaved_to_half = "interleaved_to_half"  # interleaved pairs in, [evens | odds] out (DeepSeek V3)
    interleaved_repeated = "interleaved_repeated"  # pairs rotated in place by cos/sin already repeated per pair (Cohere)
    complex = "complex"  # pairs as complex numbers times freqs_cis: f(xq, xk, freqs_cis) (Llama 4)


class RopePatch(FunctionPatch):
    """Rotary embedding applied to q and k, in one of the :class:`RopeLayout` layouts."""

    op: Literal["rope"]
    function: str = "apply_rotary_pos_emb"
    layout: RopeLayout = Field(
        default=RopeLayout.half, description="half, interleaved, interleaved_to_half, complex, interleaved_repeated."
    )
    upcast: bool = Field(default=False, description="Rotate in fp32 and cast back (the Qwen-VL vision functions).")
    unsqueeze_dim: int = Field(default=1, description="Default head dimension of cos/sin (-2: the vision functions).")

    @model_validator(mode="after")
    def _settings_of_layout(self) -> RopePatch:
        if self.layout in (RopeLayout.interleaved_to_half, RopeLayout.complex):
            given = [k for k, default in (("upcast", False), ("unsqueeze_dim", 1)) if getattr(self, k) != default]
            if given:
                raise ValueError(
                    f"{' and '.join(given)} apply to layouts half and interleaved only; "
                    f"layout {self.layout.value} follows its function's own signature"
                )
        return self


class DeltaRule(StrEnum):
    """The recurrence a linear-attention function computes (fla's names in the comments)."""

    gated_delta_rule = "gated_delta_rule"  # Qwen3-Next, Qwen3.5 GatedDeltaNet: scalar decay per head
    kimi_delta_attention = "kimi_delta_attention"  # Kimi Linear KDA: per-channel decay (fla: kda)


class DeltaRuleForm(StrEnum):
    """Which algorithm of the gated delta rule a function computes (same math, different schedule)."""

    chunk = "chunk"  # chunked over the sequence: training and prefill
    recurrent = "recurrent"  # token by token from a cached state: decode


class LinearAttentionPatch(FunctionPatch):
    """Linear attention by a delta rule (Qwen3-Next / Qwen3.5 GatedDeltaNet, Kimi Linear KDA).

    Replaces a module-level ``f(query, key, value, g, beta, ..., initial_state,
    output_final_state, use_qk_l2norm_in_kernel, **kwargs) -> (out, final_state)`` (fla's API).
    """

    op: Literal["linear_attention"]
    rule: DeltaRule = Field(default=DeltaRule.gated_delta_rule, description="The recurrence the function computes.")
    form: DeltaRuleForm = Field(description="chunk (training, prefill) or recurrent (decode): declared per function.")


class FusedLinearCrossEntropyPatch(ModulePatch):
    """Causal-LM head + loss fused: the loss from hidden states without the full ``[tokens, vocab]`` logits.

    Targets the ``*ForCausalLM`` class. With labels in training the loss is computed chunk by
    chunk (gradients included) and the output's ``logits`` is ``None``; without labels, or in
    eval mode, the model's own forward runs unchanged.
    """

    op: Literal["fused_linear_cross_entropy"]
    backbone: str | None = Field(
        default=None, description="Submodule returning last_hidden_state; default: the model's base_model_prefix."
    )
    lm_head: str = Field(default="lm_head", description="The output nn.Linear (no bias).")
    chunk_size: int | None = Field(
        default=None, ge=1,
        description="Tokens per chunk; default: an eighth of the tokens, with one chunk's fp32 logits between 32 and 256 MiB.",
    )


class FusedCrossEntropy(StrictModel):
    """Settings of the fused head when ``fused_cross_entropy`` is switched on with a mapping."""

    kernel: KernelSpec = Field(default="auto", description="auto, a kernel name, or {device: kernel name}.")
    chunk_size: int | None = Field(default=None, ge=1, description="Tokens per chunk (torch kernel); default: automatic.")

    @field_validator("kernel")
    @classmethod
    def _known_kernels(cls, value: Any) -> Any:
        return _check_kernel_names(value)


class ExpertsLayout(StrEnum):
    """Where gate and up sit in the fused gate_up projection's output features."""

    concatenated = "concatenated"  # [gate | up]: gate, up = out.chunk(2, -1) (qwen, mixtral, deepseek, ...)
    interleaved = "interleaved"  # g0, u0, g1, u1, ...: gate, up = out[..., ::2], out[..., 1::2] (gpt_oss)


class ExpertsActivation(StrEnum):
    """The gating of an expert, ``h = f(gate, up)``: ``act(gate) * up`` (the module's act checked bit for bit)."""

    silu = "silu"  # the activations of MlpActivation (ACT2FN's expressions): silu experts are most MoEs'
    gelu = "gelu"  # exact erf GELU (a config's hidden_act="gelu", as transformers' testers set it)
    gelu_tanh = "gelu_tanh"
    gelu_new = "gelu_new"
    quick_gelu = "quick_gelu"
    relu = "relu"
    relu2 = "relu2"
    clamped_swiglu = "clamped_swiglu"  # gpt_oss: g = min(gate, limit); (clamp(up, +-limit) + 1) * g * sigmoid(alpha g)


class MoeExpertsPatch(ModulePatch):
    """The experts of an MoE block: ``forward(hidden_states, top_k_index, top_k_weights)`` over 3-D expert weights.

    Per routed (token, slot): ``down_e(f(gate_up_e(x))) * weight``, summed per token. The
    layout of the weights is declared, and checked at plan time against the weights' shapes
    and the flags transformers' ``use_experts_implementation`` sets on the class.
    """

    op: Literal["moe_experts"]
    gate_up_proj: str = Field(default="gate_up_proj", description="3-D parameter: [E, 2I, H], or [E, H, 2I] if transposed.")
    down_proj: str = Field(default="down_proj", description="3-D parameter: [E, H, I], or [E, I, H] if transposed.")
    gate_up_bias: str | None = Field(default=None, description="[E, 2I] bias of gate_up_proj (gpt_oss: gate_up_proj_bias).")
    down_bias: str | None = Field(default=None, description="[E, H] bias of down_proj (gpt_oss: down_proj_bias).")
    layout: ExpertsLayout = Field(default=ExpertsLayout.concatenated, description="concatenated [gate|up] or interleaved.")
    transposed: bool = Field(default=False, description="Weights stored [E, in, out] (x @ W) instead of [E, out, in].")
    activation: ExpertsActivation = ExpertsActivation.silu
    act_attr: str = Field(default="act_fn", description="Attribute holding act; checked bit for bit.")
    alpha_attr: str = Field(default="alpha", description="clamped_swiglu: attribute holding alpha.")
    limit_attr: str = Field(default="limit", description="clamped_swiglu: attribute holding the clamp limit.")


Patch = Annotated[
    RmsNormPatch
    | GatedRmsNormPatch
    | SwigluPatch
    | GegluPatch
    | LayerNormPatch
    | MlpPatch
    | RopePatch
    | LinearAttentionPatch
    | FusedLinearCrossEntropyPatch
    | MoeExpertsPatch,
    Field(discriminator="op"),
]


class TinyModel(StrictModel):
    """A config for a tiny model of this family, so `patch-engine verify` and tests can build one."""

    model_type: str | None = Field(default=None, description="Defaults to the first of model_types.")
    config: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of AutoConfig.for_model.")
    random_buffers: dict[str, int | str] = Field(
        default_factory=dict,
        description=(
            "Integer buffers a checkpoint fills and transformers' init leaves at zero (a hash router's token-to-expert "
            "table), filled with seeded random values so the tiny model exercises them: buffer name (the last part of "
            "its path) -> exclusive upper bound, an int or the name of a config attribute (n_routed_experts)."
        ),
    )


class Patchset(StrictModel):
    """A named list of patches for one model family."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    extends: str | None = Field(
        default=None,
        description="A bundled patchset name (qwen3) or a .yaml/.yml path relative to this file; its patches come first.",
    )
    model_types: list[str] = Field(min_length=1, description="config.model_type values this patchset is for.")
    requires: Requires = Field(default_factory=Requires)
    on_unsupported: OnUnsupported = OnUnsupported.error
    tiny_model: TinyModel | None = None
    patches: list[Patch] = Field(default_factory=list)
    fused_cross_entropy: bool | FusedCrossEntropy = Field(
        default=False,
        description=(
            "Fuse the causal-LM head + loss (op fused_linear_cross_entropy on the model's own *ForCausalLM / "
            "*ForConditionalGeneration class, found at plan time): true, false, or {kernel, chunk_size}. "
            "engine.apply(model, ps, fused_cross_entropy=...) overrides it."
        ),
    )

    #: Where each patch is written, set by the loader: ``{(index,) or (index, key): (file, line)}``.
    #: Private (not data): planner errors use it to point at the offending patch.
    _origins: dict[tuple[Any, ...], tuple[str | None, int | None]] = PrivateAttr(default_factory=dict)
    #: The files read, as absolute paths: this patchset's own first, then each base ``extends`` pulled in.
    _files: tuple[str, ...] = PrivateAttr(default=())

    @property
    def files(self) -> tuple[str, ...]:
        """The files this patchset was loaded from (its own first, then its ``extends`` bases); () for a dict."""
        return self._files

    @model_validator(mode="after")
    def _unique_targets(self) -> Patchset:
        seen: dict[str, int] = {}
        for i, patch in enumerate(self.patches):
            key = patch_key(patch)
            if key in seen:
                raise ValueError(
                    f"patches[{i}] targets {key!r}, already targeted by patches[{seen[key]}]; "
                    "merge them into one patch"
                )
            seen[key] = i
        return self


def patch_key(patch: PatchBase) -> str:
    """What a patch replaces: its target class or its function, and its ``when`` range if any
    (unique within a patchset: one target may have one patch per version range)."""
    when = f" when transformers{patch.when.transformers}" if patch.when and patch.when.transformers else ""
    if isinstance(patch, ModulePatch):
        return patch.target + when
    if isinstance(patch, FunctionPatch):
        return f"function:{patch.function}" + when
    raise TypeError(f"not a patch: {patch!r}")
