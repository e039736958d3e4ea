"""What a condition of use sets for one run (eval or train mode, a cast, gradient checkpointing, an attention
implementation), and what it keeps: each a context manager that puts the model back bit for bit after the run.

Why a module of its own: :class:`engine.verification.scenario.Scenario` combines them per condition; each is a small,
separately checkable promise (the parameters' very tensors back after a cast, every buffer's object and value back
after calls that update one), and ``verify`` runs on the user's own model, which must come out as it went in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["attention", "buffers_kept", "cast", "checkpointing", "mode", "parameters_kept"]


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Every buffer's object and value put back after the run (a call may update or replace one)."""
    saved = [(m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items()
             if isinstance(b, torch.Tensor)]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, value in saved:
                m._buffers[name] = b
                if b.shape == value.shape and not torch.equal(b, value):
                    b.copy_(value)


@contextlib.contextmanager
def parameters_kept(model: nn.Module) -> Iterator[None]:
    """The parameters' values put back after the run (an optimizer step moved them)."""
    saved = [(p, p.detach().clone()) for p in model.parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)


@contextlib.contextmanager
def mode(model: nn.Module, *, training: bool) -> Iterator[None]:
    saved = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@contextlib.contextmanager
def cast(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Floating parameters and buffers in ``dtype`` for the run; the very tensors they held put back after."""
    params = [(p, p.data) for p in model.parameters() if p.is_floating_point()]
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items()
               if isinstance(b, torch.Tensor) and b.is_floating_point()]
    try:
        for p, data in params:
            p.data = data.to(dtype)
        for m, name, b in buffers:
            m._buffers[name] = b.to(dtype)
        yield
    finally:
        for p, data in params:
            p.data = data
        for m, name, b in buffers:
            m._buffers[name] = b


@contextlib.contextmanager
def checkpointing(model: nn.Module) -> Iterator[None]:
    new = hasattr(model, "activation_checkpointing_enable")  # transformers 5.25 on (the old names warn)
    if getattr(model, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False):
        yield
        return
    if new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        disable = model.activation_checkpointing_disable
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        disable = model.gradient_checkpointing_disable
    try:
        yield
    finally:
        disable()


@contextlib.contextmanager
def attention(model: nn.Module, implementation: str) -> Iterator[None]:
    configs = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), object)
               and hasattr(getattr(m, "config", None), "_attn_implementation")]
    saved = {id(c): (c, c._attn_implementation) for c in configs}
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        for config, value in saved.values():
            config._attn_implementation = value
