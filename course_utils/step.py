"""Chapter 12's training step written out by hand, llm.c's way: the GPT's forward and backward as plain
calls of the course's kernels, with no autograd engine in between.

Autograd is a bookkeeper: for every op of the forward it records a node (an ``autograd.Function``
for each course op, a C++ node for each aten op), and the backward walks that graph, calling each
node's backward through the engine. On a GPU host every call of that machinery costs microseconds,
and a GPT-2 step has hundreds of them. A trainer that knows its model's graph can skip the
bookkeeping: it keeps what each layer's backward reads in a list (:class:`Saved`), calls the backward
functions in reverse order, and writes each parameter's gradient where the optimizer reads it.
llm.c's ``gpt2_forward`` and ``gpt2_backward`` are this, in C.

The kernels are the very ones the ``torch.ops.course`` ops run (the forward and backward functions
of :mod:`course_utils.ops`, with their cached launch plans), and the GEMMs are cuBLAS's through
``torch.addmm``/``torch.mm`` as ``nn.Linear``'s are, so the gradients are the autograd step's, the
same kernels in the same order (:func:`grads_match` checks that, and tests/test_step.py on the CPU).

:class:`HandStep` supports :class:`course_utils.gpt.GPT` without autocast (bf16 weights and
:class:`course_utils.tuned.adamw.MasterAdamW` on a GPU; float32 or float16 weights on the CPU), a
residual stream in the weights' dtype or in float32 (``gpt.bf16_weights(model, torch.float32)``: the fused
add + LayerNorm keeps the sum in float32, each branch reads and returns its own dtype), and training only
(no KV cache, no dropout).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .ops import attn as A
from .ops import linear as L
from .ops import linear_ce as C
from .ops import norms as Nm
from .ops.block import Saved, block_backward, block_forward, params_of  # noqa: F401  (Saved: what a block keeps)

#: GPT-2's initial positions and tokens feed ``aten.embedding_dense_backward`` as autograd's embedding does
_NO_PADDING = -1

#: the kernels the step calls: the ops' Python functions (the eager step), or the registered ops themselves,
#: which ``torch.compile`` traces (on a GPU they are triton_ops: Inductor launches their kernels)
FUNCTIONS = (Nm, A, L, C)
def _add_layer_norm_bwd_low(dy, ds, s, weight, mean, rstd, low_dtype):
    """The registered op, then a cast to ``low_dtype``: in a compiled graph Inductor fuses the cast (the eager
    functions' ``add_layer_norm_bwd_low`` has the kernel write both dtypes)."""
    dx, dw, db = torch.ops.course.add_layer_norm_bwd(dy, ds, s, weight, mean, rstd)
    return dx, dx.to(low_dtype), dw, db


OPS = (SimpleNamespace(layer_norm_fwd=torch.ops.course.layer_norm_fwd, layer_norm_bwd=torch.ops.course.layer_norm_bwd,
                       add_layer_norm_fwd=torch.ops.course.add_layer_norm_fwd,
                       add_layer_norm_bwd=torch.ops.course.add_layer_norm_bwd,
                       add_layer_norm_bwd_low=_add_layer_norm_bwd_low),
       SimpleNamespace(attention_qkv_fwd=torch.ops.course.attention_qkv_fwd,
                       attention_qkv_bwd=torch.ops.course.attention_qkv_bwd),
       SimpleNamespace(linear_gelu_fwd=torch.ops.course.linear_gelu_fwd,
                       linear_gelu_bwd=torch.ops.course.linear_gelu_bwd),
       SimpleNamespace(linear_ce_fwd=torch.ops.course.linear_cross_entropy_fwd))


class HandStep:
    """``step(x, y) -> loss``: forward, backward and the optimizer's step of ``model`` on a batch, by hand.

    ``model`` must be a :class:`course_utils.gpt.GPT` on the course's ops with weights in the compute
    dtype (:func:`course_utils.gpt.bf16_weights` on a GPU) and ``opt`` its optimizer
    (:func:`course_utils.gpt.optimizer`). The loss is returned as a 0-d float32 tensor on the device.

    ``compiled=True``: forward and backward run as one ``torch.compile``d function of the registered ops
    (:data:`OPS`), a graph with no autograd in it: on a GPU, Inductor launches the course's kernels from its
    generated code (the ops are triton_ops there) and fuses the glue between them (the embeddings, the bias
    gradients' sums, the casts). The first call compiles."""

    def __init__(self, model, opt, compiled: bool = False):
        from . import gpt
        if gpt.uses_autocast(model) and next(model.parameters()).is_cuda:
            raise ValueError("HandStep runs without autocast: convert the model with gpt.bf16_weights(model) "
                             "first (bf16 weights, float32 masters in the optimizer)")
        compute = next(model.parameters()).dtype
        if model.residual_dtype not in (None, compute, torch.float32):
            raise ValueError(f"HandStep keeps the residual stream in the weights' dtype or in float32; this model "
                             f"asks for {model.residual_dtype}")
        self.model, self.opt = model, opt
        self.compute = compute
        self.residual = model.residual_dtype or compute   # the stream's dtype: float32 is what autocast keeps
        cfg = model.cfg
        self.n_head, self.eps, self.scale = cfg.n_head, cfg.eps, cfg.head_dim ** -0.5
        self.kernels = OPS if compiled else FUNCTIONS
        self.grads = torch.compile(self._grads, fullgraph=True) if compiled else self._grads

    # --- forward --------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        """(loss, dh, dwte, saved): the loss with its gradients for the last hidden state and the tied
        head (the fused classifier computes them with the loss), and what the backward reads."""
        m, eps = self.model, self.eps
        Nm, A, L, C = self.kernels   # the ops' functions, or the registered ops when compiled (OPS)
        B, N = idx.shape
        if N > m.cfg.seq_len:
            raise ValueError(f"sequence of {N} tokens is longer than the model's seq_len={m.cfg.seq_len}")
        pos = torch.arange(N, device=idx.device)
        x = (m.wte.weight[idx] + m.wpe.weight[pos]).to(self.residual)
        first = m.blocks[0].ln1
        h, mean0, rstd0 = Nm.layer_norm_fwd(x, first.weight, first.bias, eps)
        h = h.to(self.compute)   # a wider stream: its first LayerNorm's output in the branches' dtype
        ctx = {"x0": x, "mean0": mean0, "rstd0": rstd0, "pos": pos, "blocks": []}
        for i, blk in enumerate(m.blocks):
            nxt = m.blocks[i + 1].ln1 if i + 1 < len(m.blocks) else m.ln_f
            h, x, saved = block_forward((Nm, A, L), h, x, params_of(blk, nxt), self.n_head, eps, self.scale)
            ctx["blocks"].append(saved)
        loss, dh, dwte = C.linear_ce_fwd(h.reshape(-1, h.shape[-1]), m.wte.weight, targets.reshape(-1), -100)
        return loss, dh.view(h.shape), dwte, ctx

    # --- backward -------------------------------------------------------------------------------------

    @torch.no_grad()
    def backward(self, idx: torch.Tensor, dh: torch.Tensor, dwte: torch.Tensor, ctx: dict) -> None:
        """Every parameter's gradient into its ``.grad``, the layers in reverse order."""
        for prm, g in self.gradients(idx, dh, dwte, ctx):
            prm.grad = g

    @torch.no_grad()
    def gradients(self, idx: torch.Tensor, dh: torch.Tensor, dwte: torch.Tensor, ctx: dict) -> list:
        """``[(parameter, gradient), ...]`` for every parameter, computed the layers in reverse order."""
        m = self.model
        Nm, A, L, C = self.kernels
        out = []
        dres = None                                   # the residual stream's gradient (None: nothing yet)
        for i in reversed(range(len(m.blocks))):
            nxt = m.blocks[i + 1].ln1 if i + 1 < len(m.blocks) else m.ln_f
            params = params_of(m.blocks[i], nxt)
            dh, dres, grads = block_backward((Nm, A, L), dh, dres, ctx["blocks"][i], params, self.n_head,
                                             self.scale)
            out += zip(params, grads)
        first = m.blocks[0].ln1
        dx, dw, db = Nm.layer_norm_bwd(dh.to(self.residual), ctx["x0"], first.weight, ctx["mean0"], ctx["rstd0"])
        out += [(first.weight, dw), (first.bias, db)]
        dx += dres                                    # x0 feeds the first LayerNorm and the residual stream
        dx = dx.to(self.compute)                      # the embeddings' sum was cast to the stream's dtype
        V, P = m.wte.weight.shape[0], m.wpe.weight.shape[0]
        dwte += torch.ops.aten.embedding_dense_backward(dx, idx, V, _NO_PADDING, False)
        out.append((m.wte.weight, dwte))              # the tied head's gradient plus the embedding's
        out.append((m.wpe.weight, torch.ops.aten.embedding_dense_backward(dx.sum(0), ctx["pos"], P, _NO_PADDING,
                                                                          False)))
        return out

    def _grads(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss; every parameter's gradient in its ``.grad`` (forward, then backward)."""
        loss, dh, dwte, ctx = self.forward(idx, targets)
        self.backward(idx, dh, dwte, ctx)
        return loss

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.grads(idx, targets)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


class ModelFunction(torch.autograd.Function):
    """The whole GPT, embeddings to loss, as ONE autograd node: :class:`HandStep`'s forward and backward behind
    autograd's interface. ``loss.backward()`` then walks one node (and one ``AccumulateGrad`` a parameter)
    where the model of one node a block records a node a block and an op-by-op model hundreds."""

    @staticmethod
    def forward(ctx, hand: HandStep, idx, targets, *params):
        loss, dh, dwte, saved = hand.forward(idx, targets)
        ctx.hand, ctx.idx, ctx.saved = hand, idx, saved   # activations: kept on ctx, dropped after the backward
        ctx.save_for_backward(dh, dwte)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        from .tuned.linear_cross_entropy import linear_cross_entropy_backward
        if ctx.saved is None:
            raise RuntimeError("ModelFunction's backward ran twice: its activations are freed after the first "
                               "(call loss.backward() once a forward)")
        dh, dwte = linear_cross_entropy_backward(dloss, *ctx.saved_tensors)   # times the loss's own gradient
        hand = ctx.hand
        pairs = hand.gradients(ctx.idx, dh, dwte, ctx.saved)
        ctx.saved = None
        if hand.order is None:   # gradients()' order is the model's, fixed: where each parameter's pair lies, once
            at = {id(p): i for i, (p, _) in enumerate(pairs)}
            hand.order = tuple(at[id(p)] for p in hand.params)
        # indexing by the cached order, not a dict of 150 ids built every backward: 5.45 -> 5.34 ms a
        # forward + backward (tools/step_host_cpu.py's tiny 12-block GPT, launches stubbed, min of 15 rounds)
        return (None, None, None, *[pairs[i][1] for i in hand.order])


class OneNode(torch.nn.Module):
    """``model`` (a :class:`course_utils.gpt.GPT` that :class:`HandStep` supports) called as one autograd node
    (:class:`ModelFunction`): ``_, loss = OneNode(model)(idx, targets)``, as the model itself is called to
    train, so :func:`course_utils.gpt.train_step` takes it. The parameters are the model's."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.hand = HandStep(model, opt=None)
        self.hand.params = tuple(model.parameters())
        self.hand.order = None   # ModelFunction.backward: where each parameter's gradient lies in gradients()' list

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        if targets is None or not torch.is_grad_enabled():
            raise ValueError("OneNode trains: call it with targets and gradients enabled (the model itself "
                             "serves inference)")
        return None, ModelFunction.apply(self.hand, idx, targets, *self.hand.params)


def grads_match(model, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Per parameter, max |hand - autograd| / max(|autograd|, tiny): the gradients of :class:`HandStep`
    against the autograd step's on the same weights and batch (no optimizer step is taken)."""
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    ref = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hand = HandStep(model, opt=None)
    hand_loss, dh, dwte, ctx = hand.forward(x, y)
    hand.backward(x, dh, dwte, ctx)
    out = {"loss": (hand_loss - loss.detach()).abs().item() / max(loss.abs().item(), 1e-30)}
    for n, p in model.named_parameters():
        r = ref[n].double()
        out[n] = (p.grad.double() - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
    model.zero_grad(set_to_none=True)
    return out
