"""The L2 prefetch words of the decode graph's row-tile GEMVs (warploop/llm/mk/prefetch.py): what the
host encodes, and which weights each stage's last round names (no GPU needed)."""
import pytest
from mk_helpers import LLAMA_GQA, QWEN3_LIKE, addressed_graph

from warploop.llm.mk.hazards import hazards
from warploop.llm.mk.prefetch import decode, encode, runs, stage_words

GEMVS = ("qkv", "o_proj", "gate_up", "down", "lm_head")


def test_words_round_trip_and_refuse_what_does_not_fit():
    w = encode(0x7F00_0000_1000, 65536, True)
    assert decode(w) == (0x7F00_0000_1000, 65536, True)
    assert decode(encode(4096, 100)) == (4096, 256, False)            # whole 256-byte units
    assert decode(encode(4096, 64 << 20))[1] == (1 << 14) * 256 - 256     # capped at the field (a hint)
    assert encode(0, 4096) == encode(4096, 0) == encode(1 << 48, 4096) == 0
    assert w > 0                                                      # bit 63 stays clear


def test_runs_group_contiguous_tiles():
    fps = [(1000, 100, False), (1100, 100, False), (5000, 100, False), (5100, 50, True), (5150, 50, True)]
    assert runs(fps) == [[0, 1], [2], [3, 4]]
    assert runs([]) == []


def test_stage_words_cover_what_follows_from_the_last_round():
    """The last round (workers) of a prefetching stage names the first `ahead` bytes after it, as
    contiguous ranges split over its nodes; other stages and earlier nodes ask for nothing."""
    a = [(100 << 20 | i << 12, 4096, False) for i in range(5)]
    b = [(200 << 20 | i << 12, 4096, False) for i in range(4)]          # one contiguous run of 16 KB
    c = [(300 << 20 | i << 11, 2048, True) for i in range(4)]           # gate_up-like: two ranges each
    words = stage_words([a, b, c], 16384 + 4096, [True, True, False], workers=3)
    assert words[0][:2] == [0, 0] and words[2] == [0, 0, 0, 0]
    got = [decode(w) for w in words[0][2:] if w]
    assert sum(n * (2 if two else 1) for _, n, two in got) == 16384 + 4096     # b, then c's first node
    assert any(addr == 300 << 20 and two for addr, _, two in got)
    covered = sorted((addr, addr + n) for addr, n, two in got if not two)
    assert covered[0][0] == 200 << 20 and covered[-1][1] == (200 << 20) + 16384
    assert all(hi == lo2 for (_, hi), (lo2, _) in zip(covered, covered[1:]))  # no gap, no overlap
    c_asked = sorted(decode(w) for w in words[1] if w)                       # b's last round: all of c,
    assert len(c_asked) == 3 and all(two for _, _, two in c_asked)            # over its three nodes
    assert c_asked[0][0] == 300 << 20 and sum(n for _, n, _ in c_asked) == 8192
    assert stage_words([a, b], 0, [True, True], 3) == [[0] * 5, [0] * 4]


@pytest.mark.parametrize("cfg", [LLAMA_GQA, QWEN3_LIKE], ids=["llama_gqa", "qwen3_like"])
@pytest.mark.parametrize("batch", [1, 3])
def test_graph_words_cover_the_weights_after_each_qkv_stage(cfg, batch):
    """Only qkv tiles carry words (l2_stages' default), and in each layer they name the o_proj tiles'
    weights that follow, whole; the hazard check still holds (the `kp` slot is not a width)."""
    dg, plan = addressed_graph(cfg, "cuda", batch, 4, tile_kb=4, build={"l2_ahead": 1 << 20})
    words = {}
    for node, kind in zip(dg.graph.nodes, dg.labels, strict=True):
        if kind in GEMVS:
            words.setdefault(kind, []).append(dict(zip([s.name for s in node.task.args], node.args, strict=True)))
    assert all(a["kp"] == 0 for kind in ("o_proj", "gate_up", "down", "lm_head") for a in words[kind])
    asked = [decode(a["kp"]) for a in words["qkv"] if a["kp"]]
    assert asked
    width = plan.heads * plan.head_dim * plan.elem
    for a in words["o_proj"]:     # each o_proj tile's rows lie inside some asked range
        lo = a["w"] + a["row0"] * width
        hi = lo + (min(a["row0"] + a["count"], a["n_out"]) - a["row0"]) * width
        assert any(addr <= lo and hi <= addr + n for addr, n, _ in asked), a["row0"]
    found = hazards(dg, plan)
    assert not found, "\n".join(h.describe(dg.labels) for h in found[:10])


def test_without_prefetch_the_slot_is_zero_on_a_gpu_plan_and_the_width_on_the_cpu_plan():
    dg, plan = addressed_graph(LLAMA_GQA, "cuda", 1, 4, tile_kb=4)
    gemv = [n for n, kind in zip(dg.graph.nodes, dg.labels, strict=True) if kind in GEMVS]
    assert {dict(zip([s.name for s in n.task.args], n.args, strict=True))["kp"] for n in gemv} == {0}
    dg, plan = addressed_graph(LLAMA_GQA, "cpu", 1, 4, build={"l2_ahead": 8 << 10})
    qkv = [n for n, kind in zip(dg.graph.nodes, dg.labels, strict=True) if kind == "qkv"]
    names = [spec.name for spec in qkv[0].task.args]
    assert {n.args[names.index("kp")] for n in qkv} == {LLAMA_GQA.hidden_size}   # no tiles: a width, not a word
