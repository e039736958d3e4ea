"""geglu and SwiGLU with a fused gate_up_proj, against every transformers class they target.

Each class is built from a small config with perturbed weights; the patched forward (torch
reference kernel) must equal the class's own forward bit for bit in fp32 and bf16, and a
class whose computation the op does not reproduce is refused at plan time.
"""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from engine.errors import SignatureMismatch
from engine.kernels import registry
from engine.ops.base import get_op
from engine.schema import GegluPatch, GeluApproximate, GateUpOrder, SwigluPatch
from engine.tiny import perturb_

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _mlp(module_path: str, cls_name: str, config_cls: str, *args, **cfg) -> torch.nn.Module:
    import importlib

    modeling = importlib.import_module(f"transformers.models.{module_path}")
    configs = importlib.import_module("transformers")
    config = getattr(configs, config_cls)(hidden_size=32, intermediate_size=48, **cfg)
    return perturb_(getattr(modeling, cls_name)(config, *args), seed=3)


GEGLU_CLASSES = [
    ("gemma.modeling_gemma", "GemmaMLP", "GemmaConfig", {}),
    ("gemma2.modeling_gemma2", "Gemma2MLP", "Gemma2Config", {}),
    ("gemma3.modeling_gemma3", "Gemma3MLP", "Gemma3TextConfig", {}),
    ("gemma4.modeling_gemma4", "Gemma4TextMLP", "Gemma4TextConfig", {"layer_idx": 0}),
]
FUSED_SWIGLU_CLASSES = [
    ("phi3.modeling_phi3", "Phi3MLP", "Phi3Config", {}),
    ("glm.modeling_glm", "GlmMLP", "GlmConfig", {}),
    ("glm4.modeling_glm4", "Glm4MLP", "Glm4Config", {}),
]


def _patched_equals_own_forward(module: torch.nn.Module, patch, dtype: torch.dtype) -> None:
    op = get_op(patch.op)
    module = copy.deepcopy(module).to(dtype)
    op.check_target(module, patch)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    forward = op.bind(module, patch, registry.get("torch", patch.op).build(patch))
    want = type(module).forward(module, x)
    (gw,) = torch.autograd.grad(want.float().pow(2).sum(), x)
    got = forward(module, x)
    (gg,) = torch.autograd.grad(got.float().pow(2).sum(), x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(gg, gw)


@pytest.mark.parametrize(("path", "cls", "config", "cfg"), GEGLU_CLASSES, ids=[c[1] for c in GEGLU_CLASSES])
@DTYPES
def test_geglu_is_bit_exact_with_every_gemma_mlp(path, cls, config, cfg, dtype) -> None:
    module = _mlp(path, cls, config, *cfg.values())
    _patched_equals_own_forward(module, GegluPatch(target=cls, op="geglu"), dtype)


@pytest.mark.parametrize(("path", "cls", "config", "cfg"), FUSED_SWIGLU_CLASSES,
                         ids=[c[1] for c in FUSED_SWIGLU_CLASSES])
@DTYPES
def test_swiglu_with_fused_gate_up_is_bit_exact(path, cls, config, cfg, dtype) -> None:
    module = _mlp(path, cls, config, **cfg)
    patch = SwigluPatch(target=cls, op="swiglu", gate_up_proj="gate_up_proj", act_attr="activation_fn")
    _patched_equals_own_forward(module, patch, dtype)


def test_swapped_chunk_order_changes_the_numbers_and_is_named_as_the_fix() -> None:
    module = _mlp("phi3.modeling_phi3", "Phi3MLP", "Phi3Config")
    wrong = SwigluPatch(target="Phi3MLP", op="swiglu", gate_up_proj="gate_up_proj", chunk_order=GateUpOrder.up_gate,
                        act_attr="activation_fn")
    op = get_op("swiglu")
    x = torch.randn(3, 32)
    got = op.bind(module, wrong, registry.get("torch", "swiglu").build(wrong))(module, x)
    assert not torch.allclose(got, module(x), atol=1e-3)
    labels = [label for label, _ in op.alternatives(wrong)]
    assert labels == ["chunk_order: gate_up"]


@pytest.mark.parametrize(
    ("module_args", "patch", "message"),
    [
        (("llama.modeling_llama", "LlamaMLP", "LlamaConfig"), GegluPatch(target="LlamaMLP", op="geglu"),
         "does not compute gelu(approximate='tanh') exactly"),
        (("gemma.modeling_gemma", "GemmaMLP", "GemmaConfig"), SwigluPatch(target="GemmaMLP", op="swiglu"),
         "does not compute silu exactly"),
        (("gemma.modeling_gemma", "GemmaMLP", "GemmaConfig"),
         GegluPatch(target="GemmaMLP", op="geglu", approximate=GeluApproximate.none),
         "does not compute gelu(approximate='none') exactly"),
        (("phi3.modeling_phi3", "Phi3MLP", "Phi3Config"),
         SwigluPatch(target="Phi3MLP", op="swiglu", act_attr="activation_fn"),
         "a fused gate and up projection is declared with gate_up_proj"),
        (("phi3.modeling_phi3", "Phi3MLP", "Phi3Config"), SwigluPatch(target="Phi3MLP", op="swiglu",
                                                                     gate_up_proj="gate_up_proj"),
         "Phi3MLP.act_fn is missing (no attribute 'act_fn')"),
    ],
    ids=["geglu-on-silu", "swiglu-on-gelu", "erf-on-tanh", "split-on-fused", "act-attr"],
)
def test_plan_time_refusals_say_why(module_args, patch, message) -> None:
    module = _mlp(*module_args)
    with pytest.raises(SignatureMismatch) as info:
        get_op(patch.op).check_target(module, patch)
    assert message in str(info.value)


def test_gelu_python_formula_is_refused_not_approximated() -> None:
    """gelu_python_tanh computes the same function by another formula: not bit-equal, so refused."""
    module = _mlp("gemma.modeling_gemma", "GemmaMLP", "GemmaConfig", hidden_act="gelu_python_tanh")
    with pytest.raises(SignatureMismatch, match="does not compute gelu"):
        get_op("geglu").check_target(module, GegluPatch(target="GemmaMLP", op="geglu"))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gate_up_proj": "gate_up_proj", "gate_proj": "w1"}, "set either gate_up_proj"),
        ({"chunk_order": "up_gate"}, "chunk_order applies only with gate_up_proj"),
    ],
)
def test_schema_refuses_contradictory_projections(data, message) -> None:
    with pytest.raises(ValidationError, match=message):
        SwigluPatch(target="X", op="swiglu", **data)


def test_dumped_patch_reloads_unchanged() -> None:
    patch = GegluPatch(target="Phi3MLP", op="geglu", gate_up_proj="gate_up_proj", chunk_order="up_gate")
    assert GegluPatch.model_validate(patch.model_dump()) == patch


@pytest.mark.parametrize(
    ("module_args", "op", "declared"),
    [
        (("gemma.modeling_gemma", "GemmaMLP", "GemmaConfig"), "geglu",
         {"gate_proj": "gate_proj", "up_proj": "up_proj", "approximate": GeluApproximate.tanh}),
        (("phi3.modeling_phi3", "Phi3MLP", "Phi3Config"), "swiglu",
         {"gate_up_proj": "gate_up_proj", "chunk_order": GateUpOrder.gate_up, "act_attr": "activation_fn"}),
    ],
    ids=["geglu", "fused-swiglu"],
)
def test_scaffold_candidates_include_the_declaration_and_only_it_is_exact(module_args, op, declared) -> None:
    """The candidates the scaffold measures contain the bundled declaration, and no other one is bit-exact."""
    module = _mlp(*module_args)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    want = module(x)
    exact = []
    for patch in get_op(op).candidates(module):
        try:
            get_op(op).check_target(module, patch)
        except SignatureMismatch:
            continue
        got = get_op(op).bind(module, patch, registry.get("torch", op).build(patch))(module, x)
        if torch.equal(got, want):
            exact.append(patch)
    assert len(exact) == 1
    assert all(getattr(exact[0], k) == v for k, v in declared.items())


# ---------------------------------------------------------------------------------- mlp (no gate)

UNGATED_CLASSES = [
    # (module path, class, config class, config keys, declaration)
    ("gpt_neox.modeling_gpt_neox", "GPTNeoXMLP", "GPTNeoXConfig", {"num_attention_heads": 4},
     {"activation": "gelu", "up_proj": "dense_h_to_4h", "down_proj": "dense_4h_to_h", "act_attr": "act"}),
    ("phi.modeling_phi", "PhiMLP", "PhiConfig", {"num_attention_heads": 4},
     {"activation": "gelu_new", "up_proj": "fc1", "down_proj": "fc2", "act_attr": "activation_fn"}),
    ("starcoder2.modeling_starcoder2", "Starcoder2MLP", "Starcoder2Config", {"num_attention_heads": 4},
     {"activation": "gelu_tanh", "up_proj": "c_fc", "down_proj": "c_proj", "act_attr": "act",
      "dropout_attr": "residual_dropout"}),
    ("falcon.modeling_falcon", "FalconMLP", "FalconConfig", {"ffn_hidden_size": 48, "num_attention_heads": 4},
     {"activation": "gelu", "up_proj": "dense_h_to_4h", "down_proj": "dense_4h_to_h", "act_attr": "act"}),
    ("nemotron_h.modeling_nemotron_h", "NemotronHMLP", "NemotronHConfig", {"mlp_bias": True},
     {"activation": "relu2", "up_proj": "up_proj", "down_proj": "down_proj", "act_attr": "act_fn"}),
    ("nemotron.modeling_nemotron", "NemotronMLP", "NemotronConfig", {"mlp_bias": True},
     {"activation": "relu2", "up_proj": "up_proj", "down_proj": "down_proj", "act_attr": "act_fn"}),
]


def _ungated(path: str, cls: str, config_cls: str, cfg: dict) -> torch.nn.Module:
    return _mlp(path, cls, config_cls, **cfg)


@pytest.mark.parametrize(("path", "cls", "config", "cfg", "declared"), UNGATED_CLASSES,
                         ids=[c[1] for c in UNGATED_CLASSES])
@DTYPES
def test_ungated_mlp_is_bit_exact_with_every_family(path, cls, config, cfg, declared, dtype) -> None:
    from engine.schema import MlpPatch

    module = _ungated(path, cls, config, cfg)
    _patched_equals_own_forward(module, MlpPatch(target=cls, op="mlp", **declared), dtype)


@pytest.mark.parametrize(("path", "cls", "config", "cfg", "declared"), UNGATED_CLASSES,
                         ids=[c[1] for c in UNGATED_CLASSES])
def test_ungated_candidates_hold_exactly_one_exact_declaration(path, cls, config, cfg, declared) -> None:
    """What the scaffold relies on: among the mlp candidates, one declaration is exact, the bundled one."""
    module = _ungated(path, cls, config, cfg)
    op = get_op("mlp")
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    want = module(x)
    exact = []
    for p in op.candidates(module):
        try:  # the other order of the two projections does not run (shapes): the scaffold counts it as no match
            got = op.bind(module, p, registry.get("torch", "mlp").build(p))(module, x)
        except RuntimeError:
            continue
        if torch.equal(got, want):
            exact.append(p)
    assert len(exact) == 1, exact
    assert {k: getattr(exact[0], k) for k in declared} == declared


def test_gelu_new_and_tanh_gelu_are_different_declarations() -> None:
    """Phi's gelu_new writes the tanh GELU out: not bit-equal to F.gelu(approximate='tanh'), so refused as that."""
    from engine.schema import MlpPatch

    module = _mlp("phi.modeling_phi", "PhiMLP", "PhiConfig", num_attention_heads=4)
    wrong = MlpPatch(target="PhiMLP", op="mlp", activation="gelu_tanh", up_proj="fc1", down_proj="fc2",
                     act_attr="activation_fn")
    with pytest.raises(SignatureMismatch, match="does not compute gelu_tanh exactly \\(activation: gelu_new fits\\)"):
        get_op("mlp").check_target(module, wrong)


def test_dropout_in_the_forward_is_declared_or_refused() -> None:
    """StarCoder2 applies residual dropout to the MLP's output: without dropout_attr the op refuses, with it
    the patched forward draws the same mask from the same generator state as the original."""
    from engine.schema import MlpPatch

    module = _mlp("starcoder2.modeling_starcoder2", "Starcoder2MLP", "Starcoder2Config", residual_dropout=0.5,
                  num_attention_heads=4).train()
    plain = MlpPatch(target="Starcoder2MLP", op="mlp", activation="gelu_tanh", up_proj="c_fc", down_proj="c_proj",
                     act_attr="act")
    with pytest.raises(SignatureMismatch, match="applies dropout.*declare dropout_attr.*residual_dropout"):
        get_op("mlp").check_target(module, plain)
    declared = plain.model_copy(update={"dropout_attr": "residual_dropout"})
    get_op("mlp").check_target(module, declared)
    forward = get_op("mlp").bind(module, declared, registry.get("torch", "mlp").build(declared))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    want = module(x)
    torch.manual_seed(7)
    got = forward(module, x)
    assert torch.equal(got, want) and (want == 0).any()  # the same mask, and dropout did drop



def test_ungated_mlp_refuses_projections_that_do_not_chain() -> None:
    from engine.schema import MlpPatch

    module = _mlp("gpt_neox.modeling_gpt_neox", "GPTNeoXMLP", "GPTNeoXConfig", num_attention_heads=4)
    module.dense_4h_to_h = torch.nn.Linear(40, 32)
    declared = MlpPatch(target="GPTNeoXMLP", op="mlp", activation="gelu", up_proj="dense_h_to_4h",
                        down_proj="dense_4h_to_h", act_attr="act")
    with pytest.raises(SignatureMismatch, match="do not chain as up then down"):
        get_op("mlp").check_target(module, declared)
