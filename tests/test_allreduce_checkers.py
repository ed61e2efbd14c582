"""Chapter 13's checkers pass a right one-shot all-reduce (and its fused residual + RMSNorm epilogue)
written apart from the course's, refuse the course's own kernel and library all-reduces, and fail
each usual wrong kernel with a message naming the fault."""

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from course_utils import check, env
from course_utils.checkers import allreduce as checks
from course_utils.kernels import allreduce as K


@triton.jit
def _peer_pad(pad_table_ptr, peer):
    return tl.load(pad_table_ptr + peer).to(tl.pointer_type(tl.int32))


@triton.jit
def _rows(pid, n_rows, WORLD: tl.constexpr, REDUCING: tl.constexpr, FAULT: tl.constexpr):
    """(start, stop, step) of the rows program pid handles in one half: pid, pid + programs, ... but for FAULT."""
    programs = tl.num_programs(0)
    if FAULT == "no row loop":
        return pid, pid + 1, programs
    if FAULT == "reduce rows WORLD apart" and REDUCING:   # the grid's stride taken as the world size
        return pid, n_rows, WORLD
    if FAULT == "reduce rows in chunks" and REDUCING:     # program pid reduces a chunk, but published a stride
        chunk = tl.cdiv(n_rows, programs)
        return pid * chunk, tl.minimum(pid * chunk + chunk, n_rows), 1
    return pid, n_rows, programs


@triton.jit
def _ar(y_ptr, s_ptr, x_ptr, r_ptr, w_ptr, buf_table_ptr, pad_table_ptr, rank, n_rows, n_cols, buf_offset, eps,
        max_spins, WORLD: tl.constexpr, BLOCK_N: tl.constexpr, PUBLISH: tl.constexpr, REDUCE: tl.constexpr,
        FUSED: tl.constexpr, FAULT: tl.constexpr):
    """A student's all-reduce (FUSED: + residual + RMSNorm), one program per row tile, with FAULT baked in."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    own = buf_offset
    if FAULT == "no buffer half":
        own = 0
    mine = tl.load(buf_table_ptr + rank).to(tl.pointer_type(dtype)) + own
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) if FUSED else None
    if PUBLISH:
        if FAULT != "barrier before the writes":
            start, stop, step = _rows(pid, n_rows, WORLD, False, FAULT)
            for row in tl.range(start, stop, step):
                base = tl.cast(row, tl.int64) * (BLOCK_N if FAULT == "row stride BLOCK_N" else n_cols)
                x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
                if FAULT == "norm applied before the sum":
                    x = x / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps) * w
                tl.store(mine + base + cols, x.to(dtype), mask=mask)
        if FAULT != "no barrier":
            tl.debug_barrier()
            for peer in tl.static_range(WORLD):
                if peer != rank:
                    flag = _peer_pad(pad_table_ptr, peer) + pid * WORLD + rank
                    if FAULT == "wrong flag index":       # the peer's slot, not the sender's
                        flag = _peer_pad(pad_table_ptr, peer) + pid * WORLD + peer
                    if FAULT == "one flag per rank":      # pid left out: the programs share a flag
                        flag = _peer_pad(pad_table_ptr, peer) + rank
                    if FAULT == "signal pad never reset":
                        tl.atomic_xchg(flag, 1, sem="release", scope="sys")
                    else:
                        old = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
                        tries = 0
                        while (old != 0) & (tries < max_spins):
                            old = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
                            tries += 1
    if REDUCE:
        ready = 0
        if FAULT == "reads before the wait":   # every rank's first row loaded before the wait, used after it
            early = tl.zeros((BLOCK_N,), tl.float32)
            for r in tl.static_range(WORLD):
                buf = tl.load(buf_table_ptr + r).to(tl.pointer_type(dtype)) + buf_offset
                early += tl.load(buf + pid * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if FAULT != "no barrier":
            pad = _peer_pad(pad_table_ptr, rank) + pid * WORLD
            for peer in tl.static_range(WORLD):
                if peer != rank or FAULT == "waits for its own flag":
                    new = 0 if FAULT != "signal pad never reset" else 1
                    slot = pad + peer
                    if FAULT == "one flag per rank":
                        slot = _peer_pad(pad_table_ptr, rank) + peer
                    if FAULT == "waits on the peers' pads":   # the flag it set itself on the peer's pad
                        slot = _peer_pad(pad_table_ptr, peer) + pid * WORLD + rank
                    old = tl.atomic_cas(slot, 1, new, sem="acquire", scope="sys")
                    tries = 0
                    if FAULT == "wait never gives up":    # max_spins ignored: spins until the flag comes
                        while old != 1:
                            old = tl.atomic_cas(slot, 1, new, sem="acquire", scope="sys")
                    while (old != 1) & (tries < max_spins):
                        old = tl.atomic_cas(slot, 1, new, sem="acquire", scope="sys")
                        tries += 1
                    ready += tl.where(old == 1, 0, 1)
            tl.debug_barrier()
        if FAULT == "wait result ignored":     # waits, then reduces whether or not every flag came
            ready = ready * 0
        if ready == 0:
            start, stop, step = _rows(pid, n_rows, WORLD, True, FAULT)
            for row in tl.range(start, stop, step):
                base = tl.cast(row, tl.int64) * (BLOCK_N if FAULT == "row stride BLOCK_N" else n_cols)
                if FAULT == "barrier before the writes":
                    tl.store(mine + base + cols, tl.load(x_ptr + base + cols, mask=mask), mask=mask)
                acc = tl.zeros((BLOCK_N,), tl.float32)
                if FAULT == "sum in x's dtype":
                    acc = tl.zeros((BLOCK_N,), dtype)
                if FAULT == "sum in float16":           # a 16-bit accumulator whatever x's dtype
                    acc = tl.zeros((BLOCK_N,), tl.float16)
                if FAULT == "own rows first":          # x from x_ptr, then the peers: each rank its own order
                    acc = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
                for r in tl.static_range(WORLD):
                    peer_offset = buf_offset
                    if FAULT == "wrong peer offset":
                        if r != rank:
                            peer_offset = 0 if buf_offset != 0 else buf_offset + 1
                    if FAULT == "no buffer half":
                        peer_offset = 0
                    src = r
                    if FAULT == "only the own buffer read":
                        src = rank
                    buf = tl.load(buf_table_ptr + src).to(tl.pointer_type(dtype)) + peer_offset
                    if FAULT == "sum in x's dtype":
                        acc += tl.load(buf + base + cols, mask=mask, other=0.0)
                    elif FAULT == "sum in float16":
                        acc += tl.load(buf + base + cols, mask=mask, other=0.0).to(tl.float16)
                    elif FAULT == "own rows first" or FAULT == "own rows left out":
                        if r != rank:
                            acc += tl.load(buf + base + cols, mask=mask, other=0.0).to(tl.float32)
                    else:
                        acc += tl.load(buf + base + cols, mask=mask, other=0.0).to(tl.float32)
                acc = acc.to(tl.float32)
                if FAULT == "averaged":
                    acc = acc / WORLD
                if FAULT == "reads before the wait":
                    if row == pid:
                        acc = early   # the first row as it was read before the flags came
                if FUSED:
                    res = tl.load((x_ptr if FAULT == "x added instead of the residual" else r_ptr) + base + cols,
                                  mask=mask, other=0.0).to(tl.float32)
                    if FAULT == "residual added twice":
                        res = res * 2
                    if FAULT == "residual not added":
                        res = res * 0
                    s = (acc + res).to(dtype)
                    s_dst, y_dst = (y_ptr, s_ptr) if FAULT == "y and s swapped" else (s_ptr, y_ptr)
                    tl.store(s_dst + base + cols, s, mask=mask)
                    sf = s.to(tl.float32)
                    if FAULT == "statistics in x's dtype":   # the stored s squared and averaged as it is
                        sf = s
                    if FAULT == "norm of the sum without the residual":
                        sf = acc
                    if FAULT == "norm of s before its rounding":   # the float32 s, not the s stored
                        sf = acc + res
                    n = n_cols
                    if FAULT == "mean over BLOCK_N":
                        n = BLOCK_N
                    y = sf / tl.sqrt(tl.sum(sf * sf, axis=0) / n + eps)
                    if FAULT == "eps outside the square root":
                        y = sf / (tl.sqrt(tl.sum(sf * sf, axis=0) / n) + eps)
                    if FAULT == "no sqrt":
                        y = sf / (tl.sum(sf * sf, axis=0) / n + eps)
                    if FAULT != "weight missing":
                        y = y * w
                    tl.store(y_dst + base + cols, y.to(dtype), mask=mask)
                elif FAULT == "no store mask":
                    tl.store(y_ptr + base + cols, acc.to(dtype))
                else:
                    tl.store(y_ptr + base + cols, acc.to(dtype), mask=mask)


def bound(fault: str, fused: bool = False):
    """``kernel[grid](...)`` with the checker's signature, this fault baked in."""
    class Bound:
        def __getitem__(self, grid):
            if fused:
                return lambda *a, **kw: _ar[grid](*a, FUSED=True, FAULT=fault, **kw)

            def plain(out, x, buf_table, pad_table, rank, n_rows, n_cols, buf_offset, max_spins, **kw):
                return _ar[grid](out, out, x, x, x, buf_table, pad_table, rank, n_rows, n_cols, buf_offset, 1e-6,
                                 max_spins, FUSED=False, FAULT=fault, **kw)
            return plain
    return Bound()


def test_right_kernels_pass(capsys):
    checks.check_all_reduce_kernel(bound("none"))
    checks.check_all_reduce_add_rms_norm_kernel(bound("none", fused=True))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS one-shot all-reduce:") and out[1].startswith("PASS all-reduce + residual + RMSNorm:")
    assert all("checked under Triton's interpreter only" in line for line in out)   # one line on CPU and GPU


@pytest.mark.parametrize("fault", ["no barrier", "barrier before the writes", "only the own buffer read",
                                   "wrong peer offset", "signal pad never reset", "reads before the wait"])
@pytest.mark.parametrize("fused", [False, True], ids=["all-reduce", "fused"])
def test_each_fault_is_named(fault, fused, capsys):
    check_fn = checks.check_all_reduce_add_rms_norm_kernel if fused else checks.check_all_reduce_kernel
    if fault == "reads before the wait" and env.on_gpu():
        # a GPU records no loads and runs the simulated ranks one after another: the verdict (the same line
        # on the CPU, where the fault fails) says the order is checked under the interpreter only
        check_fn(bound(fault, fused))
        assert "checked under Triton's interpreter only" in capsys.readouterr().out
        return
    words = "before their flags came" if fault == "reads before the wait" else fault
    with pytest.raises(check.CheckFailure, match=words):
        check_fn(bound(fault, fused))


def test_norm_before_the_sum_is_named():
    with pytest.raises(check.CheckFailure, match="norm applied before the sum"):
        checks.check_all_reduce_add_rms_norm_kernel(bound("norm applied before the sum", fused=True))


@pytest.mark.parametrize("fault, fused", [
    ("averaged", False), ("averaged", True),                                   # the mean, not the sum
    ("sum in x's dtype", False), ("sum in x's dtype", True),                   # exact bits: under the tolerance
    ("own rows first", False), ("own rows first", True),                       # a rank-dependent order
    ("no row loop", False), ("no row loop", True),                             # one row per program
    ("wrong flag index", False), ("one flag per rank", False),                 # the flags at other slots
    ("waits for its own flag", False),                                         # a wait no peer answers
    ("waits on the peers' pads", False), ("waits on the peers' pads", True),   # takes the flags it set itself
    ("residual added twice", True), ("residual not added", True),
    ("norm of the sum without the residual", True), ("mean over BLOCK_N", True), ("weight missing", True),
    ("no sqrt", True),                                                         # any other wrong scale per row
    ("eps outside the square root", True),                                     # shows on rows of mean square eps
    ("statistics in x's dtype", True),                                         # float16 squares of a loud row: inf
    ("own rows left out", False), ("own rows left out", True),                 # the peers' rows alone
    ("wait result ignored", False),                                            # waits, then reduces anyway
    ("no store mask", False),                                                  # lanes past n_cols stored
    ("row stride BLOCK_N", False), ("row stride BLOCK_N", True),               # rows a tile apart, not n_cols
    ("y and s swapped", True), ("x added instead of the residual", True),
    ("sum in float16", False), ("sum in float16", True),                       # 16 bits whatever x's dtype
])
def test_more_faults_are_named(fault, fused):
    words = {"averaged": "averaged instead of summed", "own rows first": "ranks summed in different orders",
             "no row loop": "rows past the grid never written", "one flag per rank": "wrong flag index",
             "waits for its own flag": "reduce never ran", "no sqrt": "the row's RMS is wrong",
             "wait result ignored": "no barrier", "no store mask": "wrote outside its buffer",
             "row stride BLOCK_N": "rows BLOCK_N apart", "sum in float16": "sum in 16 bits"}.get(fault, fault)
    check_fn = checks.check_all_reduce_add_rms_norm_kernel if fused else checks.check_all_reduce_kernel
    with pytest.raises(check.CheckFailure, match=words):
        check_fn(bound(fault, fused))


@pytest.mark.skipif(env.on_gpu(), reason="a GPU's wait cannot be stopped from the host: the check would hang")
@pytest.mark.parametrize("fused", [False, True], ids=["all-reduce", "fused"])
def test_a_wait_that_never_gives_up_is_stopped_and_named(fused, monkeypatch):
    from course_utils.faults import allreduce_probes
    monkeypatch.setattr(allreduce_probes, "WAIT_LIMIT_S", 1.0)
    check_fn = checks.check_all_reduce_add_rms_norm_kernel if fused else checks.check_all_reduce_kernel
    with pytest.raises(check.CheckFailure, match="rank 0's reduce half: it had not returned after 1 s: wait never "
                                                 "gives up: .*max_spins"):
        check_fn(bound("wait never gives up", fused))
    checks.check_all_reduce_kernel(bound("none"))   # the interpreter is left as it was: a right kernel passes


@pytest.mark.skipif(env.on_gpu(), reason="loads are recorded under the interpreter only")
@pytest.mark.parametrize("fault", ["reduce rows in chunks", "reduce rows WORLD apart"])
@pytest.mark.parametrize("fused", [False, True], ids=["all-reduce", "fused"])
def test_rows_reduced_without_their_flag_are_named(fault, fused):
    check_fn = checks.check_all_reduce_add_rms_norm_kernel if fused else checks.check_all_reduce_kernel
    with pytest.raises(check.CheckFailure, match=r"every peer's program 2 had not yet published: it loaded \d+ "
                                                 r"element\(s\) of the rows those programs publish \(2, 5, ...\): "
                                                 "rows split otherwise than published"):
        check_fn(bound(fault, fused))


def test_rows_world_apart_are_named_without_the_loads(monkeypatch):
    """A GPU records no loads: there 4 ranks' reduce stepping by WORLD over 3 programs leaves row 3 unwritten (of the
    first case's 5 rows on the CPU, 7 on a GPU), named so at the first case."""
    from course_utils.faults import allreduce_probes
    monkeypatch.setattr(allreduce_probes, "split_probe", lambda *a, **k: None)
    first_rows = checks._shapes()[0][0]
    with pytest.raises(check.CheckFailure, match=rf"4 ranks, {first_rows} rows .*rows WORLD apart"):
        checks.check_all_reduce_kernel(bound("reduce rows WORLD apart"))


def test_a_norm_of_the_unrounded_s_is_named():
    # float16: y of the float32 sum is within the tolerance, not within one rounding of the norm of the stored s
    with pytest.raises(check.CheckFailure, match=r"\(float16, .*rank \d's y: \d+ element\(s\) further from the "
                                                 "float64 norm of the s you stored .*norm of s before its rounding"):
        checks.check_all_reduce_add_rms_norm_kernel(bound("norm of s before its rounding", fused=True))


def test_a_kernel_that_ignores_the_buffer_halves_fails():
    with pytest.raises(check.CheckFailure, match="buf_offset"):
        checks.check_all_reduce_kernel(bound("no buffer half"))


def test_the_course_kernels_are_refused():
    for kernel, fn in ((K.one_shot_all_reduce_kernel, checks.check_all_reduce_kernel),
                       (K.all_reduce_add_rms_norm_kernel, checks.check_all_reduce_add_rms_norm_kernel)):
        with pytest.raises(check.CheckFailure, match="course's own"):
            fn(kernel)


def _uses_nccl(xs):
    dist.all_reduce(xs)


def _uses_symm_mem(x):
    return torch.ops.symm_mem.one_shot_all_reduce(x, "sum", "0")


def _uses_course_launcher(xs, ranks):
    return K.one_shot_all_reduce_teaching(xs, ranks)


@pytest.mark.parametrize("answer, words", [(_uses_nccl, "all_reduce"), (_uses_symm_mem, "symm_mem"),
                                           (_uses_course_launcher, "course")])
def test_library_and_course_all_reduces_are_refused(answer, words):
    with pytest.raises(check.CheckFailure, match=words):
        checks.check_all_reduce_kernel(answer)


def test_a_case_too_small_to_tell_faults_apart_names_each():
    """One column: every RMSNorm is +-w, so "norm of the sum without the residual" and "norm applied before the
    sum" give the same y; the checker names both (it used to name whichever it tried first)."""
    from course_utils.checkers import allreduce as ar_checker
    one = lambda v: torch.tensor([[v]], dtype=torch.float64)  # noqa: E731
    t = {"x": [one(1.0), one(2.0)], "r": one(0.5), "w": torch.tensor([1.5], dtype=torch.float64)}
    with pytest.raises(check.CheckFailure) as e:
        ar_checker._diagnose("1 x 1", t, one(1.5), None, None, 0, "y", torch.float32)
    assert "norm of the sum without the residual" in str(e.value) and "norm applied before the sum" in str(e.value)
    assert "cannot tell them apart" in str(e.value)
