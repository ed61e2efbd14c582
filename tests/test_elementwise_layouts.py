"""Issue 21 item 6: the GELU launchers of both shelves take non-contiguous inputs (transposed,
permuted, sliced, broadcast). The tuned ``gelu`` reads a layout dense in memory in place (the output
gets x's strides) and rows one stride apart with its row kernel; every other case, and every
teaching launcher, copies x once. Results against float64, outputs NaN-poisoned inside guards."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu
from course_utils import check
from course_utils.kernels import elementwise as ew
from course_utils.profile import count_launches
from course_utils.tuned import elementwise as tuned
from course_utils.tuned.elementwise_config import dense_in_memory, rows_of

DTYPES = cu.env.supported_dtypes()

# name -> (base shape, view of the base, how the tuned gelu reads it)
LAYOUTS = {
    "transposed": ((37, 13), lambda b: b.t(), "dense"),
    "permuted 3-D": ((5, 7, 33), lambda b: b.permute(2, 0, 1), "dense"),
    "sliced columns": ((13, 71), lambda b: b[:, 3:40], "rows"),
    "every other row": ((26, 40), lambda b: b[::2], "rows"),
    "broadcast row": ((1, 37), lambda b: b.expand(9, 37), "rows"),
    "every other column": ((13, 80), lambda b: b[:, ::2], "copy"),
    "transposed slice": ((40, 16), lambda b: b[:, :13].t(), "copy"),
}


def _input(name, dtype):
    shape, view, path = LAYOUTS[name]
    x = view(check.randn(shape, dtype, scale=3.0))
    assert not x.is_contiguous()
    return x, path


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_helpers_say_which_path(name):
    x, path = _input(name, torch.float32)
    assert dense_in_memory(x) == (path == "dense")
    assert (not dense_in_memory(x) and rows_of(x) is not None) == (path == "rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", LAYOUTS)
def test_tuned_gelu_any_layout_into_a_poisoned_output(name, dtype):
    x, path = _input(name, dtype)
    before = x.clone()
    strides = torch.empty_like(x, device="meta").stride() if path == "dense" else None
    g = check.Guarded((x.numel(),), dtype)
    out = g.tensor.as_strided(x.shape, strides) if strides else g.tensor.view(x.shape)
    for approximate in ("tanh", "none"):
        got = tuned.gelu(x, approximate, out=out)
        assert got is out
        g.check(f"gelu, {name}")
        check.compare(f"tuned gelu {approximate}, {name}, {dtype}", got, ew.gelu_ref(x.double(), approximate))
    assert torch.equal(x, before)
    fresh = tuned.gelu(x, "none")  # the last one written into out
    assert fresh.stride() == (x.stride() if path == "dense" else fresh.contiguous().stride())
    assert torch.equal(fresh, out)


@pytest.mark.parametrize("name", ["transposed", "sliced columns", "every other column"])
def test_tuned_gelu_copies_only_where_it_says(name):
    x, path = _input(name, torch.float32)
    counts = count_launches(tuned.gelu, x)
    kernel = {"dense": "gelu_tuned_kernel", "rows": "gelu_rows_kernel", "copy": "gelu_tuned_kernel"}[path]
    assert dict(counts.triton) == {kernel: 1}, counts
    assert dict(counts.torch) == ({"clone": 1} if path == "copy" else {}), counts  # the one copy, or none


def test_tuned_gelu_out_with_other_strides_is_refused():
    x, _ = _input("transposed", torch.float32)
    with pytest.raises(ValueError, match="strides"):
        tuned.gelu(x, out=torch.empty(x.shape, device=cu.DEVICE))
    with pytest.raises(ValueError, match="out must"):
        tuned.gelu(x, out=torch.empty(x.shape, device=cu.DEVICE, dtype=torch.float16).t().t())


@pytest.mark.parametrize("shelf", ["teaching", "tuned"])
@pytest.mark.parametrize("name", ["transposed", "sliced columns", "every other column"])
def test_every_gelu_launcher_takes_a_strided_x(shelf, name):
    s = "_teaching" if shelf == "teaching" else ""
    gelu, chain, drop = (getattr(ew if shelf == "teaching" else tuned, n + s)
                         for n in ("gelu", "bias_gelu_scale", "bias_gelu_dropout"))
    for dtype in DTYPES:
        x, _ = _input(name, dtype)
        b = check.randn((x.shape[-1],), dtype)
        check.compare(f"{shelf} gelu, {name}", gelu(x), ew.gelu_ref(x.double()))
        check.compare(f"{shelf} bias_gelu_scale, {name}", chain(x, b, 0.5),
                      ew.bias_gelu_scale_ref(x.double(), b.double(), 0.5))
        # the mask is drawn by the element's logical index: a strided x gets the contiguous x's mask
        assert torch.equal(drop(x, b, 0.3, 11), drop(x.contiguous(), b, 0.3, 11))
        check.compare(f"{shelf} bias_gelu_dropout, {name}", drop(x, b, 0.3, 11),
                      ew.bias_gelu_dropout_ref(x.double(), b.double(), 0.3, 11))


@pytest.mark.parametrize("shelf", ["teaching", "tuned"])
def test_add_still_refuses_a_strided_input_clearly(shelf):
    add = ew.add_teaching if shelf == "teaching" else tuned.add
    x = check.randn((4, 6)).t()
    with pytest.raises(ValueError, match="contiguous"):
        add(x, x)
