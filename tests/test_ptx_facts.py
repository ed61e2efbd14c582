"""The loop forms of results/ptx/pipelining_ptx.csv compute the same softmax, and the CSV says what
chapters 6 and 7 print about Triton's software pipeliner (sm_90 PTX, compiled without a GPU)."""

import pandas as pd
import pytest
import torch

import course_utils as cu
from course_utils import ptx_facts
from course_utils.bench import RESULTS


@pytest.mark.parametrize("loop", sorted(ptx_facts.LOOP_FORMS))
def test_each_loop_form_is_a_row_softmax(loop):
    x = torch.randn(3, 301, device=cu.DEVICE) * 4
    x[1, :150] = float("-inf")  # more than a tile of -inf first
    y = ptx_facts.long_row_forms(x, loop, block_size=64)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), dim=-1), rtol=1e-5, atol=1e-6)


def test_bad_loop_form_is_refused():
    with pytest.raises(ValueError, match="loop must be one of"):
        ptx_facts.long_row_forms(torch.zeros(2, 8), 7)


def test_recorded_counts_say_what_the_chapters_say():
    df = pd.read_csv(RESULTS / "ptx" / "pipelining_ptx.csv")
    assert set(df.columns) >= {"arch", "what", "launch_num_stages", "cp_async", "triton", "date"}
    ex = df[df.what.str.startswith("exercise 6.2")].set_index("what").cp_async
    forms = {what: ex[f"exercise 6.2, {what}"] for what in ptx_facts.LOOP_FORMS.values()}
    assert forms[ptx_facts.LOOP_FORMS[0]] == 0 and forms[ptx_facts.LOOP_FORMS[2]] == 0
    assert forms[ptx_facts.LOOP_FORMS[1]] > 0
    att = df[df.kernel == "attn_fwd_kernel"]
    assert (att[att.launch_num_stages == 3].cp_async > 0).all()
    assert (att[att.launch_num_stages == 1].cp_async == 0).all()
