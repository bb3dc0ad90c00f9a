"""The kernel cache: ODTRAIN_CACHE_DIR, the fallback from a read-only package folder, `odtrain warmup`.

Each case runs in a new Python process, since Numba reads its cache folder once, at import.
"""
import json
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from odtrain import cli

REPO = pathlib.Path(__file__).resolve().parents[1]

# Compiles (or loads) one small kernel and reports where its cache went.
ONE_KERNEL = textwrap.dedent("""
    import json, sys
    {before}
    import odtrain
    import numba, numpy as np
    from odtrain.jit import cache
    from odtrain.kernels.optim import add_into
    add_into(np.zeros(4, np.float32), np.ones(4, np.float32))
    print(json.dumps({{"odtrain": odtrain.__file__, "numba_cache_dir": numba.config.CACHE_DIR,
                      "source": cache.configured_source(), "cache_dir": cache.cache_dir(),
                      "stats": cache.kernel_stats()}}))
""")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "ODTRAIN_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(code: str, env: dict, cwd, prefix=()) -> dict:
    done = subprocess.run([*prefix, sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def cache_files(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.suffix in (".nbi", ".nbc"))


@pytest.mark.parametrize("numba_first", [False, True], ids=["odtrain-first", "numba-imported-first"])
def test_odtrain_cache_dir_is_honoured(tmp_path, numba_first):
    target = tmp_path / "kernels-cache"
    code = ONE_KERNEL.format(before="import numba" if numba_first else "")
    report = run_python(code, clean_env(ODTRAIN_CACHE_DIR=target), tmp_path)
    assert report["source"] == "ODTRAIN_CACHE_DIR"
    assert report["numba_cache_dir"] == str(target)
    assert report["cache_dir"] == str(target)
    assert any(name.startswith("optim.add_into") for name in cache_files(target)), cache_files(target)


def test_numba_cache_dir_of_the_user_wins(tmp_path):
    ours, theirs = tmp_path / "odtrain-cache", tmp_path / "numba-cache"
    report = run_python(ONE_KERNEL.format(before=""), clean_env(ODTRAIN_CACHE_DIR=ours, NUMBA_CACHE_DIR=theirs),
                        tmp_path)
    assert report["source"] == "NUMBA_CACHE_DIR"
    assert cache_files(theirs) and not ours.exists()


def read_only_runner():
    """A command prefix under which chmod a-w holds: root ignores file modes unless it drops the capabilities."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make a folder read-only for this process")
    return (setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner")


def copy_sources(package: pathlib.Path) -> pathlib.Path:
    """odtrain's sources copied to `package`, laid out as a checkout (odtrain/, graph/, kernels/): a copy no
    edit of the working tree changes while a test runs (an edited kernel file invalidates its cache)."""
    for folder in ("odtrain", "graph", "kernels"):
        shutil.copytree(REPO / folder, package / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return package


@pytest.fixture
def read_only_package(tmp_path):
    """A copy of the sources that nobody can write."""
    package = copy_sources(tmp_path / "site")
    for path in [package, *package.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    yield package
    for path in [package, *package.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)


def test_read_only_package_folder_falls_back_to_the_user_cache(tmp_path, read_only_package):
    prefix = read_only_runner()
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(PYTHONPATH=read_only_package, HOME=home, PYTHONDONTWRITEBYTECODE=1)
    report = run_python(ONE_KERNEL.format(before=""), env, tmp_path, prefix)
    assert report["odtrain"].startswith(str(read_only_package))
    assert report["source"] == "user"
    assert report["stats"]["compiled"] >= 1
    user_cache = home / ".cache" / "numba"
    assert any(name.startswith("optim.add_into") for name in cache_files(user_cache)), cache_files(home)
    assert not cache_files(read_only_package)
    # A second process loads the kernel from the user cache instead of compiling it again.
    again = run_python(ONE_KERNEL.format(before=""), env, tmp_path, prefix)
    assert again["stats"]["compiled"] == 0 and again["stats"]["loaded"] >= 1


def test_nothing_writable_falls_back_to_a_temporary_folder(tmp_path, read_only_package):
    prefix = read_only_runner()
    home, scratch = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    scratch.mkdir()
    home.chmod(0o555)
    try:
        env = clean_env(PYTHONPATH=read_only_package, HOME=home, TMPDIR=scratch, PYTHONDONTWRITEBYTECODE=1)
        report = run_python(ONE_KERNEL.format(before=""), env, tmp_path, prefix)
    finally:
        home.chmod(0o755)
    assert report["source"] == "temporary"
    assert report["numba_cache_dir"].startswith(str(scratch))
    assert cache_files(scratch)


FIRST_STEP = textwrap.dedent("""
    import json, sys
    import numpy as np
    from odtrain.jit import cache
    from odtrain.api import CheckpointState, Module, Optimizer
    directory = sys.argv[1]
    state = CheckpointState.load_checkpoint(directory + "/checkpoint")
    module = Module(directory + "/training_model.onnx", state, directory + "/eval_model.onnx")
    optimizer = Optimizer(directory + "/optimizer_model.onnx", module)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 784), dtype=np.float32), rng.integers(0, 10, 64)
    module(x, y)
    optimizer.step()
    module.lazy_reset_grad()
    module.eval()
    module(x, y)
    print(json.dumps(cache.kernel_stats()))
""")


def odtrain_command(*args, env, cwd):
    done = subprocess.run([sys.executable, "-m", "odtrain", *map(str, args)], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def demo_warmed(tmp_path_factory):
    """A kernel cache filled by `odtrain warmup` (the demo classifier) from empty: (env, its output)."""
    folder = tmp_path_factory.mktemp("warmup")
    env = clean_env(ODTRAIN_CACHE_DIR=folder / "cache", PYTHONPATH=copy_sources(folder / "site"))
    return env, odtrain_command("warmup", env=env, cwd=folder)


def test_warmup_of_the_demo_model(demo_warmed, tmp_path):
    env, output = demo_warmed
    assert "warmed up the built-in demo classifier on inputs input [32, 64], labels [32] (train, optimizer, eval steps)" \
        in output
    assert f"kernel cache: {env['ODTRAIN_CACHE_DIR']}" in output
    kernels, first, loaded = map(int, re.search(r"(\d+) kernels, (\d+) compiled and (\d+) loaded", output).groups())
    assert first >= 5 and kernels == first + loaded, output  # from an empty cache, every kernel compiles
    again = json.loads(odtrain_command("warmup", "--json", env=env, cwd=tmp_path))
    assert again["compiled"] == 0 and again["loaded"] >= 5, again


def test_warmup_then_first_step_compiles_nothing(demo_warmed, tmp_path, mlp_artifacts):
    env, _ = demo_warmed
    report = json.loads(odtrain_command("warmup", mlp_artifacts, "--batch-size", 64, "--json", env=env, cwd=tmp_path))
    assert report["steps"] == ["train", "optimizer", "eval"] and report["inputs"]["input"] == [64, 784]
    assert report["cache_dir"] == env["ODTRAIN_CACHE_DIR"]
    done = subprocess.run([sys.executable, "-c", FIRST_STEP, str(mlp_artifacts)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["compiled"] == 0, stats
    assert stats["loaded"] >= 5


def test_warmup_takes_a_sequence_length_and_several_shapes_in_one_flag(tmp_path, capsys):
    """x[batch, seq, 4] -> MatMul -> [batch, seq, 3], scored by MSE: the seq axis needs --seq-len or shapes."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from odtrain import artifacts

    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, ["batch", "seq", 4])],
                              [helper.make_tensor_value_info("y", 1, ["batch", "seq", 3])],
                              [numpy_helper.from_array(np.ones((4, 3), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path / "seq")
    assert cli.main(["warmup", str(tmp_path / "seq"), "--batch-size", "2"]) == 2
    assert "--seq-len N" in capsys.readouterr().err
    assert cli.main(["warmup", str(tmp_path / "seq"), "--batch-size", "2", "--seq-len", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["inputs"] == {"x": [2, 5, 4], "target": [2, 5, 3]}
    assert result["kernels"] == result["compiled"] + result["loaded"] > 0
    assert cli.main(["warmup", str(tmp_path / "seq"), "--input-shape", "x=1,7,4", "target=1,7,3"]) == 0
    out = capsys.readouterr().out
    assert "on inputs x [1, 7, 4], target [1, 7, 3]" in out
    kernels, compiled, loaded = map(int, re.search(r"(\d+) kernels?, (\d+) compiled and (\d+) loaded", out).groups())
    assert kernels == compiled + loaded


def test_warmup_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["warmup", str(tmp_path / "missing")]) == 2
    assert "has no training_model.onnx" in capsys.readouterr().err
    assert cli.main(["warmup", "--input-shape", "x=a,b"]) == 2
    assert "--input-shape" in capsys.readouterr().err
    assert cli.main(["warmup", "--batch-size", "0"]) == 2
    assert "batch size must be >= 1" in capsys.readouterr().err


# Binds and runs a one-node step (the executor checks the cache against the kernel sources first).
ONE_STEP = textwrap.dedent("""
    import json
    import numpy as np
    from odtrain.jit import cache
    from odtrain.executor import ExecutableStep
    from odtrain.graph.ir import Graph, Node, TensorType
    square = TensorType(np.dtype(np.float32), (4, 4))
    graph = Graph([Node("Relu", ["a"], ["y"], name="relu")], ["a"], ["y"], value_types={"a": square, "y": square})
    step = ExecutableStep(graph, feed_types={"a": square}, external={})
    step.run([np.full((4, 4), -1.0, np.float32)])
    assert not step.output("y").any()
    print(json.dumps({"stats": cache.kernel_stats(), "cache_dir": cache.cache_dir(), "digest": cache.sources_digest()}))
""")


def test_an_edited_kernel_file_recompiles_the_kernels_of_other_files(tmp_path):
    """Numba would load a kernel whose own file is unchanged although a file it calls into changed; the
    sources' digest in the cache folder makes it compile again, once."""
    package = copy_sources(tmp_path / "checkout")
    env = clean_env(PYTHONPATH=package, ODTRAIN_CACHE_DIR=tmp_path / "cache", PYTHONDONTWRITEBYTECODE=1)
    first = run_python(ONE_STEP, env, tmp_path)
    assert first["stats"]["compiled"] >= 1
    stamps = list((tmp_path / "cache").rglob("odtrain-kernel-sources.sha256"))
    assert stamps and all(stamp.read_text().strip() == first["digest"] for stamp in stamps)  # one a cache folder
    again = run_python(ONE_STEP, env, tmp_path)
    assert again["stats"]["compiled"] == 0 and again["stats"]["loaded"] >= 1
    relu_file = next(name for name in again["stats"]["compiled_kernels"] + cache_files(tmp_path / "cache")
                     if "relu" in name.lower() or "unary" in name.lower() or "activation" in name.lower())
    edited = package / "kernels" / "parallel_split.py"
    assert not relu_file.startswith("parallel_split.")
    edited.write_text(edited.read_text() + "\n# an edit in another kernel file\n")
    after_edit = run_python(ONE_STEP, env, tmp_path)
    assert after_edit["stats"]["compiled"] >= 1 and after_edit["stats"]["loaded"] == 0
    settled = run_python(ONE_STEP, env, tmp_path)
    assert settled["stats"]["compiled"] == 0


def test_the_sources_digest_covers_the_families_in_folders(tmp_path):
    """A family in a folder of its own (kernels/conv/) is kernel source too: an edit there changes the digest
    that stamps the cache and the kernel library's manifest."""
    from odtrain.jit import cache

    folder = tmp_path / "kernels"
    (folder / "conv").mkdir(parents=True)
    (folder / "jit.py").write_text("# the base\n")
    (folder / "conv" / "taps.py").write_text("# a strategy\n")
    before = cache._digest(str(folder))
    (folder / "conv" / "taps.py").write_text("# a strategy, edited\n")
    assert cache._digest(str(folder)) != before


def test_the_cache_is_stamped_with_the_sources_as_imported(tmp_path, monkeypatch):
    """Kernel files edited between `import odtrain` and the first bind: the kernels this process compiles
    come from the files as imported, so the stamp beside them must name those, not the edited ones."""
    from odtrain.jit import cache

    imported = cache.sources_digest()
    edited = tmp_path / "kernels"
    edited.mkdir()
    (edited / "optim.py").write_text("# the kernels' folder after an update in place\n")
    monkeypatch.setattr(cache, "kernels_dir", lambda: str(edited))
    assert cache.sources_digest() == imported
    cache._discard_stale_in(str(tmp_path / "cache"))
    assert (tmp_path / "cache" / cache.SOURCES_STAMP).read_text().strip() == imported


def test_a_step_that_compiles_says_so_first_and_a_cached_one_says_nothing(tmp_path, mlp_artifacts, mlp_reference):
    """Without a kernel library, the first step of a model on a cold cache compiles its kernels: the note says
    how many before they compile; the next process loads them from the cache and says nothing."""
    script = textwrap.dedent(f"""
        import numpy as np
        from odtrain.api import CheckpointState, Module, Optimizer
        d = {str(mlp_artifacts)!r}
        golden = np.load({str(mlp_reference[0].parent / "golden.npz")!r})
        module = Module(d + "/training_model.onnx", CheckpointState.load_checkpoint(d + "/checkpoint"))
        module(golden["x"][0], golden["y"][0])
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), ODTRAIN_KERNEL_LIBRARY="off")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
            for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr + runs[1].stderr
    note = re.search(r"compiling (\d+) kernels for this model \(once; `odtrain compile` or `odtrain warmup`",
                     runs[0].stderr)
    assert note and int(note.group(1)) > 3, runs[0].stderr
    assert "compiling" not in runs[1].stderr, runs[1].stderr
