"""GPU checks of the course's operators (course_utils/ops), in under 3 minutes on an H100.

    python tools/gpu_checks/ops.py

1. ``torch.library.opcheck`` of every public op on CUDA tensors (bf16: schema, fakes, autograd, AOT);
2. forward and gradients of every op against float64 at GPT-like sizes (bf16 inputs, plus fp32);
3. attention on packed-QKV views: no copy of q, k, v (the kernel reads the views) and o laid out for
   the output projection, checked against float64;
4. a CUDA graph of bias_gelu_dropout forward + backward + ``seed.add_(1)``: every replay draws a new
   mask, and the backward of a replay regenerates that replay's mask;
5. ``torch.compile(fullgraph=True)`` (Inductor) of a block of course ops against eager;
6. the per-op host overhead table (course wrapper, torch.ops.course, aten), printed last.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from checklog import RESULTS, record  # noqa: E402  (tools/gpu_checks, the script's folder)

import course_utils as cu  # noqa: E402
from course_utils import ops  # noqa: E402
from course_utils.kernels.attention import attention_ref  # noqa: E402
from course_utils.kernels.elementwise import bias_gelu_dropout_ref  # noqa: E402


def cases(dtype, B=2, N=128, H=4, hd=64, V=256):
    d = H * hd
    g = torch.Generator(device="cuda").manual_seed(0)

    def leaf(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dt).requires_grad_(True)

    x, r, w, b = leaf(B, N, d, scale=2.0), leaf(B, N, d, dt=torch.float32), leaf(d), leaf(d)
    fw, fb = leaf(4 * d, d, scale=d ** -0.5), leaf(4 * d, scale=0.1)
    qkv = leaf(B, N, 3 * d)
    logits, targets = leaf(B * N, V, scale=3.0), torch.randint(0, V, (B * N,), device="cuda", generator=g)
    seed = torch.tensor([99], dtype=torch.int64, device="cuda")

    def attn(f, qkv):
        q, k, v = qkv.view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
        return f(q, k, v)

    return {
        "layer_norm": (lambda f, *a: f(*a, 1e-5), lambda x, w, b: F.layer_norm(x, (d,), w, b, 1e-5), (x, w, b)),
        "add_layer_norm": (lambda f, *a: f(*a, 1e-5), lambda x, r, w, b: (F.layer_norm(x + r, (d,), w, b, 1e-5),
                                                                          x + r), (x, r, w, b)),
        "linear_gelu": (lambda f, *a: f(*a), lambda x, w, b: F.gelu(x @ w.T + b, approximate="tanh"), (x, fw, fb)),
        "attention": (lambda f, qkv: attn(lambda q, k, v: f(q, k, v, True, hd ** -0.5), qkv),
                      lambda qkv: attn(lambda q, k, v: attention_ref(q, k, v, True, hd ** -0.5), qkv), (qkv,)),
        "cross_entropy": (lambda f, *a: f(*a), lambda lg, t: F.cross_entropy(lg, t), (logits, targets)),
        "bias_gelu_dropout": (lambda f, *a: f(*a, 0.1, seed), lambda x, b: bias_gelu_dropout_ref(x, b, 0.1, 99),
                              (x, b)),
    }


def opchecks():
    """The public ops on the bf16 shapes of :func:`gradients` (the same kernels: compiled once)."""
    for name, (call, _, args) in cases(torch.bfloat16).items():
        captured = {}
        call(lambda *a: captured.setdefault("args", a), *args)
        torch.library.opcheck(getattr(torch.ops.course, name).default, captured["args"])
    return f"{len(ops.OPS)} ops"


def gradients():
    worst = []
    for dtype, tol in ((torch.bfloat16, 0.03), (torch.float32, 0.01)):  # fp32: tl.dot in TF32
        for name, (call, ref, args) in cases(dtype).items():
            outs = call(getattr(ops, name), *args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            a64 = [a.detach().double().requires_grad_(True) if a.is_floating_point() else a for a in args]
            wants = ref(*a64)
            wants = wants if isinstance(wants, tuple) else (wants,)
            diff = [i for i, a in enumerate(args) if a.is_floating_point()]
            dys = [torch.randn_like(o, dtype=torch.float32).to(o.dtype) for o in outs]
            got = torch.autograd.grad(outs, [args[i] for i in diff], dys)
            exp = torch.autograd.grad(wants, [a64[i] for i in diff], [dy.double() for dy in dys])
            for label, g, e in [("out", o, w) for o, w in zip(outs, wants)] + [("grad", g, e) for g, e in
                                                                                 zip(got, exp)]:
                err = ((g.double() - e).norm() / e.norm().clamp_min(1e-12)).item()
                worst.append((err, f"{name} {dtype} {label}"))
                if not err < tol:
                    raise AssertionError(f"{name} {dtype} {label}: relative error {err:.3g} > {tol}")
    err, where = max(worst)
    return f"worst relative L2 error {err:.2e} ({where})"


def packed_qkv():
    B, N, H, hd = 4, 1024, 12, 64
    qkv = torch.randn(B, N, 3 * H * hd, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
    ops.attention(q, k, v, True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        o = ops.attention(q, k, v, True)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [k_ for k_ in kernels if "copy" in k_.lower() or "elementwise" in k_.lower()]
    if copies or not o.transpose(1, 2).is_contiguous():
        raise AssertionError(f"copies {copies}, o strides {o.stride()}")
    want = attention_ref(q[:1].double(), k[:1].double(), v[:1].double(), True)
    err = ((o[:1].double() - want).norm() / want.norm()).item()
    if not err < 1e-2:
        raise AssertionError(f"relative error {err:.3g}")
    return f"kernels {sorted(set(kernels))}, rel err {err:.1e}"


def graphed_dropout():
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seed = torch.tensor([5], dtype=torch.int64, device="cuda")
    dy = torch.ones(256, 1024, device="cuda", dtype=torch.bfloat16)
    static = {}

    def step():
        y = ops.bias_gelu_dropout(x, b, 0.5, seed)
        (dx,) = torch.autograd.grad(y, (x,), dy)
        seed.add_(1)
        static["y"], static["dx"] = y, dx

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    masks = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        keep_y, keep_dx = static["y"] != 0, static["dx"] != 0
        gelu_zero = F.gelu(x.detach().float() + b.detach().float(), approximate="tanh") == 0
        if not torch.equal(keep_y | gelu_zero, keep_dx | gelu_zero):
            raise AssertionError("the backward of a replay did not regenerate that replay's mask")
        masks.append(keep_y)
    if torch.equal(masks[0], masks[1]) or torch.equal(masks[1], masks[2]):
        raise AssertionError("two replays drew the same mask")
    return f"3 replays, 3 masks (kept {masks[0].float().mean().item():.3f}), seed now {int(seed)}"


def inductor():
    B, N, H, hd = 2, 256, 4, 64
    d = H * hd
    w = torch.ones(d, device="cuda", requires_grad=True)
    b = torch.zeros(d, device="cuda", requires_grad=True)
    wqkv = (torch.randn(3 * d, d, device="cuda") * d ** -0.5).requires_grad_(True)

    def f(x):
        with torch.autocast("cuda", torch.bfloat16):
            h = ops.layer_norm(x, w, b, 1e-5)
            q, k, v = F.linear(h, wqkv).view(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
            a = ops.attention(q, k, v, True).transpose(1, 2).reshape(B, N, d)
            y, s = ops.add_layer_norm(a, x, w, b, 1e-5)
            return y.float().square().mean() + s.mean()

    x = torch.randn(B, N, d, device="cuda", requires_grad=True)
    want = f(x)
    g_want = torch.autograd.grad(want, (x, w, wqkv))
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    got = cf(x)
    g_got = torch.autograd.grad(got, (x, w, wqkv))
    errs = [((g - e).norm() / e.norm()).item() for g, e in zip(g_got, g_want)]
    if not abs(got.item() - want.item()) < 1e-3 * abs(want.item()) + 1e-4 or max(errs) > 1e-2:
        raise AssertionError(f"loss {got.item()} vs {want.item()}, gradient errors {errs}")
    return f"loss {got.item():.5f} = eager {want.item():.5f}; gradient rel errors {max(errs):.1e}"


def main():
    if not cu.on_gpu():
        sys.exit("tools/gpu_checks/ops.py needs a CUDA GPU")
    print(cu.banner())
    record("opcheck (bf16)", opchecks)
    record("forward + gradients vs float64", gradients)
    record("attention on packed QKV views", packed_qkv)
    record("CUDA graph: new dropout mask per replay", graphed_dropout)
    record("torch.compile fullgraph (Inductor)", inductor)
    table = None
    try:
        ops.warmup(1, 16, 64, 2, 64)
        table = ops.host_overhead_table(n_calls=500)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        RESULTS.append(("host overhead table", "FAIL", "see the traceback"))
    print(f"\n{'check':<42} {'status':<6} detail")
    for name, status, detail in RESULTS:
        print(f"{name:<42} {status:<6} {detail}")
    if table is not None:
        print(f"\nhost microseconds per forward call ({torch.cuda.get_device_name()}, 500 calls, tiny shapes):")
        print(table.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    sys.exit(1 if any(s == "FAIL" for _, s, _ in RESULTS) else 0)


if __name__ == "__main__":
    main()
