"""The course's ops as PyTorch operators (course_utils/ops): torch.ops.course.<op> and the wrappers.

Each op's forward and gradients against float64 references, through both paths (the wrapper's
autograd.Function and the registered op), ``torch.library.opcheck`` for every registered op, a
``torch.compile(fullgraph=True)`` trace of a tiny block, attention on packed-QKV views, dropout's
device seed, plans cached once per shape (nothing global written per call), and clear errors.
"""

import pytest
import torch
import torch.nn.functional as F

import course_utils as cu
from course_utils import check, ops
from course_utils.kernels.attention import attention_ref
from course_utils.kernels.elementwise import bias_gelu_dropout_ref

DT = torch.float32
TOL = cu.pick(gpu=dict(atol=2e-2, rtol=2e-2), cpu=dict(atol=1e-4, rtol=1e-4))  # GPU: tl.dot may use TF32


def _leaf(shape, scale=1.0, dtype=DT):
    return (check.randn(shape, dtype) * scale).requires_grad_(True)


def _inputs():
    """(name, course call, float64 reference call, inputs): odd sizes, one case per op."""
    B, N, H, hd, d, V = 1, 7, 2, 5, 15, 37
    seed = torch.tensor([1234], dtype=torch.int64, device=cu.DEVICE)
    x, r = _leaf((B, N, d), 2.0), _leaf((B, N, d))
    w, b = _leaf((d,)), _leaf((d,))
    fw, fb = _leaf((29, d), d ** -0.5), _leaf((29,))
    qkv = _leaf((B, N, 3 * H * hd))
    logits, targets = _leaf((B * N, V), 3.0), torch.randint(0, V, (B * N,), device=cu.DEVICE)
    db = _leaf((d,))

    def attn(f, qkv):
        q, k, v = qkv.view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
        return f(q, k, v)

    return [
        ("layer_norm", lambda f, *a: f(*a, 1e-5), lambda *a: F.layer_norm(a[0], (d,), *a[1:], 1e-5), (x, w, b)),
        ("add_layer_norm", lambda f, *a: f(*a, 1e-5),
         lambda x, r, w, b: (F.layer_norm(x + r, (d,), w, b, 1e-5), x + r), (x, r, w, b)),
        ("linear_gelu", lambda f, *a: f(*a), lambda x, w, b: F.gelu(x @ w.T + b, approximate="tanh"), (x, fw, fb)),
        ("attention", lambda f, qkv: attn(lambda q, k, v: f(q, k, v, True, 0.3), qkv),
         lambda qkv: attn(lambda q, k, v: attention_ref(q, k, v, True, 0.3), qkv), (qkv,)),
        ("cross_entropy", lambda f, *a: f(*a), lambda lg, t: F.cross_entropy(lg, t), (logits, targets)),
        ("bias_gelu_dropout", lambda f, *a: f(*a, 0.25, seed),
         lambda x, b: bias_gelu_dropout_ref(x, b, 0.25, 1234), (x, db)),
    ]


CASES = {c[0]: c for c in _inputs()}


@pytest.mark.parametrize("path", ["wrapper", "torch.ops"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_float64(nan_empty, name, path):
    _, call, ref, args = CASES[name]
    f = getattr(ops, name) if path == "wrapper" else getattr(torch.ops.course, name)
    out = call(f, *args)
    outs = out if isinstance(out, tuple) else (out,)
    args64 = [a.detach().double().requires_grad_(True) if a.is_floating_point() else a for a in args]
    want = ref(*args64)
    wants = want if isinstance(want, tuple) else (want,)
    diff = [i for i, a in enumerate(args) if a.is_floating_point()]
    dys = [check.randn(o.shape, torch.float32).to(o.dtype) for o in outs]
    got = torch.autograd.grad(outs, [args[i] for i in diff], dys)
    exp = torch.autograd.grad(wants, [args64[i] for i in diff], [dy.double() for dy in dys])
    for i, (o, w_) in enumerate(zip(outs, wants)):
        check.compare(f"{name} output {i}", o, w_, **TOL)
    for i, g, e in zip(diff, got, exp):
        check.compare(f"{name} gradient of input {i}", g, e, atol=TOL["atol"] * 20, rtol=TOL["rtol"] * 10)


def test_the_two_paths_agree_exactly():
    for name, (_, call, _, args) in CASES.items():
        a, b = call(getattr(ops, name), *args), call(getattr(torch.ops.course, name), *args)
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y), name


KERNEL_OPS = ["layer_norm_fwd", "add_layer_norm_fwd", "linear_gelu_fwd", "attention_fwd", "cross_entropy_fwd",
              "bias_gelu_dropout"]


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck_public_and_kernel_ops(name):
    _, call, _, args = CASES[name]
    captured = {}
    call(lambda *a: captured.setdefault("args", a), *args)   # the op's own arguments (attention: the views)
    public = getattr(torch.ops.course, name).default
    torch.library.opcheck(public, captured["args"])
    kernel = next(k for k in KERNEL_OPS if k.startswith(name))
    torch.library.opcheck(getattr(torch.ops.course, kernel).default, captured["args"])


def _backward_args(name):
    """(backward op, its arguments as autograd would pass them) from a forward on CASES' inputs."""
    _, call, _, args = CASES[name]
    captured = {}
    call(lambda *a: captured.setdefault("args", a), *args)
    a = [t.detach() if isinstance(t, torch.Tensor) else t for t in captured["args"]]
    c = torch.ops.course
    if name == "layer_norm":
        y, mean, rstd = c.layer_norm_fwd(*a)
        return c.layer_norm_bwd, (torch.randn_like(y), a[0], a[1], mean, rstd)
    if name == "add_layer_norm":
        y, s, mean, rstd = c.add_layer_norm_fwd(*a)
        return c.add_layer_norm_bwd, (torch.randn_like(y), torch.randn_like(s), s, a[2], mean, rstd)
    if name == "linear_gelu":
        y, acc = c.linear_gelu_fwd(*a)
        return c.linear_gelu_bwd, (torch.randn_like(y), *a, acc)
    if name == "attention":
        o, lse = c.attention_fwd(*a)
        return c.attention_bwd, (torch.randn_like(o), a[0], a[1], a[2], o, lse, a[3], a[4])
    if name == "cross_entropy":
        loss, lse = c.cross_entropy_fwd(*a)
        return c.cross_entropy_bwd, (torch.tensor(1.5, device=cu.DEVICE), a[0], a[1], lse)
    y = c.bias_gelu_dropout(*a)
    return c.bias_gelu_dropout_bwd, (torch.randn_like(y), *a)


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck_backward_ops(name):
    """Each backward op's schema and fake (shapes, strides, dtypes of its results) against its kernels."""
    op, args = _backward_args(name)
    torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))


def test_attention_reads_packed_qkv_views_and_writes_the_projection_layout():
    B, N, H, hd = 2, 9, 3, 8
    qkv = check.randn((B, N, 3 * H * hd))
    q, k, v = qkv.view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
    assert not q.is_contiguous()
    o = ops.attention(q, k, v, True, hd ** -0.5)
    assert o.shape == (B, H, N, hd) and o.transpose(1, 2).is_contiguous()  # the reshape below is a view
    flat = o.transpose(1, 2).reshape(B, N, H * hd)
    assert flat.data_ptr() == o.data_ptr()
    check.compare("o", o, attention_ref(q.double(), k.double(), v.double(), True, hd ** -0.5), **TOL)


def test_dropout_mask_follows_the_device_seed():
    x, b = check.randn((5, 40)), check.randn((40,))
    seed = torch.tensor([7], dtype=torch.int64, device=cu.DEVICE)
    y1 = ops.bias_gelu_dropout(x, b, 0.5, seed)
    assert torch.equal(y1, ops.bias_gelu_dropout(x, b, 0.5, seed))       # same seed: same mask
    seed.add_(1)                                                           # bumped in place, as a graph would
    y2 = ops.bias_gelu_dropout(x, b, 0.5, seed)
    assert not torch.equal(y1 == 0, y2 == 0)
    check.compare("bumped seed", y2, bias_gelu_dropout_ref(x.double(), b.double(), 0.5, 8), **TOL)
    check.compare("p = 0", ops.bias_gelu_dropout(x, b, 0.0, seed), F.gelu(x.double() + b.double(),
                                                                          approximate="tanh"), **TOL)


def test_torch_compile_traces_a_block_of_course_ops_fullgraph():
    B, N, H, hd = 1, 5, 2, 4
    d = H * hd
    ln_w, ln_b = _leaf((d,)), _leaf((d,))
    wqkv, wfc, bfc = _leaf((3 * d, d), d ** -0.5), _leaf((2 * d, d), d ** -0.5), _leaf((2 * d,))
    head = _leaf((11, 2 * d), 0.3)
    seed = torch.tensor([3], dtype=torch.int64, device=cu.DEVICE)

    def block(x, targets):
        h = ops.layer_norm(x, ln_w, ln_b, 1e-5)
        q, k, v = (h @ wqkv.T).view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
        a = ops.attention(q, k, v, True, hd ** -0.5).transpose(1, 2).reshape(B, N, d)
        y, s = ops.add_layer_norm(a, x, ln_w, ln_b, 1e-5)
        m = ops.bias_gelu_dropout(ops.linear_gelu(y, wfc, bfc), bfc, 0.1, seed)
        return ops.cross_entropy((m @ head.T).view(B * N, -1), targets) + s.mean()

    x, targets = _leaf((B, N, d)), torch.randint(0, 11, (B * N,), device=cu.DEVICE)
    params = (x, ln_w, ln_b, wqkv, wfc, bfc, head)
    want = block(x, targets)
    g_want = torch.autograd.grad(want, params)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got = compiled(x, targets)
    g_got = torch.autograd.grad(got, params)
    check.compare("loss", got, want.double(), **TOL)
    for i, (g, e) in enumerate(zip(g_got, g_want)):
        check.compare(f"gradient {i}", g, e.double(), **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="Inductor's code generation is timed on the GPU (about 5 s on the CPU)")
def test_inductor_compiles_a_block_of_course_ops():
    B, N, H, hd = 2, 64, 2, 32
    d = H * hd
    w, b = _leaf((d,)), _leaf((d,))

    def f(x):
        q = ops.layer_norm(x, w, b, 1e-5).view(B, N, H, hd).transpose(1, 2)
        return ops.attention(q, q, q, True, hd ** -0.5).float().square().sum()

    x = _leaf((B, N, d))
    torch._dynamo.reset()
    check.compare("inductor", torch.compile(f, fullgraph=True)(x), f(x).double(), **TOL)


def test_plans_are_chosen_once_and_hot_calls_write_no_globals():
    from course_utils.ops import attn, linear, norms
    from course_utils.tuned import attention as TA
    from course_utils.tuned import gemm as TG
    counts = ops.warmup(1, 6, 8, 2, 13)
    before = {m.__name__: dict(m.PLANS) for m in (attn, linear, norms)}
    TA.last_config = TG.last_config = "untouched"
    ops.warmup(1, 6, 8, 2, 13)
    assert {m.__name__: dict(m.PLANS) for m in (attn, linear, norms)} == before
    assert TA.last_config == TG.last_config == "untouched"
    assert counts["attention"] >= 2 and counts["linear"] >= 1 and counts["norms"] >= 4


def test_attention_calls_seen_before_reuse_their_launches(monkeypatch):
    """A call with the arguments of an earlier one finds its launches in CALLS: no checks, no plan lookups, the
    same bits, nothing added; a full CALLS is emptied, not grown."""
    from course_utils.ops import attn
    from course_utils.state import RuntimeCache
    qkv = _leaf((1, 9, 3 * 2 * 8))

    def step():
        q, k, v = qkv.view(1, 9, 3, 2, 8).permute(2, 0, 3, 1, 4)
        o = ops.attention(q, k, v, True, 0.3)
        return (o, *torch.autograd.grad(o, (qkv,), torch.ones_like(o)))
    first = step()
    kept = dict(attn.CALLS)
    monkeypatch.setattr(attn, "validate", lambda *a: pytest.fail("checked a call seen before"))
    monkeypatch.setattr(attn.B_, "check_backward_inputs", lambda *a: pytest.fail("checked a call seen before"))
    monkeypatch.setattr(attn, "PLANS", {})   # a plan lookup would choose tiles again and fill this
    again = step()
    assert attn.CALLS == kept and attn.PLANS == {} and all(torch.equal(a, b) for a, b in zip(first, again))
    monkeypatch.setattr(attn, "CALLS", RuntimeCache({("a call",): 1}))
    monkeypatch.setattr(attn, "MAX_CALLS", 1)
    attn._keep(("another",), 2)
    assert attn.CALLS == {("another",): 2}


@pytest.mark.machinery   # a tool around the kernels: their own tests run them under the newest Triton
def test_host_overhead_table_has_every_op():
    table = ops.host_overhead_table(n_calls=1, seq=4, d_model=8, vocab=8)
    from course_utils.ops import overhead as O
    assert list(table["op"])[:-2] == list(ops.OPS) and table["op"].iloc[-1].startswith("(one launch")
    assert table["op"].iloc[-2] == O.FLOOR_ROW   # the Python autograd.Function floor, forward and backward
    assert (table[["course_us", "aten_us"]] > 0).all().all() and (table["torch_ops_us"][:-2] > 0).all()
    assert (table[["course_fwd_bwd_us", "aten_fwd_bwd_us"]][:-1] > 0).all().all()


def test_host_overhead_table_times_every_op_and_the_floor_in_the_same_rounds(monkeypatch):
    """One interleaved timing per mode (forward, forward + backward) holding each op's three calls and the
    floor's two: the floor's extra, added to an op's aten time, comes from the same slow and fast spells."""
    from course_utils.ops import overhead as O
    sizes = []
    real = O._interleaved_us
    monkeypatch.setattr(O, "_interleaved_us", lambda fns, *a, **k: sizes.append(len(fns)) or real(fns, *a, **k))
    table = ops.host_overhead_table(n_calls=1, seq=4, d_model=8, vocab=8)
    assert sizes == [3 * len(ops.OPS) + 2, 3 * len(ops.OPS) + 2, 2]   # the last: the bare launch against add_
    assert table.set_index("op").loc[O.FLOOR_ROW, ["course_us", "aten_us", "course_fwd_bwd_us",
                                                   "aten_fwd_bwd_us"]].gt(0).all()


def test_the_host_bound_past_the_floor_adds_the_floors_extra_to_aten():
    """course / (aten + floor's extra), the larger of forward and forward + backward; the floor rows get none, and
    a table recorded before the floor row gets NaN (judged against 1.5x aten alone)."""
    import pandas as pd

    from course_utils.ops import overhead as O
    nan = float("nan")
    table = pd.DataFrame([
        dict(op="layer_norm", course_us=40.0, aten_us=10.0, course_fwd_bwd_us=300.0, aten_fwd_bwd_us=100.0),
        dict(op=O.FLOOR_ROW, course_us=20.0, aten_us=8.0, course_fwd_bwd_us=200.0, aten_fwd_bwd_us=100.0),
        dict(op="(one launch: touch_kernel / add_)", course_us=12.0, aten_us=7.0, course_fwd_bwd_us=nan,
             aten_fwd_bwd_us=nan)])
    got = O.over_aten_past_the_floor(table)["course_over_aten_floor"].tolist()
    assert got[0] == pytest.approx(max(40 / (10 + 12), 300 / (100 + 100)))
    assert got[1] != got[1] and got[2] != got[2]
    no_floor = O.over_aten_past_the_floor(table.iloc[[0, 2]])
    assert no_floor["course_over_aten_floor"].isna().all()
    cheap = table.assign(course_us=[40.0, 5.0, 12.0])   # a floor cheaper than aten adds nothing
    assert O.over_aten_past_the_floor(cheap)["course_over_aten_floor"].iloc[0] == pytest.approx(max(40 / 10, 1.5))


def test_the_autograd_floor_launches_once_each_way(monkeypatch):
    """The floor row's Function: one launch in its forward, one in its backward, each on a fresh tensor."""
    from course_utils.ops import overhead as O
    seen = []
    monkeypatch.setattr(O, "launch", lambda kernel, key, grid, args, meta: seen.append((kernel, args[0])))
    x = torch.zeros(3, requires_grad=True)
    y = O._OneLaunchEachWay.apply(x)
    y.backward(torch.ones(3))
    assert [k for k, _ in seen] == [O.touch_kernel] * 2
    assert seen[0][1].data_ptr() == y.data_ptr() and seen[1][1].shape == x.shape and x.grad is not None


def test_the_host_table_times_its_calls_in_turn_and_keeps_medians(monkeypatch):
    """A host slow for the first three timings (the first round): interleaved, every function keeps the fast
    median; timed one after another, the first would have taken the whole slow spell."""
    from course_utils.ops import overhead as O
    order = []

    def fake(fn, n_calls, sync):
        order.append(fn)
        return 100.0 if len(order) <= 3 else 10.0
    monkeypatch.setattr(O, "_per_call_us", fake)
    a, b, c = (lambda: None), (lambda: None), (lambda: None)
    assert O._interleaved_us([a, b, c], 50, None, rounds=5) == [10.0, 10.0, 10.0]
    assert order == [a, b, c] * 5


@pytest.mark.parametrize("call,err,match", [
    (lambda: ops.layer_norm(torch.randn(3, 4), torch.ones(5), torch.ones(5)), ValueError, "weight must be"),
    (lambda: ops.add_layer_norm(torch.randn(3, 4), torch.randn(3, 5), torch.ones(4), torch.ones(4)), ValueError,
     "residual must have shape"),
    (lambda: ops.linear_gelu(torch.randn(3, 4), torch.randn(4, 5), torch.ones(4)), ValueError, "out_features"),
    (lambda: ops.attention(torch.randn(1, 2, 3), torch.randn(1, 2, 3), torch.randn(1, 2, 3)), ValueError, "4-D"),
    (lambda: ops.attention(*[torch.randn(1, 1, 3, 4)] * 3, scale=float("nan")), ValueError, "scale"),
    (lambda: ops.cross_entropy(torch.randn(3, 4), torch.zeros(3)), ValueError, "int64 or int32"),
    (lambda: ops.bias_gelu_dropout(torch.randn(3, 4), torch.ones(4), 0.1, 5), TypeError, "seed must be"),
    (lambda: ops.bias_gelu_dropout(torch.randn(3, 4), torch.ones(4), 0.1, torch.tensor([1.0])), TypeError,
     "int64"),
    (lambda: ops.bias_gelu_dropout(torch.randn(3, 4), torch.ones(4), 1.0, torch.tensor([1])), ValueError,
     r"\[0, 1\)"),
], ids=["ln weight", "aln residual", "linear weight", "attention 3-D", "attention scale", "ce targets",
        "seed int", "seed float", "p = 1"])
def test_bad_inputs_say_what_was_expected(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.parametrize("n_q,n_kv,kv_heads", [(1, 9, 2), (3, 7, 1)], ids=["decode", "gqa"])
def test_attention_bottom_right_causal_against_a_cache(n_q, n_kv, kv_heads):
    cache = check.randn((1, kv_heads, 12, 2, 8))   # (B, H_kv, max_len, k|v, d): k and v are strided views
    q = check.randn((1, 2, n_q, 8)).requires_grad_(True)
    k, v = cache[:, :, :n_kv, 0].requires_grad_(True), cache[:, :, :n_kv, 1].requires_grad_(True)
    o = ops.attention(q, k, v, True, 0.4)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want = attention_ref(q64, k64, v64, True, 0.4)
    check.compare("o", o, want, **TOL)
    do = check.randn(o.shape)
    for name, g, e in zip("qkv", torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(want, (q64, k64, v64),
                                                                                         do.double())):
        check.compare(f"d{name}", g, e, atol=TOL["atol"] * 20, rtol=TOL["rtol"] * 10)


def test_add_layer_norm_mixed_dtypes_give_each_input_its_own_gradient_dtype():
    """A 16-bit branch output and a float32 residual stream: s (the stream) is float32, y is in the branch's
    16-bit dtype (what the next 16-bit GEMM reads: nothing casts it down), each input's gradient in its own dtype."""
    x, r = _leaf((3, 7, 24), dtype=torch.float16), _leaf((3, 7, 24))
    w, b = _leaf((24,)), _leaf((24,))
    y, s = ops.add_layer_norm(x, r, w, b)
    assert y.dtype == torch.float16 and s.dtype == torch.float32
    dy, ds = check.randn(y.shape, torch.float16), check.randn(s.shape)
    dx, dr = torch.autograd.grad((y, s), (x, r), (dy, ds))
    assert dx.dtype == torch.float16 and dr.dtype == torch.float32
    x64, r64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, r, w, b))
    s64 = x64 + r64
    want = torch.autograd.grad((F.layer_norm(s64, (24,), w64, b64, 1e-5), s64), x64, (dy.double(), ds.double()))[0]
    check.compare("dresidual", dr, want, atol=1e-4, rtol=1e-4)
    check.compare("dx", dx, want)
    assert torch.equal(dx, dr.to(torch.float16))   # the kernel's second store: the cast of dr, bit for bit


def test_add_layer_norm_writes_the_branch_gradient_in_its_kernel(monkeypatch):
    """The eager path's backward asks the kernel for dx in the 16-bit branch's dtype too (LOW), and casts nothing;
    the compiled step's namespace casts the registered op's dx instead (Inductor fuses that cast)."""
    from course_utils import step
    from course_utils.ops import norms
    asked = []
    real = norms._aln_bwd
    monkeypatch.setattr(norms, "_aln_bwd", lambda *a: asked.append(a[-1]) or real(*a))
    x, r = _leaf((5, 24), dtype=torch.float16), _leaf((5, 24))
    y, s = ops.add_layer_norm(x, r, _leaf((24,)), _leaf((24,)))
    torch.autograd.grad((y, s), (x, r), (check.randn(y.shape, torch.float16), check.randn(s.shape)))
    assert asked == [torch.float16]
    t = [check.randn((5, 24)), check.randn((5, 24)), check.randn((5, 24)), check.randn((24,))]
    mean, rstd = t[2].mean(-1), t[2].var(-1).add(1e-5).rsqrt()
    got = norms.add_layer_norm_bwd_low(*t, mean, rstd, torch.float16)
    ref = step.OPS[0].add_layer_norm_bwd_low(*t, mean, rstd, torch.float16)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    same = norms.add_layer_norm_bwd_low(*t, mean, rstd, torch.float32)
    assert same[0] is same[1]   # no second copy where the branch is as wide as the stream


def test_decoding_with_a_growing_cache_chooses_tiles_once_per_doubling():
    from course_utils.ops import attn
    cache = check.randn((1, 2, 16, 2, 8))
    q = check.randn((1, 2, 1, 8))
    ops.attention(q, cache[:, :, :9, 0], cache[:, :, :9, 1], True)
    plans = dict(attn.PLANS)
    for n in range(10, 17):   # 10..16: one power-of-two bucket
        o = ops.attention(q, cache[:, :, :n, 0], cache[:, :, :n, 1], True)
        check.compare(f"decode n={n}", o, attention_ref(q.double(), cache[:, :, :n, 0].double(),
                                                         cache[:, :, :n, 1].double(), True), **TOL)
    assert attn.PLANS == plans


# ------------------------------------------------------------------ the teaching shelf never imports the tuned one

def test_importing_and_using_the_teaching_shelf_never_imports_the_tuned_shelf():
    """A fresh process imports every course_utils/kernels/ module, looks up every public name of each (a
    PEP 562 forward would import its home on lookup; none is left) and runs the references that draw
    chapter 4's dropout mask (they once imported the tuned mask at call time): nothing from
    course_utils.tuned is ever imported."""
    import pkgutil
    import subprocess
    import sys

    import course_utils.kernels as K
    names = sorted(m.name for m in pkgutil.iter_modules(K.__path__))
    code = ("import sys, importlib, torch\n"
            "import course_utils as cu\n"
            f"for name in {names!r}:\n"
            "    module = importlib.import_module('course_utils.kernels.' + name)\n"
            "    assert not hasattr(module, '__getattr__'), (name, 'forwards names (PEP 562)')\n"
            "    for attr in dir(module):\n"
            "        getattr(module, attr)\n"
            "    bad = sorted(m for m in sys.modules if m.startswith('course_utils.tuned'))\n"
            "    assert not bad, (name, bad)\n"
            "from course_utils.kernels import elementwise, gemm\n"
            "x, w, b = (torch.randn(*s, device=cu.DEVICE) for s in ((3, 8), (8, 5), (5,)))\n"
            "y1 = elementwise.bias_gelu_dropout_ref(x, torch.randn(8, device=cu.DEVICE), 0.5, 1)\n"
            "y2 = gemm.linear_gelu_ref(x, w, b, p=0.5, seed=1)\n"
            "assert (y1 == 0).any() and (y2 == 0).any(), 'no element dropped'\n"
            "bad = sorted(m for m in sys.modules if m.startswith('course_utils.tuned'))\n"
            "assert not bad, ('the dropout references', bad)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_no_teaching_module_imports_the_tuned_shelf_anywhere_in_its_source():
    """Every import statement of course_utils/kernels/*.py, at module level or inside a function (a
    call-time import), resolved to its absolute name: none is course_utils.tuned or below."""
    import ast
    import pathlib

    import course_utils.kernels as K

    def tuned_imports(source: str) -> list[tuple[int, str]]:
        hits = []
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # relative to course_utils.kernels
                base = ".".join((["course_utils", "kernels"][: 3 - node.level] if node.level else [])
                                + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            hits += [(node.lineno, t) for t in targets if (t + ".").startswith("course_utils.tuned.")][:1]
        return hits

    probe = ("def f():\n    from ..tuned.elementwise import gelu\n"
             "from .. import tuned\nimport course_utils.tuned.softmax\nfrom .elementwise import gelu_math\n")
    assert sorted(line for line, _ in tuned_imports(probe)) == [2, 3, 4]  # the check sees each form it looks for
    found = [(path.name, hit) for path in sorted(pathlib.Path(K.__file__).parent.glob("*.py"))
             for hit in tuned_imports(path.read_text())]
    assert not found, f"the teaching shelf imports the tuned shelf: {found}"


def test_outputs_nothing_reads_cost_no_zero_gradients():
    """The wrapper's Function leaves an unread output's gradient as None (autograd would otherwise fill a
    zeros tensor for it, one kernel each): add_layer_norm's last residual stream and its statistics."""
    x, r, w, b = _leaf((4, 16)), _leaf((4, 16)), _leaf((16,)), _leaf((16,))
    y, s = ops.add_layer_norm(x, r, w, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (dx,) = torch.autograd.grad(y.sum(), (x,))
    filled = [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zeros_like", "aten::zero_")]
    assert not filled, filled
    x64, r64 = (t.detach().double().requires_grad_(True) for t in (x, r))
    want = torch.autograd.grad(F.layer_norm(x64 + r64, (16,), w.double(), b.double()).sum(), x64)[0]
    check.compare("dx with s unread", dx, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("plan", ["cublas", "gemm"])
def test_linear_gelu_plans_agree_with_float64(plan):
    """Both plans of linear_gelu (cuBLAS + the bias-GELU kernel saving acc; chapter 9's GEMM recomputing it):
    the same values and gradients, and the GEMM plan saves nothing of (rows x out_features)."""
    from course_utils.ops import linear
    _, call, ref, args = CASES["linear_gelu"]
    with linear.linear_plan(plan):
        y, acc = torch.ops.course.linear_gelu_fwd(*[a.detach() for a in args])
        assert acc.numel() == (0 if plan == "gemm" else y.numel())
        out = call(ops.linear_gelu, *args)
        dy = check.randn(out.shape)
        got = torch.autograd.grad(out, args, dy)
    a64 = [a.detach().double().requires_grad_(True) for a in args]
    want = ref(*a64)
    check.compare(f"{plan} output", out, want, **TOL)
    for name, g, e in zip(("dx", "dw", "db"), got, torch.autograd.grad(want, a64, dy.double())):
        check.compare(f"{plan} {name}", g, e, atol=TOL["atol"] * 20, rtol=TOL["rtol"] * 10)


def test_attention_defaults_to_non_causal_as_sdpa_does():
    """``causal`` defaults to False, like ``F.scaled_dot_product_attention``'s ``is_causal``."""
    q, k, v = (check.randn((1, 2, 9, 8)) for _ in range(3))
    check.compare("default (non-causal)", ops.attention(q, k, v), attention_ref(q.double(), k.double(), v.double(),
                                                                                False, 8 ** -0.5), **TOL)
    check.compare("sdpa's default", ops.attention(q, k, v), F.scaled_dot_product_attention(q, k, v), **TOL)


def test_attention_qkv_writes_the_gradient_in_the_packed_layout():
    """attention_qkv on a packed projection: the same output as attention on its views, and dqkv (one
    tensor, the projection's layout) against float64, written by the backward kernels without a gather."""
    B, N, H, hd = 2, 9, 3, 8
    qkv = _leaf((B, N, 3 * H * hd))
    o = ops.attention_qkv(qkv, H, True, hd ** -0.5)
    q, k, v = qkv.view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
    assert torch.equal(o, ops.attention(q, k, v, True, hd ** -0.5))
    do = check.randn(o.shape)
    (got,) = torch.autograd.grad(o, qkv, do)
    q64 = qkv.detach().double().requires_grad_(True)
    qq, kk, vv = q64.view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
    (want,) = torch.autograd.grad(attention_ref(qq, kk, vv, True, hd ** -0.5), q64, do.double())
    assert got.shape == qkv.shape and got.is_contiguous()
    check.compare("dqkv", got, want, atol=TOL["atol"] * 20, rtol=TOL["rtol"] * 10)
    torch.library.opcheck(torch.ops.course.attention_qkv_fwd.default, (qkv, H, True, hd ** -0.5))
    with pytest.raises(ValueError, match="3 \\* n_head"):
        ops.attention_qkv(check.randn((1, 4, 10)), 3)


def test_rows_view_gives_a_row_stride_only_for_evenly_strided_rows():
    """The norms launch on the input itself with one row stride when its rows are evenly strided (no view,
    no copy), else they copy it once: contiguous, a column slice, and a permutation."""
    from course_utils.ops.norms import _rows_view
    x = torch.randn(2, 3, 8)
    assert _rows_view(x, 8) == 8
    assert _rows_view(x[:, :, :5], 5) == 8                      # rows of 5 inside rows of 8
    assert _rows_view(x.transpose(0, 1), 8) is None             # (3, 2, 8): rows not evenly strided
    assert _rows_view(x.transpose(1, 2), 3) is None             # the last dim is not unit stride
    y, r = check.randn((3, 7, 24))[:, :, :16], check.randn((3, 7, 16))
    w, b = check.randn((16,)), check.randn((16,))
    got, s = ops.add_layer_norm(y, r, w, b)                     # a strided x read in place
    check.compare("add_layer_norm on a column slice", got, F.layer_norm((y + r).double(), (16,), w.double(),
                                                                       b.double(), 1e-5), **TOL)


@pytest.mark.parametrize("layout", ["column slice", "transposed"])
def test_layer_norm_backward_reads_strided_rows_in_place_or_copies_them(layout):
    """layer_norm's backward launches on x and dy at their own row strides (a column slice: no copy) or on a
    copy (rows not evenly strided), each layout with its own cached plan; gradients match float64."""
    base = check.randn((3, 7, 24))
    x = base[:, :, :16] if layout == "column slice" else check.randn((7, 3, 16)).transpose(0, 1)
    x = x.detach().requires_grad_()
    w, b = (check.randn((16,)).requires_grad_() for _ in range(2))
    dy = check.randn((3, 7, 40))[:, :, 3:19]                      # a strided gradient too
    got = torch.autograd.grad(ops.layer_norm(x, w, b), (x, w, b), dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    want = torch.autograd.grad(F.layer_norm(x64, (16,), w64, b64, 1e-5), (x64, w64, b64), dy.double())
    for what, g, e in zip(("dx", "dw", "db"), got, want):
        check.compare(f"layer_norm {what} ({layout})", g, e, atol=TOL["atol"] * 20, rtol=TOL["rtol"] * 10)


def test_no_autograd_node_when_nothing_needs_a_gradient():
    """With nothing to differentiate the ops run their forward directly (no autograd.Function, as aten
    records no node); with a tensor that requires grad they record one, and both give the same output."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, 24, generator=g).to(cu.DEVICE)
    w, b = (torch.randn(24, generator=g).to(cu.DEVICE) for _ in range(2))
    y0 = ops.layer_norm(x, w, b)
    assert y0.grad_fn is None
    with torch.no_grad():
        assert ops.layer_norm(x, w, b.requires_grad_()).grad_fn is None
    y1 = ops.layer_norm(x, w, b)
    assert y1.grad_fn is not None and torch.equal(y0, y1.detach())
