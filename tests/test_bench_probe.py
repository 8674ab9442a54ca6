"""The MLP probe's boundary anatomy (warploop/bench/runtime_mlp_probe.py), on synthetic stamps."""
import numpy as np

from warploop.bench.runtime_mlp_probe import TILES, boundaries


def test_boundary_anatomy_from_stamps():
    """Two GEMVs of 256 tiles: tiles end at 10 us except worker 5's at 12 us; the next GEMV's tiles
    wake at 13 us and end at 20 us (worker 5's at 22 us). Tail 2 us, detection 1 us after the last
    end, body 7 us; workers alternate over 128 SMs, two per SM."""
    n = int(TILES.value)
    st = np.zeros((2, n, 4), dtype=np.int64)
    st[0, :, 0], st[0, :, 1], st[0, :, 2] = 0, 3_000, 10_000
    st[0, 5, 2] = 12_000
    st[1, :, 0], st[1, :, 1], st[1, :, 2] = 10_500, 13_000, 20_000
    st[1, 5, 2] = 22_000
    st[:, :, 3] = np.arange(n) % 128
    b = boundaries(st, 2)
    assert b["tail_us"] == 2.0 and b["detect_us"] == 1.0 and b["first_wakeup_us"] == 1.0
    assert b["body_us_median"] == 7.0 and b["between_tiles_us"] == 0.5
    assert b["sms_used"] == 128 and b["sms_by_workers"] == {"2": 128}
    assert b["slowest_worker"] == 5 and b["span_us"] == 22.0
