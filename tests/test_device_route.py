"""The device route: a kernel library serves every shape its artifacts accept, on a device with numpy and odtrain
only, and every way that route can fail says so in one line.

Two libraries serve this module (`odtrain compile` at its defaults: batch 32, the language model at one sequence
length, threads 1 and 2): the reference MLP's (with the demo classifier's kernels; conftest's, shared with
tests/test_kernel_library.py) and a tiny Llama's with LoRA adapters and dynamic batch and sequence axes, built here.
A child process in which numba, llvmlite, scipy and onnx cannot be imported (the device) then runs a training, an
optimizer and an eval step at batch sizes and sequence lengths the library was never recorded at, and its losses
and weights must be the JIT's, bit for bit, at the same shapes.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA, odtrain_main, reference_artifacts
from odtrain import artifacts, kernel_library
from odtrain.api import CheckpointState
from odtrain.library_build import compile_artifacts
from device_steps import steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREADS = 2  # the library records 1 and 2 threads; the device runs at 2
MLP_BATCHES = [1, 7, 32, 100, 512, 2048]
# every batch size and every sequence length of the device's list, each at least once
LLAMA_SHAPES = [(1, 1), (7, 200), (32, 64), (100, 24), (512, 5), (2048, 1)]
COMPILER = ("numba", "llvmlite", "scipy", "onnx")

# The device: the compiler's modules cannot be imported (as where they are not installed)
DEVICE = """
import importlib.abc, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in %r:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
sys.meta_path.insert(0, NotInstalled())
""" % (COMPILER,)

STEPS = DEVICE + """
import json
import numpy as np
sys.path.insert(0, sys.argv[1])
from device_steps import steps
folder, kind, shapes, threads = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
print(json.dumps(steps(folder, kind, shapes, threads)))
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(%r))))
""" % (COMPILER,)

CLI = DEVICE + """
from odtrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def llama_artifacts(folder):
    config = artifacts.LoraConfig(4, 8.0, ["*q_proj.weight", "*v_proj.weight"], seed=1)
    artifacts.generate_artifacts(str(DATA / "decoders" / "llama" / "torchscript17.onnx"),
                                 loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1, ignore_index=-100,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder,
                                 requires_grad=["model.norm.weight"], lora=config)
    return folder


@pytest.fixture(scope="module")
def device(tmp_path_factory, mlp_kernel_library):
    """{"mlp": folder, "llama": folder, "library": the MLP's library folder}: one library holds the MLP's and the
    demo's kernels (conftest's, in the MLP's kernels/, a copy apart), the Llama's own (recorded at sequence length
    16) sits in its kernels/. Apart, so that one model's kernels do not stand in for another's."""
    root = tmp_path_factory.mktemp("device")
    assert THREADS == 2  # conftest's library records 1 and 2 threads
    mlp = mlp_kernel_library
    llama = llama_artifacts(root / "llama")
    library = root / "library"
    shutil.copytree(mlp / kernel_library.FOLDER, library)
    compile_artifacts(llama, thread_counts=(1, THREADS), sequence_length=16, out=lambda line: None)
    return {"mlp": mlp, "llama": llama, "library": library}


def on_device(*argv, env=None, script=STEPS, timeout=900):
    return subprocess.run([sys.executable, "-c", script, *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def jit_steps(monkeypatch, folder, kind, shapes, threads):
    monkeypatch.setenv(kernel_library.LIBRARY_ENV, "off")
    return steps(folder, kind, shapes, threads)


@pytest.mark.slow
@pytest.mark.parametrize("kind, shapes, threads", [
    ("mlp", [(b, None) for b in MLP_BATCHES], THREADS), ("mlp", [(1, None), (100, None), (2048, None)], 1),
    ("llama", LLAMA_SHAPES, THREADS)], ids=["mlp-2-threads", "mlp-1-thread", "llama-2-threads"])
def test_the_library_serves_every_shape_without_a_compiler_with_the_jits_bits(device, monkeypatch, kind, shapes,
                                                                              threads):
    """Batches 1 to 2048 and sequences 1 to 200 from a library recorded at batch 32 and sequence 16: every call of
    every step in the library, nothing of the compiler imported, and each loss and the trained weights equal to
    the JIT's at the same shape and threads."""
    result = on_device(os.path.dirname(__file__), device[kind], kind, json.dumps(shapes), threads)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    on_library, loaded = json.loads(lines[0]), json.loads(lines[1])
    assert loaded == []
    assert all(r["library"] and r["jit"] == 0 for r in on_library), on_library
    by_jit = jit_steps(monkeypatch, device[kind], kind, shapes, threads)
    assert [{k: v for k, v in r.items() if k not in ("jit", "library")} for r in on_library] == \
        [{k: v for k, v in r.items() if k not in ("jit", "library")} for r in by_jit]


def artifacts_copy(source, target, with_library=False):
    shutil.copytree(source, target, ignore=None if with_library else shutil.ignore_patterns(kernel_library.FOLDER))
    return target


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_without_a_library_train_exits_2_naming_odtrain_compile(device, tmp_path):
    folder = artifacts_copy(device["mlp"], tmp_path / "mlp")
    np.savez(tmp_path / "data.npz", x=np.zeros((40, 784), np.float32), y=np.zeros(40, np.int64))
    result = on_device("train", folder, "--data", tmp_path / "data.npz", "--epochs", 1, script=CLI)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert f"no kernel library in {folder / 'kernels'}" in line and f"`odtrain compile {folder}" in line
    assert (folder / "checkpoint").read_bytes() == (device["mlp"] / "checkpoint").read_bytes()  # nothing done


def test_a_library_of_other_artifacts_is_named_and_no_step_runs(device, tmp_path):
    """The MLP's artifacts again with SGD (another optimizer model) beside the AdamW artifacts' library: the
    manifest names the artifacts it was built for."""
    folder = tmp_path / "mlp-sgd"
    reference_artifacts("mlp", folder, optimizer="SGD")
    shutil.copytree(device["library"], folder / kernel_library.FOLDER)
    result = on_device(os.path.dirname(__file__), folder, "mlp", json.dumps([[8, None]]), THREADS)
    assert result.returncode != 0
    assert "KernelsUnavailableError" in result.stderr and "built for other artifacts" in result.stderr
    assert str(device["mlp"]) in result.stderr and f"odtrain compile {folder}" in result.stderr
    np.savez(tmp_path / "data.npz", x=np.zeros((16, 784), np.float32), y=np.zeros(16, np.int64))
    result = on_device("train", folder, "--data", tmp_path / "data.npz", "--epochs", 1, script=CLI)
    assert result.returncode == 2 and "built for other artifacts" in one_line(result.stderr)


def test_a_library_for_another_architecture_is_refused_in_the_one_line(device, tmp_path):
    folder = artifacts_copy(device["mlp"], tmp_path / "mlp", with_library=True)
    manifest_path = folder / kernel_library.FOLDER / kernel_library.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["triple"] = "riscv64-unknown-linux-gnu"  # as a library cross-built for another device would say
    manifest_path.write_text(json.dumps(manifest))
    np.savez(tmp_path / "data.npz", x=np.zeros((16, 784), np.float32), y=np.zeros(16, np.int64))
    result = on_device("train", folder, "--data", tmp_path / "data.npz", "--epochs", 1, script=CLI)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "refused" in line and "built for riscv64" in line and "odtrain compile" in line


OPTIMIZER = DEVICE + """
from odtrain.api import CheckpointState, Module, Optimizer
folder, fused = sys.argv[1], sys.argv[2] == "fused"
module = Module(folder + "/training_model.onnx", CheckpointState.load_checkpoint(folder + "/checkpoint"))
Optimizer(folder + "/optimizer_model.onnx", module, fuse_with_backward=fused)
print("constructed")
"""


def test_a_library_without_the_optimizers_update_says_so_before_any_step(device, tmp_path):
    """The MLP's AdamW artifacts with their library less its AdamW update (as one compiled from the SGD artifacts
    would be): the optimizer refuses when it is made, naming its kernel, before a step computes gradients."""
    folder = artifacts_copy(device["mlp"], tmp_path / "mlp", with_library=True)
    manifest_path = folder / kernel_library.FOLDER / kernel_library.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    kept = [e for e in manifest["entries"] if e["kernel"].split(":")[1] not in ("adamw_update", "adamw_update_parts")]
    assert 0 < len(kept) < len(manifest["entries"])
    manifest_path.write_text(json.dumps(dict(manifest, entries=kept)))
    for fused in ("fused", "unfused"):
        result = on_device(folder, fused, script=OPTIMIZER)
        assert result.returncode != 0 and "constructed" not in result.stdout, (fused, result.stdout, result.stderr)
        message = result.stderr.strip().splitlines()[-1]
        assert message.startswith("odtrain.graph.errors.KernelsUnavailableError: the optimizer's update: kernel ")
        assert ":adamw_update" in message and "(float32[1C]" in message and f"odtrain compile {folder}" in message
    np.savez(tmp_path / "data.npz", x=np.zeros((16, 784), np.float32), y=np.zeros(16, np.int64))
    result = on_device("train", folder, "--data", tmp_path / "data.npz", "--epochs", 1, script=CLI)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "the optimizer's update: kernel " in line and ":adamw_update" in line and f"odtrain compile {folder}" in line
    assert (folder / "checkpoint").read_bytes() == (device["mlp"] / "checkpoint").read_bytes()


CNN_STEP = DEVICE + """
import numpy as np
from odtrain.api import CheckpointState, Module
folder = sys.argv[1]
module = Module(folder + "/training_model.onnx", CheckpointState.load_checkpoint(folder + "/checkpoint"))
shape = [t.shape for t in module.input_types(True).values()][0]
module(np.zeros((2, *shape[1:]), np.float32), np.zeros(2, np.int64))
"""


def test_a_kernel_the_library_lacks_names_node_kernel_and_argument_types(device, tmp_path):
    """The CNN's artifacts with the MLP's library (ODTRAIN_KERNEL_LIBRARY: no artifacts to check it against):
    its convolutions are not in it."""
    folder = reference_artifacts("cnn", tmp_path / "cnn")
    result = on_device(folder, script=CNN_STEP, env={kernel_library.LIBRARY_ENV: str(device["library"])})
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("odtrain.graph.errors.KernelsUnavailableError: ")
    assert "Conv" in message.split("kernel ")[0]  # the node
    assert "odtrain.kernels." in message and "float32[" in message and "is not in the kernel library" in message
    assert f"odtrain compile {folder}" in message


def test_the_demo_and_the_profile_run_on_the_device(device, tmp_path):
    result = on_device("demo", "-o", tmp_path / "demo", "--epochs", 1, script=CLI,
                       env={kernel_library.LIBRARY_ENV: str(device["library"])})
    assert result.returncode == 0, result.stderr
    assert "artifacts copied to" in result.stdout and "held-out accuracy" in result.stdout
    result = on_device("profile", device["mlp"], "--batch-size", 64, "--steps", 2, script=CLI)
    assert result.returncode == 0, result.stderr
    assert "profile of" in result.stdout and "/fc1/Gemm" in result.stdout


@pytest.mark.parametrize("argv, module", [(["check", "MODEL"], "onnx"), (["compile", "FOLDER"], "numba")])
def test_a_command_that_needs_the_desktop_says_so_in_one_line(device, argv, module):
    argv = [str(DATA / "mlp" / "forward.onnx") if a == "MODEL" else str(device["mlp"]) if a == "FOLDER" else a
            for a in argv]
    result = on_device(*argv, script=CLI)
    assert result.returncode == 2
    assert f"needs {module}, which is not installed here" in one_line(result.stderr)


def test_the_packages_demo_artifacts_are_what_the_demo_generates(tmp_path):
    from odtrain import demo
    from odtrain.demo import demo_artifacts

    demo_artifacts(tmp_path)
    for name in demo.ARTIFACT_FILES[:3]:  # the models: their bytes (the library's record of them)
        assert (tmp_path / name).read_bytes() == open(os.path.join(demo.ARTIFACTS, name), "rb").read(), name
    fresh = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    shipped = CheckpointState.load_checkpoint(os.path.join(demo.ARTIFACTS, "checkpoint"))
    for name in demo.classifier_parameters():
        assert np.array_equal(fresh.parameters[name].data, shipped.parameters[name].data), name


def test_prepare_force_replaces_the_kernel_library(tmp_path, capsys):
    folder = tmp_path / "artifacts"
    model = DATA / "mlp" / "forward.onnx"
    assert odtrain_main(capsys, "prepare", model, "-o", folder)[0] == 0
    (folder / kernel_library.FOLDER).mkdir()
    (folder / kernel_library.FOLDER / kernel_library.MANIFEST_FILE).write_text("{}")
    code, _, err = odtrain_main(capsys, "prepare", model, "-o", folder, "--force")
    assert code == 0 and not (folder / kernel_library.FOLDER).exists()
    assert f"`odtrain compile {folder}` builds theirs" in err


@pytest.mark.slow
def test_a_pure_wheel_installs_for_aarch64(tmp_path):
    """`ODTRAIN_BUILD_LIBRARY=0 pip wheel --no-deps .`: py3-none-any, which pip installs for manylinux2014_aarch64."""
    pytest.importorskip("setuptools", reason="the build backend, used here without pip's isolated environment")
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                                 ".hypothesis", "benchmarks", "data"))
    shutil.copytree(os.path.join(ROOT, "odtrain", "data"), source / "odtrain" / "data",
                    ignore=shutil.ignore_patterns("kernels"))  # a library built there is no part of a checkout
    env = dict(os.environ, ODTRAIN_BUILD_LIBRARY="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), "."], cwd=source, env=env, check=True, timeout=600)
    (wheel,) = os.listdir(tmp_path / "dist")
    assert wheel.endswith("-py3-none-any.whl"), wheel
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
                             "--platform", "manylinux2014_aarch64", "--only-binary=:all:", "--target",
                             str(tmp_path / "site"), str(tmp_path / "dist" / wheel)], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0 and "Would install odtrain" in result.stdout, result.stderr
