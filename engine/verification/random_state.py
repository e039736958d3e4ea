"""Verification leaves every random state as it found it.

Why: verification runs the model's modules and the whole model several times, some outside a
seeded block, and a training model draws dropout masks on each run (a PEFT LoRA with
``lora_dropout``, attention dropout). Had ``engine.apply(model, ..., verify=True)`` moved the
global generator, the training that follows would draw other masks than an unpatched run: the
losses of a LoRA fine-tune differed from step 2 with verification on, and were bit-identical
with it off. So :func:`engine.verify` runs inside :func:`random_state_kept`, which puts back
torch's CPU generator, every initialised accelerator's generators (CUDA and the model's own
device type), Python's ``random`` and, if numpy is imported, numpy's global state.
:func:`same_draws` gives every run of one module check the same draws (its dropout masks).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["keeps_random_state", "random_state_kept", "same_draws"]

F = TypeVar("F", bound=Callable[..., Any])


def _accelerators(extra: str | None) -> list[Any]:
    """Device modules (``torch.cuda``, ...) whose generators exist now: available and initialised.

    An uninitialised one is left alone: reading its state would initialise it (seconds, and a
    CUDA context the user did not ask for), and nothing that ran on it can have drawn from it.
    """
    found = []
    for kind in dict.fromkeys(["cuda", extra or "cuda"]):
        if kind in ("cpu", "meta"):
            continue
        try:
            module = torch.get_device_module(kind)
        except (RuntimeError, AttributeError, ValueError):  # a device type this torch does not know
            continue
        if not all(hasattr(module, f) for f in ("get_rng_state_all", "set_rng_state_all", "is_available")):
            continue
        initialised = getattr(module, "is_initialized", lambda: True)
        if module.is_available() and initialised():
            found.append(module)
    return found


@contextlib.contextmanager
def random_state_kept(device_type: str | None = None) -> Iterator[None]:
    """Restore every global random state on exit (also on an exception); ``device_type``: the model's."""
    cpu = torch.get_rng_state()
    devices = [(m, m.get_rng_state_all()) for m in _accelerators(device_type)]
    python = random.getstate()
    numpy = sys.modules.get("numpy")  # only if imported: never import it for this
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        for module, states in devices:
            module.set_rng_state_all(states)
        random.setstate(python)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


#: The seed every run of one module check starts from.
SEED = 0x5EED


@contextlib.contextmanager
def same_draws(module: nn.Module | None) -> Iterator[None]:
    """Run a block on a fixed seed, then put every random state back (see :func:`random_state_kept`).

    Why: one module check runs the original forward, the declaration and its alternatives, the
    kernel and the fp64 truth on the same inputs. A LoRA adapter with ``lora_dropout`` inside a
    patched MLP draws a dropout mask in each; unseeded, every run drew another mask (a spurious
    "declaration does not reproduce" failure) and moved the caller's generator.
    """
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None) if module is not None else None
    device_type = tensor.device.type if tensor is not None else None
    with random_state_kept(device_type):
        # not torch.manual_seed: on an uninitialised CUDA it queues a seed for its first use, later
        torch.default_generator.manual_seed(SEED)
        for accelerator in _accelerators(device_type):
            accelerator.manual_seed_all(SEED)
        yield


def _device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    model = args[0] if args else kwargs.get("model")
    try:
        return next(model.parameters()).device.type
    except (AttributeError, StopIteration, TypeError):
        return None


def keeps_random_state(fn: F) -> F:
    """Decorate an entry point taking the model first so that it runs inside :func:`random_state_kept`."""

    @functools.wraps(fn)
    def kept(*args: Any, **kwargs: Any) -> Any:
        with random_state_kept(_device_type(args, kwargs)):
            return fn(*args, **kwargs)

    return kept  # type: ignore[return-value]
