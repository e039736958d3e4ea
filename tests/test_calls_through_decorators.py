"""A function patch finds its callers through a forward's decorators, ``functools.wraps`` or not.

Why: transformers 5.15's ``force_accelerate_hooks("conv1d")`` wraps GatedDeltaNet's forward in a
closure without ``__wrapped__``; the planner, reading only ``__wrapped__``, found no module calling
``torch_chunk_gated_delta_rule`` and refused qwen3_next (TargetNotFound) on that release, in
transformers' own tests of it (tests/hf_suite/).
"""

from __future__ import annotations

import functools

from torch import nn

from engine.planning.planner import _calls_name


def layer_function(x):  # type: ignore[no-untyped-def]
    return x


def hooks_without_wraps(fn):  # type: ignore[no-untyped-def]
    def wrapped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return fn(self, *args, **kwargs)

    return wrapped


def hooks_with_wraps(fn):  # type: ignore[no-untyped-def]
    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return fn(self, *args, **kwargs)

    return wrapped


class ClosureDecorated(nn.Module):
    @hooks_without_wraps
    def forward(self, x):  # type: ignore[no-untyped-def]
        return layer_function(x)


class BothDecorators(nn.Module):
    @hooks_with_wraps
    @hooks_without_wraps
    def forward(self, x):  # type: ignore[no-untyped-def]
        return layer_function(x)


class Other(nn.Module):
    @hooks_without_wraps
    def forward(self, x):  # type: ignore[no-untyped-def]
        return x


def test_a_closure_decorator_without_wraps_is_seen_through() -> None:
    assert _calls_name(ClosureDecorated, "layer_function") is globals()
    assert _calls_name(BothDecorators, "layer_function") is globals()


def test_a_forward_that_does_not_call_it_is_still_not_a_caller() -> None:
    assert _calls_name(Other, "layer_function") is None
    assert _calls_name(ClosureDecorated, "another_function") is None
