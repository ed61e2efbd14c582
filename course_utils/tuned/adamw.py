"""MasterAdamW: the whole model's AdamW step in one launch (v2 of ``kernels/adamw.py``).
(The gradient tables' bookkeeping, CUDA-graph captures included, lives in :mod:`course_utils.tuned.adamw_tables`.)

The model holds bf16 (or fp16, or fp32) parameters, which its forward and backward use as they are;
the optimizer holds fp32 master weights and the moments m and v in three flat fp32 buffers, one slice
per parameter. Each step, one kernel reads every gradient, updates the masters and moments, and
writes each parameter's rounded copy (the update is :func:`course_utils.kernels.adamw.adamw_math`);
with the step count's increment before it, a step is two launches.

**One launch over separate tensors.** Autograd allocates each gradient on its own, so the kernel
cannot take one flat gradient: it takes a *table of pointers*, an int64 device tensor of the
gradients' ``data_ptr()`` (and one of the parameters'), and a static *block table*, one row per
program: (tensor index, offset of the block in the tensor, the tensor's numel, offset of the block
in the flat buffers). A program loads its row, turns the tensor's address into a pointer
(``tl.load(table + i).to(tl.pointer_type(...))``) and updates BLOCK_SIZE elements.

**The gradient table is rebuilt only when a gradient moves.** Each step compares the tuple of the
gradients' ``data_ptr()`` (one attribute read and one call per parameter: most of the host cost
of a step, which ``tools/gpu_checks/adamw.py`` measures beside torch's fused AdamW) with the tables
it has built; PyTorch's caching allocator usually hands ``backward`` the same addresses every step,
so the table is found and nothing is copied. Eager tables live in rows allocated with the optimizer
(``MAX_EAGER_TABLES`` of them): a table allocated when it is built would shift the allocator's blocks, so
that the next backward's gradients land elsewhere and force the next rebuild, every step. A parameter
whose ``.grad`` is None gets address 0 and its programs do nothing (torch.optim.AdamW skips it too); the
step count is one per optimizer, shared by all parameters, so unlike torch's per-parameter counts it advances on a step
that skipped a parameter. Gradients are validated (dtype, shape, device, layout) when a table is
built; between rebuilds, autograd guarantees a ``.grad`` of the parameter's shape and dtype.

**Vector loads.** The compiler vectorizes a load only when it can prove the addresses aligned and
the mask constant over the vector: the kernel says that the gradient and weight addresses it loads
from the table are aligned (``tl.multiple_of``: the optimizer checks them), and each tensor's full
blocks run without a mask (only its last block is masked). Every tensor is read four elements at a
time (16-byte fp32 vectors, 8-byte bf16 ones): with 16-byte bf16 vectors (8 elements) the compiler
gives the bf16 and fp32 tensors different register layouts and converts between them through shared
memory, with barriers (seen in the sm_90 PTX of Triton 3.6; the teaching kernel does this).

**CUDA graphs.** Step count and learning rate live on the device (``step_count``, ``lr``), so a
captured step replays the next step. Under ``torch.cuda.graph`` the gradients live in the graph's
private pool, new addresses, so the table is built during the capture: the optimizer writes the
addresses into a pinned host buffer that it allocated *before* the capture (allocating pinned
memory queries CUDA events, which a capture forbids) and keeps for its whole life, and the graph's copy node re-copies
that buffer into the graph's own device table at every replay (8 bytes per parameter). A table a
capture uses is never freed nor rewritten; eager steps build their own. So eager and graphed steps
may be mixed. Call ``step()`` once before capturing (the usual warm-up on a side stream), which
compiles the kernel. To change the learning rate, write the device tensor:
``opt.lr.fill_(3e-4)`` between replays, or ``opt.lr.copy_(t)`` from a device tensor inside the graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import adamw as teaching
from ..kernels.adamw import adamw_math
from .adamw_tables import MAX_EAGER_TABLES, POINTER_ALIGN, SPARE_PINNED, GradTables  # noqa: F401  (re-exported)

BLOCK_SIZE = 2048          # elements per program: 16 per thread at 4 warps
NUM_WARPS = 4
ALIGN_ELEMENTS = 16        # each tensor's slice of the flat buffers starts at a multiple of 16 (64 bytes)
VECTOR_ELEMENTS = 4        # elements per vector load of every tensor (see "Vector loads" above)
BLOCK_COLUMNS = 5          # a block table row: tensor index, offset in it, its numel, flat offset, decay 0/1
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _adamw_block(grad_ptr, weight_ptr, master_ptr, m_ptr, v_ptr, mask, t, lr, beta1, beta2, log2_beta1, log2_beta2,
                 eps, weight_decay, WEIGHT_DTYPE: tl.constexpr, FULL: tl.constexpr):
    """One block: pointers to its BLOCK_SIZE elements in each tensor. FULL: every lane is in bounds, so
    no mask (a mask the compiler cannot prove constant over a vector's lanes forbids vector loads)."""
    if FULL:
        g = tl.load(grad_ptr).to(tl.float32)
        w = tl.load(master_ptr)
        m = tl.load(m_ptr)
        v = tl.load(v_ptr)
    else:
        g = tl.load(grad_ptr, mask=mask).to(tl.float32)
        w = tl.load(master_ptr, mask=mask)
        m = tl.load(m_ptr, mask=mask)
        v = tl.load(v_ptr, mask=mask)
    w, m, v = adamw_math(g, w, m, v, t, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay)
    if FULL:
        tl.store(master_ptr, w)
        tl.store(m_ptr, m)
        tl.store(v_ptr, v)
        tl.store(weight_ptr, w.to(WEIGHT_DTYPE))
    else:
        tl.store(master_ptr, w, mask=mask)
        tl.store(m_ptr, m, mask=mask)
        tl.store(v_ptr, v, mask=mask)
        tl.store(weight_ptr, w.to(WEIGHT_DTYPE), mask=mask)


@triton.jit
def multi_tensor_adamw_kernel(blocks_ptr, weight_table_ptr, grad_table_ptr, master_ptr, m_ptr, v_ptr,
                              step_ptr, lr_ptr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
                              WEIGHT_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, ALIGN: tl.constexpr,
                              VECTOR_BYTES: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    pid = tl.program_id(axis=0)
    row = blocks_ptr + pid * BLOCK_COLUMNS
    tensor = tl.load(row)                                           # which parameter
    start = tl.multiple_of(tl.load(row + 1), BLOCK_SIZE)            # first element of the block in it
    numel = tl.load(row + 2)
    flat = tl.multiple_of(tl.load(row + 3), ALIGN)                  # the same element in master, m, v
    decay = tl.load(row + 4).to(tl.float32)                         # 0: a parameter without weight decay
    grad_addr = tl.load(grad_table_ptr + tensor)
    if grad_addr != 0:                                              # address 0: no gradient, skip
        weight_addr = tl.load(weight_table_ptr + tensor)
        lanes = tl.arange(0, BLOCK_SIZE)
        # an address loaded from memory has no known alignment: say it (in bytes), or no vector loads
        grad_ptr = tl.multiple_of(grad_addr.to(tl.pointer_type(WEIGHT_DTYPE)), VECTOR_BYTES) + start + lanes
        weight_ptr = tl.multiple_of(weight_addr.to(tl.pointer_type(WEIGHT_DTYPE)), VECTOR_BYTES) + start + lanes
        flat_offsets = flat + lanes
        t = tl.load(step_ptr).to(tl.float32)
        lr = tl.load(lr_ptr).to(tl.float32)
        args = (grad_ptr, weight_ptr, master_ptr + flat_offsets, m_ptr + flat_offsets, v_ptr + flat_offsets)
        if start + BLOCK_SIZE <= numel:                             # all but each tensor's last block
            _adamw_block(*args, None, t, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay * decay,
                         WEIGHT_DTYPE, True)
        else:
            _adamw_block(*args, start + lanes < numel, t, lr, beta1, beta2, log2_beta1, log2_beta2, eps,
                         weight_decay * decay, WEIGHT_DTYPE, False)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_params(params) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors (model.parameters()), not one tensor")
    params = list(params)
    if not params:
        raise ValueError("MasterAdamW got an empty parameter list")
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor (param groups are not supported)")
        if p.dtype not in TL_DTYPES:
            raise TypeError(f"parameter {i} has dtype {p.dtype}; expected a floating dtype "
                            f"({', '.join(map(str, TL_DTYPES))})")
        if p.dtype != params[0].dtype:
            raise TypeError(f"parameter {i} is {p.dtype} but parameter 0 is {params[0].dtype}: one dtype per "
                            "optimizer (make one MasterAdamW per dtype)")
        if p.device != params[0].device:
            raise ValueError(f"parameter {i} is on {p.device} but parameter 0 is on {params[0].device}: "
                             "one device per optimizer")
        if not p.is_contiguous() or p.layout != torch.strided:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not a contiguous dense tensor")
        if p.data_ptr() % POINTER_ALIGN:
            raise ValueError(f"parameter {i} does not start on a {POINTER_ALIGN}-byte boundary (a view at an odd "
                             "offset?): the kernel's vector loads need aligned tensors")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter appears twice in params: it would be updated twice per step")
    return params


class MasterAdamW:
    """AdamW on fp32 master weights and moments for a model's low-precision parameters; one launch per step.

    ``MasterAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, master_from=None,
    no_decay=(), block_size=2048)``: ``params`` are the model's parameters (one floating dtype, one
    device, contiguous); the masters start from them, or from ``master_from`` (tensors of the same
    shapes in the same order, e.g. the fp32 parameters the model had before
    ``model.to(torch.bfloat16)``), in which case the parameters are rewritten as the masters rounded.
    ``no_decay``: parameters that get no weight decay (like a second torch param group with
    ``weight_decay=0``: biases and norms, say). ``step()`` applies one step to every parameter that has
    a gradient; ``zero_grad(set_to_none=True)``; ``state_dict()`` / ``load_state_dict()``.
    Attributes: ``master``, ``exp_avg``, ``exp_avg_sq`` (flat fp32), ``masters()`` (views shaped like
    the parameters), ``step_count`` and ``lr`` (one-element fp32 device tensors; the count is exact up
    to 2^24 steps), ``rebuilds`` (how many gradient tables were built). :meth:`from_fp32_model`
    converts an fp32 model and builds its optimizer in one call.

    The kernel writes the parameters in place without bumping their autograd version counters (no
    custom kernel does): step between a backward and the next forward, as every training loop does.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, master_from=None, no_decay=(), block_size: int = BLOCK_SIZE):
        self.params = _check_params(params)
        self.device, self.dtype = self.params[0].device, self.params[0].dtype
        self._args = teaching.scalar_args(betas, eps, weight_decay)
        if block_size < ALIGN_ELEMENTS or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= {ALIGN_ELEMENTS}, got {block_size}")
        self.block_size = block_size
        self._vector_bytes = VECTOR_ELEMENTS * self.dtype.itemsize
        self.numels = [p.numel() for p in self.params]
        self.offsets, total = [], 0
        for n in self.numels:
            self.offsets.append(total)
            total += _round_up(n, ALIGN_ELEMENTS)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.master = torch.zeros(total, **f32)
        self.exp_avg = torch.zeros(total, **f32)
        self.exp_avg_sq = torch.zeros(total, **f32)
        self.step_count = torch.zeros(1, **f32)
        self.lr = torch.full((1,), float(lr), **f32)
        self._init_masters(master_from)
        self._blocks = self._block_table(no_decay)
        self._n_blocks = self._blocks.numel() // BLOCK_COLUMNS
        self._weight_table = torch.tensor([p.data_ptr() for p in self.params], dtype=torch.int64).to(self.device)
        self._grads = GradTables(self.params, self.dtype, self.device, self.numels)

    @classmethod
    def from_fp32_model(cls, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, **kwargs) -> MasterAdamW:
        """Converts ``model`` to ``dtype`` in place (``model.to(dtype)``: its floating parameters and
        buffers) and returns a MasterAdamW whose masters are the model's fp32 weights from before the
        conversion, exactly. ``kwargs`` are the constructor's (lr, betas, eps, weight_decay, block_size)."""
        if dtype not in TL_DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(map(str, TL_DTYPES))}, got {dtype}")
        source = [p.detach().float().clone() for p in model.parameters()]
        model.to(dtype)
        return cls(model.parameters(), master_from=source, **kwargs)

    # --- construction ---------------------------------------------------------------------------

    def masters(self) -> list[torch.Tensor]:
        """The fp32 master weights, one view of ``master`` per parameter, shaped like it."""
        return [self.master[o:o + n].view(p.shape) for o, n, p in zip(self.offsets, self.numels, self.params)]

    def _init_masters(self, master_from) -> None:
        with torch.no_grad():
            if master_from is None:
                for w, p in zip(self.masters(), self.params):
                    w.copy_(p)
                return
            sources = list(master_from)
            if len(sources) != len(self.params):
                raise ValueError(f"master_from has {len(sources)} tensors but params has {len(self.params)}")
            for i, (w, p, s) in enumerate(zip(self.masters(), self.params, sources)):
                if not isinstance(s, torch.Tensor) or not s.is_floating_point():
                    raise TypeError(f"master_from[{i}] must be a floating tensor, got {type(s).__name__} "
                                    f"{getattr(s, 'dtype', '')}")
                if s.shape != p.shape:
                    raise ValueError(f"master_from[{i}] has shape {tuple(s.shape)} but parameter {i} has "
                                     f"{tuple(p.shape)}")
                w.copy_(s)
                p.copy_(w)                      # the model's copy is the master rounded, as after every step

    def _block_table(self, no_decay) -> torch.Tensor:
        skip = {id(p) for p in no_decay}
        unknown = skip - {id(p) for p in self.params}
        if unknown:
            raise ValueError(f"no_decay names {len(unknown)} tensor(s) that are not among params")
        decays = [0 if id(p) in skip else 1 for p in self.params]
        rows = [(i, start, n, o + start, decays[i])
                for i, (n, o) in enumerate(zip(self.numels, self.offsets))
                for start in range(0, n, self.block_size)]
        return torch.tensor(rows, dtype=torch.int64).reshape(-1).to(self.device)

    @property
    def rebuilds(self) -> int:
        """How many gradient tables were built (:class:`course_utils.tuned.adamw_tables.GradTables`)."""
        return self._grads.rebuilds

    # --- the public step ------------------------------------------------------------------------------

    def step(self) -> None:
        """One AdamW step for every parameter with a gradient: the step count, then one kernel.

        (No ``torch.no_grad()`` needed: nothing here is recorded by autograd, and its context costs host time.)"""
        if torch.autograd.profiler._is_profiler_enabled:   # so a profile ties its kernels to the optimizer
            with torch.profiler.record_function("MasterAdamW.step"):
                return self._step()
        self._step()

    def _step(self) -> None:
        grads = self._grads
        table = grads.table()
        if len(grads.spare) < SPARE_PINNED and not grads.capturing():
            grads.top_up_spare()
        self.step_count.add_(1)
        if self._n_blocks:
            multi_tensor_adamw_kernel[(self._n_blocks,)](
                self._blocks, self._weight_table, table, self.master, self.exp_avg, self.exp_avg_sq,
                self.step_count, self.lr, *self._args, WEIGHT_DTYPE=TL_DTYPES[self.dtype],
                BLOCK_SIZE=self.block_size, ALIGN=ALIGN_ELEMENTS, VECTOR_BYTES=self._vector_bytes,
                BLOCK_COLUMNS=BLOCK_COLUMNS, num_warps=NUM_WARPS)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict:
        """Copies of the step count, learning rate, masters and moments, and the hyperparameters."""
        beta1, beta2, _, _, eps, weight_decay = self._args
        return {"step_count": self.step_count.clone(), "lr": self.lr.clone(), "master": self.master.clone(),
                "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone(),
                "betas": (beta1, beta2), "eps": eps, "weight_decay": weight_decay, "numels": list(self.numels)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copies a :meth:`state_dict` into this optimizer's buffers, in place (a graph that captured
        ``step()`` keeps reading the same memory), and rewrites the parameters from the masters."""
        if list(state["numels"]) != self.numels:
            raise ValueError("the state dict was saved for parameters of other sizes: "
                             f"{list(state['numels'])[:4]}... vs {self.numels[:4]}...")
        self._args = teaching.scalar_args(state["betas"], state["eps"], state["weight_decay"])
        for name in ("step_count", "lr", "master", "exp_avg", "exp_avg_sq"):
            getattr(self, name).copy_(state[name])
        for w, p in zip(self.masters(), self.params):
            p.copy_(w)


def compile_cases(info):
    """The launches the compile matrix compiles for ``info`` (see course_utils/aot.py): both shelves,
    every weight dtype, parameters of odd sizes."""
    from ..aot import dtype_name, dtypes_for, empty

    def tuned(dt):
        params = [empty(n, dtype=dt) for n in (1, 4099, 768 * 3)]
        for p in params:
            p.grad = empty(p.shape, dtype=dt)
        MasterAdamW(params).step()

    def plain(dt):
        f32 = [empty(1000) for _ in range(3)]
        teaching.adamw_teaching(empty(1000, dtype=dt), *f32, empty(1000, dtype=dt), empty(1), empty(1))

    for dt in dtypes_for(info):
        yield f"MasterAdamW {dtype_name(dt)}", lambda dt=dt: tuned(dt)
        yield f"adamw_teaching {dtype_name(dt)}", lambda dt=dt: plain(dt)
