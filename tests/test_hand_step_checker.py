"""Exercise 12.3's checker (course_utils.checkers.hand_step): a right block backward passes, the course's own
backward and autograd are refused, and each usual mistake fails with a message naming it."""

import importlib

import pytest
import torch

import course_utils as cu
from course_utils import check, gpt, step
from course_utils.checkers import hand_step as checks
from course_utils.ops import attn as A
from course_utils.ops import block
from course_utils.ops import linear as L
from course_utils.ops import norms as Nm

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)


def student(fault: str = "none"):
    """A block backward written from step.py's forward, with one usual mistake (``fault``) baked in."""
    def linear_backward(dy, x, lin, name):
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dw = torch.mm(dy2.t(), x2)
        if fault == f"{name} dW transposed":
            dw = torch.mm(x2.t(), dy2)
        if fault == f"{name} dW per batch element":      # 3-D matmul: one dW per sequence, never summed
            dw = dy.transpose(-1, -2) @ x
        if fault == f"{name} dW in float32":             # accumulated in float32, never cast back
            dw = torch.mm(dy2.t().float(), x2.float())
        if fault == f"{name} dW averaged":               # the mean over the rows, as if the loss were summed
            dw = dw / dy2.shape[0]
        if fault == "dW added into .grad":
            lin.weight.grad += dw
        lin.weight.grad = dw
        if fault == f"{name} bias averaged":
            lin.bias.grad = dy2.mean(0)
        elif fault == f"{name} bias over the batch":
            lin.bias.grad = dy.sum(0)
        elif fault == f"{name} bias over the features":
            lin.bias.grad = dy2.sum(1)
        elif fault != f"{name} bias missing":
            lin.bias.grad = dy2.sum(0)
        if fault == f"{name} dx with W.T":
            return torch.mm(dy2, lin.weight.t()).view(x.shape)
        if fault == f"{name} dx as F.linear(dy, W)":     # F.linear(dy, W) is dy @ W.T
            return torch.nn.functional.linear(dy, lin.weight)
        if fault == f"{name} dx as (W @ dy.T).T":        # dx.T = W.T @ dy.T, written with W
            return (lin.weight @ dy2.t()).t().reshape(x.shape)
        return torch.mm(dy2, lin.weight).view(x.shape)

    def block_backward(blk, saved, dh, dres, ln_next, n_head, scale):
        """No autograd here: x.backward() is what this replaces."""   # words in comments and strings are fine
        if fault == "ln_next unpacked as (dw, dx, db)":
            ln_next.weight.grad, ds, ln_next.bias.grad = Nm.add_layer_norm_bwd(
                dh, dres, saved.s2, ln_next.weight, saved.mean2, saved.rstd2)
        ds, ln_next.weight.grad, ln_next.bias.grad = Nm.add_layer_norm_bwd(
            dh, None if fault == "dres dropped" else dres, saved.s1 if fault == "ln_next from s1" else saved.s2,
            blk.ln2.weight if fault == "ln_next with ln2's weight" else ln_next.weight,
            *((saved.mean1, saved.rstd1) if fault == "ln_next with ln2's statistics" else
              (saved.rstd2, saved.mean2) if fault == "ln_next mean and rstd swapped" else (saved.mean2, saved.rstd2)))
        if fault == "dres added twice":                 # dres given to the backward and added again
            ds = ds + dres if dres is not None else ds
        if fault == "ln grads swapped":
            ln_next.weight.grad, ln_next.bias.grad = ln_next.bias.grad, ln_next.weight.grad
        d_out, d_s1 = ds, ds
        if fault in ("MLP branch without dres", "residual only dres"):
            d_ln, _, _ = Nm.add_layer_norm_bwd(dh, None, saved.s2, ln_next.weight, saved.mean2, saved.rstd2)
            if fault == "MLP branch without dres":
                d_out = d_ln
            else:
                d_s1 = dres
        if fault == "out given dh":                     # the LayerNorm's output gradient, not its input's
            d_out = dh
        df = linear_backward(d_out, saved.acc if fault == "out from acc" else saved.f, blk.out, "out")
        f_rows = saved.f.reshape(-1, saved.f.shape[-1])   # acc's own layout (B * N, 4d)
        gelu_in = {"gelu from f": saved.f, "gelu from f as rows": f_rows}.get(fault, saved.acc)
        if fault == "out skipped":                      # the out GEMM's backward left out: fc given ds
            df = ds
        dh2, blk.fc.weight.grad, blk.fc.bias.grad = L.linear_gelu_bwd(
            df, {"fc from h1": saved.h1, "fc from s1": saved.s1}.get(fault, saved.h2), blk.fc.weight, blk.fc.bias,
            gelu_in)
        stats = (saved.mean2, saved.rstd2) if fault == "ln2 with ln_next's statistics" else (saved.mean1, saved.rstd1)
        d_s1 = dres if fault == "ln2 given dres" else d_s1       # the block's dres where ds belongs
        dx, blk.ln2.weight.grad, blk.ln2.bias.grad = Nm.add_layer_norm_bwd(
            dh2, None if fault == "ds dropped at ln2" else d_s1, saved.s2 if fault == "ln2 from s2" else saved.s1,
            ln_next.weight if fault == "ln2 with ln_next's weight" else blk.ln2.weight, *stats)
        d_proj, dres_in = dx, dx
        if fault == "ds added twice at ln2":            # ds given to the backward and added again
            d_proj = dres_in = dx + ds
        if fault == "proj given dh2":
            d_proj = dh2
        if fault == "attention branch without ds":      # the branch given LayerNorm 2's part alone
            d_proj, _, _ = Nm.add_layer_norm_bwd(dh2, None, saved.s1, blk.ln2.weight, saved.mean1, saved.rstd1)
        if fault == "dres_in is ds":
            dres_in = ds
        if fault == "dres_in plus dres":                # the residual passed through on top of dx
            dres_in = dx + dres if dres is not None else dx
        if fault == "dres passed through":
            dres_in = dres if dres is not None else torch.zeros_like(dx)
        do2 = linear_backward(d_proj, saved.o.reshape(saved.o2.shape) if fault == "proj from o" else saved.o2,
                              blk.proj, "proj")
        B, H, N, hd = saved.o.shape
        do = do2.view(B, H, N, hd) if fault == "do not transposed" else do2.view(B, N, H, hd).transpose(1, 2)
        if fault == "do as (B, N, H, hd)":               # the view without its transpose back
            do = do2.view(B, N, H, hd)
        scale = {"scale forgotten": 1.0, "scale of d_model": saved.h1.shape[-1] ** -0.5}.get(fault, scale)
        o = saved.o2 if fault == "attention given o2" else saved.o
        dqkv = A.attention_qkv_bwd(do, saved.qkv, o, saved.lse, n_head, fault != "not causal", scale)
        dh_in = linear_backward(dqkv, saved.h2 if fault == "qkv from h2" else saved.h1, blk.qkv, "qkv")
        if fault == "returns None":
            return None
        if fault == "returns float32":
            return dh_in.float(), dres_in.float()
        if fault == "returns rows":
            return dh_in.reshape(-1, dh_in.shape[-1]), dres_in
        if fault == "returned swapped":
            return dres_in, dh_in
        if fault == "dh_in doubled":                    # no usual mistake: the first wrong gradient is named
            dh_in = dh_in * 2
        if fault == "dh changed in place":
            dh.zero_()
        return dh_in, dres_in
    return block_backward


def test_right_block_backward_passes(capsys):
    checks.check_block_backward(student())
    assert capsys.readouterr().out.startswith("PASS block backward")


@pytest.mark.parametrize("fault, words", [
    ("dres dropped", r"dres dropped: .*add_layer_norm_bwd\(dh, dres, saved.s2"),                           # (a)
    ("ds dropped at ln2", r"ds dropped at LayerNorm 2: .*add_layer_norm_bwd\(dh2, ds, saved.s1"),          # (a)
    ("MLP branch without dres", "MLP branch without dres: .*both inputs of the add"),                      # (b)
    # (b); in the last block (dres=None) it is the same mistake as the one above
    ("residual only dres", "ds dropped at LayerNorm 2|residual without LayerNorm.s part after the MLP"),
    ("attention branch without ds", "attention branch without ds: .*both inputs of the add"),              # (b)
    ("dres_in is ds", "dres_in without the attention branch"),                                             # (b)
    ("dres passed through", "dres returned unchanged"),                                                    # (b)
    ("dres added twice", r"dres added twice: .*already adds the ds it is given"),                          # (b)
    ("dres_in plus dres", "dres added again to dres_in"),                                                  # (b)
    ("ln2 given dres", r"the last block: dres=None\): ds dropped at LayerNorm 2"),   # the last block is judged first
    ("qkv dW averaged", r"blk.qkv.weight.grad is averaged over the rows: dW = dy.T @ x sums over all 72 rows"),
    ("proj dW averaged", r"blk.proj.weight.grad is averaged over the rows"),              # square: not "transposed"
    # the op's own error names the operand: the view (B, N, H, hd) without its transpose, o2 for o
    ("do as (B, N, H, hd)", r"raised ValueError: do must be a tensor of q's shape \(3, 2, 24, 16\)"),
    ("attention given o2", r"raised ValueError: o must be a tensor of q's shape"),
    ("out skipped", r"raised RuntimeError(.|\n)*at: dh2, blk.fc.weight.grad, blk.fc.bias.grad = L.linear_gelu_bwd"),
    ("proj dx with W.T", r"proj's dx with W.T: .*dx = dy @ W"),                                            # (c)
    ("not causal", r"attention backward not causal: .*n_head, True, scale\)"),                             # (e)
    ("returned swapped", "dh_in and dres_in returned in each other's place"),                              # (f)
    ("proj dW transposed", r"blk.proj.weight.grad is transposed: dW = dy.T @ x"),                             # (c)
    ("qkv dW transposed", r"blk.qkv.weight.grad was given a \(32, 96\) \S+ tensor, the transpose of \(96, 32\): "
                          r"dW = dy.T @ x is \(out_features, in_features\).*at: lin.weight.grad = dw"),       # (c)
    ("out dW transposed", r"blk.out.weight.grad was given a \(128, 32\) \S+ tensor, the transpose of \(32, 128\)"),
    ("qkv dW per batch element", r"blk.qkv.weight.grad was given a \(3, 96, 32\) .*one dW per sequence of the batch"),
    # the float32 model passes; float16's refuses the float32 .grad
    ("out dW in float32", r"\(float16, .*blk.out.weight.grad was given a \(32, 128\) float32 tensor; the parameter "
                          r"is torch.float16, .*needs .to\(the parameter's dtype\)"),
    # (c) out's and qkv's W are not square, so their dx with W.T raises: named by the operand, either way round
    ("out dx with W.T", r"out's dx with W.T: the out GEMM's input gradient multiplied by blk.out.weight.T; "
                        r".*dx = dy @ W"),
    ("qkv dx with W.T", r"qkv's dx with W.T: the qkv GEMM's input gradient multiplied by blk.qkv.weight.T"),
    ("out dx as F.linear(dy, W)", r"out's dx with W where W.T belongs: .*took blk.out.weight as stored"),
    ("qkv dx as F.linear(dy, W)", r"qkv's dx with W where W.T belongs: .*took blk.qkv.weight as stored"),
    ("out dx as (W @ dy.T).T", r"out's dx with W where W.T belongs"),
    ("out given dh", r"out GEMM given dh: .*the ds that add_layer_norm_bwd\(dh, dres, saved.s2"),           # (b)
    ("proj given dh2", r"proj GEMM given dh2: .*the dx that add_layer_norm_bwd\(dh2, ds, saved.s1"),        # (b)
    ("ds added twice at ln2", r"ds added twice at LayerNorm 2: .*already adds the ds it is given"),          # (b)
    ("scale forgotten", r"attention backward given scale=1: .*the forward's scale, 0.25 \(1/sqrt\(head_dim\)\)"),
    ("scale of d_model", r"attention backward given scale=0.176777: .*pass the scale your function is given"),
    ("ln_next mean and rstd swapped", r"ln_next.weight.grad is computed with mean and rstd swapped: "
                                      r".*saved.mean2 before saved.rstd2"),
    ("ln_next unpacked as (dw, dx, db)", r"ln_next.weight.grad was given a \(3, 24, 32\) .*an activation's gradient: "
                                         r"add_layer_norm_bwd and linear_gelu_bwd return \(dx, dw, db\)"),
    ("qkv from h2", r"blk.qkv.weight.grad is taken from saved.h2: the qkv GEMM's input is saved.h1"),         # (c)
    ("fc from h1", r"blk.fc.weight.grad is taken from saved.h1: the fc GEMM's input is saved.h2"),            # (c)
    ("out from acc", r"blk.out.weight.grad is taken from saved.acc: the out GEMM's input is saved.f"),        # (c)
    ("fc from s1", r"blk.fc.weight.grad is taken from saved.s1, the sum before LayerNorm 2: the fc GEMM's input "
                   "is saved.h2"),                                                                         # (c)
    # saved.f as it is (B, N, 4d) makes linear_gelu_bwd raise; reshaped to acc's rows it runs: both are named
    ("gelu from f", r"GELU's backward given f: .*pass saved.acc(.|\n)*raised RuntimeError"),                # (c)
    ("gelu from f as rows", r"GELU's backward given f: linear_gelu_bwd was given saved.f, GELU's output"),   # (c)
    ("ln_next from s1", r"ln_next.weight.grad is computed from the other LayerNorm's sum \(saved.s1\)"
                        r"(.|\n)*saved.s2, with its own saved.mean2, saved.rstd2"),
    ("ln_next with ln2's weight", r"ln_next's backward given LayerNorm 2's weight: .*saved.s2, ln_next.weight"),
    ("ln2 with ln_next's weight", r"LayerNorm 2's backward given ln_next's weight: .*saved.s1, blk.ln2.weight"),
    ("ln2 from s2", r"blk.ln2.weight.grad is computed from the other LayerNorm's sum \(saved.s2\)"
                    r"(.|\n)*saved.s1, with its own saved.mean1, saved.rstd1"),
    ("proj from o", r"blk.proj.weight.grad is taken from saved.o reshaped without its transpose: the proj GEMM's "
                    "input is saved.o2"),                                                                  # (c)
    ("out bias missing", r"blk.out.bias.grad was not written \(it is None\)(.|\n)*ds summed over the rows"),   # (d)
    ("qkv bias averaged", "blk.qkv.bias.grad is averaged over the rows: db is dy summed over all 72 rows"),    # (d)
    ("proj bias over the batch", r"blk.proj.bias.grad was given a \(24, 32\) .*summed over one axis of dy only; "
                                 r"db sums dy over all B\*N rows.*at: lin.bias.grad = dy.sum\(0\)"),          # (d)
    ("out bias over the features", r"blk.out.bias.grad was given a \(72,\) .*summed over the features, not over "
                                   "the rows"),                                                            # (d)
    ("do not transposed", r"do not laid out as o: .*do = do2.view\(B, N, n_head, head_dim\).transpose"),   # (e)
    ("ln grads swapped", "ln_next's weight and bias gradients swapped"),
    ("ln2 with ln_next's statistics", r"blk.ln2.weight.grad is computed with the other LayerNorm's statistics"
                                      r"(.|\n)*\(saved.mean1, saved.rstd1\)"),
    ("ln_next with ln2's statistics", r"ln_next.weight.grad is computed with the other LayerNorm's statistics"
                                      r"(.|\n)*\(saved.mean2, saved.rstd2\)"),
    ("returns None", r"returned NoneType: return the pair \(dh_in, dres_in\)"),                           # (f)
    ("returns float32", r"dh_in is \(3, 24, 32\) torch.float32 on \S+; expected a \(3, 24, 32\) tensor of "
                        "torch.float16"),
    ("returns rows", r"dh_in is \(72, 32\) .*; expected a \(3, 24, 32\) tensor"),
    ("dh changed in place", "changed dh or dres in place"),
    ("dW added into .grad", r"raised TypeError(.|\n)*at: lin.weight.grad \+= dw(.|\n)*every .grad is None .* assign"),
    ("dh_in doubled", r"dh_in differs from the float64 reference(.|\n)*before it .*blk.qkv.bias.grad\) is right"
                      r"(.|\n)*Hint: dh_in = dqkv @ W"),
])
def test_each_fault_is_named(fault, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_block_backward(student(fault))


@pytest.mark.parametrize("fault, name", [
    ("dres dropped", "dres dropped"), ("ds dropped at ln2", "ds dropped at LayerNorm 2"),
    ("MLP branch without dres", "MLP branch without dres"),
    ("attention branch without ds", "attention branch without ds"),
    ("dres_in is ds", "dres_in without the attention branch"), ("do not transposed", "do not laid out as o"),
    ("not causal", "attention backward not causal"), ("out given dh", "out GEMM given dh"),
    ("proj given dh2", "proj GEMM given dh2"), ("ds added twice at ln2", "ds added twice at LayerNorm 2")])
def test_the_flow_faults_are_named_in_float16_alone(fault, name, monkeypatch):
    """A GPU judges float16 first (its float32 weights mean autocast): the names must not need float32."""
    monkeypatch.setattr(checks, "_dtypes", lambda: (torch.float16,))
    with pytest.raises(check.CheckFailure, match=r"\(float16, .*\): " + name):
        checks.check_block_backward(student(fault))


def test_a_torch_error_the_student_caught_is_not_named():
    """A slip is named by the torch call that raised the student's error itself: a shape error the student's code
    caught, before raising one of its own, names nothing."""
    def tries(blk, saved, dh, dres, ln_next, n_head, scale):
        try:
            torch.mm(dh.reshape(-1, dh.shape[-1]), blk.out.weight.t())      # out's dx with W.T: raises
        except RuntimeError:
            pass
        raise ValueError("my own error")
    with pytest.raises(check.CheckFailure, match=r"raised ValueError: my own error") as e:
        checks.check_block_backward(tries)
    assert "with W.T" not in str(e.value)


@pytest.mark.skipif(cu.on_gpu(), reason="HandStep takes 16-bit weights on a GPU; float32 is compared on the CPU")
def test_the_reference_is_autograds_gradient():
    """The checker's float64 reference, block by block from the last with the first LayerNorm and the
    embeddings added as step.py does, equals autograd's gradients of the whole model."""
    m = checks._model(torch.float32)
    x, y = checks._batch(m.cfg.vocab)
    _, loss = m(x, y)
    loss.backward()
    want = {n: p.grad.double() for n, p in m.named_parameters()}
    hand = step.HandStep(m, None)
    _, dh, dwte, ctx = hand.forward(x, y)
    dres, got = None, {}
    for i in reversed(range(checks.LAYERS)):
        blk, sv = m.blocks[i], ctx["blocks"][i]
        nxt_name = f"blocks.{i + 1}.ln1" if i + 1 < checks.LAYERS else "ln_f"
        nxt = m.get_submodule(nxt_name)
        ref = checks.reference(blk, sv, dh, dres, nxt, hand.n_head, hand.scale, hand.eps)
        for k in checks.ORDER[:-2]:
            lin, _, p = k.partition(".")
            got[f"{nxt_name}.{p}" if lin == "ln_next" else f"blocks.{i}.{k}"] = ref[k]
        dh, dres = ref["dh_in"], ref["dres_in"]
    for n, g in got.items():
        assert (g - want[n]).abs().max() <= 1e-5 * want[n].abs().max(), n
    assert len(got) == len(want) - 4          # all but wte, wpe and the first LayerNorm's weight and bias


def test_the_courses_backward_and_autograd_are_refused():
    def the_courses(blk, saved, dh, dres, ln_next, n_head, scale):
        return block.linear_backward(dh, saved.h1, blk.qkv.weight)[0], dres
    with pytest.raises(check.CheckFailure, match=r"block.linear_backward, the course's GEMM backward"):
        checks.check_block_backward(the_courses)

    def the_whole_block(blk, saved, dh, dres, ln_next, n_head, scale):
        p = block.params_of(blk, ln_next)
        return block.block_backward((Nm, A, L), dh, dres, saved, p, n_head, scale)[:2]
    with pytest.raises(check.CheckFailure, match=r"block.block_backward, the course's block backward"):
        checks.check_block_backward(the_whole_block)

    def whole_step(blk, saved, dh, dres, ln_next, n_head, scale):
        return step.HandStep.backward
    with pytest.raises(check.CheckFailure, match=r"your code calls step.HandStep, the course's hand-written step"):
        checks.check_block_backward(whole_step)

    def hidden(blk, saved, dh, dres, ln_next, n_head, scale):   # no course name in the code: seen as it runs
        back = getattr(importlib.import_module("course_utils.ops." + "block"), "linear" + "_backward")
        return back(dh, saved.h1, blk.qkv.weight)[0], dres       # (raises: dh is not qkv's output gradient)
    with pytest.raises(check.CheckFailure, match="while your function ran it called the course's GEMM backward"):
        checks.check_block_backward(hidden)

    def with_autograd(blk, saved, dh, dres, ln_next, n_head, scale):
        return torch.autograd.grad(saved.h1.sum(), saved.h1), dres
    with pytest.raises(check.CheckFailure, match="torch.autograd.grad, the course's torch.autograd.grad"):
        checks.check_block_backward(with_autograd)

    def with_backward(blk, saved, dh, dres, ln_next, n_head, scale):
        saved.h1.sum().backward()
    with pytest.raises(check.CheckFailure, match=r"uses autograd \('.backward\('"):
        checks.check_block_backward(with_backward)

    def hidden_autograd(blk, saved, dh, dres, ln_next, n_head, scale):
        getattr(torch, "auto" + "grad").grad(saved.h1.sum(), saved.h1)
    with pytest.raises(check.CheckFailure, match="called autograd .* while it ran"):
        checks.check_block_backward(hidden_autograd)
    assert torch.autograd.grad is not None and torch.Tensor.backward.__name__ == "backward"   # restored


def test_a_backward_without_the_courses_functions_is_named():
    def in_torch(blk, saved, dh, dres, ln_next, n_head, scale):
        return torch.zeros_like(saved.h1), torch.zeros_like(saved.h1)
    with pytest.raises(check.CheckFailure, match="called add_layer_norm_bwd 0 time"):
        checks.check_block_backward(in_torch)


def test_an_untouched_stub_fails():
    def stub(blk, saved, dh, dres, ln_next, n_head, scale):
        raise NotImplementedError("Exercise 12.3: replace this line with your code")
    with pytest.raises(NotImplementedError):
        checks.check_block_backward(stub)


def test_the_model_is_one_the_hand_step_runs():
    m = checks._model(torch.float16)
    assert isinstance(m, gpt.GPT) and next(m.parameters()).dtype == torch.float16
    assert any(float(p.detach().abs().max()) > 0 for n, p in m.named_parameters() if n.endswith("bias"))
