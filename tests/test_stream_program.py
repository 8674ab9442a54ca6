"""The streaming executor's program on the CPU: node kinds as data, the hazard check, placement into
instruction words, and the CPU reference against plain PyTorch (a Llama-shaped layer chain)."""
import dataclasses

import pytest
import torch

from warploop.bench import stream_chain
from warploop.llm.config import ModelConfig
from warploop.runtime.stream.compiled import StreamConfig
from warploop.runtime.stream.hazards import HazardError
from warploop.runtime.stream.kinds import BY_NAME, GEMV, HEADER, NOP, WORDS, Field, Instruction, NodeKind
from warploop.runtime.stream.program import StreamProgram
from warploop.runtime.stream.reference import first_difference, reference

CFG = StreamConfig(block_rows=16, block_k=64, ring=4, kmax=256)


def test_instruction_round_trips_every_field_by_name():
    fields = dict(pool=2, row=96, rows=13, k=2048, x=64, out=4096, norm=-1, bias=128, epi=1, eps=1e-5, narrow=1,
                  amax=-1, row2=96, batch=4, ostride=3072, astride=-1, samp=-1, xbf=1, obf=0, col=128, xk=4096, tall=1)
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
        NodeKind("s", 9, (Field("a"),), streamed=Streamed("a", "b", "c", "d", "e"))
    with pytest.raises(TypeError, match="missing fields"):
        GEMV.encode(dict(pool=0))
    with pytest.raises(ValueError, match="int32"):
        Instruction(GEMV, fields=dict(pool=0, row=2 ** 31, rows=1, k=8, x=0, out=0, norm=-1, bias=-1, epi=0,
                                      eps=0.0, narrow=0, amax=-1, row2=0, batch=1, ostride=1,
                                      astride=0, samp=-1, xbf=0, obf=0, col=0, xk=64, tall=0)).serialize()
    with pytest.raises(ValueError, match="opcode"):
        Instruction.parse([99] + [0] * (WORDS - 1))


def small(**kw):
    base = dict(family="llama", vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16)
    return ModelConfig(**(base | kw))


SHAPES = {"llama_gqa": small(), "qwen2_bias": small(family="qwen2", qkv_bias=True, intermediate_size=80),
          "qwen3_q_wider": small(family="qwen3", num_heads=8, num_kv_heads=1, head_dim=16, o_bias=True, vocab_size=50)}


def attention(chain, arena, x, i, model):
    """Plain GQA attention for layer i's qkv row x: q/k norm, RoPE, the new k and v (rounded to the
    cache's bf16) after the cached context, softmax over all of it."""
    hd, h, kvh = model.head_dim, model.num_heads, model.num_kv_heads
    get = lambda name: chain.view(arena, name)
    ints = chain.program.int_arena()
    r = chain.regions["step"]
    pos, n_ctx, _ = ints[r.offset:r.offset + 3].tolist()
    table = ints[r.offset + 3:r.offset + r.size].long()
    c = get("cos").view(-1, hd // 2)[pos]
    s = get("sin").view(-1, hd // 2)[pos]
    heads = x.view(h + 2 * kvh, hd)
    q, k, v = heads[:h], heads[h:h + kvh], heads[h + kvh:]
    if f"qn{i}" in chain.regions:
        rms = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + chain.dims["eps"]) * w
        q, k = rms(q, get(f"qn{i}")), rms(k, get(f"kn{i}"))
    rot = lambda t: torch.cat([t[:, :hd // 2] * c - t[:, hd // 2:] * s, t[:, hd // 2:] * c + t[:, :hd // 2] * s], -1)
    q, k = rot(q), rot(k).to(torch.bfloat16).float()
    cache = chain.program.kv[i].float()                      # [2, blocks, bs, kvh, hd]
    bs = cache.shape[2]
    toks = torch.arange(n_ctx - 1)
    keys = torch.cat([cache[0, table[toks // bs], toks % bs], k[None]])       # [n_ctx, kvh, hd]
    vals = torch.cat([cache[1, table[toks // bs], toks % bs], v.to(torch.bfloat16).float()[None]])
    g = h // kvh
    out = [torch.softmax(q[j] @ keys[:, j // g].T * hd ** -0.5, -1) @ vals[:, j // g] for j in range(h)]
    return torch.cat(out)


def torch_chain(chain, arena, model=None):
    """The chain in plain PyTorch: fp32 activations, bf16 weights upcast."""
    get = lambda name: chain.view(arena, name)
    d = chain.dims
    res = get("res").clone()
    norm = lambda x, n: x * torch.rsqrt(x.pow(2).mean() + d["eps"]) * get(n)
    bias = lambda name: get(name) if name in chain.regions else 0.0
    for i in range(d["layers"]):
        qkv = chain.mats[f"qkv{i}"].float() @ norm(res, f"n{2 * i}") + bias(f"bqkv{i}")
        x_o = attention(chain, arena, qkv, i, model) if d["context"] else qkv[:d["q"]]
        res = res + chain.mats[f"o{i}"].float() @ x_o + bias(f"bo{i}")
        gate, up = (chain.mats[f"gu{i}"].float() @ norm(res, f"n{2 * i + 1}")).chunk(2)
        act = torch.nn.functional.silu(gate) * up
        res = res + chain.mats[f"down{i}"].float() @ act
    return res, chain.mats["head"].float() @ norm(res, f"n{2 * d['layers']}")


def layer_chain(model=None, context=0, splits=1):
    cfg = CFG if not context else dataclasses.replace(CFG, head_dim=(model or SHAPES["llama_gqa"]).head_dim,
                                                      attn_group=8, attn_tile=16)
    return stream_chain.layer_chain(model or SHAPES["llama_gqa"], cfg, context=context, block_size=4, splits=splits)


@pytest.mark.parametrize("name", SHAPES)
def test_reference_equals_plain_torch(name):
    chain = layer_chain(SHAPES[name])
    p = chain.program
    got = reference(p)
    res, logits = torch_chain(chain, p.arena())
    torch.testing.assert_close(chain.view(got, "res"), res, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chain.view(got, "logits"), logits, rtol=1e-4, atol=1e-4)
    assert first_difference(p, got, got) is None
    bad = got.clone()
    bad[chain.regions["logits"].offset + 3] += 1.0
    assert "node" in first_difference(p, bad, got)
    bad[chain.regions["logits"].offset + 3] = float("nan")
    assert "node" in first_difference(p, bad, got)
    # the PyTorch peer the bench times computes the same step in bf16 activations
    peer = chain.peer()(chain.view(p.arena(), "res").to(torch.bfloat16)).float()
    assert ((peer - logits).abs().max() / logits.abs().max()).item() < 3e-2


@pytest.mark.parametrize("context, splits", [(1, 1), (5, 1), (37, 1), (37, 3), (5, 4), (100, 2)])
@pytest.mark.parametrize("name", SHAPES)
def test_reference_attention_equals_plain_torch(name, context, splits):
    """With attention (ATTN nodes over a paged cache with a shuffled block table), the reference's
    step equals plain GQA attention, and it leaves the new k and v in the cache at the slot."""
    chain = layer_chain(SHAPES[name], context, splits)
    p = chain.program
    kv = p.kv.clone()
    got = reference(p, kv=kv)
    res, logits = torch_chain(chain, p.arena(), SHAPES[name])
    torch.testing.assert_close(chain.view(got, "logits"), logits, rtol=2e-4, atol=2e-4)
    r = chain.regions["step"]
    slot = int(p.int_arena()[r.offset + 2])
    bs = kv.shape[3]
    assert first_difference(p, got, got) is None              # an empty split's -inf equals itself
    changed = (kv != p.kv).flatten(4).any(-1)                 # [layers, 2, blocks, bs]
    assert changed.nonzero()[:, 2:].unique(dim=0).tolist() == [[slot // bs, slot % bs]]


def test_shares_past_the_context_write_nothing_and_the_merge_skips_them():
    """5 tokens over 4 shares: one share holds them (shares are whole ring chunks), the other three
    leave their partials as they found them (poisoned here), and the logits are plain attention's."""
    name = "llama_gqa"
    chain = layer_chain(SHAPES[name], 5, 4)
    p = chain.program
    start = p.arena()
    chain.view(start, "part").fill_(float("nan"))
    got = reference(p, start.clone(), kv=p.kv.clone())
    _, logits = torch_chain(chain, p.arena(), SHAPES[name])
    torch.testing.assert_close(chain.view(got, "logits"), logits, rtol=2e-4, atol=2e-4)
    part = chain.view(got, "part").view(SHAPES[name].num_kv_heads, 4, -1)
    assert part[:, 0].isfinite().all() and part[:, 1:].isnan().all()
    assert first_difference(p, got, got) is not None            # NaN is no value: it never agrees
    assert first_difference(p, got, got, start=start) is None   # unless neither run wrote it


def test_attention_shares_take_tickets_of_their_own_kv_head():
    """Each KV head's shares share a merge ticket: a counter after the program's others, taken as
    many times a run as there are shares; one share alone takes none."""
    from warploop.runtime.stream.kinds import ATTN
    model = SHAPES["llama_gqa"]
    for splits in (3, 1):
        built = layer_chain(model, 37, splits).program.build(8)
        attn = [i for i in built.instructions if i.kind is ATTN]
        tickets = sorted({i.fields["ticket"] for i in attn})
        if splits == 1:
            assert tickets == [-1]
            continue
        heads = model.num_kv_heads * model.num_layers
        assert len(tickets) == heads and tickets[0] == built.counters - heads
        assert built.counter_sizes[-heads:] == (splits,) * heads
        assert all(sum(i.fields["ticket"] == t for i in attn) == splits for t in tickets)


@pytest.mark.parametrize("epi", ["store", "add"])
def test_narrow_tiles_halve_the_rows_and_compute_the_same(epi):
    """A narrow GEMV's tiles are BR/2 pool rows (twice as many tiles, each chunk two column blocks),
    and the reference computes W @ x either way, past a width that is not a multiple of two chunks."""
    g = torch.Generator().manual_seed(3)
    k = 3 * CFG.block_k                             # an odd number of chunks: the last pair half zeros
    w = torch.randn(40, k, generator=g).to(torch.bfloat16)
    x0 = torch.randn(k, generator=g)
    outs = {}
    for narrow in (False, True):
        p = StreamProgram(CFG)
        pool = p.pool(w)
        x, y = p.buffer("x", k, init=x0), p.buffer("y", 40, init=torch.ones(40))
        tiles = p.gemv(pool, 0, 40, x, y, epi=epi, narrow=narrow)
        assert len(tiles) == (5 if narrow else 3)         # BR = 16
        assert all(p.nodes[t].fields["rows"] <= (CFG.block_rows // 2 if narrow else CFG.block_rows) for t in tiles)
        outs[narrow] = reference(p)[y.offset:y.offset + 40]
    want = w.float() @ x0 + (1.0 if epi == "add" else 0.0)
    torch.testing.assert_close(outs[True], want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(outs[False], outs[True])
    with pytest.raises(ValueError, match="narrow"):
        p.gemv(pool, 0, 8, x, y, epi="silu_mul", up=8, narrow=True)
    with pytest.raises(ValueError, match="up"):
        p.gemv(pool, 0, 8, x, y, epi="silu_mul")
    with pytest.raises(ValueError, match="do not fit"):
        p.gemv(pool, 0, 8, x, y, epi="silu_mul", up=w.shape[0] - 4)


def test_build_places_every_node_and_counts_waits():
    p = layer_chain().program
    built = p.build(ctas=8)
    placed = sorted(i.node for lst in built.schedule.lists for i in lst if i.node >= 0)
    assert placed == list(range(len(p.nodes)))
    assert built.words.size == (len(built.instructions) + 1) * WORDS       # and a NOP past the end
    assert int(built.table[1::2].sum()) == len(built.instructions)
    # a node's waits need every signaller of its counter: the counts add up to the signals
    signals = [0] * built.counters
    for inst in built.instructions:
        if inst.signal >= 0:
            signals[inst.signal] += inst.signals
    assert tuple(signals) == built.schedule.counter_sizes
    # a CTA's run of one stage's tiles waits once and signals once, by the run's length
    assert any(inst.signals > 1 for inst in built.instructions)
    waiting = sum(1 for i in built.instructions if i.waits)
    assert waiting < sum(1 for lst in built.schedule.lists for i in lst if i.waits)


def test_hazard_check_finds_a_missing_edge():
    chain = layer_chain()
    p, r = chain.program, chain.regions
    p.build(ctas=4)
    # a second lm_head that writes the residual stream while nothing orders it after the first layer
    q = StreamProgram(CFG)
    q.pools, q.floats = p.pools, p.floats
    q.nodes = list(p.nodes)
    q.gemv(0, 0, 16, r["qkv"], r["res"], epi="add")
    with pytest.raises(HazardError, match="neither depends on the other"):
        q.build(ctas=4)


def test_counters_are_reset_before_int32_overflows():
    """A counter grows by its signallers every run: Llama-3.2-1B's lm_head has 4,008 tiles feeding
    SAMPLE's one counter, so resets come sooner than for a 32-tile stage; a program whose counters would
    overflow within a thousand runs is refused, naming the fix."""
    from warploop.runtime.stream.executor import MIN_RESET, RESET_EPOCH, reset_interval
    assert reset_interval((32, 1)) == RESET_EPOCH
    runs = reset_interval((4008, 96))
    assert MIN_RESET <= runs < RESET_EPOCH and 4008 * (runs + 1) < 2 ** 31
    with pytest.raises(ValueError, match="split the stage"):
        reset_interval((3_000_000,))


def test_decode_loop_back_edge_and_greedy_sample():
    """EMBED -> GEMV (amax pairs) -> SAMPLE as a decode loop: the build gives SAMPLE a counter of its
    own that EMBED waits on one run back (a negative need); the reference's runs feed each picked
    token to the next run's embedding, and SAMPLE takes the first of equal maxima."""
    g = torch.Generator().manual_seed(5)
    vocab, k = 40, 64
    p = StreamProgram(CFG)
    table = torch.randn(vocab, k, generator=g).to(torch.bfloat16)
    p.embedding(table)
    w = p.pool(torch.randn(vocab, k, generator=g).to(torch.bfloat16))
    tok, toks = p.ints("tok", 1, init=[7]), p.ints("toks", 4)
    x, y = p.buffer("x", k), p.buffer("y", vocab)
    pairs = p.buffer("pairs", 2 * -(-vocab // CFG.block_rows))
    e = p.embed(tok, x, k)
    head = p.gemv(w, 0, vocab, x, y, amax=pairs, after=e)
    smp = p.sample(pairs, len(head), y, tok, toks, after=head)
    p.decode_loop(smp, e)
    built = p.build(ctas=4)
    back = built.counters - 1
    assert built.counter_sizes[back] == 1
    insts = {i.kind.name: i for i in built.instructions if i.kind.name in ("embed", "sample")}
    assert insts["sample"].signal == back and (back, -1) in insts["embed"].waits
    ints = p.int_arena()
    reference(p, ints=ints, steps=4)
    want, t = [], 7
    for _ in range(4):
        t = int((p.pools[0].float() @ table[t].float()).argmax())
        want.append(t)
    assert ints[toks.offset:toks.offset + 4].tolist() == want
    # ties: the first of equal maxima, across tiles too
    arena = p.arena()
    arena[pairs.offset:pairs.offset + 6] = torch.tensor([1.0, y.offset + 9.0, 2.0, y.offset + 20.0,
                                                        2.0, y.offset + 33.0])
    from warploop.runtime.stream.reference import run_node
    run_node(p, arena, p.nodes[smp], ints)
    assert int(ints[tok.offset]) == 20
    with pytest.raises(ValueError, match="decode loop"):
        p.decode_loop(e, smp)


def test_ancestry_by_class_equals_the_transitive_closure():
    """check_hazards' ancestors, worked out once per deps tuple, equal the plain closure over every
    edge, on random DAGs where many nodes share a tuple (a stage's tiles)."""
    import random
    from collections import namedtuple

    from warploop.runtime.ancestry import ancestors
    N = namedtuple("N", "index deps")
    rng = random.Random(7)
    for _ in range(30):
        nodes, tuples = [], []
        for i in range(rng.randint(1, 60)):
            if i and rng.random() < 0.5 and tuples:
                deps = rng.choice(tuples)           # a tile of a stage already seen
            elif i and rng.random() < 0.3:
                deps = tuple(range(rng.randint(0, i - 1), i))     # a whole stage before it
            else:
                deps = tuple(sorted(rng.sample(range(i), rng.randint(0, min(i, 4))))) if i else ()
                tuples.append(deps)
            nodes.append(N(i, tuple(list(deps))))   # equal tuples, not the same object
        cls, anc = ancestors([n.deps for n in nodes])
        want_anc = [0] * len(nodes)
        for n in nodes:
            for d in n.deps:
                want_anc[n.index] |= want_anc[d] | (1 << d)
        assert [anc[c] for c in cls] == want_anc
        assert all(cls[a.index] == cls[b.index] for a in nodes for b in nodes if a.deps == b.deps)


def test_hazard_check_names_what_a_float_by_float_check_names():
    """On random small programs (shared reads, overlapping and own writes, empty ranges), the
    hazard check passes or raises exactly as the plain check does: float by float from the lowest,
    the lowest writer there with a node it is not ordered against (neither an ancestor of the
    other, by the closure over every edge), that node the lowest, named at the first float of its
    segment (the arena cut at every range's ends)."""
    import random
    import types

    from warploop.runtime.stream.hazards import check_hazards
    from warploop.runtime.stream.program import Node
    kind = NodeKind("touch", 99, (), footprint=lambda f, br: (f["reads"], f["writes"]))

    def plain(nodes) -> str | None:
        anc = [0] * len(nodes)
        for n in nodes:
            for d in n.deps:
                anc[n.index] |= anc[d] | (1 << d)
        ranges = [(s, s + ln, n.index, w) for n in nodes for w in (0, 1) for s, ln in n.fields[("reads", "writes")[w]]
                  if ln > 0]
        cuts = sorted({x for s, e, _, _ in ranges for x in (s, e)})
        for x in range(max(cuts, default=0)):
            touched = sorted({i for s, e, i, _ in ranges if s <= x < e})
            for i in sorted({i for s, e, i, w in ranges if w and s <= x < e}):
                loose = [j for j in touched if j != i and not anc[max(i, j)] >> min(i, j) & 1]
                if loose:
                    a, b = sorted((i, loose[0]))
                    return (f"nodes {a} (touch) and {b} (touch) both touch arena offset "
                            f"{max(c for c in cuts if c <= x)} and one writes it, but neither depends on the other")
        return None

    rng = random.Random(11)

    def span(size: int) -> tuple[int, int]:
        s = rng.randrange(size)
        return s, rng.randint(-1, min(8, size - s))

    outcomes = set()
    for _ in range(400):
        nodes, tuples, size = [], [], rng.randint(4, 40)
        dense, writing = rng.random(), rng.random()
        for i in range(rng.randint(1, 24)):
            if i and rng.random() < 0.6 and tuples:
                deps = rng.choice(tuples)            # another tile of a stage
            else:
                deps = tuple(range(max(0, i - rng.randint(1, 8)), i)) if i and rng.random() < dense else \
                    tuple(sorted(rng.sample(range(i), rng.randint(0, min(i, 3)))))
                tuples.append(deps)
            shared = [span(size), span(size)]
            reads = [rng.choice(shared) if rng.random() < 0.5 else span(size) for _ in range(rng.randint(0, 3))]
            writes = [span(size) for _ in range(rng.randint(0, 2))] if rng.random() < writing else []
            if reads and rng.random() < 0.2:
                writes.append(rng.choice(reads))     # an "add" epilogue: reads what it writes
            nodes.append(Node(i, kind, {"reads": reads, "writes": writes}, deps, None))
        want = plain(nodes)
        program = types.SimpleNamespace(nodes=nodes, config=CFG)
        if want is None:
            check_hazards(program)
        else:
            with pytest.raises(HazardError) as err:
                check_hazards(program)
            assert str(err.value) == want
        outcomes.add(want is None)
    assert outcomes == {True, False}
