"""What a ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward does after its backbone, read from its code.

Why read the code: the fused head replaces ``logits = lm_head(h)`` and ``loss_function``
and must reproduce every step in between and after, for any family, without a line of
per-family Python. transformers' causal-LM forwards are generated from a handful of
templates, so the steps are few and recognizable:

* ``hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)`` before the head
  (the patched forward passes an empty index so the model computes no logits at all);
* ``logits = self.lm_head(hidden_states)``;
* optionally Granite's logit scaling: ``logits = logits / self.config.logits_scaling`` (a
  division by an attribute path, read at call time; the kernel divides each chunk's logits), or
  MiniCPM3's, the same division of the head's input (``hidden_states = hidden_states / ...``);
* optionally Gemma's soft-capping: ``if <...>.final_logit_softcapping is not None:`` with
  ``logits = logits / cap; logits = torch.tanh(logits); logits = logits * cap``;
* ``loss = self.loss_function(logits, labels, ...)`` under ``if labels is not None``;
* optionally the MoE router loss: ``loss += self.<coef> * aux_loss.to(loss.device)``.

Anything else that touches ``logits`` or ``loss`` (a multiplication, a z-loss, a different
loss) is refused at plan time, naming the line, rather than silently computing another loss.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import SignatureMismatch

__all__ = ["HeadContract", "head_weight", "read_head_contract"]

_SOFTCAP = "final_logit_softcapping"


@dataclass(frozen=True)
class HeadContract:
    """The steps of a causal-LM forward after its backbone that the fused head reproduces."""

    softcap_path: tuple[str, ...] | None  # attributes from the model to the final-logit soft-cap, if applied
    aux_coef_path: tuple[str, ...] | None  # attributes from the model to the coefficient of ``aux_loss``, if added
    divisor_path: tuple[str, ...] | None = None  # attributes from the model to what the logits are divided by, if any

    def divisor(self, model: object) -> float | None:
        """What the forward divides the logits by now (Granite's ``config.logits_scaling``), or None."""
        return None if self.divisor_path is None else _resolve(model, self.divisor_path)

    def softcap(self, model: object) -> float | None:
        """The soft-cap value the forward would apply now (read at call time, as the forward does)."""
        return None if self.softcap_path is None else _resolve(model, self.softcap_path)

    def aux_coef(self, model: object) -> float | None:
        return None if self.aux_coef_path is None else _resolve(model, self.aux_coef_path)


#: A path step that stands for ``config.get_text_config()`` (composite models keep the cap there).
TEXT_CONFIG = "get_text_config()"


def _resolve(obj: object, path: tuple[str, ...]) -> object:
    if TEXT_CONFIG in path:  # as PaliGemma reads it: getattr(text_config, cap, None)
        head, tail = path[: path.index(TEXT_CONFIG)], path[path.index(TEXT_CONFIG) + 1 :]
        return getattr(_resolve(obj, head).get_text_config(), ".".join(tail), None)  # type: ignore[attr-defined]
    for attr in path:
        obj = getattr(obj, attr)
    return obj


def _text_config_softcap(fn: ast.FunctionDef, test: ast.expr) -> tuple[str, ...] | None:
    """``("config", TEXT_CONFIG, cap)`` when the test reads the cap from ``self.config.get_text_config()``.

    The two forms transformers writes: a walrus in the test (Gemma 4), or a local assigned
    from ``getattr(self.config.get_text_config(), "final_logit_softcapping", None)`` (PaliGemma).
    """
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    sources = [test] + [stmt for stmt in ast.walk(fn) if names & _assigned_names(stmt)]
    for node in sources:
        text = ast.unparse(node)
        if "self.config.get_text_config()" in text and _SOFTCAP in text:
            return ("config", TEXT_CONFIG, _SOFTCAP)
    return None


def _self_path(node: ast.AST) -> tuple[str, ...] | None:
    """``self.a.b.c`` as ``("a", "b", "c")``; None for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return tuple(reversed(parts))
    return None


def _source(function: object) -> tuple[ast.FunctionDef, int, str]:
    function = inspect.unwrap(function)  # type: ignore[arg-type]
    lines, first = inspect.getsourcelines(function)  # type: ignore[arg-type]
    tree = ast.parse(textwrap.dedent("".join(lines)))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    return node, first, inspect.getsourcefile(function) or "?"  # type: ignore[arg-type]


def _assigned_names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    return set()


def _calls_self_attr(node: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
        and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"
        for n in ast.walk(node)
    )


def _divisor(node: ast.stmt, name: str) -> tuple[str, ...] | None:
    """The path of ``self.<...>`` in ``<name> = <name> / self.<...>``, else None.

    ``logits = logits / self.config.logits_scaling`` (Granite, after the head) and ``hidden_states =
    hidden_states / self.config.logits_scaling`` (MiniCPM3, before it) are one contract: dividing the
    head's input by a scalar divides its logits by it (the fused head takes a head without bias,
    :func:`head_weight`).
    """
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == name):
        return None
    value = node.value
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Div)
            and isinstance(value.left, ast.Name) and value.left.id == name):
        return None
    return _self_path(value.right)


def _aux_coef(node: ast.AugAssign) -> tuple[str, ...] | None:
    """The path of ``self.<...>`` in ``loss += self.<...> * aux_loss...``, else None."""
    value = node.value
    if not (isinstance(node.op, ast.Add) and isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)):
        return None
    left, right = value.left, value.right
    mentions_aux = any(isinstance(n, ast.Name) and n.id == "aux_loss" for n in ast.walk(right))
    path = _self_path(left)
    return path if path is not None and mentions_aux else None


@functools.cache
def read_head_contract(cls: type, lm_head: str = "lm_head") -> HeadContract:
    """Read ``cls.forward`` and return what the fused head must reproduce.

    Raises:
        SignatureMismatch: the forward does something after the head that the fused head
            does not implement (named, with its file and line), or is not the template.
    """
    name = cls.__name__
    try:
        fn, first, file = _source(cls.forward)
    except (OSError, TypeError, SyntaxError) as exc:
        raise SignatureMismatch(f"cannot read {name}.forward's source ({exc}); fused_linear_cross_entropy "
                                "reproduces what the forward does after the head and needs to read it") from None
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    if not {"labels", "logits_to_keep"} <= params:
        missing = sorted({"labels", "logits_to_keep"} - params)
        raise SignatureMismatch(f"{name}.forward takes no {', '.join(missing)}: fused_linear_cross_entropy replaces "
                                "the head + loss of a causal-LM forward that takes both")
    if not any(isinstance(n, ast.Name) and n.id == "logits_to_keep" and isinstance(n.ctx, ast.Load) for n in ast.walk(fn)):
        raise SignatureMismatch(f"{name}.forward ignores logits_to_keep, so fused_linear_cross_entropy cannot skip "
                                "its logits; leave the fused head off for this family")
    softcap: tuple[str, ...] | None = None
    aux: tuple[str, ...] | None = None
    divisor: tuple[str, ...] | None = None
    head_calls = 0

    def where(node: ast.AST) -> str:
        return f"{file}:{first + getattr(node, 'lineno', 1) - 1}"

    def visit(stmts: list[ast.stmt], in_softcap: bool) -> None:
        nonlocal softcap, aux, divisor, head_calls
        for stmt in stmts:
            if isinstance(stmt, ast.If):
                test = ast.unparse(stmt.test)
                is_cap = _SOFTCAP in test and "is not None" in test
                if is_cap:
                    paths = [_self_path(n) for n in ast.walk(stmt.test) if isinstance(n, ast.Attribute)]
                    softcap = next((p for p in paths if p and p[-1] == _SOFTCAP), None)
                    softcap = softcap or _text_config_softcap(fn, stmt.test)
                    if softcap is None:
                        raise SignatureMismatch(
                            f"{name}.forward soft-caps with `{test}` ({where(stmt)}), not read from an attribute "
                            "path that fused_linear_cross_entropy can follow; leave the fused head off for this family"
                        )
                visit(stmt.body, in_softcap or is_cap)
                visit(stmt.orelse, in_softcap)
                continue
            if isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, field, []) or [], in_softcap)
                continue
            names = _assigned_names(stmt)
            if _calls_self_attr(stmt, lm_head):
                head_calls += 1
                continue
            before_head = head_calls == 0 and not in_softcap and divisor is None
            if before_head and (found := _divisor(stmt, "hidden_states")) is not None:
                divisor = found
                continue
            if "logits" in names and not in_softcap and head_calls == 1 and softcap is None and divisor is None:
                divisor = _divisor(stmt, "logits")
                if divisor is not None:
                    continue
            if "logits" in names and not in_softcap:
                raise SignatureMismatch(
                    f"{name}.forward changes the logits after the head ({where(stmt)}: `{ast.unparse(stmt)}`), "
                    "which fused_linear_cross_entropy does not implement; leave the fused head off for this family"
                )
            if "loss" in names:
                if isinstance(stmt, ast.AugAssign) and (coef := _aux_coef(stmt)) is not None:
                    aux = coef
                elif isinstance(stmt, ast.Assign) and (
                    (isinstance(stmt.value, ast.Constant) and stmt.value.value is None)
                    or _calls_self_attr(stmt.value, "loss_function")
                ):
                    pass
                else:
                    raise SignatureMismatch(
                        f"{name}.forward computes its loss in a way fused_linear_cross_entropy does not implement "
                        f"({where(stmt)}: `{ast.unparse(stmt)}`); leave the fused head off for this family"
                    )

    visit(fn.body, False)
    if head_calls != 1:
        raise SignatureMismatch(f"{name}.forward calls self.{lm_head} {head_calls} times; fused_linear_cross_entropy "
                                "replaces a forward that calls its head once")
    return HeadContract(softcap_path=softcap, aux_coef_path=aux, divisor_path=divisor)


def head_weight(head: object, where: str) -> torch.Tensor:
    """The ``[vocab, hidden]`` weight that ``head(h) == h @ weight.T`` computes, differentiable.

    A plain ``nn.Linear`` (no bias) gives its weight. A peft LoRA ``Linear`` (a LoRA on
    ``lm_head``) gives ``W + sum(scaling * B @ A)`` over its active adapters, so the
    adapters get their gradients through it and the loss is the unpatched one; a merged or
    disabled adapter gives the base weight, as its forward does. What cannot be written as
    one weight (dropout on the adapter's input, DoRA and other variants, a bias, mixed
    adapter batches) raises :class:`SignatureMismatch` saying what to change.
    """
    base = getattr(head, "base_layer", None)
    if base is None:
        if not isinstance(head, nn.Linear):
            raise SignatureMismatch(f"{where} is {type(head).__name__}, not an nn.Linear or a peft LoRA Linear")
        if head.bias is not None:
            raise SignatureMismatch(f"{where} has a bias; fused_linear_cross_entropy supports none")
        return head.weight
    if not (isinstance(base, nn.Linear) and hasattr(head, "lora_A") and hasattr(head, "lora_B")):
        raise SignatureMismatch(
            f"{where} is {type(head).__name__} around {type(base).__name__}; fused_linear_cross_entropy handles a plain "
            "nn.Linear head or a LoRA on one: leave lm_head out of the adapter's target_modules, or the fused head off"
        )
    weight = head_weight(base, f"{where}.base_layer")
    if getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        return weight
    for name in head.active_adapters:  # type: ignore[attr-defined]
        if name not in head.lora_A:  # type: ignore[attr-defined]
            continue
        problem = None
        if not isinstance(head.lora_dropout[name], nn.Identity):  # type: ignore[attr-defined]
            problem = "has lora_dropout > 0 (dropout on the head's input cannot be folded into one weight)"
        elif name in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(name, False):
            problem = "is a LoRA variant (e.g. DoRA)"
        elif head.lora_B[name].bias is not None:  # type: ignore[attr-defined]
            problem = "has a LoRA bias"
        if problem:
            raise SignatureMismatch(
                f"the LoRA adapter {name!r} on {where} {problem}, which fused_linear_cross_entropy cannot fuse; "
                "use lora_dropout=0 and plain LoRA on lm_head, leave lm_head out of target_modules, "
                "or apply without fused_cross_entropy"
            )
        delta = head.get_delta_weight(name)  # type: ignore[attr-defined]  (scaling * B @ A, differentiable)
        weight = weight + delta.to(weight.dtype)
    return weight

