"""The memory planner on random graphs (hypothesis) and on real ones; steps that never allocate."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odtrain.graph.ir import Node, TensorType
from odtrain.graph.planner import ALIGNMENT, MemoryPlan, StorageGroup, aligned, plan_memory

F32 = np.dtype(np.float32)


@st.composite
def random_graphs(draw):
    """Chains and diamonds of elementwise (in-place-able), view and reduction nodes over random sizes."""
    sizes = [draw(st.integers(1, 300)) for _ in range(3)]
    values = ["x0"]
    types = {"x0": TensorType(F32, (sizes[0],))}
    nodes = []
    for i in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["Relu", "Add", "Reshape", "ReduceSum", "Identity"]))
        a = draw(st.sampled_from(values))
        out = f"v{i}"
        if kind == "Add":
            same = [v for v in values if types[v].shape == types[a].shape]
            nodes.append(Node("Add", [a, draw(st.sampled_from(same))], [out]))
            types[out] = types[a]
        elif kind == "ReduceSum":
            nodes.append(Node("ReduceSum", [a], [out], {"keepdims": 1}))
            types[out] = TensorType(F32, (1,))
        elif kind == "Reshape":
            nodes.append(Node("Reshape", [a, "shape"], [out]))
            types[out] = TensorType(F32, (1, types[a].shape[-1]))
        else:
            nodes.append(Node(kind, [a], [out]))
            types[out] = types[a]
        values.append(out)
    outputs = draw(st.lists(st.sampled_from(values), min_size=1, max_size=3, unique=True))
    scratch = {}
    for index in draw(st.lists(st.integers(0, len(nodes) - 1), max_size=3, unique=True)):
        scratch[index] = f"scratch{index}"
        types[scratch[index]] = TensorType(np.dtype(np.uint8), (draw(st.integers(1, 2000)),))
    return nodes, types, outputs, scratch


@settings(max_examples=300, deadline=None)
@given(random_graphs())
def test_random_plans_verify_and_respect_the_lower_bound(graph):
    nodes, types, outputs, scratch = graph
    arena_values = {"x0"} | {n.outputs[0] for n in nodes} | set(scratch.values())
    plan = plan_memory(nodes, types, arena_values, ["x0"], outputs, scratch)
    plan.verify()
    assert plan.arena_bytes >= plan.lower_bound
    assert plan.arena_bytes % ALIGNMENT == 0
    for index, name in scratch.items():  # working memory lives for its own step only
        group = plan.groups[plan.group_of[name]]
        assert (group.start, group.end, group.values) == (index + 1, index + 1, [name])
    for node in nodes:  # a view always shares its input's storage
        if node.op_type in ("Reshape", "Identity"):
            assert plan.group_of[node.outputs[0]] == plan.group_of[node.inputs[0]]


def test_in_place_reuse_only_when_the_input_dies():
    t = TensorType(F32, (100,))
    nodes = [Node("Relu", ["x"], ["a"]), Node("Relu", ["a"], ["b"]), Node("Add", ["a", "b"], ["c"])]
    plan = plan_memory(nodes, {"x": t, "a": t, "b": t, "c": t}, {"x", "a", "b", "c"}, ["x"], ["c"])
    plan.verify()
    assert plan.group_of["a"] == plan.group_of["x"]  # x dies at the first Relu
    assert plan.group_of["b"] != plan.group_of["a"]  # a is still read by Add
    assert plan.group_of["c"] in (plan.group_of["a"], plan.group_of["b"])


def test_verify_refuses_a_value_written_in_place_over_one_still_live():
    """One group for x, a, b, c: no two groups overlap, yet the second Relu writes b over a, which
    the Add still reads; verify names them. Writing c over both at the Add, where they die, is fine."""
    t = TensorType(F32, (100,))
    nodes = [Node("Relu", ["x"], ["a"]), Node("Relu", ["a"], ["b"]), Node("Add", ["a", "b"], ["c"])]
    written, read_until = {"x": 0, "a": 1, "b": 2, "c": 3}, {"x": 1, "a": 3, "b": 3, "c": 4}

    def plan_of(values):
        group = StorageGroup(values, aligned(t.nbytes), 0, 4, offset=0)
        return MemoryPlan(nodes, [group], {v: 0 for v in values}, group.nbytes, group.nbytes, 3, dict.fromkeys("xabc", t),
                    {v: written[v] for v in values}, {v: read_until[v] for v in values})

    plan_of(["x", "a", "c"]).verify()
    with pytest.raises(AssertionError, match="Relu node producing \\['b'\\] writes 'b' over 'a', which is read until step 3"):
        plan_of(["x", "a", "b", "c"]).verify()


def test_mlp_plan_reaches_its_lower_bound(mlp_artifacts, mlp_reference):
    from odtrain.api import CheckpointState, Module

    golden = mlp_reference[2]
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx")
    module(golden["x"][0], golden["y"][0])
    module.eval()
    module(golden["x"][0], golden["y"][0])
    for session in (module._train, module._eval):
        for bound in session.plans.values():
            bound.plan.verify()
            assert bound.plan.arena_bytes <= 1.10 * bound.plan.lower_bound
            assert "lower bound" in bound.plan.render()


def test_a_training_step_allocates_nothing(mlp_artifacts, mlp_reference):
    """Counted by Numba's runtime (NUMBA_NRT_STATS=1) in a fresh process. Passing an array from Python
    into a kernel registers it with the runtime (one count per array argument); a kernel's own
    allocation would add to that."""
    script = textwrap.dedent(f"""
        import numpy as np
        from numba.core.runtime import rtsys
        from odtrain.api import CheckpointState, Module, Optimizer
        d = {str(mlp_artifacts)!r}
        golden = np.load({str(mlp_reference[0].parent / "golden.npz")!r})
        state = CheckpointState.load_checkpoint(d + "/checkpoint")
        module = Module(d + "/training_model.onnx", state)
        optimizer = Optimizer(d + "/optimizer_model.onnx", module)
        x, y = golden["x"][0], golden["y"][0]
        for _ in range(2):
            module(x, y); optimizer.step(); module.lazy_reset_grad()
        bound = next(iter(module._train.plans.values()))
        for view, value in zip(bound.feed_views, (x, y)):
            view[...] = value
        extra = []
        for kernel, args in bound.calls:
            before = rtsys.get_allocation_stats().alloc
            kernel(*args)
            arrays = sum(isinstance(a, np.ndarray) for a in args)
            extra.append(rtsys.get_allocation_stats().alloc - before - arrays)
        import odtrain.optimizer_update as update
        passed, invoke = [], update.invoke
        def counted(kernel, args, **options):  # the update's array arguments (its parts' bounds included)
            passed.append(sum(isinstance(a, np.ndarray) for a in args))
            return invoke(kernel, args, **options)
        update.invoke = counted
        before = rtsys.get_allocation_stats().alloc
        optimizer.step()
        extra.append(rtsys.get_allocation_stats().alloc - before - sum(passed))
        print(len(extra), max(extra), min(extra))
    """)
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                            cwd=mlp_artifacts)
    assert result.returncode == 0, result.stderr
    calls, most, least = (int(v) for v in result.stdout.split())
    assert calls > 10 and most == 0 and least == 0, result.stdout


@settings(max_examples=200, deadline=None)
@given(random_graphs())
def test_memory_aware_order_is_a_topological_permutation(graph):
    from odtrain.graph.schedule import memory_aware_order

    nodes, types, outputs, _ = graph
    sizes = {name: t.nbytes for name, t in types.items()}
    barrier = nodes[len(nodes) // 2]
    reordered = memory_aware_order(nodes, sizes, set(outputs), barrier)
    assert sorted(map(id, reordered)) == sorted(map(id, nodes))
    position = {id(node): k for k, node in enumerate(reordered)}
    produced_at = {o: position[id(n)] for n in nodes for o in n.outputs}
    for node in reordered:
        for name in node.inputs:
            if name in produced_at:
                assert produced_at[name] < position[id(node)]


def test_a_step_is_planned_by_the_graph_layer_alone():
    """The planning step decides order, storage and scratch from the graph and a scratch-size function:
    no kernel loads. A view of a parameter stays outside the arena; scratch lives for its node's step."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from odtrain.graph.ir import Graph, Node, TensorType
        from odtrain.graph.planner import SCRATCH_SUFFIX
        from odtrain.graph.step_plan import plan_step
        f32 = np.dtype(np.float32)
        graph = Graph([Node("MatMul", ["x", "w"], ["h"], name="first"), Node("Relu", ["h"], ["a"], name="act"),
                       Node("Reshape", ["v", "shape"], ["v2"], name="view"),
                       Node("MatMul", ["a", "v2"], ["y"], name="second")],
                      ["x", "w", "v"], ["y"], {"shape": np.array([8, 8], np.int64)})
        step = plan_step(graph, {"x": TensorType(f32, (4, 8))}, {"w": TensorType(f32, (8, 8)), "v": TensorType(f32, (64,))},
                         lambda node, types: 1000 if node.op_type == "Relu" else 0)
        assert step.views == {"v2": "v"}, step.views
        assert step.arena_values == {"x", "h", "a", "y", "act" + SCRATCH_SUFFIX}, step.arena_values
        index = next(k for k, node in enumerate(step.order) if node.name == "act")
        assert step.scratch == {index: "act" + SCRATCH_SUFFIX}
        group = step.plan.groups[step.plan.group_of["act" + SCRATCH_SUFFIX]]
        assert (group.start, group.end, group.nbytes) == (index + 1, index + 1, 1024)
        assert step.copies == set() and step.recomputed == 0 and "shape" in step.folded
        print(sorted(m for m in sys.modules if m.startswith(("odtrain.kernels", "numba"))))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
