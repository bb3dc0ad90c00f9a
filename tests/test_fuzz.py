"""Damaged files never crash odtrain: seeded mutations of real artifacts, each opened as a user opens it.

What is damaged (each file kind below is written once, then mutated many times from one seed):
- the reference MLP's training, eval and optimizer models (odtrain's own protobuf reader), its checkpoint
  after a step and a save (optimizer state and properties included), and the CNN's training model (Conv
  attributes);
- the two forward models as an exporter writes them (onnx's reader), and the MLP's forward model with its
  weights in an external-data file (the model and the data file each);
- a kernel library's manifest and its shared object's name (a small stand-in shared object with the
  runner's symbols, built with the C compiler);
- a data .npz and a WAV clip.
How: bit flips, truncation, inserted bytes, a length or count inflated (a 4- or 8-byte integer or a protobuf
varint written over the bytes at an offset), and for the manifest also its JSON records changed (a key
dropped, a value of another type, a symbol renamed).
How each is opened: as the API opens it and then used (a training step, an eval step, an optimizer step,
an inference run, a dataset read, a clip cut to the model's length; the CNN's training model is loaded into
a Module only: with a cold kernel cache its first step compiles for minutes, and planning each step takes
a good part of a second), or, for a library, found beside the artifacts (`kernel_library.find`, which refuses a library by name and falls back to the JIT).
Each must end loaded or refused with an odtrain error (`odtrain.OdtrainError`): never another exception,
a hang (an alarm per file), or an allocation larger than the file justifies (the address space is capped
while the files are opened, so such an allocation fails as a MemoryError instead of succeeding lazily).
"""
import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import wave

import numpy as np
import onnx
import pytest

from conftest import DATA, reference_artifacts
from odtrain import OdtrainError, kernel_library
from odtrain.api import CheckpointState, Module, Optimizer

SEED = 20261129
SECONDS_PER_FILE = 60  # a hang ends here; the slowest open (a step that compiles a new kernel) takes seconds
ADDRESS_SPACE_HEADROOM = 3 << 30  # bytes of address space the opens may add to what the process holds
BATCH = 4
# how many damaged copies of each file kind (at least 2,000 in all)
COUNTS = {"training model": 300, "eval model": 160, "optimizer model": 120, "checkpoint": 300,
          "cnn training model": 160, "forward models": 240, "external model": 100, "external data": 140,
          "manifest": 220, "shared object name": 20, "npz": 160, "wav": 160}
INFLATED = (0xFFFFFFFF, 0x7FFFFFFF, 1 << 40, (1 << 63) - 1)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def mutated(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """(what was done, the damaged bytes) of one random mutation of `data`."""
    kind = rng.choice(("flip", "truncate", "insert", "inflate"))
    offset = rng.randrange(max(1, len(data)))
    if kind == "flip":
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        return f"flip near {offset}", bytes(damaged)
    if kind == "truncate":
        return f"truncate at {offset}", data[:offset]
    if kind == "insert":
        return f"insert at {offset}", data[:offset] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) \
            + data[offset:]
    value = rng.choice(INFLATED)
    encoded = rng.choice((struct.pack("<I", value & 0xFFFFFFFF), struct.pack("<Q", value), varint(value)))
    return f"inflate {value} at {offset}", data[:offset] + encoded + data[offset + len(encoded):]


def manifest_mutated(text: bytes, rng: random.Random) -> tuple[str, bytes]:
    """A byte mutation, or one of the manifest's records changed as JSON."""
    if rng.random() < 0.5:
        return mutated(text, rng)
    manifest = json.loads(text)
    entry = rng.choice(manifest["entries"])
    key = rng.choice(sorted(entry))
    change = rng.choice(("drop", "type", "rename", "top"))
    if change == "drop":
        del entry[key]
    elif change == "type":
        entry[key] = rng.choice((None, 7, [], {"a": 1}, 1.5))
    elif change == "rename":
        value = str(entry[key]) or "x"
        index = rng.randrange(len(value))
        entry[key] = value[:index] + chr(rng.randrange(33, 127)) + value[index + 1:]
    else:
        key = rng.choice(sorted(manifest))
        manifest[key] = rng.choice((None, 7, [], "", {"a": 1}))
    return f"manifest {change} {key}", json.dumps(manifest).encode()


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """The undamaged files and what opening each needs."""
    from odtrain.jit.cache import sources_digest

    root = tmp_path_factory.mktemp("fuzz")
    mlp = reference_artifacts("mlp", root / "mlp")
    golden = np.load(DATA / "mlp" / "golden.npz")
    x, y = golden["x"][0][:BATCH], golden["y"][0][:BATCH]
    state = CheckpointState.load_checkpoint(mlp / "checkpoint")
    module = Module(mlp / "training_model.onnx", state, mlp / "eval_model.onnx")
    optimizer = Optimizer(mlp / "optimizer_model.onnx", module)
    module(x, y)
    optimizer.step()
    CheckpointState.save_checkpoint(state, mlp / "checkpoint")  # with moments, a step and properties
    cnn = reference_artifacts("cnn", root / "cnn")

    external = root / "external"
    external.mkdir()
    forward = onnx.load(str(DATA / "mlp" / "forward.onnx"))
    onnx.save(forward, str(external / "forward.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="forward.onnx.data", size_threshold=0)

    data = root / "data.npz"
    np.savez(data, input=golden["x"][0][:16], labels=golden["y"][0][:16])
    clip = root / "clip.wav"
    with wave.open(str(clip), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(16000)
        file.writeframes((np.sin(np.arange(8000) / 7) * 9000).astype("<i2").tobytes())

    library = root / "library"
    folder = library / kernel_library.FOLDER
    folder.mkdir(parents=True)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is not None:
        (folder / "stand_in.c").write_text(
            "#include <stdint.h>\n"
            "int64_t odtrain_run(int64_t n, void *f, void *b, int64_t t) { return -1; }\n"
            "int32_t odtrain_regions_forked(void) { return 0; }\n"
            "void odtrain_set_gemm(void *a, void *b) {}\n"
            + "".join(f"int32_t odtrainkernel_{i}(void **a) {{ return 0; }}\n" for i in range(3)))
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / kernel_library.LIBRARY_FILE),
                        str(folder / "stand_in.c")], check=True)
    from odtrain import __version__
    from odtrain.kernel_library.cpu import TARGETS, host_arch

    manifest = {"odtrain": __version__, "kernel_sources": sources_digest(),
                "numba": kernel_library.installed_version("numba"), "llvmlite": None,
                "triple": TARGETS[host_arch()], "cpu": "generic", "features": "",
                "entries": [{"kernel": f"odtrain.kernels.training:kernel_{i}", "signature": "float32[1C]",
                             "symbol": f"odtrainkernel_{i}", "errors": ["a message"]} for i in range(3)]}
    (folder / kernel_library.MANIFEST_FILE).write_text(json.dumps(manifest))
    return {"mlp": mlp, "x": x, "y": y, "cnn": cnn, "external": external, "data": data,
            "clip": clip, "library": library, "has_compiler": compiler is not None}


def opener(kind: str, files: dict, work):
    """(the file to damage, a function opening the damaged file at that path as a user does: it returns False
    for a file refused without an exception, a library `find` passes over)."""
    mlp, x, y = files["mlp"], files["x"], files["y"]

    def state():
        return CheckpointState.load_checkpoint(work / "checkpoint")

    def train(folder):
        module = Module(folder / "training_model.onnx", state(), folder / "eval_model.onnx")
        Optimizer(folder / "optimizer_model.onnx", module).step()
        module(x, y)
        module.eval()
        module(x, y)

    if kind in ("training model", "eval model", "optimizer model", "checkpoint"):
        name = {"training model": "training_model.onnx", "eval model": "eval_model.onnx",
                "optimizer model": "optimizer_model.onnx", "checkpoint": "checkpoint"}[kind]
        return mlp / name, lambda: train(work)
    if kind == "cnn training model":  # loaded into a Module only: see the module docstring
        def cnn_module():
            Module(work / "training_model.onnx", CheckpointState.load_checkpoint(work / "checkpoint"))
        return files["cnn"] / "training_model.onnx", cnn_module
    if kind == "forward models":
        from odtrain.graph.onnx_io import load_graph
        from odtrain.graph.ops import check_supported

        def check():
            graph = load_graph(str(work / "forward.onnx"))
            check_supported(graph.nodes, "forward.onnx")
        return None, check
    if kind in ("external model", "external data"):
        from odtrain.inference import InferenceSession

        def infer():
            InferenceSession(str(work / "forward.onnx")).run(None, {"input": x})
        name = "forward.onnx" if kind == "external model" else "forward.onnx.data"
        return files["external"] / name, infer
    if kind == "npz":
        from odtrain import data_loading as data
        from odtrain.data_loading import InputSpec

        inputs = [InputSpec("input", np.dtype(np.float32), ("batch", 784), False),
                  InputSpec("labels", np.dtype(np.int64), ("batch",), True)]
        return files["data"], lambda: data.load(str(work / "data.npz"), inputs)
    if kind == "wav":
        from odtrain.audio import AudioSource

        return files["clip"], lambda: AudioSource(str(work)).clip(str(work / "clip.wav"), 8000)
    if kind in ("manifest", "shared object name"):
        def find():
            folder = os.path.abspath(work / kernel_library.FOLDER)
            kernel_library.forget(folder)  # find remembers each folder's library: look again
            return kernel_library.find(work) is not None  # refused: None, said on stderr
        return files["library"] / kernel_library.FOLDER / kernel_library.MANIFEST_FILE, find
    raise AssertionError(kind)


class Alarm(BaseException):
    """A file whose open outlived SECONDS_PER_FILE (a BaseException: nothing in odtrain may swallow it)."""


def _alarm(signum, frame):
    raise Alarm()


def test_damaged_files_load_or_are_refused_with_an_odtrain_error(originals, tmp_path, capsys):
    rng = random.Random(SEED)
    outcomes, failures, seconds = {}, [], {}
    previous_handler = signal.signal(signal.SIGALRM, _alarm)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = held + ADDRESS_SPACE_HEADROOM
    try:
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
        for kind, count in COUNTS.items():
            if kind in ("manifest", "shared object name") and not originals["has_compiler"]:
                continue
            start = time.perf_counter()
            work = tmp_path / kind.replace(" ", "-")
            source_folder = {"cnn training model": originals["cnn"], "external model": originals["external"],
                             "external data": originals["external"], "manifest": originals["library"],
                             "shared object name": originals["library"]}.get(kind, originals["mlp"])
            shutil.copytree(source_folder, work)
            shutil.copy(originals["data"], work / "data.npz")
            shutil.copy(originals["clip"], work / "clip.wav")
            target, open_it = opener(kind, originals, work)
            sources = [DATA / "mlp" / "forward.onnx", DATA / "cnn" / "forward.onnx"] if target is None else [target]
            if target is None:
                shutil.copy(sources[0], work / "forward.onnx")
            if kind != "shared object name":  # (its library is never opened from the undamaged name)
                assert open_it() is not False  # undamaged, it loads: the kernels it needs compile now, unalarmed
            for index in range(count):
                source = sources[index % len(sources)]
                original = source.read_bytes()
                if kind == "shared object name":
                    # a folder of its own each time: the dynamic loader keeps a shared object it opened by its
                    # path, and a user's process opens one library once
                    case = work / f"case{index}"
                    shutil.copytree(originals["library"], case)
                    name = bytearray(kernel_library.LIBRARY_FILE.encode())
                    name[rng.randrange(len(name))] = rng.choice(b"abcdefgh_.0123")
                    what = f"shared object named {name.decode()}"
                    library = case / kernel_library.FOLDER
                    (library / kernel_library.LIBRARY_FILE).rename(library / name.decode())
                    open_it = (lambda folder: lambda: kernel_library.find(folder) is not None)(case)
                    path = None
                else:
                    what, damaged = (manifest_mutated if kind == "manifest" else mutated)(original, rng)
                    path = work / ("forward.onnx" if kind == "forward models" else
                                   source.relative_to(source_folder) if source.is_relative_to(source_folder) else
                                   source.name)
                    path.write_bytes(damaged)
                signal.alarm(SECONDS_PER_FILE)
                counts = outcomes.setdefault(kind, {"loaded": 0, "refused": 0})
                try:
                    counts["loaded" if open_it() is not False else "refused"] += 1
                except OdtrainError:
                    counts["refused"] += 1
                except (Exception, Alarm) as error:  # noqa: B902  (what the test is for)
                    failures.append(f"{kind} ({source.name}, {what}): {type(error).__name__}: {str(error)[:300]}")
                finally:
                    signal.alarm(0)
                if path is not None:
                    path.write_bytes(original)
            seconds[kind] = time.perf_counter() - start
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous_handler)
    capsys.readouterr()  # the refusals a library's find says on stderr
    total = sum(c["loaded"] + c["refused"] for c in outcomes.values()) + len(failures)
    print(f"{total} damaged files, {len(failures)} failures; by kind (loaded / refused, seconds): " + ", ".join(
        f"{k} {c['loaded']}/{c['refused']} {seconds[k]:.1f} s" for k, c in outcomes.items()), file=sys.__stderr__)
    assert not failures, f"{len(failures)} of {total} damaged files ended otherwise:\n" + "\n".join(failures[:20])
    assert total >= 2000 or not originals["has_compiler"]


# ---- the damage the fuzz found, each on its own --------------------------------------------------------

@pytest.mark.parametrize("rate", [1, 999, 4_294_967_295])
def test_a_clip_declaring_a_sample_rate_no_recorder_writes_is_refused(tmp_path, rate):
    """A damaged rate field (1 Hz, 4 GHz) would make resampling to the model's rate hold gigabytes for a file of
    kilobytes (the filter spans ~16 periods of the slower rate, the output grows by their ratio)."""
    from odtrain.audio import AudioSource

    path = tmp_path / "clip.wav"
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(16000)
        file.writeframes(np.zeros(8000, "<i2").tobytes())
    data = bytearray(path.read_bytes())
    data[24:28] = struct.pack("<I", rate)  # the fmt chunk's sample rate
    path.write_bytes(bytes(data))
    with pytest.raises(OdtrainError, match=rf"declares 1 channels at {rate} Hz: it is damaged"):
        AudioSource(str(tmp_path)).clip(str(path), 8000)


def test_an_npz_array_declaring_more_values_than_its_member_holds_is_refused(tmp_path):
    """numpy allocates an .npz member's declared array before reading it: a shape inflated by damage is refused
    from the member's size instead of allocating what the file never held."""
    from odtrain import data_loading as data
    from odtrain.data_loading import InputSpec

    import io
    import zipfile

    members = {}
    for name, array in (("input", np.ones((4, 3), np.float32)), ("labels", np.arange(4))):
        buffer = io.BytesIO()
        np.save(buffer, array)
        members[name] = buffer.getvalue()
    header = members["input"][10:members["input"].index(b"\n")]
    inflated = b"{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000,), }".ljust(len(header))
    members["input"] = members["input"].replace(header, inflated)  # 400 GB declared, 48 bytes held
    with zipfile.ZipFile(tmp_path / "d.npz", "w") as archive:  # a whole archive (its checksums match)
        for name, blob in members.items():
            archive.writestr(name + ".npy", blob)
    inputs = [InputSpec("input", np.dtype(np.float32), ("batch", 3), False),
              InputSpec("labels", np.dtype(np.int64), ("batch",), True)]
    with pytest.raises(OdtrainError, match=r"data file '.*d.npz' is damaged: array 'input' declares \(100000000000,\) float32"):
        data.load(str(tmp_path / "d.npz"), inputs)
