"""course_utils/traffic/links.py: per-rank bytes of the collectives, pinned by hand-worked values, and
the alpha-beta fit recovering a known model."""

import pytest

from course_utils import traffic
from course_utils.traffic import links

MIB = 2**20


def test_hand_worked_bytes_for_four_ranks():
    ring = links.all_reduce(16 * MIB, 4, "ring")
    assert ring.sent == ring.received == 24 * MIB and ring.steps == 6        # 2 * 3/4 * 16 MiB
    one = links.all_reduce(16 * MIB, 4, "one-shot")
    assert one.received == 48 * MIB and one.steps == 1                      # three peers' whole buffers
    two = links.all_reduce(16 * MIB, 4, "two-shot")
    assert two.received == 24 * MIB and two.steps == 2
    assert links.reduce_scatter(16 * MIB, 4).received == 12 * MIB == links.all_gather(16 * MIB, 4).sent
    assert links.reduce_scatter(16 * MIB, 4).steps == 3
    assert links.all_reduce(8, 1, "one-shot").received == 0 and links.all_reduce(8, 1, "ring").steps == 0


def test_one_shot_moves_w_over_2_times_the_ring():
    for w in (2, 4, 8):
        ratio = links.all_reduce(MIB, w, "one-shot").link_bytes / links.all_reduce(MIB, w, "ring").link_bytes
        assert ratio == pytest.approx(w / 2)


def test_fit_recovers_a_known_model_and_bus_bandwidth():
    truth = links.AlphaBeta(alpha_us=3.0, beta_gbs=150.0)
    points = [(n * MIB, truth.time_us(links.all_reduce(n * MIB, 4))) for n in (1, 4, 16, 64)]
    fit = links.fit_alpha_beta(points, 4)
    assert fit.alpha_us == pytest.approx(3.0) and fit.beta_gbs == pytest.approx(150.0)
    # bus bandwidth of a pure-bandwidth ring is the link bandwidth
    t = links.all_reduce(64 * MIB, 4).link_bytes / 150e9
    assert links.bus_bandwidth(64 * MIB, t, 4) == pytest.approx(150e9)


def test_one_shot_wins_small_ring_wins_large():
    model = links.AlphaBeta(alpha_us=5.0, beta_gbs=200.0)
    assert links.best_all_reduce(64 * 1024, 4, model)[0] == "one-shot"
    assert links.best_all_reduce(256 * MIB, 4, model)[0] in ("ring", "two-shot")


def test_epilogue_saving_and_bad_inputs():
    assert links.epilogue_saving_us(12 * MIB, 3000.0, 2.0) == pytest.approx(2 * 12 * MIB / 3e12 * 1e6 + 2.0)
    with pytest.raises(ValueError, match="unknown all-reduce"):
        links.all_reduce(1, 2, "tree")
    with pytest.raises(ValueError, match="world"):
        links.all_reduce(1, 0)
    with pytest.raises(ValueError, match="two different"):
        links.fit_alpha_beta([(MIB, 1.0), (MIB, 2.0)], 2)
    assert traffic.links is links
