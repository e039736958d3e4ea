"""A tiny model exercises the tables a checkpoint fills: ``tiny_model.random_buffers``.

DeepSeek-V4's hash router sends each token to the experts ``tid2eid[token]`` names, a table
transformers' init leaves at zero until a checkpoint fills it. Built from a config, every token
went to expert 0: three of four experts and the router's weight got no gradient, so a check of
that routing compared zeros with zeros. The patchset declares the table (``random_buffers``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_for

import engine
from engine.loader import load_patchset
from engine.tiny import build_tiny_for, build_tiny_model
from engine.verification import probe_batch


def _gradients(model: torch.nn.Module) -> tuple[list[bool], float]:
    """Which experts of the first layer receive a gradient, and the size of its router's."""
    model(**probe_batch(model)).loss.backward()
    experts = model.model.layers[0].mlp.experts.down_proj.grad
    return [bool(experts[e].abs().sum() > 0) for e in range(experts.shape[0])], float(
        model.model.layers[0].mlp.gate.weight.grad.abs().sum())


def test_the_hash_router_table_is_filled_and_every_expert_and_the_router_learn() -> None:
    model = tiny_for("deepseek_v4")
    experts = model.config.n_routed_experts
    tables = [b for n, b in model.named_buffers() if n.endswith("tid2eid")]
    assert tables and all(sorted(t.unique().tolist()) == list(range(experts)) for t in tables)
    assert all(bool((t[:, 0] != t[:, 1]).all()) for t in tables)  # a token's experts are distinct
    reached, router = _gradients(model)
    bare = build_tiny_model("deepseek_v4", load_patchset("deepseek_v4").tiny_model.config)  # as before: zeros
    bare_reached, bare_router = _gradients(bare)
    assert all(reached) and router > 1e-3
    assert bare_reached == [True] + [False] * (experts - 1) and bare_router < 1e-6
    assert engine.verify(tiny_for("deepseek_v4"), "deepseek_v4", device="cpu").passed


@pytest.mark.parametrize(
    ("buffers", "parts"),
    [
        ("{no_such_table: 4}", ["tiny_model.random_buffers.no_such_table", "has no integer buffer named",
                                "its integer buffers:"]),
        ("{tid2eid: no_such_attribute}", ["tiny_model.random_buffers.tid2eid", "'no_such_attribute'",
                                          "give an int or an attribute name"]),
        ("{tid2eid: 0}", ["tiny_model.random_buffers.tid2eid", "not a positive int"]),
    ],
)
def test_a_bad_random_buffer_is_a_patchset_error_naming_its_key(buffers: str, parts: list[str], tmp_path: Path) -> None:
    config = load_patchset("deepseek_v4").tiny_model.config
    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: mine
        extends: deepseek_v4
        tiny_model:
          config: {config!r}
          random_buffers: {buffers}
        """).replace("'", '"'))
    with pytest.raises(engine.PatchsetError) as info:
        build_tiny_for(load_patchset(str(path)))
    assert all(p in str(info.value) for p in parts), str(info.value)
