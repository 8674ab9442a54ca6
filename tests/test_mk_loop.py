"""The decode loop on the GPU (warploop/llm/mk/loop.py), run by the CPU executor: a loop request of K
steps gives the tokens K single steps give, takes KV blocks from the lent free list at block
boundaries, stops rows at their stop ids and token budgets, and ends early when asked or when a row
needs the host."""
import pytest
import torch
from mk_helpers import LLAMA_GQA, QWEN3_LIKE, backends, model_weights
from mk_loop_helpers import BS, GreedySeq, loop, prefill, single_steps

from warploop.llm.mk.loop import (
    LOOP_ALL_STOPPED,
    LOOP_HALTED,
    LOOP_HOST_SAMPLE,
    LOOP_NO_BLOCK,
    LOOP_STEPS,
    NO_TOKEN,
    LoopBlock,
)


@pytest.fixture(scope="module")
def pair():
    ref, mk = backends(LLAMA_GQA, model_weights(LLAMA_GQA), max_num_seqs=2, block_size=BS, blocks=128)
    yield ref, mk
    mk.close()


PROMPTS = [[5, 6, 7, 8, 9], [11] * 6]
STEPS = 4       # row 1 takes a block at the second step, row 0 at the third


@pytest.fixture(scope="module")
def single(pair):
    """STEPS greedy single steps of PROMPTS on the graph, before any loop: each row's tokens, and how
    many blocks each row took (the tokens do not depend on which blocks the pool holds)."""
    _, mk = pair
    want, blocks = single_steps(mk, PROMPTS, list(range(128)), steps=STEPS)
    return want, [len(b) for b in blocks]


def test_a_loop_request_gives_the_tokens_of_single_steps_and_takes_blocks_at_boundaries(pair, single):
    _, mk = pair
    pool = torch.randperm(128, generator=torch.Generator().manual_seed(3)).tolist()
    want, want_blocks = single
    tokens, blocks, status, rows, free = loop(mk, PROMPTS, pool, steps=STEPS)
    assert status == LOOP_STEPS and tokens.shape == (STEPS, 2)
    for i in range(2):
        assert rows.tokens[i] + tokens[:, i].tolist() == want[i]
    # blocks come off the free list in step order, row order within a step, where a token starts a block
    taken = [(s, i, int(blocks[s, i])) for s in range(STEPS) for i in range(2) if blocks[s, i] >= 0]
    assert [b for _, _, b in taken] == free[:len(taken)]
    for s, i, _ in taken:
        assert (len(rows.tokens[i]) + s) % BS == 0
    assert len(taken) == sum(want_blocks) > 0


def test_rows_stop_at_a_stop_id_or_their_budget_and_the_request_ends_when_all_have(pair, single):
    _, mk = pair
    pool = list(range(20, 128))
    want, _ = single
    first = [want[i][len(PROMPTS[i]) + 1:] for i in range(2)]        # each row's loop tokens, unstopped
    stop = first[0][3]
    k = first[0].index(stop)                                          # the first time row 0 makes it
    tokens, _, status, _, _ = loop(mk, PROMPTS, pool, steps=6, remaining=[6, 2], stops=[[stop], []])
    assert status == LOOP_ALL_STOPPED
    assert tokens[:k + 1, 0].tolist() == first[0][:k + 1]
    assert tokens[:2, 1].tolist() == first[1][:2]
    assert (tokens[k + 1:, 0] == NO_TOKEN).all() and (tokens[2:, 1] == NO_TOKEN).all()
    assert len(tokens) == max(k + 1, 2)


def test_a_loop_asked_to_halt_ends_after_the_step_in_flight(pair):
    _, mk = pair
    tokens, _, status, _, _ = loop(mk, PROMPTS, list(range(128)), steps=9, before=lambda run: run.halt())
    assert status == LOOP_HALTED and len(tokens) == 1


def test_a_row_without_a_free_block_ends_the_request_for_the_host(pair):
    _, mk = pair
    tokens, blocks, status, rows, _ = loop(mk, PROMPTS, list(range(128)), steps=9, free=[])
    assert status == LOOP_NO_BLOCK
    s, i = next((s, i) for s in range(len(tokens)) for i in range(2)
                if (len(rows.tokens[i]) + s) % BS == 0)             # the first token that starts a block
    assert len(tokens) == s + 1 and (blocks == -1).all() and tokens[s, i] >= 0


def test_a_row_the_graph_cannot_draw_ends_the_request_for_host_sampling():
    ref, mk = backends(QWEN3_LIKE, model_weights(QWEN3_LIKE), max_num_seqs=1, block_size=BS, blocks=64)
    try:
        rows = prefill(mk, [[3, 4, 5]], list(range(64)))

        class Wide(GreedySeq):
            class params(GreedySeq.params):      # top_p's cut lies past the 32 candidates: not exact on the graph
                temperature, top_p = 5.0, 0.999

        run = mk.start_loop(rows.decode_batch(), [Wide()], 6, [6], [[]], rows.pool[:4])
        tokens, _ = run.take(wait_s=60)
        while not run.finished():
            assert len(run.take(wait_s=60)[0]) == 0
        assert run.status == LOOP_HOST_SAMPLE and tokens.tolist() == [[-1]]
        assert mk.loop_logits([0]).shape == (1, QWEN3_LIKE.vocab_size)
    finally:
        mk.close()


def test_single_steps_after_a_loop_leave_the_loop_off(pair, single):
    _, mk = pair
    pool = list(range(40, 128))
    loop(mk, PROMPTS, pool, steps=2)
    got, _ = single_steps(mk, PROMPTS, pool, steps=2)
    assert got == [t[:len(t) - STEPS + 2] for t in single[0]]       # the tokens of steps run before any loop
    assert int(mk.graphs[2].buffers.loop[0]) == 0
    again, _ = single_steps(mk, PROMPTS, pool, steps=2)
    assert again == got


def test_the_loop_block_refuses_what_does_not_fit():
    block = LoopBlock(batch=2, free=3)
    with pytest.raises(ValueError, match="free blocks"):
        block.serialize(4, [4, 4], [[], []], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="stop ids"):
        block.serialize(4, [4, 4], [list(range(17)), []], [])
    with pytest.raises(ValueError, match="does not fit"):
        block.serialize(4, [4, 4, 4], [[], [], []], [])
    with pytest.raises(ValueError, match="at least one token"):
        block.serialize(4, [0, 4], [[], []], [])


def test_the_advance_node_is_the_graph_sink(pair):
    _, mk = pair
    dg = mk.graphs[2]
    nodes = dg.graph.nodes
    sink = dg.labels.index("advance")
    assert sink == len(nodes) - 1
    seen, todo = set(), [sink]
    while todo:
        for d in nodes[todo.pop()].deps:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    assert seen == set(range(len(nodes) - 1))
