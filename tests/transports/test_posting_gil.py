"""How much of a NIXL post holds the interpreter lock, measured on the installed NIXL
(UCX, host memory, two processes), and the profile fragment it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")

from pushkv.sim.profile import load_profile
from pushkv.transports.calibrate import (
    CalibrationError,
    _pair,
    held_share,
    measure_post,
    measure_post_gil,
    network_table,
    render,
)

pytestmark = pytest.mark.nixl


def test_the_post_lock_share_and_descriptor_cost_come_from_real_nixl_and_load(
        tmp_path: Path) -> None:
    n, each = 256, 4096
    with _pair(2 * n * each) as pair:
        post = measure_post(n, each, 1 << 20, 3, pair)
        gil = measure_post_gil(n, each, 3, window_s=0.02, pair=pair)
    for key in ("post_gil_fraction", "prepare_gil_fraction", "transfer_gil_fraction",
                "gil_control_sleep_fraction"):
        assert 0.0 <= gil[key] <= 1.0, (key, gil)
    assert gil["gil_control_held_raw"] > 0  # a call that keeps the lock is seen keeping it
    assert gil["gil_prepare_s"] > 0 and gil["gil_transfer_s"] > 0
    assert post["post_per_descriptor_s"] > 0
    table = network_table({**post, **gil})
    assert set(table) == {"post_per_descriptor_s", "post_fixed_s", "post_gil_fraction"}
    fragment = tmp_path / "posting.toml"
    fragment.write_text(render({"network": table}, ["measured by the test"]))
    profile = load_profile(fragment)
    assert profile.network.post_gil_fraction == pytest.approx(table["post_gil_fraction"],
                                                              rel=1e-3, abs=1e-12)
    assert profile.network.post_per_descriptor_s == pytest.approx(
        table["post_per_descriptor_s"], rel=1e-3)


def test_held_share_is_the_time_the_counter_lost_over_the_call() -> None:
    assert held_share(0.1, 0, 1000.0, 0.1) == pytest.approx(1.0)  # never counted
    assert held_share(0.1, 100, 1000.0, 0.1) == pytest.approx(0.0)  # counted throughout
    assert held_share(0.1, 50, 1000.0, 0.1) == pytest.approx(0.5)
    with pytest.raises(CalibrationError, match="never ran"):
        held_share(0.1, 0, 0.0, 0.1)
    with pytest.raises(CalibrationError, match="post_gil_fraction"):
        network_table({"post_per_descriptor_s": 1e-6, "post_fixed_s": 1e-5,
                       "post_gil_fraction": 1.5})
