"""Threads: the one setting, parallel kernels against their serial twins and the oracles, reproducibility.

Parallel kernels split their work only when it pays (kernels/parallel_split.py); these tests force the split on
small shapes (MIN_PARALLEL_WORK = 0), so every parallel kernel runs its parts, also on a 1-core machine
(a step split for 2 threads gives the same bits whatever threads run its parts).
"""
import os
import threading

import numpy as np
import pytest
from onnx import helper

import odtrain.threads as thread_policy
from odtrain import ArgumentError, artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.kernels import conv, linalg, parallel_split
from oracles import OPSET, gradient_check, make_model, reference_outputs, with_weighted_sum
from test_attention import decomposed_rms_norm, decomposed_rotary
from test_vision import GRADIENT_CASES, _artifacts as reference_artifacts

# What splits change: sums that cross parts (weight gradients summed per part of the batch, then added;
# products over another number of images per product). Measured over the cases below: at most 2.1e-7 of
# the tensor's largest magnitude (conv_depthwise_stride2); the bound leaves 10x room.
PARTS_RTOL = 2e-6


@pytest.fixture
def split_everything(monkeypatch):
    """Every kernel with a parallel twin runs it, whatever the work: the small cases below take the paths
    large models take (products in parts, weight gradients split by output channels)."""
    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)
    monkeypatch.setattr(linalg, "MIN_PARALLEL_PRODUCT", 0)
    monkeypatch.setattr(conv, "CHANNEL_SPLIT_SUMS", 0)


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, inputs, list(outputs), **attrs)


def _train(tmp_path, nodes, params, constants, threads, steps=1, seed=0, opset=OPSET):
    """(losses, gradients after the last step, parameters) of `steps` SGD steps on sum(output · R), and
    whether the step ran parallel kernels."""
    rng = np.random.default_rng(seed)
    probe = make_model(nodes, {**params, **constants}, opset=opset)
    weights = rng.standard_normal(np.asarray(reference_outputs(probe)[0]).shape).astype(np.float32)
    model = make_model(with_weighted_sum(nodes, "y", weights), {**params, **constants, "gc_weights": weights},
                       outputs=[("loss", np.float32, [])], opset=opset)
    folder = tmp_path / f"threads{threads}"
    if not (folder / "checkpoint").exists():
        artifacts.generate_artifacts(model, requires_grad=list(params), loss=None, optimizer=artifacts.OptimType.SGD,
                                     artifact_directory=folder)
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, num_threads=threads)
    optimizer = Optimizer(folder / "optimizer_model.onnx", module)
    losses = []
    for _ in range(steps):
        losses.append(float(module()))
        grads = {name: state.parameters[name].grad.copy() for name in params}
        optimizer.step()
        module.lazy_reset_grad()
    split = any(getattr(kernel, "__name__", "").endswith("_parts") for plan in module._train.plans.values()
                for kernel, _ in plan.calls)
    return losses, grads, {name: state.parameters[name].data.copy() for name in params}, split


def _close(a, b, rtol=PARTS_RTOL):
    scale = max(float(np.abs(a).max()), 1e-30)
    assert float(np.abs(a - b).max()) <= rtol * scale, (float(np.abs(a - b).max()), scale)


rng = np.random.default_rng(7)


def rand(*shape, low=-1.0, high=1.0):
    return rng.uniform(low, high, shape).astype(np.float32)


VISION_CASES = {name: case for name, case in GRADIENT_CASES.items()
                if name.startswith(("conv", "max_pool", "average_pool", "global_", "batch_norm", "clip", "leaky_relu",
                                    "hard_"))}
CASES = {name: (case.nodes, case.params, case.constants) for name, case in VISION_CASES.items()}
CASES.update({
    # pointwise over a small plane: parts of the output channels of one product (kernels/conv/pointwise.py)
    "conv_pointwise_channel_parts": ([node("Conv", ["x", "w"])], {"x": rand(2, 3, 3, 3), "w": rand(32, 3, 1, 1)}),
    # an im2col weight gradient that splits its output channels (its per-part sums would outweigh the work memory)
    "conv_one_cell_channel_parts": ([node("Conv", ["x", "w", "b"])],
                                    {"x": rand(4, 2, 3, 3), "w": rand(48, 2, 3, 3), "b": rand(48)}),
    "layer_norm": ([node("LayerNormalization", ["x", "s", "b"], epsilon=1e-3)],
                   {"x": rand(5, 3, 4), "s": rand(4, low=0.5, high=1.5), "b": rand(4)}),
    "layer_norm_statistics_broadcast": ([node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=1)],
                                        {"x": rand(3, 3, 4), "s": rand(4, low=0.5, high=1.5), "b": rand(1)}),
    "softmax": ([node("Softmax", ["x"])], {"x": rand(4, 3, 5, low=-2, high=2)}),
    "softmax_middle_axis": ([node("Softmax", ["x"], axis=1)], {"x": rand(4, 3, 5, low=-2, high=2)}),
    "log_softmax": ([node("LogSoftmax", ["x"], axis=1)], {"x": rand(4, 3, 5, low=-2, high=2)}),
    "gemm_rows": ([node("Gemm", ["x", "w", "b"], transB=1)], {"x": rand(40, 6), "w": rand(5, 6), "b": rand(5)}),
    "matmul_products": ([node("MatMul", ["a", "b"])], {"a": rand(3, 4, 5), "b": rand(3, 5, 6)}),
    # B's gradient sums over the batch into one output: rows of every product, in product order
    "matmul_shared_output_rows": ([node("MatMul", ["a", "b"])], {"a": rand(4, 2, 40), "b": rand(1, 40, 3)}),
    "attention_heads": ([node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["s"]),
                         node("Mul", ["s", "scale"], ["ss"]), node("Softmax", ["ss"], ["p"], axis=-1),
                         node("MatMul", ["p", "v"])],
                        {"q": rand(2, 2, 17, 4), "k": rand(2, 2, 17, 4), "v": rand(2, 2, 17, 4)},
                        {"scale": np.array(0.5, np.float32)}),
    "gather_embedding": ([node("Gather", ["emb", "ids"])], {"emb": rand(5, 3)},
                         {"ids": np.array([[0, 2, 2], [4, 0, 2]], dtype=np.int64)}),
    "gather_axis": ([node("Gather", ["x", "ids"], axis=1)], {"x": rand(2, 4, 3)},
                    {"ids": np.array([3, -1, 0, 3], dtype=np.int64)}),
    "elementwise_chain": ([node("Mul", ["a", "b"], ["m"]), node("Add", ["m", "bias"], ["s"]),
                           node("Relu", ["s"], ["r"]), node("Tanh", ["r"], ["t"]), node("Mul", ["t", "half"])],
                          {"a": rand(4, 6), "b": rand(4, 6), "bias": rand(6)}, {"half": np.array(0.5, np.float32)}),
    # a product's Relu epilogue: rows of the product in parts, its gradient's columns in parts
    "gemm_relu_epilogue": ([node("Gemm", ["x", "w", "b"], ["p"], transB=1), node("Relu", ["p"])],
                           {"w": rand(5, 6), "b": rand(5)}, {"x": rand(40, 6)}),
    # PyTorch's exact GELU, fused into Gelu and GeluGrad in the training model
    "gelu": ([node("Div", ["x", "root2"], ["d"]), node("Erf", ["d"], ["e"]), node("Add", ["e", "one"], ["a"]),
              node("Mul", ["x", "a"], ["m"]), node("Mul", ["m", "half"])], {"x": rand(3, 7, low=-3, high=3)},
             {"root2": np.array(1.4142135, np.float32), "one": np.array(1.0, np.float32),
              "half": np.array(0.5, np.float32)}),
    # decoder ops: RMSNorm's rows; rotary rows; attention's (batch, kv head) units, each with its query heads
    "rms_norm": ([node("RMSNormalization", ["x", "s"], epsilon=1e-3)],
                 {"x": rand(5, 3, 4), "s": rand(4, low=0.5, high=1.5)}),
    "rms_norm_fused": (decomposed_rms_norm()[0], {"x": rand(5, 3, 8), "w": rand(8, low=0.5, high=1.5)},
                       decomposed_rms_norm()[1]),
    "rotary_embedding": ([node("RotaryEmbedding", ["x", "cos", "sin"])],
                         {"x": rand(2, 3, 4, 6), "cos": rand(2, 4, 3), "sin": rand(2, 4, 3)}),
    "rotary_fused": (decomposed_rotary(), {"x": rand(2, 3, 4, 4), "cos": rand(2, 1, 4, 4), "sin": rand(2, 1, 4, 4)}),
    # grouped-query attention's repeated kv heads, a head transpose, a mask over heads, a fan-out (Sum): copies
    # split into parts of their rows, broadcasting binaries likewise
    "repeated_heads_layout": ([node("Unsqueeze", ["k", "axis"], ["u"]), node("Expand", ["u", "shape"], ["e"]),
                               node("Reshape", ["e", "merged"], ["r"]),
                               node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]), node("Add", ["t", "mask"], ["s"]),
                               node("Mul", ["s", "s"])],
                              {"k": rand(2, 2, 3, 4), "mask": rand(2, 3, 1, 4)},
                              {"axis": np.array([2], np.int64), "shape": np.array([2, 2, 2, 3, 4], np.int64),
                               "merged": np.array([2, 4, 3, 4], np.int64)}),
    "attention_gqa_causal": ([node("Attention", ["q", "k", "v"], is_causal=1)],
                             {"q": rand(2, 4, 5, 4), "k": rand(2, 2, 5, 4), "v": rand(2, 2, 5, 3)}),
})
OPSETS = {"rms_norm": 23, "rotary_embedding": 23, "attention_gqa_causal": 23}
# ONNX's reference erf rounds to float32: a larger step keeps its rounding out of the differences
STEPS = {"gelu": 1e-3, **{name: case.step for name, case in VISION_CASES.items()}}
PARALLEL_CASES = sorted(CASES)
# Too large for finite differences, against one thread only: a pointwise weight gradient over images of more
# cells than one product holds (one image per product), its output channels split
LARGE_CASES = {"conv_pointwise_large_images": ([node("Conv", ["x", "w"])], {"x": rand(2, 4, 24, 24),
                                                                             "w": rand(32, 4, 1, 1)})}
# Kernels split where no sum crosses a part (planes, channels, rows): every value as in the serial kernel.
EXACT = ("max_pool", "average_pool", "global_", "batch_norm", "softmax", "log_softmax", "gather", "elementwise",
         "gelu", "clip", "leaky_relu", "hard_", "attention_gqa", "rotary", "repeated_heads")


@pytest.mark.parametrize("name", PARALLEL_CASES)
def test_parallel_parts_match_the_oracle(name, tmp_path, split_everything):
    """Each parallel kernel, split into parts, against float64 finite differences."""
    thread_policy.set_num_threads(2)
    try:
        nodes, params, *constants = CASES[name]
        gradient_check(nodes, params, constants=constants[0] if constants else None, tmp_path=tmp_path,
                       step=STEPS.get(name, 1e-6), opset=OPSETS.get(name, OPSET))
    finally:
        thread_policy._process_default = None


@pytest.mark.parametrize("name", PARALLEL_CASES + sorted(LARGE_CASES))
def test_two_threads_match_one(name, tmp_path, split_everything):
    nodes, params, *constants = CASES[name] if name in CASES else LARGE_CASES[name]
    constants = constants[0] if constants else {}
    one = _train(tmp_path, nodes, params, constants, threads=1, opset=OPSETS.get(name, OPSET))
    two = _train(tmp_path, nodes, params, constants, threads=2, opset=OPSETS.get(name, OPSET))
    assert not one[3] and two[3], "parallel kernels run exactly when the step is bound for more than one thread"
    if name.startswith(EXACT):
        assert one[0] == two[0] and all(np.array_equal(one[1][k], two[1][k]) for k in params)
    np.testing.assert_allclose(one[0], two[0], rtol=PARTS_RTOL)
    for key in params:
        _close(one[1][key], two[1][key])


def test_an_index_out_of_range_stops_a_parallel_gather(tmp_path, split_everything):
    from odtrain import InputError
    from odtrain.inference import InferenceSession

    model = make_model([node("Gather", ["emb", "ids"])], {"emb": rand(5, 3)},
                       inputs=[("ids", np.int64, [4])])
    thread_policy.set_num_threads(2)
    try:
        session = InferenceSession(model)
        assert session.run(None, {"ids": np.array([0, 4, 1, 2])})[0].shape == (4, 3)
        with pytest.raises(InputError, match="outside the gathered axis"):
            session.run(None, {"ids": np.array([0, 1, 5, 2])})
    finally:
        thread_policy._process_default = None


def test_thread_counts_are_checked():
    for bad in (0, -1, 1.5, True, "2", None):
        with pytest.raises(ArgumentError, match="num_threads"):
            thread_policy.checked(bad)
    assert thread_policy.checked(3) == 3 and thread_policy.checked(np.int64(2)) == 2


def test_the_default_is_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv(thread_policy.ENVIRONMENT, raising=False)
    monkeypatch.setattr(thread_policy, "_process_default", None)
    monkeypatch.setattr(thread_policy.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7}, raising=False)
    monkeypatch.setattr(thread_policy, "pool_size", lambda: 6)
    assert thread_policy.get_num_threads() == 6  # the cores we may use, at most Numba's pool
    monkeypatch.setattr(thread_policy.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert thread_policy.get_num_threads() == 1
    monkeypatch.setenv(thread_policy.ENVIRONMENT, "3")
    assert thread_policy.get_num_threads() == 3
    monkeypatch.setenv(thread_policy.ENVIRONMENT, "many")
    with pytest.raises(ArgumentError, match=thread_policy.ENVIRONMENT):
        thread_policy.get_num_threads()
    thread_policy.set_num_threads(2)
    assert thread_policy.get_num_threads() == 2


@pytest.mark.parametrize("kind", ["adamw", "sgd", "sgd_momentum_nesterov"])
def test_parallel_optimizer_updates_are_the_serial_ones(kind, split_everything):
    from odtrain.optimizer_update import apply_update
    from odtrain.graph.optimizers import SGD, AdamW, SGDMomentum

    config = {"adamw": AdamW(weight_decay=0.01), "sgd": SGD(),
              "sgd_momentum_nesterov": SGDMomentum(momentum=0.9, nesterov=True, weight_decay=1e-3)}[kind]
    runs = []
    for threads in (1, 2, 3):
        same = np.random.default_rng(3)
        weights, grads = same.standard_normal((2, 1001), np.float32)
        moments = {name: same.uniform(0, 1, 1001).astype(np.float32) for name in config.state_names}
        for step in (1, 2):
            apply_update(config, weights, grads, moments, 1e-2, step, threads)
        runs.append((weights, *moments.values()))
    for other in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(runs[0], other))


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """AdamW artifacts of the reference CNN (convolutions, batch norms, pooling, a product) and its batches."""
    folder = tmp_path_factory.mktemp("cnn")
    _, golden = reference_artifacts("cnn", "adamw", folder)
    return folder, [(golden["x"][step].astype(np.float32), golden["y"][step]) for step in range(3)]


def _cnn_run(cnn, threads):
    """Parameters and losses after three AdamW steps of a fresh module."""
    folder, batches = cnn
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, num_threads=threads)
    optimizer = Optimizer(folder / "optimizer_model.onnx", module)
    losses = []
    for x, y in batches:
        losses.append(module(x, y)[0])
        optimizer.step()
        module.lazy_reset_grad()
    return np.array(losses), state._store.flat.copy()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_run_is_bit_for_bit_reproducible(cnn, threads):
    """One thread runs the serial kernels; more threads split the work into parts fixed when the step is bound,
    their partial sums added in part order: either way, the same bits at every run."""
    first, second = _cnn_run(cnn, threads), _cnn_run(cnn, threads)
    assert np.array_equal(first[0], second[0]) and np.array_equal(first[1], second[1])


def test_two_modules_train_at_once_in_two_python_threads(cnn):
    """Each Python thread keeps its own thread count (Numba's is per calling thread) and the runs interleave
    kernel by kernel: each ends exactly as when run alone."""
    alone = {threads: _cnn_run(cnn, threads) for threads in (1, 2)}
    results, errors = {}, []

    def run(threads):
        try:
            results[threads] = _cnn_run(cnn, threads)
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    workers = [threading.Thread(target=run, args=(threads,)) for threads in (1, 2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    for threads in (1, 2):
        assert np.array_equal(results[threads][1], alone[threads][1]), threads


def test_a_module_refuses_a_bad_thread_count(cnn):
    folder, _ = cnn
    for bad in (0, 2.5, "2"):
        with pytest.raises(ArgumentError, match="num_threads must be a positive whole number"):
            Module(folder / "training_model.onnx", CheckpointState.load_checkpoint(folder / "checkpoint"),
                   num_threads=bad)


def test_the_command_line_sets_the_threads(capsys):
    from conftest import odtrain_main

    code, _, err = odtrain_main(capsys, "train", "missing-folder", "--data", "none.npz", "--threads", "0")
    assert code == 2 and "--threads must be a positive whole number" in err
    assert thread_policy._process_default is None  # the setting lasts as long as the command


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_a_child_forked_after_parallel_steps_trains_on_one_thread(cnn):
    """GNU OpenMP does not survive fork(): Numba would terminate the child at its first parallel region."""
    losses, weights = _cnn_run(cnn, 2)
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's exit handlers
        code = 1
        try:
            child = _cnn_run(cnn, 2)
            os.write(writer, b"same" if np.array_equal(child[1], _cnn_run(cnn, 1)[1]) else b"different")
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.read(reader, 16) == b"same"  # the child's 2-thread module ran the serial kernels


def test_steps_run_on_openmp_with_passive_waiting(cnn):
    """A fresh process: the threading layer is chosen at the first parallel region, once per process."""
    import subprocess
    import sys

    folder, batches = cnn
    np.savez(folder / "batch.npz", x=batches[0][0], y=batches[0][1])
    script = f"""
import os, numpy as np, numba
from odtrain.api import CheckpointState, Module
data = np.load({str(folder / "batch.npz")!r})
state = CheckpointState.load_checkpoint({str(folder / "checkpoint")!r})
Module({str(folder / "training_model.onnx")!r}, state, num_threads=2)(data["x"], data["y"])
print(numba.threading_layer(), os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
"""
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_THREADING_LAYER")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["omp", "PASSIVE", str(thread_policy.SPIN_COUNT)]


def test_a_step_runs_on_the_cores_other_processes_leave_free():
    """Readings (wall s, busy CPU s of our cores, our CPU s, cores) at the steps' start times: the threads
    follow the cores others use, measured over windows of at least LOAD_WINDOW."""
    readings = {0.0: (0.0, 0.0, 0.0, 2),
                1.0: (1.0, 1.1, 0.1, 2),  # others kept one core busy: one thread
                2.0: (2.0, 2.1, 1.1, 2),  # we used a core, nobody else did: two
                2.1: None,  # within the window: not read, the last estimate stands
                3.0: (3.0, 3.5, 1.4, 4),  # another affinity: the estimate stands, measured anew from here
                4.0: (4.0, 6.5, 2.4, 4)}  # others kept two of the four busy: two
    now = [0.0]
    read = []
    neighbours = thread_policy.Neighbours(read=lambda: read.append(now[0]) or readings[now[0]], clock=lambda: now[0])
    decisions = []
    for now[0] in readings:
        decisions.append(neighbours.enter(4))
        neighbours.leave()
    assert decisions == [2, 1, 2, 2, 4, 2]
    assert read == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_step_beside_another_step_of_this_process_runs_one_thread():
    neighbours = thread_policy.Neighbours(read=lambda: None)
    assert neighbours.enter(2) == 2  # no /proc/stat: the threads bound for
    assert neighbours.enter(2) == 1  # a second step at once, from another Python thread
    neighbours.leave()
    neighbours.leave()
    assert neighbours.enter(3) == 3


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) != 2,
                    reason="reads /proc/stat on a 2-core machine")
def test_a_busy_neighbour_leaves_a_step_one_thread():
    import subprocess
    import sys
    import time

    cpu = max(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        neighbours = thread_policy.Neighbours()
        neighbours.enter(2)
        neighbours.leave()
        time.sleep(2 * thread_policy.LOAD_WINDOW)
        assert neighbours.enter(2) == 1, neighbours.others
        neighbours.leave()
    finally:
        hog.kill()
        hog.wait()
