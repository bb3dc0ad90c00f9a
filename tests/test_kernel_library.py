"""The kernel library (odtrain compile): the same bits as the JIT's kernels, errors by node, refusals, no compiler.

One library is built for the reference MLP's artifacts and the demo (16 kernels, ~20-40 s; conftest's
`mlp_kernel_library`, shared with tests/test_device_route.py); its steps are compared with
the JIT's call by call and step by step, at one thread and at two with the same parts.
"""
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import reference_model
from odtrain import kernel_library
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.executor import Program, record_calls
from odtrain.graph.errors import InputError
from odtrain.library_build import compile_artifacts
from odtrain.jit.ahead import FALLBACK_MESSAGE
from odtrain.kernel_library import KernelLibrary, kernel_name, pack, refusal_of, signature_of
from odtrain.kernel_library import messages as kernel_messages
from odtrain.kernel_library.digest import DIGESTED_MODELS
from odtrain.progress import Progress, announce


@pytest.fixture(scope="module")
def mlp_library(tmp_path_factory, mlp_kernel_library):
    """(artifact folder with its library in kernels/, the same artifacts without one). The library also holds
    the demo's kernels (what `pip install .` builds for it): one build (conftest's) serves both."""
    with_library = mlp_kernel_library
    without = tmp_path_factory.mktemp("mlp-jit")
    for name in os.listdir(with_library):
        if name != kernel_library.FOLDER:
            shutil.copy(with_library / name, without / name)
    return with_library, without


def train(folder, threads, steps=3):
    _, meta, golden = reference_model("mlp")
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx", num_threads=threads)
    optimizer = Optimizer(folder / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(meta["adamw"]["lr"])
    losses = []
    for step in range(steps):
        losses.append(float(module(golden["x"][step], golden["y"][step])))
        optimizer.step()
        module.lazy_reset_grad()
    return module, losses, state._store.flat.copy()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_step_through_the_library_gives_the_jits_bits(mlp_library, threads):
    with_library, without = mlp_library
    module, losses, weights = train(with_library, threads)
    assert module.kernel_library is not None
    bound = next(iter(module._train.plans.values()))
    assert bound.program.jit_calls == 0  # every call of the step ran in the library
    jit_module, jit_losses, jit_weights = train(without, threads)
    assert jit_module.kernel_library is None
    assert losses == jit_losses
    assert np.array_equal(weights, jit_weights)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_a_step_in_parts_gives_the_jits_bits_as_many_parts_as_threads_or_more(mlp_library, threads, monkeypatch):
    """Bound for 2, 3 or 5 parts and run on this machine's threads (2 here: the neighbours' load set aside, so
    that the parts always run in parallel): the library's parallel schedule deals one part to each thread, or
    several, unevenly, and every part must run once. Three whole steps against the JIT's at the same parts
    (every kernel that has a parallel twin runs it, even for this small model)."""
    import odtrain.threads as thread_policy
    from odtrain.kernels import parallel_split

    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)
    enter = thread_policy.NEIGHBOURS.enter  # counted as ever (leave() uncounts it), its answer set aside
    monkeypatch.setattr(thread_policy.NEIGHBOURS, "enter", lambda count: enter(count) and count)
    with_library, without = mlp_library
    library_module, library_losses, library_state = train(with_library, threads)
    jit_module, jit_losses, jit_state = train(without, threads)
    bound = next(iter(library_module._train.plans.values()))
    assert any(kernel_name(kernel) and kernel_name(kernel).endswith("_parts") for kernel, _ in bound.calls)
    assert library_losses == jit_losses
    np.testing.assert_array_equal(library_state, jit_state)


def _bases(arrays):
    """The distinct buffers that the arrays view."""
    found = {}
    for array in arrays:
        while isinstance(array, np.ndarray) and array.base is not None and isinstance(array.base, np.ndarray):
            array = array.base
        if isinstance(array, np.ndarray) and array.flags.writeable:  # read-only ones are constants
            found[id(array)] = array
    return list(found.values())


def _same_bits_call_by_call(library, calls, threads) -> set:
    """Run each call once by the library and once by its JIT kernel from the same memory; the same bytes
    everywhere afterwards. Returns the (kernel, signature) pairs checked."""
    buffers = _bases([a for _, args in calls for a in args])
    checked = set()
    for kernel, args in calls:
        before = [b.copy() for b in buffers]
        assert library.call(kernel, args, threads), kernel_name(kernel)
        by_library = [b.copy() for b in buffers]
        for buffer, saved in zip(buffers, before):
            np.copyto(buffer, saved)
        kernel(*args)
        for buffer, expected in zip(buffers, by_library):
            assert np.array_equal(buffer.view(np.uint8), expected.view(np.uint8)), kernel_name(kernel)
        checked.add((kernel_name(kernel), signature_of(args)))
    return checked


@pytest.mark.parametrize("threads", [1, 2])
def test_every_library_kernel_of_a_step_gives_its_jit_twins_bits(mlp_library, threads):
    """Each call of a bound training step on the step's own data (the feeds copied in, then call by call),
    and the optimizer's update."""
    with_library, _ = mlp_library
    _, _, golden = reference_model("mlp")
    module, _, _ = train(with_library, threads, steps=1)
    bound = next(iter(module._train.plans.values()))
    for view, value in zip(bound.feed_views, [golden["x"][1], golden["y"][1]]):
        np.copyto(view, value)
    checked = _same_bits_call_by_call(module.kernel_library, bound.calls, threads)
    optimizer = Optimizer(with_library / "optimizer_model.onnx", module)
    with record_calls() as update:
        optimizer.step()
    checked |= _same_bits_call_by_call(module.kernel_library, update, threads)
    used = {(e["kernel"], e["signature"]) for e in module.kernel_library.manifest["entries"]}
    assert checked <= used and len(checked) >= 8


def test_kernels_taking_tuples_give_their_jit_twins_bits_through_a_library(tmp_path):
    """A depthwise Conv's kernels take tuples (their geometry, taps and frames): records of several words each,
    which the library's loader must rebuild item by item in order. Its training step, call by call, at 1 and 2
    threads, against the JIT on the same memory."""
    from onnx import helper

    from odtrain import artifacts
    from oracles import make_model

    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=4, pads=[1, 0, 1, 1], strides=[1, 2],
                              dilations=[2, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    model = make_model(nodes, {"w": rng.standard_normal((4, 1, 3, 2)).astype(np.float32),
                               "b": rng.standard_normal(4).astype(np.float32)},
                       inputs=[("x", np.float32, ["batch", 4, 9, 11])], outputs=[("y", np.float32, ["batch", 4, 7, 6])])
    folder = tmp_path / "depthwise"
    artifacts.generate_artifacts(model, requires_grad=["w", "b"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=folder)
    compile_artifacts(folder, batch_size=3, thread_counts=(1, 2), out=lambda line: None)
    x = rng.standard_normal((3, 4, 9, 11)).astype(np.float32)
    target = rng.standard_normal((3, 4, 7, 6)).astype(np.float32)
    with_tuples = set()
    for threads in (1, 2):
        module = Module(folder / "training_model.onnx", CheckpointState.load_checkpoint(folder / "checkpoint"),
                        num_threads=threads)
        assert module.kernel_library is not None
        module(x, target)
        bound = next(iter(module._train.plans.values()))
        for view, value in zip(bound.feed_views, [x, target]):
            np.copyto(view, value)
        _same_bits_call_by_call(module.kernel_library, bound.calls, threads)
        with_tuples |= {kernel_name(kernel) for kernel, args in bound.calls
                        if any(isinstance(a, tuple) for a in args)}
    assert any("depthwise" in name for name in with_tuples), with_tuples


def test_the_manifest_names_each_parallel_twins_serial_kernel(mlp_library):
    """From kernels/parallel_split.py's table: the MLP at two threads runs its products (the first with its Relu as
    an epilogue, whose gradient sums the bias's in the same pass) and its update in parts, and larger batches its
    element-wise ops (recorded split: kernels/parallel_split.py, every_split)."""
    from odtrain.kernels.parallel_split import TWINS

    with_library, _ = mlp_library
    manifest = json.loads((with_library / kernel_library.FOLDER / kernel_library.MANIFEST_FILE).read_text())
    expected = {kernel_name(t.parallel): kernel_name(t.serial) for t in TWINS.values()}
    found = {e["kernel"]: e.get("twin_of") for e in manifest["entries"]}
    assert {name: found[name] for name in found if name in expected} == \
        {"odtrain.kernels.blas:gemm_batched_parts": "odtrain.kernels.linalg:_gemm_batched",
         "odtrain.kernels.optim:adamw_update_parts": "odtrain.kernels.optim:adamw_update",
         "odtrain.kernels.linalg:_product_epilogue_parts": "odtrain.kernels.linalg:_product_epilogue",
         "odtrain.kernels.linalg:_activation_bias_grad_parts": "odtrain.kernels.linalg:_activation_bias_grad",
         "odtrain.kernels.elementwise:_unary_parts": "odtrain.kernels.elementwise:_unary"}
    assert all(found[name] is None for name in found if name not in expected)


@pytest.mark.parametrize("route", ["library", "jit"])
def test_a_label_outside_the_classes_names_the_node(mlp_library, route):
    """Through the library and through the JIT alike: the model, the node, the sample, the label and the class
    count, each once (the CLI's check before training names the same)."""
    folder = mlp_library[0] if route == "library" else mlp_library[1]
    _, meta, golden = reference_model("mlp")
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, num_threads=1)
    assert (module.kernel_library is not None) == (route == "library")
    labels = golden["y"][0].copy()
    labels[3] = meta["classes"] + 5
    with pytest.raises(InputError) as raised:
        module(golden["x"][0], labels)
    message = str(raised.value)
    assert "node" in message and "SoftmaxCrossEntropyLoss" in message
    assert f"sample 3 has label {meta['classes'] + 5}, outside the model's {meta['classes']} classes" in message
    model = str(folder / "training_model.onnx")
    assert message.count(model) == 1 and message.count("SoftmaxCrossEntropyLoss") == 1, message
    assert message.count("relabel") == 1 and "check the inputs' values" not in message, message


def test_a_library_kernel_stopped_on_its_data_is_worded_once(tmp_path):
    """An index outside an embedding, through a kernel library: the graph, the node and the advice once each
    (the library's error is not wrapped again as the JIT's ValueError is)."""
    from onnx import helper

    from odtrain import artifacts
    from oracles import make_model

    embed = np.random.default_rng(3).standard_normal((10, 4)).astype(np.float32)
    model = make_model([helper.make_node("Gather", ["embed", "ids"], ["out"], name="lookup")], {"embed": embed},
                       inputs=[("ids", np.int64, ["batch", 3])], outputs=[("out", np.float32, ["batch", 3, 4])])
    folder = tmp_path / "embedding"
    artifacts.generate_artifacts(model, requires_grad=["embed"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=folder)
    compile_artifacts(folder, batch_size=2, thread_counts=(1,), out=lambda line: None)
    module = Module(folder / "training_model.onnx", CheckpointState.load_checkpoint(folder / "checkpoint"),
                    num_threads=1)
    assert module.kernel_library is not None
    ids = np.array([[1, 2, 3], [4, 10, 5]], np.int64)
    with pytest.raises(InputError) as raised:
        module(ids, np.zeros((2, 3, 4), np.float32))
    message = str(raised.value)
    graph = module.graph(training=True).name
    assert "lookup" in message and message.count("check the inputs' values") == 1, message
    assert message.count(f"{graph}:") == 1, message


def test_kernels_the_library_lacks_compile_through_numba_and_say_so_once(mlp_library, capsys):
    with_library, _ = mlp_library
    library = KernelLibrary(str(with_library / kernel_library.FOLDER))
    with record_calls() as calls:
        train(with_library, 1, steps=1)
    removed = {(kernel_name(k), signature_of(a)) for k, a in calls[:2]}
    for key in removed:
        library.entries.pop(key)
    capsys.readouterr()
    terminal = Terminal()
    bar = Progress(10, "epoch 1/1", terminal)  # the line odtrain train and odtrain demo draw
    program = Program(library, calls)
    assert program.jit_calls >= 1
    message = FALLBACK_MESSAGE.format(count=len(removed))
    assert message in capsys.readouterr().err
    assert message in bar.line() and message in terminal.getvalue()  # while the first step compiles
    bar.update(1, loss=2.5)
    assert message not in bar.line() and "loss=2.5" in bar.line()
    bar.close()
    Program(library, calls)
    assert message not in capsys.readouterr().err  # once


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_note_shows_in_the_drawn_bar_and_on_stderr(capsys):
    makers = [lambda: Progress(4, "epoch 1/2", Terminal())]
    try:
        from odtrain.progress import _Tqdm
        from tqdm import tqdm
    except ImportError:  # tqdm is optional (the cli extra)
        pass
    else:
        makers.append(lambda: _Tqdm(tqdm, 4, "epoch 2/2", Terminal(), "it", 0, True))
    for make in makers:
        bar = make()
        announce("odtrain: compiling 3 kernels for this model")
        shown = bar.stream.getvalue()
        assert shown.count("compiling 3 kernels") == 2, shown  # a line of its own, and in the bar
        assert "compiling 3 kernels" in capsys.readouterr().err  # the bar draws elsewhere: stderr too
        bar.update(1, loss=0.5)
        bar.close()
    announce("odtrain: no bar is drawn")
    assert capsys.readouterr().err == "odtrain: no bar is drawn\n"


def test_a_library_from_elsewhere_is_refused_by_name(mlp_library, tmp_path, capsys):
    with_library, _ = mlp_library
    manifest = json.loads((with_library / kernel_library.FOLDER / kernel_library.MANIFEST_FILE).read_text())
    assert refusal_of(manifest) == ""
    assert "odtrain 0.0.1" in refusal_of({**manifest, "odtrain": "0.0.1"})
    assert "other kernel sources" in refusal_of({**manifest, "kernel_sources": "0" * 64})
    assert "Numba 0.1" in refusal_of({**manifest, "numba": "0.1"})
    assert "aarch64" in refusal_of({**manifest, "triple": "aarch64-unknown-linux-gnu"})
    if kernel_library.cpu_flags() is not None and "avx512_fp16" not in kernel_library.cpu_flags():
        assert "avx512fp16" in refusal_of({**manifest, "features": "+avx512fp16"})
    folder = tmp_path / "artifacts"
    shutil.copytree(with_library, folder)
    path = folder / kernel_library.FOLDER / kernel_library.MANIFEST_FILE
    path.write_text(json.dumps({**manifest, "odtrain": "0.0.1"}))
    assert kernel_library.find(folder) is None
    assert "kernel library refused" in capsys.readouterr().err


def test_argument_blocks_hold_records_numba_would_type_the_same():
    from numba import typeof

    from odtrain.library_build.link import argument_types, numba_type

    arena = np.zeros(64, dtype=np.float32)
    strided = arena[:48].reshape(6, 8)[:, ::2]
    frozen = np.arange(4, dtype=np.int64)
    frozen.flags.writeable = False
    values = [strided, arena.reshape(8, 8).T, frozen, 3, 2.5, True, np.float32(1.5), np.int64(7), (1, 2, 3),
              (1, 2.5, True)]
    for value in values:
        assert numba_type(kernel_library.argument_type(value)) == typeof(value), value
    assert [numba_type(t) for t in argument_types(signature_of(values))] == [typeof(v) for v in values]
    block = pack([strided, 3, np.float32(1.5)])
    assert block[0] == block.ctypes.data + 3 * 8  # the first record follows the pointers
    assert list(block[3:8]) == [strided.ctypes.data, 6, 4, 32, 8]
    assert block[8] == 3 and block[9:].view(np.float32)[0] == np.float32(1.5)


OPEN_ARTIFACTS = """
import sys, tempfile, numpy as np
from odtrain.api import CheckpointState, Module, Optimizer
folder = sys.argv[1]
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
module = Module(folder + "/training_model.onnx", state, folder + "/eval_model.onnx", num_threads=2)
optimizer = Optimizer(folder + "/optimizer_model.onnx", module)
"""  # a child process's session on the artifacts folder it is given

NO_COMPILER = OPEN_ARTIFACTS + """
rng = np.random.default_rng(0)
x, y = rng.standard_normal((64, 784)).astype(np.float32), rng.integers(0, 10, 64)
for _ in range(2):
    module(x, y); optimizer.step(); module.lazy_reset_grad()
module.eval(); module(x, y)
def loaded(roots):
    modules = sorted(m for m in sys.modules if m.split(".")[0] in roots)
    mapped = sorted({line.split()[-1] for line in open("/proc/self/maps")
                     if any(n in line for n in ("llvmlite", "/numba/", "/scipy/", "scipy.libs", "/onnx/"))})
    return modules, mapped
with tempfile.TemporaryDirectory() as out:
    CheckpointState.save_checkpoint(state, out + "/checkpoint")
    assert module.kernel_library is not None
    print(*loaded(("numba", "llvmlite", "scipy", "onnx")))
    module.export_model_for_inferencing(out + "/inference.onnx", ["output"])
    print(*loaded(("numba", "llvmlite", "scipy", "onnx")))
    import onnx, onnxruntime  # the same export through onnx: the same predictions
    onnx.checker.check_model(out + "/inference.onnx")
    module.export_model_for_inferencing(out + "/through_onnx.onnx", ["output"])
    predicted = [onnxruntime.InferenceSession(out + f).run(["output"], {"input": x})[0]
                 for f in ("/inference.onnx", "/through_onnx.onnx")]
    print(np.array_equal(*predicted))
"""


def test_a_training_loop_with_a_library_loads_no_compiler(mlp_library):
    with_library, _ = mlp_library
    result = subprocess.run([sys.executable, "-c", NO_COMPILER, str(with_library)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    training, export, agrees = result.stdout.splitlines()
    assert training == "[] []"  # checkpoint, Module, Optimizer, train and eval steps, save_checkpoint
    assert export == "[] []"  # the inference model written by onnx_wire
    assert agrees == "True"  # and ONNX Runtime runs it to the eval step's outputs
    assert "compiling" not in result.stderr


FORKED = """
import os, sys, numpy as np
from odtrain.api import CheckpointState, Module
folder = sys.argv[1]
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
module = Module(folder + "/training_model.onnx", state, num_threads=2)
rng = np.random.default_rng(0)
x, y = rng.standard_normal((64, 784)).astype(np.float32), rng.integers(0, 10, 64)
module(x, y)
module.lazy_reset_grad()
reader, writer = os.pipe()
child = os.fork()
if child == 0:
    module(x, y)
    os.write(writer, state._store.grad_flat.tobytes())
    os._exit(0)
module(x, y)
expected = state._store.grad_flat.tobytes()
received = b""
while len(received) < len(expected):
    received += os.read(reader, 1 << 20)
os.waitpid(child, 0)
print(received == expected)
"""


def test_a_child_forked_after_parallel_steps_still_trains(mlp_library):
    with_library, _ = mlp_library
    result = subprocess.run([sys.executable, "-c", FORKED, str(with_library)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_two_python_threads_step_two_modules_correctly(mlp_library):
    import threading

    with_library, _ = mlp_library
    _, _, golden = reference_model("mlp")
    alone = train(with_library, 2)[2]
    results = [None, None]

    def run(slot):
        results[slot] = train(with_library, 2)[2]

    workers = [threading.Thread(target=run, args=(slot,)) for slot in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert all(np.array_equal(r, alone) for r in results)


def test_strided_views_reshape_in_place_where_numpy_does(tmp_path):
    """The launcher's numba_attempt_nocopy_reshape (Numba's `reshape` of an 'A' view in library code) against
    numpy's reshape without a copy, on random strided views and shapes, in both orders."""
    import ctypes

    from odtrain.library_build.link import LAUNCHER

    library = tmp_path / "launcher.so"
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-fopenmp", "-DHIDDEN=", "-o", str(library),
                    LAUNCHER], check=True)
    reshape = ctypes.CDLL(str(library)).numba_attempt_nocopy_reshape
    reshape.restype = ctypes.c_int
    rng = np.random.default_rng(0)
    in_place = 0
    for _ in range(500):
        shape = tuple(int(s) for s in rng.integers(1, 5, size=rng.integers(1, 4)))
        view = np.zeros(tuple(2 * s for s in shape), np.float32)[
            tuple(slice(None, None, int(rng.integers(1, 3))) if rng.random() < 0.5 else slice(0, s) for s in shape)]
        view = view.T if rng.random() < 0.3 else view
        dims, rest = [], view.size
        for _ in range(rng.integers(1, 3)):
            dims.append(int(rng.choice([k for k in range(1, rest + 1) if rest % k == 0])))
            rest //= dims[-1]
        dims.append(rest)
        for order in "CF":
            try:
                expected = np.reshape(view, dims, order=order, copy=False).strides
            except ValueError:
                expected = None
            strides = (ctypes.c_int64 * len(dims))()
            done = reshape(ctypes.c_int64(view.ndim), (ctypes.c_int64 * view.ndim)(*view.shape),
                           (ctypes.c_int64 * view.ndim)(*view.strides), ctypes.c_int64(len(dims)),
                           (ctypes.c_int64 * len(dims))(*dims), strides, ctypes.c_int64(4), ctypes.c_int(order == "F"))
            assert bool(done) == (expected is not None), (view.shape, view.strides, dims, order)
            if done:
                in_place += 1
                assert all(a == b for a, b, d in zip(strides, expected, dims) if d != 1)
    assert in_place > 100


def test_compile_without_artifacts_asks_for_the_librarys_folder(capsys):
    from conftest import odtrain_main

    code, _, err = odtrain_main(capsys, "compile")
    assert code != 0 and "-o DIR" in err


def test_compile_takes_several_thread_counts_for_the_device():
    from odtrain.cli import build_parser

    args = build_parser().parse_args(["compile", "artifacts", "--threads", "1", "--threads", "4"])
    assert args.thread_counts == [1, 4] and getattr(args, "threads", None) is None  # not the process's own count


DEMO = """
import sys
from odtrain import demo
demo.LIBRARY = sys.argv[1]  # the package's library of the demo's kernels, as `pip install .` builds it (setup.py)
demo.run(sys.argv[2], epochs=2)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite", "scipy")))
"""


def test_the_demo_with_the_packages_library_compiles_nothing(mlp_library, tmp_path):
    with_library, _ = mlp_library
    result = subprocess.run([sys.executable, "-c", DEMO, str(with_library / kernel_library.FOLDER),
                             str(tmp_path / "demo")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "copied to" in result.stdout and "held-out accuracy" in result.stdout
    assert "compiling" not in result.stderr  # the fallback note: no kernel compiled
    assert result.stdout.splitlines()[-1] == "[]"  # nor was the compiler loaded
    assert (tmp_path / "demo" / kernel_library.FOLDER / kernel_library.MANIFEST_FILE).is_file()


def test_the_demo_without_a_library_in_the_package_says_so(tmp_path, monkeypatch):
    from odtrain import demo

    monkeypatch.setattr(demo, "LIBRARY", str(tmp_path / "none"))  # an editable install, or no C compiler
    line = demo.place_library(str(tmp_path / "demo"))
    assert "holds no library" in line and f"odtrain compile -o {tmp_path / 'none'}" in line
    assert not (tmp_path / "demo" / kernel_library.FOLDER).exists()


def test_a_prepared_update_follows_its_arrays_and_scalars(mlp_library):
    """library.call packs an update once for its arrays: later calls on other arrays of the same layout, or with
    other scalars, give what the JIT's kernel gives on them."""
    from odtrain.kernels.jit import resolved
    from odtrain.kernels.optim import adamw_update

    with_library, _ = mlp_library
    library = KernelLibrary(str(with_library / kernel_library.FOLDER))
    rng = np.random.default_rng(0)

    def buffers():
        weights, gradient, first, second = (rng.standard_normal(1000).astype(np.float32) for _ in range(4))
        return [weights, gradient, first, np.abs(second)]

    for arrays, rate, step in [(buffers(), 1e-2, 1.0), (buffers(), 1e-2, 1.0), (buffers(), 3e-3, 7.0)]:
        twins = [a.copy() for a in arrays]
        assert library.call(adamw_update, (*arrays, rate, 0.9, 0.999, 1e-8, 0.01, step, True))
        resolved(adamw_update)(*twins, rate, 0.9, 0.999, 1e-8, 0.01, step, True)
        assert all(np.array_equal(a, b) for a, b in zip(arrays, twins))
        again = [a.copy() for a in arrays]
        assert library.call(adamw_update, (*arrays, rate / 2, 0.9, 0.999, 1e-8, 0.01, step + 1, True))
        resolved(adamw_update)(*again, rate / 2, 0.9, 0.999, 1e-8, 0.01, step + 1, True)
        assert all(np.array_equal(a, b) for a, b in zip(arrays, again))
    assert len(library._prepared) == 3


def test_a_prepared_call_is_not_reused_for_a_view_of_other_strides_or_dtype(mlp_library):
    """A view at the same address and of the same shape as a prepared call's array, but with other strides or
    another dtype, is another argument: the call is prepared for it anew (here: the library has no such
    signature, so it is not run), never run on the packed layout of the first."""
    from odtrain.kernels.optim import adamw_update

    folder = str(mlp_library[0] / kernel_library.FOLDER)
    library = KernelLibrary(folder)
    rng = np.random.default_rng(2)
    base = rng.standard_normal(2000).astype(np.float32)
    gradient, first, second = (rng.standard_normal(1000).astype(np.float32) for _ in range(3))
    second = np.abs(second)

    def args(weights):  # the other arrays stay: only the weights' view changes
        return (weights, gradient, first, second, 1e-2, 0.9, 0.999, 1e-8, 0.01, 1.0, True)

    assert library.call(adamw_update, args(base[:1000]))  # prepared for a contiguous float32 view at base
    for view in (base[::2][:1000], base[:1000].view(np.int32)):
        assert view.__array_interface__["data"] == base.__array_interface__["data"] and view.shape == (1000,)
        expected = KernelLibrary(folder).address(adamw_update, args(view)) is not None
        before = base.copy()
        assert library.call(adamw_update, args(view)) == expected, (view.strides, view.dtype)
        if not expected:
            np.testing.assert_array_equal(base, before)


LANGUAGE_STEPS = OPEN_ARTIFACTS + """
rng = np.random.default_rng(1)
ids, labels = rng.integers(0, 7, (3, 5)), rng.integers(0, 7, (3, 5))
losses = []
for _ in range(3):
    losses.append(float(module(ids, labels)))
    optimizer.step()
    module.lazy_reset_grad()
print(losses)
print(sorted({m.split(".")[0] for m in sys.modules} & {"numba", "llvmlite"}))
"""


def test_a_language_model_compiles_at_a_sequence_length_and_trains_without_numba(tmp_path, capsys):
    """`odtrain compile --seq-len`: a model whose inputs have a sequence axis records its steps at that length; its
    library (here with the fused vocabulary loss reading an int8 tied embedding) trains with the JIT's bits and
    without loading Numba."""
    from conftest import odtrain_main
    from odtrain import artifacts
    from test_sequence_loss import stored_head_lm

    folder = tmp_path / "lm"
    artifacts.generate_artifacts(stored_head_lm(tied=True), requires_grad=["w"], frozen_params=["embed"],
                                 loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1, frozen_dtype="int8",
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
    code, _, err = odtrain_main(capsys, "compile", folder, "--batch-size", 3)
    assert code == 2 and "--seq-len N" in err  # the message names the option that exists
    code, _, err = odtrain_main(capsys, "compile", folder, "--batch-size", 3, "--seq-len", 5, "--threads", 2)
    assert code == 0, err
    runs = {}
    for library in ("on", "off"):
        env = dict(os.environ, **({"ODTRAIN_KERNEL_LIBRARY": "off"} if library == "off" else {}))
        result = subprocess.run([sys.executable, "-c", LANGUAGE_STEPS, str(folder)], capture_output=True, text=True,
                                timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        runs[library] = result.stdout.splitlines()
    assert runs["on"][0] == runs["off"][0]
    assert runs["on"][1] == "[]" and runs["off"][1] != "[]"


# ---- what a library records and how it is checked, without building one ---------------------------------

def test_a_library_records_batch_1_and_sequence_length_1_besides_the_sizes_asked():
    """A size-1 axis changes a call's types (a strided view of one row is contiguous): the transformer's batch-1
    step calls kernels no larger batch does, so a library records size 1 of every symbolic axis as well."""
    from odtrain.library_build.record import recorded_shapes

    assert recorded_shapes(32, None) == [(1, None), (32, None)]
    assert recorded_shapes(4, 64) == [(1, 1), (1, 64), (4, 1), (4, 64)]
    assert recorded_shapes(1, None) == [(1, None)]


def test_the_artifacts_digest_covers_the_models_not_the_checkpoint(tmp_path):
    """A library records the digest of the artifacts it was built for; training rewrites the checkpoint, so
    the digest must leave it out, or the folder's own library is refused after the first save."""
    for name in DIGESTED_MODELS:
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "checkpoint").write_bytes(b"before training")
    before = kernel_library.artifacts_digest(tmp_path)
    (tmp_path / "checkpoint").write_bytes(b"after a save")
    assert kernel_library.artifacts_digest(tmp_path) == before
    (tmp_path / "training_model.onnx").write_bytes(b"another model")
    assert kernel_library.artifacts_digest(tmp_path) != before


def test_cpu_features_a_library_disables_are_not_required():
    """A manifest's features string lists '+f' for what the code may use and '-f' for what it must not: only
    the former are required of the CPU (a host with every AVX-512 flag would never notice otherwise)."""
    from odtrain.kernel_library.cpu import missing_features

    without_avx512 = {"sse4_1", "sse4_2", "avx", "avx2", "fma"}
    assert missing_features("x86_64", "+avx2,+fma,-avx512f,-avx512bw,-avx512vl", without_avx512) == []
    assert missing_features("x86_64", "+avx2,+avx512f,-avx512bw", without_avx512) == ["avx512f"]
    assert missing_features("aarch64", "+neon,-sve", {"asimd"}) == []


def test_the_compile_advice_names_the_target_of_a_device_that_needs_one(monkeypatch):
    """On a Raspberry Pi (aarch64, a named default CPU) the advice says `--target aarch64`: the command runs on
    the desktop, which would otherwise build for itself; on x86_64 the desktop's own target is the default."""
    monkeypatch.setattr(kernel_messages, "host_arch", lambda: "aarch64")
    assert "`odtrain compile art --target aarch64` " in kernel_library.compile_command("art")
    monkeypatch.setattr(kernel_messages, "host_arch", lambda: "x86_64")
    assert "`odtrain compile art` " in kernel_library.compile_command("art")


def test_the_optimizer_precheck_asks_for_the_update_the_steps_run_at_their_thread_count(monkeypatch):
    """Where Numba is not installed, the pre-check asks the library for the update apply_update calls: its
    parallel twin at 2 threads on a large block. A library holding only the serial update is refused before
    any gradient is computed, naming the twin; at 1 thread it serves."""
    from odtrain import optimizer_update
    from odtrain.graph.errors import KernelsUnavailableError
    from odtrain.graph.optimizers import SGD

    class SerialOnly:
        folder = "kernels"

        def address(self, kernel, args):
            return None if kernel_name(kernel).endswith("_parts") else 1

    monkeypatch.setattr(optimizer_update, "compiler_installed", lambda: False)
    size = 1 << 20
    weights, grads = np.zeros(size, np.float32), np.zeros(size, np.float32)
    config = SGD()
    optimizer_update.require_update_kernels(config, weights, grads, {}, 1, None, SerialOnly(), "art")
    with pytest.raises(KernelsUnavailableError, match=r"the optimizer's update: kernel \S+:sgd_update_parts\("):
        optimizer_update.require_update_kernels(config, weights, grads, {}, 2, None, SerialOnly(), "art")


def stand_in_library(folder, symbols=3) -> dict:
    """A library folder whose shared object has the runner's symbols and `symbols` kernel wrappers (built with the C
    compiler, no Numba), and its manifest (returned), which this odtrain loads."""
    from odtrain import __version__
    from odtrain.jit.cache import sources_digest
    from odtrain.kernel_library.cpu import TARGETS, host_arch

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    folder.mkdir(parents=True)
    (folder / "stand_in.c").write_text(
        "#include <stdint.h>\nint64_t odtrain_run(int64_t n, void *f, void *b, int64_t t) { return -1; }\n"
        "int32_t odtrain_regions_forked(void) { return 0; }\nvoid odtrain_set_gemm(void *a, void *b) {}\n"
        + "".join(f"int32_t odtrainkernel_{i}(void **a) {{ return 0; }}\n" for i in range(symbols)))
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / kernel_library.LIBRARY_FILE),
                    str(folder / "stand_in.c")], check=True)
    manifest = {"odtrain": __version__, "kernel_sources": sources_digest(),
                "numba": kernel_library.installed_version("numba"), "triple": TARGETS[host_arch()], "cpu": "generic",
                "features": "", "entries": [{"kernel": f"odtrain.kernels.training:kernel_{i}",
                                             "signature": "float32[1C]", "symbol": f"odtrainkernel_{i}"}
                                            for i in range(symbols)]}
    (folder / kernel_library.MANIFEST_FILE).write_text(json.dumps(manifest))
    return manifest


def test_a_manifest_that_does_not_describe_its_shared_object_is_refused_by_name(tmp_path, capsys):
    """A symbol the shared object lacks, an entry without its symbol, entries that are not records, a shared object
    that is missing: each refused by name (find then falls back to the JIT), never ctypes' AttributeError or a
    KeyError."""
    folder = tmp_path / "artifacts" / kernel_library.FOLDER
    manifest = stand_in_library(folder)
    assert len(KernelLibrary(str(folder)).entries) == 3
    path = folder / kernel_library.MANIFEST_FILE
    damaged = {"symbol renamed": ({**manifest, "entries": [*manifest["entries"][:2], {**manifest["entries"][2],
                                                                                       "symbol": "odtrainkernel_10"}]},
                                  "entry 2 has a symbol libodtrain_kernels.so lacks"),
               "symbol missing": ({**manifest, "entries": [{k: v for k, v in manifest["entries"][1].items()
                                                            if k != "symbol"}]}, "entry 0 has no 'symbol'"),
               "entries not records": ({**manifest, "entries": ["odtrainkernel_0"]}, "damaged manifest"),
               "not an object": ([manifest], "damaged manifest")}
    for case, (content, reason) in damaged.items():
        path.write_text(json.dumps(content))
        with pytest.raises(kernel_library.LibraryRefused, match=reason):
            KernelLibrary(str(folder))
        kernel_library.forget(folder)
        assert kernel_library.find(tmp_path / "artifacts") is None, case
        assert reason in capsys.readouterr().err, case
    other = tmp_path / "other" / kernel_library.FOLDER  # never loaded: the loader keeps what it opened by path
    stand_in_library(other)
    (other / kernel_library.LIBRARY_FILE).rename(other / "moved.so")
    with pytest.raises(kernel_library.LibraryRefused, match="libodtrain_kernels.so cannot be loaded"):
        KernelLibrary(str(other))


def test_an_update_whose_parallel_twin_the_library_lacks_runs_serially_there(monkeypatch):
    """A thread count raised after the Optimizer's pre-check (which passed at one thread) meets a library holding
    the serial update only: the step runs the serial update through the library, with the same numbers, instead
    of failing after the gradients were computed."""
    from odtrain import optimizer_update
    from odtrain.graph.optimizers import SGD

    class SerialOnly:
        folder = "kernels"
        ran = []

        def address(self, kernel, args):
            return None if kernel_name(kernel).endswith("_parts") else 1

        def call(self, kernel, args, threads=1):
            if self.address(kernel, args) is None:
                return False
            self.ran.append(kernel_name(kernel))
            kernel.py_func(*args) if hasattr(kernel, "py_func") else kernel(*args)
            return True

    monkeypatch.setattr(optimizer_update, "compiler_installed", lambda: False)
    size = 1 << 20
    weights, grads = np.ones(size, np.float32), np.full(size, 2.0, np.float32)
    library = SerialOnly()
    optimizer_update.apply_update(SGD(), weights, grads, {}, 0.25, 1, threads=2, library=library)
    assert library.ran and all(name.endswith(":sgd_update") for name in library.ran)
    np.testing.assert_array_equal(weights, np.full(size, 0.5, np.float32))
