"""scripts/stream_step_time.py's stage timeline from a traced launch's stamps (kinds.TRACE_STAMPS), on
a made-up launch: two CTAs, a stage of two tiles on one CTA (a merged run: the first signals
nothing), then a stage on both."""
import importlib.util
import sys
import types

import numpy as np
import pytest
from server_helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("stream_step_time", ROOT / "scripts" / "stream_step_time.py")
sst = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sst)


def inst(kind, signal, **fields):
    return types.SimpleNamespace(kind=types.SimpleNamespace(name=kind), signal=signal, fields=fields)


def test_timeline_groups_each_counters_instructions_and_times_stages_end_to_end():
    # CTA 0: gemv tile (run member, no signal), gemv tile (signals 0), cast (signals 1)
    # CTA 1: gemv tile (signals 0), cast (signals 1)
    insts = [inst("gemv", -1, k=64), inst("gemv", 0, k=64), inst("cast", 1), inst("gemv", 0, k=64), inst("cast", 1)]
    table = np.array([0, 3, 3, 2])
    assert sst.stage_of(table, insts) == [0, 0, 1, 0, 1]
    us = 1000                                  # stamps in ns: start, met, first chunk, published, ...
    stamps = np.array([[1, 2, 3, 5, 0, 0, 0], [5, 5, 6, 9, 0, 0, 0], [9, 12, 12, 14, 0, 0, 0],
                       [1, 2, 3, 8, 0, 0, 0], [8, 11, 11, 15, 0, 0, 0]], dtype=np.int64) * us
    out = sst.timeline(stamps, table, insts)
    assert out["span_us"] == 14.0              # from the first start (1) to the last publish (15)
    gemv, cast = out["stages"]["gemv/k64 x3"], out["stages"]["cast x2"]
    assert (gemv["n"], gemv["median_us"], gemv["median_met_us"]) == (1, 8.0, 1.0)   # ends at 9, met at 2
    assert (cast["n"], cast["median_us"], cast["median_met_us"]) == (1, 6.0, 2.0)   # 9 -> 15, met at 11
    assert list(out["stages"]) == ["gemv/k64 x3", "cast x2"]                        # the longest first


def test_timeline_leaves_out_instructions_that_did_not_run():
    insts = [inst("embed", 0), inst("sample", 1)]
    stamps = np.array([[2, 2, 2, 4, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]], dtype=np.int64) * 1000
    out = sst.timeline(stamps, np.array([0, 2]), insts)
    assert list(out["stages"]) == ["embed x1"] and out["span_us"] == pytest.approx(2.0)
