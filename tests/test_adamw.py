"""AdamW with fp32 master weights: the teaching kernel (course_utils.kernels.adamw) and the one-launch
MasterAdamW (course_utils.tuned.adamw), against torch.optim.AdamW run in float64 on the same gradients.

Under the interpreter the low-precision copies are fp32 and fp16 (its bf16 arithmetic is wrong);
``tools/gpu_checks/adamw.py`` runs bf16, CUDA graphs and the timing on a GPU."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu
from course_utils import check
from course_utils.kernels import adamw as teaching
from course_utils.tuned import adamw as tuned

DTYPES = (torch.float32, torch.float16)


@pytest.fixture
def on_the_course_device():
    """Tensors made without a device land on the course's (a GPU on a GPU host), as the optimizer's do: these
    tests make theirs that way (not autouse: the mode's Python would count in the host-work profile)."""
    with torch.device(cu.DEVICE):
        yield


def step_t(t: int) -> torch.Tensor:
    return torch.tensor([float(t)], device=cu.DEVICE)


def lr_t() -> torch.Tensor:
    return torch.tensor([LR], device=cu.DEVICE)
SIZES = (1, 7, 1000, 4099)
SHAPES = ((1,), (7,), (0,), (1000,), (33, 65), (4099,))     # several tensors in one call, one empty
LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8
STEPS = 3
# fp32 masters after a few steps against float64: a few ulp of |w| (the update itself is ~LR, so a
# wrong formula, a missing bias correction or weight decay misses by orders of magnitude more)
MASTER_TOL = dict(rtol=4e-6, atol=1e-6)
# m = beta1 m + (1 - beta1) g can cancel: its rounding error is relative to its terms, the gradients, not
# to m itself (a one-element m near zero failed the tensor's own scale). The gradients' scale comes from
# v = sum (1 - beta2) beta2^k g_k^2: sqrt(v / (1 - beta2)) >= beta2^(k/2) |g_k| for every step k.
MOMENT_RTOL = 4e-6


def _name(d):
    return str(d).removeprefix("torch.")


def _torch_adamw(inits, weight_decay):
    """float64 copies of ``inits`` and torch.optim.AdamW over them (the reference trajectory)."""
    ref = [w.detach().double().clone().requires_grad_() for w in inits]
    return ref, torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)


def _grad(shape, dtype, scale=1.0):
    return check.randn(shape, torch.float32, scale=scale).to(dtype)


def _assert_matches(opt_masters, opt_m, opt_v, ref, ropt, what=""):
    for i, (w, m, v, r) in enumerate(zip(opt_masters, opt_m, opt_v, ref)):
        st = ropt.state.get(r)
        torch.testing.assert_close(w.double(), r.detach(), **MASTER_TOL, msg=lambda s: f"{what} master {i}: {s}")
        if st:
            grad_scale = float((st["exp_avg_sq"].max() / (1 - BETAS[1])).sqrt()) if r.numel() else 0.0
            for got, want, name in ((m, st["exp_avg"], "m"), (v, st["exp_avg_sq"], "v")):
                scale = grad_scale if name == "m" else float(want.abs().max()) if want.numel() else 0.0
                atol = MOMENT_RTOL * scale
                torch.testing.assert_close(got.double(), want, rtol=MOMENT_RTOL, atol=atol,
                                           msg=lambda s: f"{what} {name} {i}: {s}")


# --- the teaching shelf ---------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", (0.0, 0.1))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_teaching_kernel_follows_torch_adamw(dtype, n, weight_decay):
    init = check.randn((n,))
    master = check.guarded_copy(init)
    m, v = (check.Guarded((n,), fill=torch.zeros(n, device=cu.DEVICE)) for _ in range(2))
    weight = check.Guarded((n,), dtype)                         # NaN-poisoned: every element must be written
    step, lr = torch.zeros(1, device=cu.DEVICE), torch.tensor([LR], device=cu.DEVICE)
    ref, ropt = _torch_adamw([init], weight_decay)
    for _ in range(STEPS):
        g = _grad((n,), dtype)
        step += 1
        teaching.adamw_teaching(g, master.tensor, m.tensor, v.tensor, weight.tensor, step, lr, betas=BETAS,
                                eps=EPS, weight_decay=weight_decay)
        ref[0].grad = g.double()
        ropt.step()
    _assert_matches([master.tensor], [m.tensor], [v.tensor], ref, ropt)
    assert torch.equal(weight.tensor, master.tensor.to(dtype)), "the low-precision copy is the master rounded"
    for buf, what in ((master, "master"), (m, "m"), (v, "v"), (weight, "weight")):
        buf.check(f"adamw_kernel ({what})")


def test_teaching_kernel_respects_eps_for_tiny_gradients():
    """Gradients of 1e-9: sqrt(v) is ~eps, so where eps sits in the denominator decides the step."""
    n = 1000
    init = check.randn((n,))
    master, weight = init.clone(), torch.empty(n, device=cu.DEVICE)
    m, v = torch.zeros(n, device=cu.DEVICE), torch.zeros(n, device=cu.DEVICE)
    ref, ropt = _torch_adamw([init], 0.0)
    for t in range(1, STEPS + 1):
        g = _grad((n,), torch.float32, scale=1e-9)
        teaching.adamw_teaching(g, master, m, v, weight, step_t(t), lr_t(), betas=BETAS,
                                eps=EPS, weight_decay=0.0)
        ref[0].grad = g.double()
        ropt.step()
    _assert_matches([master], [m], [v], ref, ropt)


@pytest.mark.parametrize("weight_decay", (0.0, 0.1))
def test_reference_is_torch_adamw(weight_decay):
    init, g = check.randn((4099,)).double(), check.randn((4099,)).double()
    ref, ropt = _torch_adamw([init], weight_decay)
    w, m, v = init.clone(), torch.zeros_like(init), torch.zeros_like(init)
    for t in (1, 2):
        w, m, v = teaching.adamw_ref(g, w, m, v, t, LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
        ref[0].grad = g
        ropt.step()
    st = ropt.state[ref[0]]
    for got, want in ((w, ref[0].detach()), (m, st["exp_avg"]), (v, st["exp_avg_sq"])):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.usefixtures("on_the_course_device")
def test_teaching_launcher_refuses_bad_inputs():
    n = 10
    f32 = [torch.zeros(n, device=cu.DEVICE) for _ in range(3)]
    g, w, step, lr = (torch.zeros(n, device=cu.DEVICE), torch.zeros(n, device=cu.DEVICE),
                      torch.ones(1, device=cu.DEVICE), torch.tensor([LR], device=cu.DEVICE))
    run = teaching.adamw_teaching
    with pytest.raises(TypeError, match="master has dtype torch.float16"):
        run(g, f32[0].half(), f32[1], f32[2], w, step, lr)
    with pytest.raises(ValueError, match="grad has 9 elements"):
        run(torch.zeros(n - 1), *f32, w, step, lr)
    with pytest.raises(TypeError, match="grad has dtype torch.int32"):
        run(g.int(), *f32, w, step, lr)
    with pytest.raises(ValueError, match="weight is not contiguous"):
        run(g, *f32, torch.zeros(2 * n)[::2], step, lr)
    with pytest.raises(TypeError, match="step must be a one-element tensor"):
        run(g, *f32, w, 1, lr)
    with pytest.raises(TypeError, match="lr must be a one-element tensor"):
        run(g, *f32, w, step, torch.tensor([LR], dtype=torch.float64))
    with pytest.raises(ValueError, match="beta2 must be in"):
        run(g, *f32, w, step, lr, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="weight_decay must be"):
        run(g, *f32, w, step, lr, weight_decay=-1.0)
    empty = [torch.zeros(0) for _ in range(5)]
    run(*empty, step, lr)                                       # empty: no launch, no error


# --- the tuned shelf: MasterAdamW ---------------------------------------------------------------


def _guarded_params(shapes, dtype, inits):
    """Parameters inside guard zones (16-byte aligned: the guard is 8192 elements)."""
    bufs = [check.Guarded(s, dtype, fill=w.to(dtype)) for s, w in zip(shapes, inits)]
    return bufs, [b.tensor for b in bufs]


def _poison_padding(opt):
    """NaN in the flat buffers' padding between parameters: a program that strays there shows."""
    for buf in (opt.master, opt.exp_avg, opt.exp_avg_sq):
        keep = torch.zeros_like(buf, dtype=torch.bool)
        for o, n in zip(opt.offsets, opt.numels):
            keep[o:o + n] = True
        buf[~keep] = float("nan")
    return lambda: all(bool(buf[~keep].isnan().all()) for buf in (opt.master, opt.exp_avg, opt.exp_avg_sq))


@pytest.mark.parametrize("block_size", (256, tuned.BLOCK_SIZE))
@pytest.mark.parametrize("weight_decay", (0.0, 0.1))
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_master_adamw_follows_torch_adamw(dtype, weight_decay, block_size):
    inits = [check.randn(s).to(dtype).float() for s in SHAPES]  # the masters start from the parameters
    bufs, params = _guarded_params(SHAPES, dtype, inits)
    opt = tuned.MasterAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, block_size=block_size)
    padding_untouched = _poison_padding(opt)
    for p in params:
        p.fill_(float("nan"))                                   # the kernel must write every weight
    ref, ropt = _torch_adamw(inits, weight_decay)
    for _ in range(STEPS):
        for p, r, scale in zip(params, ref, (1.0, 10.0, 1.0, 1e-3, 1.0, 0.5)):
            p.grad = _grad(p.shape, dtype, scale)
            r.grad = p.grad.double()
        opt.step()
        ropt.step()
    _assert_matches(opt.masters(), _views(opt, opt.exp_avg), _views(opt, opt.exp_avg_sq), ref, ropt)
    for i, (p, w) in enumerate(zip(params, opt.masters())):
        assert torch.equal(p, w.to(dtype)), f"parameter {i} is not its master rounded"
    for i, b in enumerate(bufs):
        b.check(f"MasterAdamW parameter {i}")
    assert padding_untouched(), "the kernel wrote into the padding between parameters in the flat buffers"
    assert float(opt.step_count) == STEPS


def _views(opt, flat):
    return [flat[o:o + n].view(p.shape) for o, n, p in zip(opt.offsets, opt.numels, opt.params)]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_parameters_without_gradient_are_skipped(dtype):
    inits = [check.randn(s).to(dtype).float() for s in SHAPES]
    params = [w.to(dtype) for w in inits]
    opt = tuned.MasterAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1)
    ref, ropt = _torch_adamw(inits, 0.1)
    skipped = 3                                                  # the (1000,) tensor has no gradient at step 2
    for step in (1, 2):
        if step == 2:
            before = [t.clone() for t in (params[skipped], opt.masters()[skipped],
                                          _views(opt, opt.exp_avg)[skipped], _views(opt, opt.exp_avg_sq)[skipped])]
        for i, (p, r) in enumerate(zip(params, ref)):
            p.grad = None if (step == 2 and i == skipped) else _grad(p.shape, dtype)
            r.grad = None if p.grad is None else p.grad.double()
        opt.step()
        ropt.step()
    after = (params[skipped], opt.masters()[skipped], _views(opt, opt.exp_avg)[skipped],
             _views(opt, opt.exp_avg_sq)[skipped])
    for b, a, what in zip(before, after, ("weight", "master", "m", "v")):
        assert torch.equal(b, a), f"a parameter without a gradient had its {what} changed"
    _assert_matches(opt.masters(), _views(opt, opt.exp_avg), _views(opt, opt.exp_avg_sq), ref, ropt)


@pytest.mark.usefixtures("on_the_course_device")
def test_pointer_table_rebuilt_only_when_gradients_move():
    dtype = torch.float16
    inits = [check.randn(s).to(dtype).float() for s in SHAPES]
    params = [w.to(dtype) for w in inits]
    opt = tuned.MasterAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    ref, ropt = _torch_adamw(inits, 0.0)
    first = [torch.empty(p.shape, dtype=dtype) for p in params]
    second = [torch.empty(p.shape, dtype=dtype) for p in params]   # alive together: other addresses
    for grads, rebuilds in ((first, 1), (first, 1), (second, 2), (first, 2)):
        for p, r, g in zip(params, ref, grads):
            g.copy_(_grad(p.shape, dtype))                       # new values, same memory
            p.grad = g
            r.grad = g.double()
        opt.step()
        ropt.step()
        assert opt.rebuilds == rebuilds, "the gradient table must be rebuilt exactly when an address changes"
        _assert_matches(opt.masters(), _views(opt, opt.exp_avg), _views(opt, opt.exp_avg_sq), ref, ropt,
                        what=f"after {rebuilds} rebuild(s)")


def test_masters_from_an_fp32_source():
    source = [check.randn(s) for s in SHAPES]
    params = [w.half() for w in source]
    for p in params:
        p.fill_(float("nan"))                                    # rewritten from the masters
    opt = tuned.MasterAdamW(params, lr=LR, betas=BETAS, eps=EPS, master_from=source)
    for w, s, p in zip(opt.masters(), source, params):
        assert torch.equal(w, s) and torch.equal(p, s.half())
    ref, ropt = _torch_adamw(source, 1e-2)
    for p, r in zip(params, ref):
        p.grad = _grad(p.shape, torch.float16)
        r.grad = p.grad.double()
    opt.step()
    ropt.step()
    _assert_matches(opt.masters(), _views(opt, opt.exp_avg), _views(opt, opt.exp_avg_sq), ref, ropt)


@pytest.mark.usefixtures("on_the_course_device")
def test_state_dict_round_trip():
    shapes = SHAPES[:4]
    params_a = [check.randn(s).half() for s in shapes]
    params_b = [torch.zeros(s, dtype=torch.float16) for s in shapes]
    a = tuned.MasterAdamW(params_a, lr=LR, betas=BETAS)
    b = tuned.MasterAdamW(params_b, lr=0.5, betas=(0.8, 0.9), eps=1e-3)
    for _ in range(2):
        for p in params_a:
            p.grad = _grad(p.shape, torch.float16)
        a.step()
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))
    grads = [_grad(p.shape, torch.float16) for p in params_a]
    for opt, params in ((a, params_a), (b, params_b)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    for name in ("master", "exp_avg", "exp_avg_sq", "step_count"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))
    with pytest.raises(ValueError, match="other sizes"):
        tuned.MasterAdamW([torch.zeros(3)]).load_state_dict(a.state_dict())


def test_zero_grad():
    params = [torch.zeros(5), torch.zeros(3)]
    opt = tuned.MasterAdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_master_adamw_refuses_bad_inputs():
    ok = torch.zeros(8)
    cases = [
        (TypeError, "floating dtype", lambda: tuned.MasterAdamW([torch.zeros(4, dtype=torch.int32)])),
        (TypeError, "one dtype per optimizer", lambda: tuned.MasterAdamW([ok, torch.zeros(4, dtype=torch.float16)])),
        (ValueError, "one device per optimizer", lambda: tuned.MasterAdamW([ok, torch.zeros(4, device="meta")])),
        (ValueError, "empty parameter list", lambda: tuned.MasterAdamW([])),
        (TypeError, "not one tensor", lambda: tuned.MasterAdamW(ok)),
        (ValueError, "appears twice", lambda: tuned.MasterAdamW([ok, ok])),
        (ValueError, "not a contiguous", lambda: tuned.MasterAdamW([torch.zeros(4, 4).t()])),
        (ValueError, "16-byte boundary", lambda: tuned.MasterAdamW([torch.zeros(9)[1:]])),
        (ValueError, "beta1 must be in", lambda: tuned.MasterAdamW([ok], betas=(1.5, 0.9))),
        (ValueError, "eps must be", lambda: tuned.MasterAdamW([ok], eps=float("nan"))),
        (ValueError, "block_size", lambda: tuned.MasterAdamW([ok], block_size=100)),
        (ValueError, "master_from has 2 tensors", lambda: tuned.MasterAdamW([ok], master_from=[ok, ok])),
        (ValueError, "master_from.0. has shape", lambda: tuned.MasterAdamW([ok], master_from=[torch.zeros(3)])),
        (TypeError, "master_from.0. must be a floating", lambda: tuned.MasterAdamW([ok], master_from=[ok.int()])),
    ]
    for error, message, make in cases:
        with pytest.raises(error, match=message):
            make()


def test_bad_gradients_raise_on_step():
    p = torch.zeros(8)
    opt = tuned.MasterAdamW([p])
    p.grad = torch.zeros(16)[::2]                                # torch allows it: same shape, strided
    with pytest.raises(ValueError, match="not a contiguous dense tensor"):
        opt.step()
    p.data = torch.zeros(8, dtype=torch.float64)                 # the parameter replaced after construction
    p.grad = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="was replaced since MasterAdamW was built"):
        opt.step()


# --- the bytes of the step (course_utils.traffic.optimizer: pure Python) ----------------------------


def test_bytes_per_parameter_by_hand():
    from course_utils import traffic
    # (a) forward cast: read fp32 4 + write bf16 2; backward cast: read bf16 2 + write fp32 4;
    #     AdamW: read grad, w, m, v (4 x 4) + write w, m, v (3 x 4)
    assert traffic.autocast_adamw_bytes_per_param() == {"forward cast": 6, "backward cast": 6, "AdamW": 28}
    assert traffic.autocast_adamw_bytes_per_param("fp16", cast=False) == {"forward cast": 0, "backward cast": 0,
                                                                           "AdamW": 28}
    # (b) read bf16 grad 2 + fp32 w, m, v 12; write w, m, v 12 + bf16 weight 2
    assert traffic.master_adamw_bytes_per_param() == {"fused AdamW": 28}
    assert traffic.master_adamw_bytes_per_param("float32") == {"fused AdamW": 32}


def test_optimizer_step_for_a_model():
    from course_utils import traffic
    n = 124_475_904                                              # GPT-2 small with a 50304-token tied head
    c = traffic.optimizer_step(n, n_tensors=148)
    assert c.unfused.total_bytes == 40 * n and c.fused.total_bytes == 28 * n
    assert c.saved_bytes == 12 * n and abs(c.ratio - 40 / 28) < 1e-12
    assert c.unfused.read_bytes == (4 + 2 + 16) * n and c.fused.write_bytes == 14 * n
    assert "bytes/param autocast=40" in c.notes and any("296" in s for s in c.notes)
    # only the GEMM weights are cast: the others pay 28 bytes under autocast too
    part = traffic.optimizer_step(1000, n_cast=600)
    assert part.unfused.total_bytes == 600 * 40 + 400 * 28 and "bytes/param autocast=35.2" in part.notes
    with pytest.raises(ValueError, match="n_cast"):
        traffic.optimizer_step(10, n_cast=11)
    with pytest.raises(ValueError, match="n_params must be positive"):
        traffic.optimizer_step(0)
    with pytest.raises(ValueError, match="unknown dtype"):
        traffic.optimizer_step(10, compute_dtype="bf17")


def test_from_fp32_model_keeps_the_exact_fp32_weights():
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.LayerNorm(33))
    fp32 = [p.detach().clone() for p in model.parameters()]
    opt = tuned.MasterAdamW.from_fp32_model(model, torch.float16, lr=LR, weight_decay=0.0)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    for w, p, s in zip(opt.masters(), model.parameters(), fp32):
        assert torch.equal(w, s) and torch.equal(p, s.half())
    with pytest.raises(TypeError, match="dtype must be one of"):
        tuned.MasterAdamW.from_fp32_model(model, torch.int8)


@pytest.mark.usefixtures("on_the_course_device")
def test_tables_a_capture_reads_are_kept_and_eager_ones_bounded(monkeypatch):
    """The bookkeeping of CUDA-graph captures, with the capture simulated (the GPU check captures for real):
    a table built while capturing comes from a pinned buffer set aside beforehand and is never dropped,
    an eager table that a capture reuses is kept too, and eager tables are bounded."""
    params = [torch.zeros(5), torch.zeros(3)]
    opt = tuned.MasterAdamW(params)
    capturing = [False]
    monkeypatch.setattr(opt._grads, "capturing", lambda: capturing[0])
    alive = []

    def step_with_new_grads():
        alive.append([torch.randn(p.shape) for p in params])   # kept alive: new addresses every time
        for p, g in zip(params, alive[-1]):
            p.grad = g
        opt.step()
        return tuple(g.data_ptr() for g in alive[-1])

    eager_key = step_with_new_grads()
    capturing[0] = True
    spare = list(opt._grads.spare)
    captured_key = step_with_new_grads()
    assert opt._grads.tables[captured_key][1] is spare[-1] and len(opt._grads.spare) == tuned.SPARE_PINNED - 1
    for p, g in zip(params, alive[0]):                          # a capture that finds an eager table
        p.grad = g
    opt.step()
    assert eager_key in opt._grads.captured
    capturing[0] = False
    for _ in range(tuned.MAX_EAGER_TABLES + 3):
        step_with_new_grads()
    assert len(opt._grads.spare) == tuned.SPARE_PINNED                 # set aside again outside the capture
    assert captured_key in opt._grads.tables and eager_key in opt._grads.tables
    assert len(opt._grads.tables) == tuned.MAX_EAGER_TABLES + 2
    capturing[0] = True
    opt._grads.spare.clear()
    with pytest.raises(RuntimeError, match="no pinned buffer left"):
        step_with_new_grads()


@pytest.mark.usefixtures("on_the_course_device")
def test_eager_tables_reuse_their_rows_and_hold_the_current_addresses():
    """Eager tables live in rows allocated once (a table allocated per step would move the next step's
    gradients): after more new addresses than rows, every table still holds its own key, in a row."""
    params = [torch.zeros(5), torch.zeros(3), torch.zeros(7)]
    opt = tuned.MasterAdamW(params)
    alive, rows_before = [], opt._grads.rows.data_ptr()
    for _ in range(tuned.MAX_EAGER_TABLES * 2 + 1):
        alive.append([torch.randn(p.shape) for p in params])
        for p, g in zip(params, alive[-1]):
            p.grad = g
        opt.step()
    assert opt._grads.rows.data_ptr() == rows_before and len(opt._grads.tables) == tuned.MAX_EAGER_TABLES
    for key, (table, host, row) in opt._grads.tables.items():
        assert row is not None and table.data_ptr() == opt._grads.rows[row].data_ptr()
        assert table.tolist() == list(key) and host.tolist() == list(key)
    assert sorted(r for _, _, r in opt._grads.tables.values()) == list(range(tuned.MAX_EAGER_TABLES))
    assert opt.rebuilds == tuned.MAX_EAGER_TABLES * 2 + 1
    for p, g in zip(params, alive[-1]):                         # the same addresses again: found, not rebuilt
        p.grad = g
    opt.step()
    assert opt.rebuilds == tuned.MAX_EAGER_TABLES * 2 + 1


def test_no_decay_is_a_second_param_group_without_weight_decay():
    inits = [check.randn(s) for s in SHAPES]
    params = [w.clone() for w in inits]
    opt = tuned.MasterAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1, no_decay=params[1::2],
                            block_size=256)
    ref = [w.double().clone().requires_grad_() for w in inits]
    ropt = torch.optim.AdamW([{"params": ref[0::2]}, {"params": ref[1::2], "weight_decay": 0.0}], lr=LR,
                             betas=BETAS, eps=EPS, weight_decay=0.1)
    for _ in range(2):
        for p, r in zip(params, ref):
            p.grad = _grad(p.shape, torch.float32)
            r.grad = p.grad.double()
        opt.step()
        ropt.step()
    _assert_matches(opt.masters(), _views(opt, opt.exp_avg), _views(opt, opt.exp_avg_sq), ref, ropt)
    with pytest.raises(ValueError, match="not among params"):
        tuned.MasterAdamW(params, no_decay=[torch.zeros(3)])


def test_host_work_per_step_is_one_address_read_per_parameter():
    """When no gradient moved, finding the table costs one data_ptr() per parameter and a dict lookup:
    no validation, no tensor built (counted with cProfile: a regression that re-checks every step shows)."""
    import cProfile
    import pstats

    params = [torch.zeros(n, device=cu.DEVICE) for n in range(1, 41)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = tuned.MasterAdamW(params)
    opt.step()
    prof = cProfile.Profile()
    prof.enable()
    opt._grads.table()
    prof.disable()
    stats = pstats.Stats(prof)
    called = {f[2] for f in stats.stats}
    assert stats.total_calls <= len(params) + 8, stats.total_calls
    assert "_check_grads" not in called and "_new_table" not in called and opt.rebuilds == 1
