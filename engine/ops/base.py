"""What an op is: its semantics (a torch reference), the target it requires, and how to bind it.

An op knows nothing about devices or vendor kernels (``engine.ops`` imports nothing from
``engine.kernels``). It defines:

* the *kernel signature*: the function every provider of the op returns from
  ``build(patch)`` (e.g. ``rms_norm(x, weight, eps) -> y``);
* the *target contract*: which forward signatures it can replace, checked before anything
  is patched;
* how to turn a kernel function into a replacement forward for one module instance;
* its *reference*: ``reference(patch)``, the torch kernel function with the patch's settings,
  the ground truth every other provider is compared with (``engine/kernels/torch_reference.py``
  registers it as the ``torch`` provider of every op);
* which other settings a user could have meant, so verification can say which one fits;
* which declarations could apply to a given module or function (:meth:`ModuleOp.candidates`,
  :meth:`FunctionOp.candidates`), so the scaffold can measure each against the original.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from engine.errors import InvalidArgument, SignatureMismatch

__all__ = [
    "FunctionOp",
    "ModuleOp",
    "Op",
    "all_ops",
    "forward_parameters",
    "get_op",
    "norm_parameter_names",
    "register_op",
]


class Op(ABC):
    """Base of all ops. Subclasses are singletons registered with :func:`register_op`."""

    name: ClassVar[str]
    kind: ClassVar[Literal["module", "function"]]
    patch_type: ClassVar[type]
    #: Settings a generated patchset writes out even at their defaults, because they are what
    #: a reader must check (a norm's ``scale``, ``cast``, ``eps_attr``).
    declared_settings: ClassVar[tuple[str, ...]] = ()
    #: An op that changes the model's contract (a fused loss returns no logits): the scaffold
    #: reports where it fits but never writes it into a patchset by itself.
    opt_in: ClassVar[bool] = False

    #: How ``patch-engine kernels`` describes the op's ``torch`` provider.
    reference_description: ClassVar[str] = "torch reference (the ground truth), every device"

    @abstractmethod
    def reference(self, patch: Any) -> Callable[..., Any]:
        """The op's torch kernel function for ``patch``'s settings: the ground truth.

        It has the op's kernel signature (what every provider's ``build(patch)`` returns),
        runs on every device, has a backward and traces under ``torch.compile``.
        """

    def alternatives(self, patch: Any) -> Iterator[tuple[str, Any]]:
        """Other declarations of this patch that a user might have meant: ``(label, patch)``."""
        return iter(())


class ModuleOp(Op):
    """An op that replaces the forward of module instances."""

    kind = "module"

    def check_target(self, module: nn.Module, patch: Any) -> None:
        """Raise :class:`SignatureMismatch` (or PatchError) when ``module`` cannot take this op."""
        raise NotImplementedError

    def module_alternatives(self, patch: Any, module: nn.Module) -> Iterator[tuple[str, Any]]:
        """:meth:`alternatives`, plus those only ``module`` suggests (a gated norm's group-size attribute)."""
        return self.alternatives(patch)

    def kernel_settings(self, module: nn.Module, patch: Any) -> Any:
        """What providers' ``supports`` judge for ``module``: the patch, unless the op also reads the module.

        Why: some numerics are found in the model, not declared (the fused head reads Granite's
        logit division from the forward's code), and a provider must be able to refuse them at
        plan time so ``auto`` passes over it. The result has the patch's attributes.
        """
        return patch

    def users_choice(self, model: nn.Module, module: nn.Module) -> str | None:
        """Why ``module`` stays as it is because the user chose its implementation, or None (default).

        Why: a model may dispatch on a setting the user made (transformers' experts on
        ``config._experts_implementation``); a patch must honour that choice, never silently
        override it. The plan then skips the module with this reason.
        """
        return None

    def bind(self, module: nn.Module, patch: Any, impl: Callable[..., Any]) -> Callable[..., Any]:
        """A plain function ``forward(self, ...)`` to be bound to ``module`` with MethodType."""
        raise NotImplementedError

    def pre_hooks(self, module: nn.Module, patch: Any) -> list[tuple[str, Callable[..., Any]]]:
        """Forward pre-hooks to put on submodules of ``module`` (path relative to it, hook), default none.

        Why: an op may need to notice a caller that goes around its forward (TRL's own LM head
        calls the backbone of a fused-head model directly). The patcher installs them with the
        forward, and revert removes them; a hook must be picklable (a module-level function).
        """
        return []

    def ground_truth(self, module: nn.Module) -> Callable[..., Any]:
        """The forward ``self`` is verified against: the class's own, unless the op says which of its paths.

        Why: a forward may dispatch on configuration (transformers' experts dispatch on
        ``config._experts_implementation``); the op names the path that defines its semantics.
        """
        return type(module).forward

    def candidates(self, module: nn.Module) -> Iterator[Any]:
        """Every declaration of this op that could replace ``module``'s forward (default: none).

        Why: the scaffold (:mod:`engine.scaffolding`) measures each one against the module's
        own forward, in fp32 and bf16, and keeps the one that is exact. Yield every
        setting a reader could not tell apart by looking (scale, cast order, eps attribute,
        activation, ...); cheap structural filters belong here, :meth:`check_target` runs
        on every candidate afterwards.
        """
        return iter(())


class FunctionOp(Op):
    """An op that replaces a module-level function of a modeling module."""

    kind = "function"

    def check_function(self, function: Callable[..., Any], patch: Any) -> None:
        """Raise :class:`SignatureMismatch` when ``function`` is not what this op replaces."""
        raise NotImplementedError

    def candidates(self, name: str, function: Callable[..., Any]) -> Iterator[Any]:
        """Every declaration of this op that could replace the module-level ``name`` (default: none)."""
        return iter(())

    def accepts(self, name: str, function: Callable[..., Any], patch: Any) -> bool:
        """Whether :meth:`check_function` accepts ``function`` under ``patch`` (for :meth:`candidates`)."""
        try:
            self.check_function(function, patch)
        except SignatureMismatch:
            return False
        return True


_OPS: dict[str, Op] = {}


def register_op(op_cls: type[Op]) -> type[Op]:
    """Class decorator: register one instance of the op; duplicates are refused."""
    if op_cls.name in _OPS:
        raise InvalidArgument(f"op {op_cls.name!r} is already registered; give the new op another name")
    _OPS[op_cls.name] = op_cls()
    return op_cls


def get_op(name: str) -> Op:
    import engine.ops  # noqa: F401  (registers the bundled ops)

    try:
        return _OPS[name]
    except KeyError:
        raise InvalidArgument(f"no op {name!r}; ops: {', '.join(sorted(_OPS))}") from None


def all_ops() -> dict[str, Op]:
    import engine.ops  # noqa: F401

    return dict(_OPS)


def forward_parameters(cls: type) -> list[inspect.Parameter]:
    """The parameters of ``cls.forward`` after ``self``, seen through decorators."""
    forward = inspect.unwrap(cls.forward)
    params = list(inspect.signature(forward).parameters.values())
    return params[1:] if params and params[0].name == "self" else params


def describe_signature(cls: type) -> str:
    return f"{cls.__name__}.forward({', '.join(str(p) for p in forward_parameters(cls))})"


def require_single_input(module: nn.Module, op_name: str, *, forbid: tuple[str, ...] = ()) -> None:
    """Check that the forward takes exactly one required tensor and none of ``forbid``.

    Why: an op that computes ``f(x)`` silently drops any other argument the forward needs.
    """
    cls = type(module)
    params = forward_parameters(cls)
    names = {p.name for p in params}
    bad = names.intersection(forbid)
    required = [
        p
        for p in params
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if bad or len(required) != 1:
        reason = f"it takes {', '.join(sorted(bad))}" if bad else f"it needs {len(required)} required arguments"
        raise SignatureMismatch(
            f"{op_name} cannot replace {describe_signature(cls)}: {reason}, "
            f"while {op_name} computes f(hidden_states) from one tensor. "
            "Pick the op that matches this forward (e.g. gated_rms_norm for a forward with a gate)."
        )


def require_norm_attributes(module: nn.Module, eps_attr: str, weight_attr: str) -> torch.Tensor:
    """Check that a norm module has a numeric eps and a tensor weight under the declared names.

    Why: a wrong ``eps_attr`` would otherwise surface as an AttributeError mid-forward, or
    worse, bind another number. Returns the weight.
    """
    require_norm_eps(module, eps_attr)
    weight = getattr(module, weight_attr, None)
    if not isinstance(weight, torch.Tensor):
        raise SignatureMismatch(f"{type(module).__name__} has no tensor attribute {weight_attr!r} (weight_attr)")
    return weight


def require_norm_eps(module: nn.Module, eps_attr: str) -> None:
    """Check that a norm module has a numeric eps under the declared name (a weightless norm needs no more)."""
    cls = type(module).__name__
    eps = getattr(module, eps_attr, None)
    if not isinstance(eps, (float, int)) or isinstance(eps, bool):
        numeric = ", ".join(k for k, v in vars(module).items() if isinstance(v, float) and not k.startswith("_"))
        eps_like = norm_parameter_names(module)[1]
        fits = f"; eps_attr: {eps_like[0]} fits" if len(eps_like) == 1 else ""
        raise SignatureMismatch(
            f"{cls} has no numeric attribute {eps_attr!r} (eps_attr); numeric attributes it has: {numeric or 'none'}"
            f"{fits}"
        )


def norm_parameter_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """``(1-d weight names, numeric eps attribute names)`` of a norm-shaped module (for candidates).

    Why every one: the eps attribute's *name* differs across families (``variance_epsilon``,
    ``eps``, ``epsilon``) and cannot be guessed; the scaffold measures each.
    """
    weights = [name for name, p in module.named_parameters(recurse=False) if p.dim() == 1]
    eps = [
        k for k, v in vars(module).items()
        if isinstance(v, float) and not k.startswith("_") and 0 < v < 1e-2
    ]
    return weights, eps
