"""The streaming executor's program on the CPU: node kinds as data, the hazard check, placement into
instruction words, and the CPU reference against plain PyTorch (a Llama-shaped layer chain)."""
import pytest
import torch

from warploop.runtime.stream.compiled import StreamConfig
from warploop.runtime.stream.kinds import BY_NAME, GEMV, HEADER, NOP, WORDS, Field, Instruction, NodeKind
from warploop.runtime.stream.program import HazardError, StreamProgram, interleave_gate_up
from warploop.runtime.stream.reference import first_difference, reference

CFG = StreamConfig(block_rows=16, block_k=64, ring=4, kmax=256)


def test_instruction_round_trips_every_field_by_name():
    fields = dict(pool=2, row=96, rows=13, k=2048, x=64, out=4096, norm=-1, bias=128, epi=1, eps=1e-5)
    inst = Instruction(GEMV, waits=((3, 64), (7, 1)), signal=5, fields=fields)
    words = inst.serialize()
    assert len(words) == WORDS and words[0] == GEMV.opcode and words[GEMV.word("k")] == 2048
    back = Instruction.parse(words)
    assert back.kind is GEMV and back.waits == ((3, 64), (7, 1)) and back.signal == 5
    assert back.fields == dict(fields, eps=pytest.approx(1e-5))
    assert Instruction.parse(Instruction(NOP, ((1, 2),)).serialize()) == Instruction(NOP, ((1, 2),), -1, {})
    assert BY_NAME["gemv"] is GEMV and GEMV.word("pool") == len(HEADER)


def test_kind_declarations_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="exceed"):
        NodeKind("big", 9, tuple(Field(f"f{i}") for i in range(WORDS)))
    with pytest.raises(ValueError, match="unknown fields"):
        from warploop.runtime.stream.kinds import Streamed
        NodeKind("s", 9, (Field("a"),), streamed=Streamed("a", "b", "c"))
    with pytest.raises(TypeError, match="missing fields"):
        GEMV.encode(dict(pool=0))
    with pytest.raises(ValueError, match="int32"):
        Instruction(GEMV, fields=dict(pool=0, row=2 ** 31, rows=1, k=8, x=0, out=0, norm=-1, bias=-1, epi=0,
                                      eps=0.0)).serialize()
    with pytest.raises(ValueError, match="opcode"):
        Instruction.parse([99] + [0] * (WORDS - 1))


def layer_chain(cfg=CFG, layers=2, hidden=64, q=64, kv=32, inter=96, vocab=80, seed=0):
    """A Llama-shaped chain: per layer qkv (norm) -> o_proj (+= res) -> gate_up (norm, silu*up) ->
    down (+= res), then lm_head (norm). Returns the program, its matrices and the regions."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(torch.bfloat16)
    p = StreamProgram(cfg)
    wh = [(rnd(q + 2 * kv, hidden), rnd(inter, hidden), rnd(inter, hidden)) for _ in range(layers)]
    wo = [rnd(hidden, q) for _ in range(layers)]
    wd = [rnd(hidden, inter) for _ in range(layers)]
    head = rnd(vocab, hidden)
    # one pool per width: every matrix's first row in its pool
    by_width, rows = {}, {}
    def put(key, m):
        lst = by_width.setdefault(m.shape[1], [])
        rows[key] = (m.shape[1], sum(t.shape[0] for t in lst))
        lst.append(m)
    for i, (wqkv, gate, up) in enumerate(wh):
        put(("qkv", i), wqkv)
        put(("gu", i), interleave_gate_up(gate, up, cfg.block_rows))
        put(("o", i), wo[i])
        put(("down", i), wd[i])
    put("head", head)
    pool = {k: p.pool(torch.cat(lst)) for k, lst in by_width.items()}
    at = lambda key: (pool[rows[key][0]], rows[key][1])
    res = p.buffer("res", hidden, init=torch.randn(hidden, generator=g))
    norms = [p.buffer(f"n{i}", hidden, init=1 + 0.1 * torch.randn(hidden, generator=g)) for i in range(2 * layers + 1)]
    qkv, act = p.buffer("qkv", q + 2 * kv), p.buffer("act", inter)
    logits = p.buffer("logits", vocab)
    prev = []
    for i in range(layers):
        a = p.gemv(*at(("qkv", i)), q + 2 * kv, res, qkv, norm=norms[2 * i], eps=1e-5, after=prev)
        b = p.gemv(*at(("o", i)), hidden, qkv, res, epi="add", after=a)
        c = p.gemv(*at(("gu", i)), inter, res, act, norm=norms[2 * i + 1], eps=1e-5, epi="silu_mul", after=b)
        prev = p.gemv(*at(("down", i)), hidden, act, res, epi="add", after=c)
    p.gemv(*at("head"), vocab, res, logits, norm=norms[-1], eps=1e-5, after=prev)
    return p, dict(wh=wh, wo=wo, wd=wd, head=head), dict(res=res, logits=logits, norms=norms, qkv=qkv, q=q)


def torch_chain(p, w, r):
    """The same chain in plain PyTorch (fp32 activations, bf16 weights upcast)."""
    arena = p.arena()
    get = lambda reg: arena[reg.offset:reg.offset + reg.size]
    res = get(r["res"]).clone()
    norm = lambda x, n: x * torch.rsqrt(x.pow(2).mean() + 1e-5) * get(n)
    for i, (wqkv, gate, up) in enumerate(w["wh"]):
        qkv = wqkv.float() @ norm(res, r["norms"][2 * i])
        res = res + w["wo"][i].float() @ qkv[:w["wo"][i].shape[1]]
        h = norm(res, r["norms"][2 * i + 1])
        res = res + w["wd"][i].float() @ (torch.nn.functional.silu(gate.float() @ h) * (up.float() @ h))
    return res, w["head"].float() @ norm(res, r["norms"][-1])


@pytest.mark.parametrize("shape", [dict(), dict(hidden=64, q=128, kv=16, inter=80, vocab=50)],
                         ids=["llama_like", "qwen3_like_q_wider"])
def test_reference_equals_plain_torch(shape):
    p, w, r = layer_chain(**shape)
    got = reference(p)
    res, logits = torch_chain(p, w, r)
    lo, ro = r["logits"], r["res"]
    torch.testing.assert_close(got[ro.offset:ro.offset + ro.size], res, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[lo.offset:lo.offset + lo.size], logits, rtol=1e-4, atol=1e-4)
    assert first_difference(p, got, got) is None
    bad = got.clone()
    bad[lo.offset + 3] += 1.0
    assert "node" in first_difference(p, bad, got)


def test_build_places_every_node_and_counts_waits():
    p, _, _ = layer_chain()
    built = p.build(ctas=8)
    placed = sorted(i.node for lst in built.schedule.lists for i in lst if i.node >= 0)
    assert placed == list(range(len(p.nodes)))
    assert built.words.size == len(built.instructions) * WORDS
    assert int(built.table[1::2].sum()) == len(built.instructions)
    # a node's waits need every signaller of its counter: the counts add up to the signals
    signals = [0] * built.counters
    for inst in built.instructions:
        if inst.signal >= 0:
            signals[inst.signal] += 1
    assert tuple(signals) == built.schedule.counter_sizes


def test_hazard_check_finds_a_missing_edge():
    p, _, r = layer_chain(layers=1)
    p.build(ctas=4)
    # a second lm_head that writes the residual stream while nothing orders it after the first layer
    q = StreamProgram(CFG)
    q.pools, q.regions, q.arena_size, q.inits = p.pools, p.regions, p.arena_size, p.inits
    q.nodes = list(p.nodes)
    q.gemv(0, 0, 16, r["qkv"], r["res"], epi="add")
    with pytest.raises(HazardError, match="neither depends on the other"):
        q.build(ctas=4)


@pytest.mark.parametrize("call, message", [
    (lambda p: p.gemv(5, 0, 16, p.regions["x"], p.regions["y"]), "pool 5 does not exist"),
    (lambda p: p.gemv(0, 40, 16, p.regions["x"], p.regions["y"]), "do not fit pool 0"),
    (lambda p: p.gemv(0, 0, 16, p.regions["y"], p.regions["y"]), "must hold the pool's width"),
    (lambda p: p.gemv(0, 0, 16, p.regions["x"], p.regions["x"], epi="gelu"), "epi must be one of"),
    (lambda p: p.gemv(0, 0, 16, p.regions["x"], p.regions["y"], after=[3]), "recorded earlier"),
    (lambda p: p.pool(torch.zeros(4, 12, dtype=torch.bfloat16)), "multiple of 8"),
    (lambda p: p.pool(torch.zeros(4, 512, dtype=torch.bfloat16)), "exceeds StreamConfig.kmax"),
    (lambda p: p.pool(torch.zeros(4, 16)), "bfloat16"),
    (lambda p: p.buffer("x", 4), "declared twice"),
])
def test_program_refuses_bad_input_naming_it(call, message):
    p = StreamProgram(CFG)
    p.pool(torch.zeros(48, 64, dtype=torch.bfloat16))
    p.buffer("x", 64)
    p.buffer("y", 16)
    with pytest.raises(ValueError, match=message):
        call(p)


@pytest.mark.parametrize("kw, message", [(dict(block_k=512), "block_k"), (dict(block_rows=8), "block_rows"),
                                         (dict(ring=1), "ring"), (dict(kmax=3000), "kmax"),
                                         (dict(ring=32, block_rows=64), "shared memory")])
def test_config_refuses_bad_shapes(kw, message):
    with pytest.raises(ValueError, match=message):
        StreamConfig(**kw)
