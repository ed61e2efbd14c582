"""The ops' cheap launch path (course_utils/tuned/launch.py): its cache logic, driven with fake kernels.

A fake ``JITFunction`` records every ``kernel[grid](...)`` call (the plain path: bind, specialize,
compile, launch) and returns a fake ``CompiledKernel`` that records every direct launch. The tests
check that the second call of a key reuses the compiled kernel with every parameter in signature
order, and that each thing Triton specializes on (a pointer's 16-byte alignment, an int's value, a
tensor's dtype, constexprs and options, the call site's key, the grid) makes a new entry, and that the
layouts the module does not map always take the plain path. The real kernels' bits, fast path against
plain, are compared on a GPU by tools/gpu_checks/fast_launch.py.
"""

import inspect
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from course_utils import env
from course_utils.tuned import launch as L


class FakeCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("fast", grid, args))


class FakeParam:
    def __init__(self, p: inspect.Parameter):
        self.name = p.name
        self.is_constexpr = p.annotation is tl.constexpr
        self.has_default = p.default is not inspect.Parameter.empty
        self.default = p.default


class FakeKernel:
    """A kernel with the signature of ``fn`` (``tl.constexpr`` annotations mark constexprs)."""

    def __init__(self, fn, compiled=True):
        self.params = [FakeParam(p) for p in inspect.signature(fn).parameters.values()]
        self.arg_names = [p.name for p in self.params]
        self.pre_run_hooks = []
        self.log = []
        self.compiled = FakeCompiled(self.log) if compiled else None

    def run(self, *args, grid, **meta):
        self.log.append(("plain", grid, args, meta))
        return self.compiled

    def __getitem__(self, grid):
        return lambda *args, **meta: self.run(*args, grid=grid, **meta)

    def kinds(self):
        return [entry[0] for entry in self.log]


def _sig(x_ptr, y_ptr, n, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr = 64, HAS_Y: tl.constexpr = True):
    pass


@pytest.fixture
def fake(monkeypatch):
    """The module with the fake types accepted and an empty cache; no GPU needed."""
    monkeypatch.setattr(L, "JIT_TYPES", (FakeKernel,))
    monkeypatch.setattr(L, "COMPILED_TYPES", (FakeCompiled,))
    monkeypatch.setattr(L, "current_device", lambda: 0)
    monkeypatch.setattr(L, "PLAIN_RUN", FakeKernel.run)
    L.clear()
    yield L
    L.clear()


def _buf(n=64, dtype=torch.float32):
    return torch.zeros(n, dtype=dtype)   # CPU tensors: data_ptr() is all the launch path reads


def _call(k, x, y, n=32, scale=0.5, key="plan", grid=(3,), **meta):
    meta = {"FLAG": True, "num_warps": 4, **meta}
    L.fast_launch(k, key, grid, (x, y, n, scale), meta)


def test_second_call_reuses_the_compiled_kernel_with_every_parameter(fake):
    k, x, y = FakeKernel(_sig), _buf(), _buf()
    _call(k, x, y)
    _call(k, x, y, scale=0.25)          # a float is a runtime value: the same compiled kernel
    assert k.kinds() == ["plain", "fast"]
    _, grid, args = k.log[1]
    assert grid == (3, 1, 1)           # padded to three dims, as CompiledKernel's runner reads them
    assert args == (x, y, 32, 0.25, True, 64, True)   # signature order: FLAG from meta, BLOCK/HAS_Y defaults
    assert L.size() == 1


def test_alignment_int_values_dtype_meta_key_and_grid_make_new_entries(fake):
    k = FakeKernel(_sig)
    x, y = _buf(), _buf()
    _call(k, x, y)
    variants = [
        dict(x=_buf()[1:]),                       # pointer 4 bytes past a 16-byte boundary
        dict(n=33),                               # an int Triton may specialize (1, % 16, 32/64-bit)
        dict(n=2 ** 40),
        dict(x=_buf(dtype=torch.float16)),        # another dtype
        dict(BLOCK=128),                          # a constexpr by keyword
        dict(num_warps=8),                        # an option
        dict(key="other plan"),                   # the call site's key
        dict(grid=(5,)),
        dict(FLAG=1),                             # True == 1 in Python, not to Triton's constexprs
    ]
    for v in variants:
        args = {"x": x, "y": y, **v}
        before = len(k.log)
        _call(k, args.pop("x"), args.pop("y"), **args)
        assert k.kinds()[before:] == ["plain"], v
    assert L.size() == 1 + len(variants)
    _call(k, x[16:], y)                # 64 bytes in: aligned, same specialization as x
    assert k.kinds()[-1] == "fast"


def test_a_new_alignment_after_the_first_call_takes_the_plain_path(fake):
    k = FakeKernel(_sig)
    base, y = _buf(), _buf()
    _call(k, base, y)
    _call(k, base[1:], y)
    _call(k, base[1:], y)
    _call(k, base, y)
    assert k.kinds() == ["plain", "plain", "fast", "fast"]


@pytest.mark.parametrize("case", ["autotuner", "not compiled", "hook", "pre-run hook", "other type", "subclass",
                                  "runtime by keyword", "float constexpr positional", "missing param",
                                  "callable grid", "unhashable meta", "run replaced"])
def test_unsupported_layouts_always_take_the_plain_path(fake, monkeypatch, case):
    k, x, y = FakeKernel(_sig, compiled=case != "not compiled"), _buf(), _buf()
    args, meta, grid = (x, y, 32, 0.5), {"FLAG": True}, (3,)
    if case == "autotuner":
        monkeypatch.setattr(L, "JIT_TYPES", ())
    elif case == "hook":
        monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    elif case == "pre-run hook":
        k.pre_run_hooks.append(lambda *a, **kw: None)
    elif case == "other type":
        args = (x, object(), 32, 0.5)
    elif case == "subclass":
        args = (x, y.as_subclass(_Sub), 32, 0.5)
    elif case == "runtime by keyword":
        args, meta = (x, y, 32), {"scale": 0.5, "FLAG": True}
    elif case == "float constexpr positional":
        args, meta = (x, y, 32, 0.5, 1.5), {}
    elif case == "missing param":
        args, meta = (x, y, 32, 0.5), {}
    elif case == "callable grid":
        grid = lambda meta: (3,)  # noqa: E731
    elif case == "unhashable meta":
        meta = {"FLAG": True, "BLOCK": [64]}
    elif case == "run replaced":   # what course_utils.profile.triton_launch_hook does to count launches
        original = FakeKernel.run
        monkeypatch.setattr(FakeKernel, "run", lambda self, *a, **kw: original(self, *a, **kw))
    for _ in range(3):
        L.fast_launch(k, "plan", grid, args, meta)
    assert k.kinds() == ["plain"] * 3, case
    assert L.size() == 0


class _Sub(torch.Tensor):
    pass


def test_a_launch_counter_sees_cached_launches(fake, monkeypatch):
    """A launch cached before ``triton_launch_hook`` (count_launches) starts is launched plainly, and so
    counted, while the hook is on; afterwards the cached launch again."""
    from course_utils import triton_internals
    from course_utils.profile import triton_launch_hook
    monkeypatch.setattr(triton_internals, "launch_classes", lambda: [FakeKernel])
    k, x, y = FakeKernel(_sig), _buf(), _buf()
    _call(k, x, y)
    _call(k, x, y)
    seen = []
    with triton_launch_hook(lambda *a: seen.append(a), SimpleNamespace(paused=0)):
        _call(k, x, y)
    _call(k, x, y)
    assert len(seen) == 1
    assert k.kinds() == ["plain", "fast", "plain", "fast"]


def test_the_cache_is_bounded(fake, monkeypatch):
    monkeypatch.setattr(L, "MAX_ENTRIES", 8)
    k, x, y = FakeKernel(_sig), _buf(), _buf()
    for step in range(50):            # an int that changes every call (a step counter) makes a key per call
        _call(k, x, y, n=step)
        assert L.size() <= 8
    assert k.kinds() == ["plain"] * 50


def test_a_plain_hook_is_a_hook(fake, monkeypatch):
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    k, x, y = FakeKernel(_sig), _buf(), _buf()
    _call(k, x, y)
    _call(k, x, y)
    assert k.kinds() == ["plain", "plain"]


def test_specialization_tells_kinds_apart():
    x = _buf()
    assert L.specialization((True,)) != L.specialization((1,))       # True == 1 in Python
    assert L.specialization((1.0,)) != L.specialization((1,))        # 1.0 == 1 in Python
    assert L.specialization((2.5,)) == L.specialization((0.5,))      # a float is a runtime value
    assert L.specialization((x,)) != L.specialization((x.half(),))
    assert L.specialization((None, 1)) != L.specialization((1, None))
    assert L.specialization((x, 16)) != L.specialization((x[1:], 16))
    assert L.specialization((object(),)) is None
    assert L.specialization(((1, 2),)) is None
    h = torch.zeros(64, 64, dtype=torch.float16)
    d16, d32 = (TensorDescriptor.from_tensor(h, [b, 16]) for b in (16, 32))
    assert L.specialization((d16,)) == L.specialization((TensorDescriptor.from_tensor(h.clone(), [16, 16]),))
    assert L.specialization((d16,)) != L.specialization((d32,))
    assert L.specialization((d16,)) != L.specialization((TensorDescriptor.from_tensor(h.float(), [16, 16]),))


def test_the_interpreter_and_the_switch_launch_plainly(monkeypatch):
    k, x, y = FakeKernel(_sig), _buf(), _buf()
    for enabled, gpu in ((True, False), (False, True)):
        monkeypatch.setattr(L, "ENABLED", enabled)
        monkeypatch.setattr(env, "on_gpu", lambda gpu=gpu: gpu)
        L.launch(k, "plan", (1,), (x, y, 32, 0.5), {"FLAG": True})
        L.launch(k, "plan", (1,), (x, y, 32, 0.5), {"FLAG": True})
    assert k.kinds() == ["plain"] * 4


# --------------------------------------------------------------------------- the hot launchers' second calls
# Under the interpreter ``launch`` is the plain launch, but a hot launcher's second call of a key takes its
# own branch (cached plan, its own argument list): each must give the bits of the public launcher it stands for.


def _matrix(shape, dtype=torch.float32, transposed=False):
    from course_utils import check
    x = check.randn(shape[::-1] if transposed else shape, dtype)
    return x.t() if transposed else x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_bias_gelu_scale_hot_is_bias_gelu_scale(dtype, transposed):
    from course_utils import check
    from course_utils.tuned import elementwise as EW
    x, bias = _matrix((13, 37), dtype, transposed), check.randn((37,), dtype)
    want = EW.bias_gelu_scale(x, bias, 1.0)
    for _ in range(3):   # the first call of the key checks and plans, the later ones take the cached plan
        got = EW.bias_gelu_scale_hot(x, bias, 1.0)
        assert torch.equal(got, want) and got.stride() == want.stride()
    with pytest.raises(TypeError, match="bias"):
        EW.bias_gelu_scale_hot(x, bias.double() if dtype == torch.float32 else bias.float(), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hot_gelu_backward_is_the_teaching_one(dtype):
    from course_utils import check
    from course_utils.kernels.gelu_backward import bias_gelu_backward_teaching
    from course_utils.tuned import gelu_backward as GB
    x, dy, bias = check.randn((45, 70), dtype), check.randn((45, 70), dtype), check.randn((70,), dtype)
    want = bias_gelu_backward_teaching(dy, x, bias)
    for _ in range(3):
        got = GB.bias_gelu_backward(dy, x, bias)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError):
        GB.bias_gelu_backward(dy[:, :69], x[:, :69], bias)


def test_cross_entropy_op_checks_each_layout_once_and_launches_as_the_teaching_one():
    from course_utils import check
    from course_utils.kernels import cross_entropy as K
    from course_utils.ops import loss
    logits = check.randn((9, 301), torch.float32, scale=3.0)
    targets = torch.randint(0, 301, (9,), device=logits.device)
    want_loss, want_lse = K.cross_entropy_teaching(logits, targets, **loss._plan(301))
    dloss = torch.ones((), device=logits.device)
    want_grad = K.cross_entropy_backward_teaching(dloss, logits, targets, want_lse, **loss._plan(301))
    for _ in range(2):
        got_loss, got_lse = loss.cross_entropy_fwd(logits, targets)
        assert torch.equal(got_loss, want_loss) and torch.equal(got_lse, want_lse)
        assert torch.equal(loss.cross_entropy_bwd(dloss, logits, targets, want_lse), want_grad)
    with pytest.raises(ValueError, match="targets"):   # a new layout of the inputs is checked again
        loss.cross_entropy_fwd(logits, targets.float())
    with pytest.raises(ValueError, match="dloss"):
        loss.cross_entropy_bwd(torch.ones(2, device=logits.device), logits, targets, want_lse)


def test_delta_rows_is_row_delta():
    from course_utils import check
    from course_utils.kernels.attention_backward import row_delta
    from course_utils.tuned.attention_backward import delta_rows
    o = check.randn((2, 3, 37, 40), torch.float32).transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, d) memory
    do = check.randn((2, 3, 37, 40), torch.float32)
    assert torch.equal(delta_rows(o, do), row_delta(o, do))


def test_attention_launch_plans_are_keyed_on_alignment():
    """The forward's cached launch plan (descriptor mode and all) is per 16-byte alignment of q, k, v."""
    from course_utils import check
    from course_utils.tuned import attention as F_
    buf = check.randn((3 * 2 * 16 * 32 + 1,), torch.float32)
    aligned = buf[:-1].view(3, 1, 2, 16, 32)
    shifted = buf[1:].view(3, 1, 2, 16, 32)
    cfg = F_.INTERPRETER_TILES
    outs = []
    before = len(F_._LAUNCH_PLANS)
    for qkv in (aligned, shifted, shifted.clone(), aligned):
        q, k, v = qkv
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        F_._launch_tuned(cfg, q, k, v, o, lse, 32 ** -0.5, True)
        outs.append(o)
    assert len(F_._LAUNCH_PLANS) - before == 2    # aligned and shifted; the clone is aligned
    assert torch.equal(outs[0], outs[3]) and torch.equal(outs[1], outs[2])


def test_a_traced_launch_passes_every_default_the_call_left_out(monkeypatch):
    """Inductor's generated code launches a wrap_triton kernel with the arguments traced, no more: a constexpr left
    to its default went missing there (the GPT under torch.compile raised ``missing ... '_grid_2'``)."""
    from course_utils.tuned.layernorm_kernels import norm_fwd_kernel
    args = tuple(range(11))   # norm_fwd_kernel's eleven runtime parameters, y_ptr .. eps
    meta = dict(BLOCK_N=64, ROWS=1, RMS=False, HAS_BIAS=True, STATS=True, num_warps=4)
    assert L.with_defaults(norm_fwd_kernel, len(args), meta) == {**meta, "RELOAD": False}
    given = {**meta, "RELOAD": True}
    assert L.with_defaults(norm_fwd_kernel, len(args), given) == given   # what the call gives is kept
    seen = []

    class _Wrapped:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((grid, a, kw))

    monkeypatch.setattr(L, "traced", lambda t: t == 0)
    monkeypatch.setattr(L.torch.library, "wrap_triton", lambda kernel: _Wrapped())
    L.plain_launch(norm_fwd_kernel, (3,), args, meta)
    assert seen == [((3,), args, {**meta, "RELOAD": False})]
