"""The folder of placed programs (runtime/stream/builds.py, StreamProgram.build's cache)."""
import numpy as np
import pytest
from test_stream_program import layer_chain

from warploop.runtime.stream import builds


def test_a_build_cache_gives_the_same_arrays_without_placing_again(tmp_path, monkeypatch):
    """StreamProgram.build(cache=): the second build of a program reads the first's arrays (no
    placement, no check when the first was checked); another program, or the same on other CTAs,
    is another file; a file that cannot be read is built again and replaced; a folder that cannot
    be written costs only the cache."""
    p = layer_chain(context=37, splits=3).program
    want = p.build(ctas=8)
    first = p.build(ctas=8, cache=tmp_path)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 1 and first.schedule is not None

    def same(b):
        return (np.array_equal(b.words, want.words) and np.array_equal(b.table, want.table)
                and b.counters == want.counters and b.counter_sizes == want.counter_sizes)

    checks = []
    monkeypatch.setattr(builds, "place", lambda *a, **k: pytest.fail("a cached build placed again"))
    monkeypatch.setattr(builds, "check_hazards", checks.append)
    hit = p.build(ctas=8, cache=tmp_path)
    assert same(hit) and hit.schedule is None and hit.instruction_count == len(want.instructions)
    assert checks == []                                        # checked when it was written
    monkeypatch.undo()
    other = layer_chain(context=37, splits=2).program
    other.build(ctas=8, cache=tmp_path)
    p.build(ctas=6, cache=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3
    files[0].write_bytes(b"not a build")                       # a torn or foreign file
    assert same(p.build(ctas=8, cache=tmp_path)) and same(p.build(ctas=8, cache=tmp_path))
    unchecked = layer_chain(context=5, splits=1).program
    unchecked.build(ctas=8, check=False, cache=tmp_path)
    checks = []
    monkeypatch.setattr(builds, "check_hazards", checks.append)
    unchecked.build(ctas=8, cache=tmp_path)
    assert checks == [unchecked]                                # a hit written unchecked is checked once
    monkeypatch.undo()
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert same(p.build(ctas=8, cache=blocker / "builds"))
