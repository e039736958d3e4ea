"""The fused head in every bundled family, switched on with ``fused_cross_entropy=True``.

Per family, on its tiny perturbed model (vocab 256) against the unpatched model in fp32:
loss and every parameter gradient within 1e-5 over several chunks, ``logits`` None in
training, the forward's signature unchanged, and the MoE router loss included where the
family adds it (``output_router_logits=True``). Gemma 2/3 soft-cap their logits; tied and
untied embeddings are both covered by the families (and by a Qwen3 pair below).
A family whose forward does something the fused head does not reproduce must be refused at
plan time and left unpatched: a new family either passes or is refused, never silently wrong.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from conftest import tiny_for

import engine
from engine.errors import SignatureMismatch
from engine.loader import bundled_names
from engine.patching.patcher import is_patched
from engine.verification import probe_batch

NAMES = [n for n in bundled_names() if n != "qwen3_flce"]  # qwen3_flce is qwen3 with the switch on


def _batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    batch = probe_batch(model, seq=12)
    if "labels" in batch:  # a base model (no LM head) takes none
        batch["labels"][0, :3] = -100
    return batch


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor], **extra):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # both models from one random state: PhiMoE's router samples its experts in training
    out = model(**batch, **extra)
    out.loss.backward()
    return out, {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _router_loss_runs(model: torch.nn.Module) -> bool:
    """Whether transformers' own forward runs with ``output_router_logits`` (DeepseekV4 in 5.24 does
    not: it collects no router logits, and load_balancing_loss_func indexes the empty tuple)."""
    batch = _batch(model)
    try:
        with torch.no_grad(), engine.torch_path(model):
            model(**batch)
    except IndexError:
        return False
    return True


@pytest.mark.parametrize("name", NAMES)
def test_fused_head_equals_unpatched(name: str) -> None:
    reference = tiny_for(name)
    reference.train()
    if hasattr(reference.config, "output_router_logits"):
        reference.config.output_router_logits = True  # the router loss is added to the loss
        if not _router_loss_runs(reference):
            reference.config.output_router_logits = False
    patched = copy.deepcopy(reference)
    try:
        engine.apply(patched, name, device="cpu", fused_cross_entropy={"chunk_size": 7})
    except SignatureMismatch as exc:  # refused: named why, and nothing changed
        assert "fused_linear_cross_entropy" in str(exc) and not is_patched(patched)
        pytest.skip(f"refused at plan time: {exc}")
    assert inspect.signature(patched.forward) == inspect.signature(reference.forward)
    batch = _batch(reference)
    with engine.torch_path(reference):
        ref, ref_grads = _step(reference, batch)
    pat, pat_grads = _step(patched, batch)
    assert pat.logits is None and ref.logits is not None
    assert abs(pat.loss.item() - ref.loss.item()) <= 1e-5, (pat.loss.item(), ref.loss.item())
    if getattr(ref, "aux_loss", None) is not None:
        assert torch.allclose(pat.aux_loss, ref.aux_loss, atol=1e-6)
    assert pat_grads.keys() == ref_grads.keys()
    for k in ref_grads:
        assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), k


def test_router_aux_loss_is_in_the_loss() -> None:
    """The MoE loss differs from the plain cross-entropy by exactly coef * aux_loss, as in transformers."""
    model = tiny_for("qwen3_moe")
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.5
    engine.apply(model, "qwen3_moe", device="cpu", fused_cross_entropy=True)
    batch = _batch(model)
    with_aux = model(**batch)
    without = model(**batch, output_router_logits=False)
    assert with_aux.aux_loss is not None and without.aux_loss is None
    torch.testing.assert_close(with_aux.loss - without.loss, 0.5 * with_aux.aux_loss, atol=1e-6, rtol=0)


def test_gemma2_softcap_is_applied() -> None:
    """Gemma 2 soft-caps its logits at 30: a small cap changes the loss, and the fused loss follows it."""
    reference = tiny_for("gemma2", final_logit_softcapping=0.5)
    patched = copy.deepcopy(reference)
    engine.apply(patched, "gemma2", device="cpu", fused_cross_entropy=True)
    batch = _batch(reference)
    ref, ref_grads = _step(reference, batch)
    pat, pat_grads = _step(patched, batch)
    uncapped = copy.deepcopy(reference)
    uncapped.config.final_logit_softcapping = None
    assert abs(uncapped(**batch).loss.item() - ref.loss.item()) > 0.1  # the cap matters here
    assert abs(pat.loss.item() - ref.loss.item()) <= 1e-5
    for k in ref_grads:
        assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), k


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tied_and_untied_embeddings(tied: bool) -> None:
    reference = tiny_for("qwen3", tie_word_embeddings=tied)
    assert (reference.lm_head.weight is reference.model.embed_tokens.weight) == tied
    patched = copy.deepcopy(reference)
    engine.apply(patched, "qwen3", device="cpu", fused_cross_entropy=True)
    batch = _batch(reference)
    ref, ref_grads = _step(reference, batch)
    pat, pat_grads = _step(patched, batch)
    assert abs(pat.loss.item() - ref.loss.item()) <= 1e-5
    assert ("lm_head.weight" in ref_grads) == (not tied)
    for k in ref_grads:
        assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), k


@pytest.mark.parametrize("name", ["granite", "granitemoe", "granitemoeshared"])
def test_granite_logits_scaling_is_reproduced(name: str) -> None:
    """Granite divides its logits by ``config.logits_scaling`` after the head: the kernel divides each chunk.

    The bundled tiny configs keep transformers' default scaling of 1.0, under which a dropped
    division would go unnoticed; 4.0 (and a change after apply: read at call time) would not.
    """
    reference = tiny_for(name, logits_scaling=4.0)
    reference.train()
    if hasattr(reference.config, "output_router_logits"):
        reference.config.output_router_logits = True
    patched = copy.deepcopy(reference)
    engine.apply(patched, name, device="cpu", fused_cross_entropy={"chunk_size": 7})
    batch = _batch(reference)
    for scaling in (4.0, 0.25):
        reference.config.logits_scaling = patched.config.logits_scaling = scaling
        ref, ref_grads = _step(reference, batch)
        pat, pat_grads = _step(patched, batch)
        assert pat.logits is None and ref.logits is not None
        assert abs(pat.loss.item() - ref.loss.item()) <= 1e-5, (scaling, pat.loss.item(), ref.loss.item())
        assert pat_grads.keys() == ref_grads.keys()
        for k in ref_grads:
            assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), (scaling, k)
    unscaled = copy.deepcopy(reference)
    unscaled.config.logits_scaling = 1.0
    assert abs(_step(unscaled, batch)[0].loss.item() - ref.loss.item()) > 1e-3  # the scaling matters here


def test_a_family_that_multiplies_its_logits_is_refused() -> None:
    """Cohere multiplies its logits by logit_scale after the head: refused at plan time, naming the line."""
    from engine.tiny import build_tiny_model

    model = build_tiny_model("cohere", {"logit_scale": 4.0})
    ps = {"name": "cohere", "model_types": ["cohere"], "patches": []}
    with pytest.raises(SignatureMismatch, match=r"changes the logits after the head .*logit_scale"):
        engine.apply(model, ps, device="cpu", fused_cross_entropy=True)
    assert not is_patched(model) and "forward" not in model.__dict__
