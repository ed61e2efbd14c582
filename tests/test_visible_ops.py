"""The ops that Inductor can see (course_utils/ops/_lib.py): on a GPU each kernel op is a ``triton_op`` whose
schema is inferred from ``annotated(impl, schema)``, and a launch with a tracer's tensors is recorded with
``wrap_triton``. On the CPU the ops stay custom ops; these tests check the pieces the GPU path is made of."""

from __future__ import annotations

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import course_utils.ops  # noqa: F401  (registers every op)
import course_utils.ops.dropout  # noqa: F401
import course_utils.ops.linear_ce  # noqa: F401
from course_utils import env
from course_utils.ops import _lib
from course_utils.ops import norms as Nm
from course_utils.tuned import launch as L


@pytest.mark.parametrize("name", sorted(_lib.KERNEL_OPS))
def test_annotated_impl_infers_the_declared_schema(name):
    schema, impl = _lib.KERNEL_OPS[name]
    inferred = torch.library.infer_schema(_lib.annotated(impl, schema), mutates_args=())
    assert inferred.replace("SymInt", "int") == schema


def test_annotated_keeps_defaults_and_calls_impl():
    seen = []
    fn = _lib.annotated(lambda x, n, eps=0.5: seen.append((n, eps)) or x, "(Tensor x, int n, float eps=0.5) -> Tensor")
    assert torch.library.infer_schema(fn, mutates_args=()) == "(Tensor x, SymInt n, float eps=0.5) -> Tensor"
    t = torch.ones(2)
    assert fn(t, 3) is t and seen == [(3, 0.5)]


def test_a_triton_op_made_from_an_impl_runs_eagerly():
    """What kernel_op registers on a GPU, here under a test namespace: the eager call runs the course's kernels."""
    schema, impl = _lib.KERNEL_OPS["layer_norm_fwd"]
    op = torch.library.triton_op("coursetest::layer_norm_fwd", _lib.annotated(impl, schema), mutates_args=())
    x, w, b = (torch.randn(*shape, device=env.DEVICE) for shape in ((5, 24), (24,), (24,)))
    y, mean, rstd = op(x, w, b, 1e-5)
    want = torch.nn.functional.layer_norm(x.double(), (24,), w.double(), b.double(), 1e-5)
    assert torch.allclose(y.double(), want, atol=1e-5, rtol=1e-5)
    y2, _, _ = Nm.layer_norm_fwd(x, w, b, 1e-5)
    assert torch.equal(y, y2)


def test_a_tracers_tensor_is_traced_and_its_alignment_comes_from_its_offset():
    with FakeTensorMode():
        t = torch.empty(64, dtype=torch.float16)
        assert L.traced(t) and _lib.tracing(t)
        assert L.aligned16(t) and L.aligned16(t[8:]) and not L.aligned16(t[3:])
    plain = torch.empty(64)
    assert not L.traced(plain) and not L.traced(torch.nn.Parameter(plain)) and not L.traced(3)
    assert L.aligned16(plain) == (plain.data_ptr() % 16 == 0)


def test_a_launch_with_a_tracers_tensor_goes_through_wrap_triton(monkeypatch):
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(("plain", grid))

    def wrap(kernel):
        assert isinstance(kernel, Kernel)
        return {(4,): lambda *a, **k: calls.append(("wrapped", k))}

    monkeypatch.setattr(torch.library, "wrap_triton", wrap)
    with FakeTensorMode():
        fake = torch.empty(8)
    L.plain_launch(Kernel(), (4,), (fake, 8), {"BLOCK": 4})
    L.plain_launch(Kernel(), (4,), (torch.empty(8), 8), {"BLOCK": 4})
    assert calls == [("wrapped", {"BLOCK": 4}), ("plain", (4,))]


def test_ops_are_visible_on_a_gpu_and_opaque_custom_ops_under_the_interpreter():
    # the interpreter: Inductor does not launch user kernels on the CPU; a GPU: triton_ops unless asked not to
    opaque = os.environ.get("COURSE_OPAQUE_OPS", "0").strip() == "1"
    assert _lib.INDUCTOR_SEES_KERNELS == (env.on_gpu() and not opaque)


def test_opaque_ops_env_names_ops():
    # COURSE_OPAQUE_OPS: "1" every op (INDUCTOR_SEES_KERNELS false), a list of names those only
    assert _lib.opaque_names("0") == _lib.opaque_names("") == _lib.opaque_names("1") == frozenset()
    assert _lib.opaque_names(" a_fwd, b_bwd,") == {"a_fwd", "b_bwd"}


# ----------------------------------------------------------------------------- the ops' functions, traced cold
# While AOTAutograd traces a triton_op, its function runs on a tracer's tensors with nothing cached yet: every
# launch must go through wrap_triton and nothing may read a data pointer or time a plan. Here the function of
# each visible op runs on fake tensors with every plan cache empty; wrap_triton is replaced by a recorder.


class Launch(str):
    """A recorded launch: the kernel's name (a str), with its arguments."""

    def __new__(cls, name, args):
        self = super().__new__(cls, name)
        self.args = args
        return self


def views_of_own_buffers(launched, inputs) -> list[str]:
    """Launches that pass a part of a tensor the op made itself (a view that does not cover it whole; views of
    ``inputs`` are fine): Inductor's copies around a user kernel that writes slices of one buffer read past
    its end (GPT-2 small at B=16 on the H100, under CUDA graphs)."""
    ins = [t for t in inputs if isinstance(t, torch.Tensor)]
    bad = []
    for launch in launched:
        for i, a in enumerate(launch.args):
            base = getattr(a, "_base", None) if isinstance(a, torch.Tensor) else None
            whole = base is not None and a.storage_offset() == base.storage_offset() and a.numel() == base.numel()
            if base is not None and not whole and not any(base is t or base is t._base for t in ins):
                bad.append(f"{launch} argument {i}: a view {tuple(a.shape)} of a buffer {tuple(base.shape)}")
    return bad


@pytest.fixture
def cold_trace(monkeypatch):
    from course_utils.ops import linear as Ln
    from course_utils.ops import linear_ce as Lce
    from course_utils.ops import loss as Ls
    from course_utils.tuned import elementwise as EW
    from course_utils.tuned import gelu_backward as GB
    launched = []

    class Recorder:
        def __init__(self, kernel):
            self.name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "?")

        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(Launch(self.name, a))

    monkeypatch.setattr(torch.library, "wrap_triton", Recorder)
    for mod, attr in ((Nm, "PLANS"), (Ln, "PLANS"), (Lce, "PLANS"), (Ls, "PLANS"), (Ls, "CHECKED"),
                      (EW, "_HOT_PLANS"), (GB, "_PLANS")):
        monkeypatch.setattr(mod, attr, type(getattr(mod, attr))())
    return launched


def test_norms_trace_cold(cold_trace):
    with FakeTensorMode():
        x, w, b, r = torch.randn(6, 40), torch.randn(40), torch.randn(40), torch.randn(6, 40)
        y, mean, rstd = Nm.layer_norm_fwd(x, w, b, 1e-5)
        dy0 = torch.randn(6, 40)
        Nm.layer_norm_bwd(dy0, x, w, mean, rstd)
        y, s, mean2, rstd2 = Nm.add_layer_norm_fwd(x, r, w, b, 1e-5)
        dy, ds = torch.randn(6, 40), torch.randn(6, 40)
        Nm.add_layer_norm_bwd(dy, ds, s, w, mean2, rstd2)
    assert len(cold_trace) >= 4
    assert views_of_own_buffers(cold_trace, (x, w, b, r, y, s, mean, rstd, mean2, rstd2, dy0, dy, ds)) == []


def test_linear_gelu_traces_cold(cold_trace):
    from course_utils.ops import linear as Ln
    with FakeTensorMode():
        x, w, b = torch.randn(2, 5, 40), torch.randn(24, 40), torch.randn(24)
        y, acc = Ln.linear_gelu_fwd(x, w, b)
        dy = torch.randn(2, 5, 24)
        dx, dw, db = Ln.linear_gelu_bwd(dy, x, w, b, acc)
    assert y.shape == (2, 5, 24) and dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape
    assert len(cold_trace) == 2    # the bias + GELU forward and its backward
    assert views_of_own_buffers(cold_trace, (x, w, b, y, acc, dy)) == []


def test_losses_trace_cold(cold_trace):
    from course_utils.ops import linear_ce as Lce
    from course_utils.ops import loss as Ls
    with FakeTensorMode():
        logits, targets = torch.randn(7, 33), torch.randint(0, 33, (7,))
        loss, lse = Ls.cross_entropy_fwd(logits, targets)
        Ls.cross_entropy_bwd(torch.ones(()), logits, targets, lse)
        h, w = torch.randn(7, 16), torch.randn(33, 16)
        loss, dh, dw = Lce.linear_ce_fwd(h, w, targets, -100)
        Lce.linear_ce_bwd(torch.ones(()), dh, dw)
    assert len(cold_trace) >= 3
    assert views_of_own_buffers(cold_trace, (logits, targets, h, w)) == []


def test_linear_cross_entropy_traced_writes_whole_buffers(cold_trace):
    # three chunks of rows (3 + 3 + 1): each launch gets the chunk's own logits and losses, not slices of one
    from course_utils.tuned import linear_cross_entropy as T
    with FakeTensorMode():
        h, w, targets = torch.randn(7, 16), torch.randn(33, 16), torch.randint(0, 33, (7,))
        loss, dh, dw = T.linear_cross_entropy_forward(h, w, targets, chunk_rows=3)
    assert len(cold_trace) == 3 and loss.shape == () and dh.shape == h.shape and dw.shape == w.shape
    assert views_of_own_buffers(cold_trace, (h, w, targets)) == []


@pytest.mark.skipif(not _lib.INDUCTOR_SEES_KERNELS, reason="needs a CUDA GPU (the ops are triton_ops only there)")
def test_the_compiled_gpt_launches_the_course_kernels_itself():
    """On a GPU: torch.compile of chapter 12's GPT on the course's ops holds the course's kernels in its
    generated code, calls no course op opaquely but attention's, and matches the eager step."""
    import copy
    import re

    from torch._inductor.utils import run_and_get_code

    from course_utils import gpt
    cfg = gpt.GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32)
    eager = gpt.bf16_weights(gpt.GPT(cfg, seed=5).cuda().use("course"))
    compiled = copy.deepcopy(eager)
    x, y = (t.cuda() for t in next(gpt.batches(gpt.tokens(), 3, cfg.seq_len, 1, seed=2)))

    def fwd_bwd(model):
        _, loss = model(x, y)
        loss.backward()
        return loss.detach()

    ref = fwd_bwd(eager)
    torch.compiler.reset()
    got, codes = run_and_get_code(lambda: fwd_bwd(torch.compile(compiled, fullgraph=True)))
    code = "\n".join(codes)
    for kernel in ("norm_fwd_kernel", "add_layer_norm_fwd_kernel", "add_layer_norm_bwd_kernel",
                   "bias_gelu_scale_tuned_kernel", "bias_gelu_backward_kernel", "fused_classifier_kernel"):
        assert re.search(rf"\b{kernel}\b", code), kernel
    opaque = set(re.findall(r"torch\.ops\.course\.(\w+)", code))
    assert opaque <= {"attention_qkv_fwd", "attention_qkv_bwd"}, opaque
    assert abs(got.item() - ref.item()) <= 1e-2 * abs(ref.item())
    for a, b in zip(eager.parameters(), compiled.parameters()):
        scale = a.grad.float().abs().max().item() + 1e-6
        assert (a.grad.float() - b.grad.float()).abs().max().item() <= 5e-2 * scale


def test_symbolic_shapes_take_the_opaque_twin():
    """Under dynamic shapes (symbolic sizes) the op's function calls its opaque twin: the launch plans are keyed
    by concrete sizes. Static shapes, ints and plain tensors run the function itself."""
    from torch.fx.experimental.proxy_tensor import make_fx
    calls = []
    impl = lambda x, n: calls.append("impl") or x.clone()          # noqa: E731
    opaque = lambda x, n: calls.append("opaque") or x.clone()      # noqa: E731
    fn = _lib.annotated(impl, "(Tensor x, int n) -> Tensor", opaque)
    fn(torch.ones(3), 2)
    make_fx(lambda x: fn(x, 2), tracing_mode="fake")(torch.ones(3))
    make_fx(lambda x: fn(x, 2), tracing_mode="symbolic")(torch.ones(5))
    make_fx(lambda x: fn(x, x.shape[0]), tracing_mode="symbolic")(torch.ones(5))
    assert calls == ["impl", "impl", "opaque", "opaque"]


def test_kernel_op_on_a_gpu_registers_a_triton_op_and_its_opaque_twin(monkeypatch):
    """What kernel_op registers where Inductor sees the kernels, driven on the CPU with an aten-only function:
    the op and its opaque twin, and opcheck passes, dynamic shapes included (the twin takes them)."""
    monkeypatch.setattr(_lib, "INDUCTOR_SEES_KERNELS", True)
    name, plans = "selftest_scaled_sum", {}

    def impl(x, s):   # a plan keyed by the shape, as the course's ops keep theirs: no symbolic size can key it
        plans.setdefault((x.shape, x.stride()), x.shape[-1])
        return x * s, x.sum(-1)
    op = _lib.kernel_op(name, "(Tensor x, float s) -> (Tensor, Tensor)", impl,
                        lambda x, s: (torch.empty_like(x), x.new_empty(x.shape[:-1])))
    assert hasattr(torch.ops.course, f"{name}_opaque")
    x = torch.randn(4, 6)
    y, t = op(x, 3.0)
    assert torch.equal(y, x * 3.0) and torch.equal(t, x.sum(-1))
    torch.library.opcheck(op, (x, 3.0))


def test_traced_qkv_backward_writes_its_own_buffers_and_packs_them_alike(monkeypatch):
    """While torch.compile traces, attention_qkv_bwd's kernels write three buffers of their own (no views of
    one buffer: Inductor copied such views wrongly, reading past a slice's end); the packed result must be the
    one the eager path writes in place."""
    from course_utils.ops import attn
    B, N, H, d = 2, 19, 3, 16
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, N, 3 * H * d, generator=g).to(env.DEVICE)
    o, lse = attn.attention_qkv_fwd(qkv, H, True, d ** -0.5)
    do = torch.randn(B, N, H, d, generator=g).to(env.DEVICE).transpose(1, 2)   # the step's layout: a transposed view
    eager = attn.attention_qkv_bwd(do, qkv, o, lse, H, True, d ** -0.5)
    seen = []
    real_bwd_into = attn._bwd_into
    monkeypatch.setattr(attn._lib, "tracing", lambda *ts: True)
    monkeypatch.setattr(attn, "_bwd_into", lambda *a: seen.append(a[-3:]) or real_bwd_into(*a))
    traced = attn.attention_qkv_bwd(do, qkv, o, lse, H, True, d ** -0.5)
    assert all(t._base is None and t.is_contiguous() for t in seen[0])
    assert traced.shape == qkv.shape and torch.equal(traced, eager)


def test_the_wrappers_cast_for_autocast_while_compiled_too(monkeypatch):
    """A custom op has no autocast rule: the wrappers cast the matrix-product inputs to autocast's dtype, in
    eager and while torch.compile traces (the compiled data-parallel step of chapter 13 passed an fp32
    tied head to linear_cross_entropy on an H100 and the fake implementation refused it)."""
    import course_utils.ops as ops
    monkeypatch.setattr(_lib, "autocast_dtype", lambda device_type: torch.float16)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 16, generator=g).to(torch.float16)
    w = torch.randn(40, 16, generator=g)                      # float32, as autocast's model keeps it
    x = torch.randn(12, 16, generator=g).to(torch.float16)
    w_fc, b_fc = torch.randn(24, 16, generator=g) / 4, torch.randn(24, generator=g)
    targets = torch.randint(0, 40, (12,), generator=g)
    h, w, x, w_fc, b_fc, targets = (t.to(env.DEVICE) for t in (h, w, x, w_fc, b_fc, targets))   # a GPU's ops

    def f(h, w, x, w_fc, b_fc, targets):
        return ops.linear_cross_entropy(h, w, targets), ops.linear_gelu(x, w_fc, b_fc)

    eager = f(h, w, x, w_fc, b_fc, targets)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager", fullgraph=True)(h, w, x, w_fc, b_fc, targets)
    assert compiled[1].dtype == torch.float16
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)
