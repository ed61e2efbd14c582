"""The chapter 13 widget, driven headlessly: set a control, read the numbers it displays."""

import pytest

pytest.importorskip("ipywidgets")

from course_utils import hardware  # noqa: E402
from course_utils import traffic as T  # noqa: E402
from course_utils.traffic import links  # noqa: E402
from course_utils.widgets import links as W  # noqa: E402


def test_times_follow_the_model_and_the_winner_changes_with_size():
    w = W.AllReduceChooser(log2_kib=0, world=4, bandwidth_gbs=300, latency_us=5)
    s = w.state()
    model = links.AlphaBeta(5.0, 300.0)
    for a in links.ALL_REDUCES:
        assert s["times_us"][a] == pytest.approx(model.time_us(links.all_reduce(1024, 4, a)))
        assert f"{s['times_us'][a]:,.1f} us" in w.output.value
    assert s["best"] == "one-shot" and "<b>one-shot</b> wins" in w.output.value
    w.controls["log2_kib"].value = 20          # 1 GiB: bandwidth decides, one-shot moves W/2 times the bytes
    assert w.state()["best"] != "one-shot" and "1024 MiB" in w.output.value


def test_epilogue_saving_uses_the_gpus_hbm_and_the_recorded_launch():
    w = W.AllReduceChooser(log2_kib=14)
    w.controls["gpu"].value = "a100-80gb"
    s = w.state()
    want = 2 * 16 * 2**20 / (hardware.lookup("a100-80gb").hbm_gbps * 1e3) + T.LAUNCH_OVERHEAD_US
    assert s["epilogue_saving_us"] == pytest.approx(want)
    assert f"saves {want:,.1f} us" in w.output.value


def test_values_out_of_range_are_clamped():
    w = W.AllReduceChooser()
    w.update(world=100, latency_us=-4, gpu="GeForce 256")
    assert (w.controls["world"].value, w.controls["latency_us"].value, w.controls["gpu"].value) == (8, 1, "h100-sxm")
    with pytest.raises(ValueError, match="control"):
        w.update(colour="red")
