"""A GPT-2-style decoder that trains on the course's kernels (chapters 11 and 12).

One module, two sets of ops (:mod:`course_utils.autograd.registry`): the same parameters and the
same batches run through eager PyTorch (SDPA for attention) or through the course's Triton kernels.
Text: the course's own markdown and notebook prose, as bytes (a vocabulary of 256): nothing is
downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .autograd.registry import Ops
from .autograd.registry import ops as make_ops

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 256  # byte-level tokens
GPT2_VOCAB = 50304  # GPT-2's 50257 tokens padded to a multiple of 128 (nanoGPT's and llm.c's size)


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    seq_len: int = 32
    vocab: int = VOCAB
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


TINY = GPTConfig()                                                       # the CPU interpreter: seconds
GPU = GPTConfig(n_layer=6, n_head=12, d_model=768, seq_len=1024)         # GPT-2 small's width, 6 layers, vocab 256
# GPT-2 small, the shape llm.c and nanoGPT report: 12 layers, width 768, 12 heads, a vocabulary of 50304.
# The course's text is bytes, so only ids 0-255 ever appear: the head, the loss and the embedding's
# gradient still cost what a 50304-token tokenizer's would (every row is a full softmax over 50304).
GPT2 = GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab=GPT2_VOCAB)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=cfg.eps), nn.LayerNorm(d, eps=cfg.eps)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def attend(self, h: torch.Tensor, ops: Ops, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """proj(attention(q, k, v)) with q, k, v read from the packed projection as strided views."""
        B, N, d = h.shape
        packed = self.qkv(h)
        if cache is None and ops.attention_qkv is not None:
            # q, k, v read from the packed projection by strides; dq, dk, dv written back into its layout
            o = ops.attention_qkv(packed, self.cfg.n_head, True)
            return self.proj(o.transpose(1, 2).reshape(B, N, d))
        qkv = packed.view(B, N, 3, self.cfg.n_head, self.cfg.head_dim)
        # (B, H, N, hd) views, no copies; unbind's backward stacks dq, dk, dv into dqkv in one kernel
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        if cache is not None:
            k, v = cache.append(layer, k, v)                              # every key so far
        o = ops.attention(q, k, v, True)                                  # causal, aligned bottom-right
        return self.proj(o.transpose(1, 2).reshape(B, N, d))

    def mlp(self, h: torch.Tensor, ops: Ops) -> torch.Tensor:
        return self.out(ops.linear_gelu(h, self.fc.weight, self.fc.bias))


class KVCache:
    """The keys and values of every layer for the tokens decoded so far (batch, heads, seq_len, hd)."""

    def __init__(self, cfg: GPTConfig, batch: int):
        self.cfg, self.batch, self.length = cfg, batch, 0
        self.k: list = [None] * cfg.n_layer
        self.v: list = [None] * cfg.n_layer

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        n = k.shape[2]
        if self.length + n > self.cfg.seq_len:
            raise ValueError(f"the cache holds {self.cfg.seq_len} tokens; {self.length} + {n} do not fit")
        if self.k[layer] is None:
            shape = (self.batch, self.cfg.n_head, self.cfg.seq_len, self.cfg.head_dim)
            self.k[layer], self.v[layer] = k.new_empty(shape), v.new_empty(shape)
        end = self.length + n
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` pre-norm blocks, a final LayerNorm, tied output head.

    Each residual add is fused into the LayerNorm that follows it (``ops.add_layer_norm``): the block
    computes ``x = x + branch`` and ``h = LayerNorm(x)`` in one call, and the loss is one op.
    """

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        # GPT-2's initialization, from a fixed generator: both versions start from the same weights.
        # Biases are zeroed, not left to nn.Linear's draw from the global RNG (two GPT(cfg) would differ).
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                    continue
                if ".ln" in name or name.startswith("ln_f"):
                    continue
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
        self.ops = make_ops("torch")
        self.residual_dtype: torch.dtype | None = None   # None: the stream in the embeddings' dtype

    def use(self, ops: Ops | str) -> GPT:
        self.ops = make_ops(ops) if isinstance(ops, str) else ops
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None):
        B, N = idx.shape
        start = cache.length if cache is not None else 0
        if start + N > self.cfg.seq_len:
            raise ValueError(f"sequence of {start + N} tokens is longer than the model's seq_len={self.cfg.seq_len}")
        ops, eps = self.ops, self.cfg.eps
        x = self.wte(idx) + self.wpe(torch.arange(start, start + N, device=idx.device))
        first = self.blocks[0].ln1
        if self.residual_dtype is not None and x.dtype != self.residual_dtype:
            # a wider residual stream than the weights (bf16 weights, float32 stream): add_layer_norm keeps s in
            # the wider dtype and writes y in the branch's, so only the first LayerNorm's output is cast
            compute, x = x.dtype, x.to(self.residual_dtype)
            h = ops.layer_norm(x, first.weight, first.bias, eps).to(compute)
        else:
            h = ops.layer_norm(x, first.weight, first.bias, eps)
        one_node = ops.block is not None and cache is None and _trains_eagerly(idx.device.type)
        for i, block in enumerate(self.blocks):
            nxt = self.blocks[i + 1].ln1 if i + 1 < len(self.blocks) else self.ln_f
            if one_node:   # the same kernels, one autograd node a block (course_utils.ops.block)
                h, x = ops.block(h, x, block, nxt, self.cfg.n_head, eps)
                continue
            h, x = ops.add_layer_norm(block.attend(h, ops, cache, i), x, block.ln2.weight, block.ln2.bias, eps)
            h, x = ops.add_layer_norm(block.mlp(h, ops), x, nxt.weight, nxt.bias, eps)
        if cache is not None:
            cache.length += N
        if targets is None:
            return F.linear(h, self.wte.weight)
        # the tied head and the loss in one op: the course's never writes the (tokens x vocab) logits whole
        return None, ops.linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.wte.weight, targets.reshape(-1))


def bf16_weights(model: GPT, residual_dtype: torch.dtype | None = None) -> GPT:
    """The model's parameters in bfloat16, llm.c's mixed precision: the forward and backward read bf16
    weights (no autocast, no casts), and :func:`optimizer` keeps float32 master weights and moments, made
    here from the exact float32 values, in one fused kernel (:mod:`course_utils.tuned.adamw`). The residual
    stream is bf16 too (llm.c's choice), unless ``residual_dtype`` (float32: what eager keeps under autocast)."""
    model.master = [p.detach().float().clone() for p in model.parameters()]
    model.residual_dtype = residual_dtype
    return model.to(torch.bfloat16)


def _trains_eagerly(device_type: str) -> bool:
    """Autograd records, torch.compile is not tracing and autocast is off: where ``Ops.block`` applies."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and not torch.is_autocast_enabled(device_type)


def uses_autocast(model: nn.Module) -> bool:
    """float32 parameters: the step runs under bf16 autocast (PyTorch's recipe); bf16 ones: it does not."""
    return next(model.parameters()).dtype == torch.float32


def twins(cfg: GPTConfig, device, seed: int = 0, bf16: bool | None = None) -> tuple[GPT, GPT]:
    """The torch version and the course version of one model: identical parameters. On a GPU the course
    version holds bf16 weights with float32 masters (:func:`bf16_weights`) unless ``bf16=False``."""
    base = GPT(cfg, seed).to(device)
    twin = copy.deepcopy(base).use("course")
    if bf16 if bf16 is not None else torch.device(device).type == "cuda":
        bf16_weights(twin)
    return base.use("torch"), twin


def model_flops(cfg: GPTConfig, batch: int) -> dict:
    """FLOPs of one training step as PaLM's appendix B counts them (nanoGPT's and llm.c's MFU):
    ``6 N`` per token for the weights (forward 2, backward 4; N without the position embeddings,
    the tied head counted once) plus ``12 L d T`` per token for attention's two products."""
    d, L, T = cfg.d_model, cfg.n_layer, cfg.seq_len
    n = cfg.vocab * d + L * (12 * d * d + 13 * d) + 2 * d      # wte, blocks (4 linears, 2 LayerNorms), ln_f
    tokens = batch * T
    return {"params": n, "tokens": tokens, "flops": (6 * n + 12 * L * d * T) * tokens}


@torch.no_grad()
def generate(model: GPT, prompt: str, new_tokens: int, *, temperature: float = 0.8, seed: int = 0) -> str:
    """Sample ``new_tokens`` bytes after ``prompt``: the prompt in one forward pass, then one token at
    a time, each a query row against every cached key (the bottom-right causal case)."""
    device = next(model.parameters()).device
    idx = tokens(prompt).view(1, -1).to(device)
    if idx.shape[1] + new_tokens > model.cfg.seq_len:
        raise ValueError(f"{idx.shape[1]} prompt + {new_tokens} new tokens exceed seq_len={model.cfg.seq_len}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    g = torch.Generator(device=device).manual_seed(seed)
    cache, out = KVCache(model.cfg, 1), []
    with _autocast(device):
        logits = model(idx, cache=cache)[:, -1]
        for i in range(new_tokens):
            nxt = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=g)
            out.append(int(nxt))
            if i + 1 < new_tokens:
                logits = model(nxt, cache=cache)[:, -1]
    return bytes(out).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------------
# Data: the course's own text, byte-level
# ------------------------------------------------------------------------------------------------

def corpus_text(root: Path = ROOT) -> str:
    """README, docs and the markdown cells of the lectures, concatenated (shipped with the repository)."""
    parts = [p.read_text(encoding="utf-8") for p in sorted([root / "README.md", *root.glob("docs/*.md")]) if p.exists()]
    for nb in sorted(root.glob("notebooks/*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        parts += ["".join(c["source"]) for c in cells if c.get("cell_type") == "markdown"]
    text = "\n\n".join(parts)
    if not text:
        raise FileNotFoundError(f"no course text found under {root}")
    return text


def tokens(text: str | None = None) -> torch.Tensor:
    """The text's UTF-8 bytes as int64 token ids in [0, 256)."""
    data = (text if text is not None else corpus_text()).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def batches(data: torch.Tensor, batch: int, seq_len: int, steps: int, seed: int = 0):
    """``steps`` batches of random windows (inputs, next-token targets), the same for every run with ``seed``."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"{data.numel()} tokens are too few for windows of {seq_len + 1}")
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=g)
        window = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------

def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _precision(model: nn.Module, device: torch.device, cache_enabled: bool = True):
    if uses_autocast(model) and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache_enabled)
    return contextlib.nullcontext()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step: forward (float32 weights under bf16 autocast on a GPU, or bf16 weights as they are),
    backward, AdamW (torch's, or the course's on float32 masters for bf16 weights)."""
    with _precision(model, x.device):
        _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def optimizer(model: nn.Module, lr: float = 3e-4, capturable: bool = False,
              fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW. float32 weights: torch's, on a GPU fused into a few multi-tensor kernels (``fused=True``;
    ``fused=False``: the foreach kernels chapter 11 used; ``capturable=True`` keeps its step counts on
    the GPU so that a CUDA graph can hold it). bf16 weights (:func:`bf16_weights`): the course's
    ``MasterAdamW``, float32 masters and moments and the bf16 copy in one launch (always capturable)."""
    if not uses_autocast(model):
        from .tuned.adamw import MasterAdamW
        masters = getattr(model, "master", None)
        return MasterAdamW(list(model.parameters()), lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                           master_from=masters)
    fused = next(model.parameters()).is_cuda if fused is None else fused
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, capturable=capturable,
                             fused=fused or None)


def graphed_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, warmup: int = 3):
    """A whole training step (forward, backward, AdamW) captured as one CUDA graph (chapter 1).

    Returns ``(replay, loss)``: ``replay()`` runs one step on whatever ``x`` and ``y`` hold (copy the
    next batch into them first), ``loss`` is the tensor the graph writes the loss into. ``replay``
    keeps ``x``, ``y`` and the optimizer alive: a graph replays raw addresses, and memory freed and
    reused after the capture would be read as a batch. The warm-up
    steps on a side stream let every launcher make its choices (tiles, compilation) before the
    capture, where nothing may synchronize with the host.
    """
    if not x.is_cuda:
        raise RuntimeError("graphed_step needs the model and the batch on a CUDA GPU")
    opt = optimizer(model, capturable=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            train_step(model, opt, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        with _precision(model, x.device, cache_enabled=False):
            _, loss = model(x, y)
        loss.backward()
        opt.step()

    def replay():  # holds x, y, the graph and the optimizer: the graph reads and writes their memory
        graph.replay()
        return x, y, opt

    return replay, loss


def train(model: nn.Module, data: torch.Tensor, *, steps: int, batch: int, seed: int = 0, lr: float = 3e-4,
          progress: bool = True, step_fn=None) -> list[float]:
    """Train for ``steps`` steps on the batches of ``seed``; the loss of each step."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    opt = optimizer(model, lr)
    step_fn = step_fn or train_step
    losses = []
    it = batches(data, batch, model.cfg.seq_len, steps, seed)
    for x, y in tqdm(it, total=steps, disable=not progress, desc=f"training ({model.ops.name} ops)"):
        losses.append(float(step_fn(model, opt, x.to(device), y.to(device))))
    return losses
