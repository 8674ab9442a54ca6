"""The node kinds' declarations (warploop/llm/mk/kinds.py) against the task functions and the graphs
built from them: the declared fields are the functions' parameters, every node's arguments are its
kind's fields in declared order, priced by its kind, and a node is refused by field name."""
import inspect

import pytest
from test_mk_hazards import CONFIGS, addressed_graph

from warploop.llm.mk.kinds import KINDS
from warploop.llm.mk.plans import plan_for
from warploop.llm.mk.tasks import FUNCTIONS, tasks_for
from warploop.runtime.tasks import lookup


def test_every_kind_has_a_task_function():
    assert list(FUNCTIONS) == list(KINDS)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_declared_fields_and_constexprs_are_the_task_functions_parameters(name):
    kind = KINDS[name]
    params = list(inspect.signature(FUNCTIONS[name]).parameters)
    takes_ctx = params[0] == "ctx"
    assert kind.waits <= takes_ctx, f"{name} waits inside its body, so it takes ctx"
    # the run-time fields in order, then the constexprs in order (minus ctx and BACKEND)
    assert list(kind.names) == [p for p in params if p not in ("ctx", "BACKEND") and p not in kind.constexprs]
    assert list(kind.names) + list(kind.constexprs) == [p for p in params if p not in ("ctx", "BACKEND")]


def test_registered_tasks_take_their_kinds_fields_in_order():
    cfg = CONFIGS["tiny"]()
    for device_type in ("cpu", "cuda"):
        plan = plan_for(cfg, "bfloat16", 16, device_type)
        consts = plan.constexprs()
        tasks = tasks_for(plan)
        for name, kind in KINDS.items():
            task = lookup(getattr(tasks, name))
            assert [(a.name, a.type) for a in task.args] == list(kind.signature("bf16").items())
            assert task.constexprs == {c: consts[c] for c in kind.constexprs}
            assert task.waits_inside == kind.waits


@pytest.mark.parametrize("device_type, workers", [("cpu", 4), ("cuda", 131)])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("splits", [None, 1], ids=["split", "fused"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_node_is_its_kinds_fields_in_order_priced_by_its_kind(name, splits, batch, device_type, workers):
    extra = {} if splits is None else {"splits": splits}
    dg, plan = addressed_graph(CONFIGS[name](), device_type, batch, workers, **extra)
    tasks = tasks_for(plan)
    assert len(dg.labels) == len(dg.graph.nodes) and set(dg.labels) <= set(KINDS)
    for label, node in zip(dg.labels, dg.graph.nodes, strict=True):
        kind = KINDS[label]
        fields = kind.named(node.args)
        assert node.task is lookup(getattr(tasks, label))
        assert [a.name for a in node.task.args] == list(fields)
        assert kind.args(fields) == node.args
        assert node.cost == float(kind.cost(fields, plan, batch))
    assert sum(dg.kinds.values()) == len(dg.labels)


def test_a_node_is_refused_by_field_name():
    combine = KINDS["combine"]
    fields = {"inp": 1, "parts": 2, "lse": 3, "out": 4, "n": 0}
    assert combine.args(fields) == (1, 2, 3, 4, 0)
    assert combine.args(dict(reversed(fields.items()))) == (1, 2, 3, 4, 0)      # by name, not by position
    with pytest.raises(TypeError, match=r"combine: unknown fields \['split'\], missing \[\]"):
        combine.args({**fields, "split": 1})
    with pytest.raises(TypeError, match=r"combine: unknown fields \[\], missing \['lse', 'out'\]"):
        combine.args({"inp": 1, "parts": 2, "n": 0})
    with pytest.raises(ValueError):
        combine.named((1, 2, 3))                # a node's arguments are all its fields
