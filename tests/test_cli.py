"""The command line through its entry points: `python -m odtrain ...` in a subprocess, or odtrain.cli.main(argv).

A small classifier (odtrain.demo's MLP) on a slice of the bundled digits: check, prepare, train, eval, export
and inspect succeed; a run stopped mid-epoch (the stop hook, SIGINT, SIGKILL) and resumed ends with exactly
the parameters and optimizer state of an uninterrupted run; wrong arguments and missing files give one line
on stderr and a non-zero exit code.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import odtrain
from odtrain import checkpoint as checkpoint_file
from odtrain import cli
from odtrain.datasets import load_digits, train_test_split
from odtrain.demo import build_classifier
from odtrain.graph.ops import OPS
from conftest import odtrain_main

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(odtrain.__file__)))
COMMANDS = ("check", "prepare", "train", "eval", "export", "inspect", "memory", "profile", "demo")
TRAIN_SAMPLES, BATCH = 320, 32  # 10 steps per epoch


def python_m_odtrain(cwd, *argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "odtrain", *map(str, argv)], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")])))


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    return lines[0]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder with mlp.onnx, train.npz (input/labels), val.npz (x/y) and prepared artifacts in art/."""
    folder = tmp_path_factory.mktemp("cli")
    images, labels = load_digits()
    train_x, val_x, train_y, val_y = train_test_split(images, labels, test_fraction=0.2, seed=0)
    np.savez(folder / "train.npz", input=train_x[:TRAIN_SAMPLES], labels=train_y[:TRAIN_SAMPLES])
    np.savez(folder / "val.npz", x=val_x[:100], y=val_y[:100])
    onnx.save(build_classifier()[0], str(folder / "mlp.onnx"))
    assert cli.main(["prepare", str(folder / "mlp.onnx"), "-o", str(folder / "art"), "--lr", "0.01"]) == 0
    return folder


@pytest.fixture()
def here(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    return workspace


def fresh_artifacts(workspace, name: str) -> str:
    target = workspace / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(workspace / "art", target)
    return name


def trained_state(folder) -> tuple[dict, dict, dict]:
    """(parameters, optimizer moments, properties) of a folder's checkpoint."""
    contents = checkpoint_file.load(os.path.join(folder, "checkpoint"))
    moments = {f"{s}/{n}": a for s, per in contents.optimizer_tensors.items() for n, a in per.items()}
    return contents.parameters, moments, contents.properties


def assert_same_state(left, right) -> None:
    (params_a, moments_a, props_a), (params_b, moments_b, props_b) = trained_state(left), trained_state(right)
    assert params_a.keys() == params_b.keys() and moments_a.keys() == moments_b.keys() and moments_a
    for name in params_a:
        np.testing.assert_array_equal(params_a[name], params_b[name], err_msg=name)
    for name in moments_a:
        np.testing.assert_array_equal(moments_a[name], moments_b[name], err_msg=name)
    for key in ("epoch", "step_in_epoch", "global_step", "finished"):
        assert props_a[key] == props_b[key], key


# ---- help and entry point ----------------------------------------------------------------------------------


def test_python_m_odtrain_lists_every_command(workspace):
    result = python_m_odtrain(workspace, "--help")
    assert result.returncode == 0, result.stderr
    for command in COMMANDS:
        assert f"    {command} " in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(capsys, command):
    code, out, _ = odtrain_main(capsys, command, "--help")
    assert code == 0 and out.startswith(f"usage: odtrain {command}")


@pytest.mark.parametrize("command", ["demo", "federated", "warmup", *COMMANDS])
def test_every_option_has_a_help_text(command):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    silent = [a.option_strings[-1] for a in sub._actions if a.option_strings and a.help is None]
    assert not silent, f"odtrain {command}: {silent} have no help text"


# ---- check ------------------------------------------------------------------------------------------------


def test_check_a_trainable_model(here, capsys):
    code, out, err = odtrain_main(capsys, "check", "mlp.onnx")
    # stderr holds nothing but the note of kernels compiled on a cold cache (the check runs a trial step)
    assert code == 0 and not [line for line in err.splitlines() if "compiling" not in line], err
    assert "Gemm x2, Relu" in out and "2,410 trainable in 4 tensors" in out and "odtrain can train this model" in out
    code, out, _ = odtrain_main(capsys, "check", "mlp.onnx", "--train-last", "1", "--json")
    report = json.loads(out)
    assert code == 0 and report["trainable"] and report["error"] is None
    assert report["parameters"] == {"trainable": 330, "frozen": 2080, "trainable_tensors": ["fc2.weight", "fc2.bias"],
                                    "frozen_tensors": ["fc1.weight", "fc1.bias"]}


def test_check_names_the_batch_size_only_where_the_batch_axis_is_free(tmp_path, capsys):
    rng = np.random.default_rng(1)
    weight = numpy_helper.from_array(rng.normal(size=(10, 64)).astype(np.float32), "w")
    for batch, said in (("batch", "a training step at batch size 2 plans"),
                        (4, "a training step at its fixed input shapes plans")):
        graph = helper.make_graph([helper.make_node("Gemm", ["input", "w"], ["output"], transB=1)], "g",
                                  [helper.make_tensor_value_info("input", 1, [batch, 64])],
                                  [helper.make_tensor_value_info("output", 1, [batch, 10])], [weight])
        path = tmp_path / f"{batch}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        code, out, _ = odtrain_main(capsys, "check", str(path))
        assert code == 0 and said in out, out


def _model_with(path, middle_ops, width=8):
    """input[batch, 64] -> fc1 -> middle ops (elementwise, in order) -> fc2 -> output[batch, 10]."""
    rng = np.random.default_rng(0)
    nodes, value = [helper.make_node("Gemm", ["input", "w1"], ["h0"], transB=1, name="fc1")], "h0"
    for index, op_type in enumerate(middle_ops):
        nodes.append(helper.make_node(op_type, [value], [f"h{index + 1}"], name=f"{op_type.lower()}_{index}"))
        value = f"h{index + 1}"
    nodes.append(helper.make_node("Gemm", [value, "w2"], ["output"], transB=1, name="fc2"))
    weights = [numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name)
               for name, shape in (("w1", (width, 64)), ("w2", (10, width)))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", 1, ["batch", 64])],
                              [helper.make_tensor_value_info("output", 1, ["batch", 10])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_check_names_the_nodes_without_kernel_or_gradient(here, capsys):
    no_kernel = next(op for op in ("Hardmax", "Det", "NonZero") if ("", op) not in OPS)
    no_gradient = next(op for op in ("Sign", "Floor", "Ceil", "Round")
                       if ("", op) in OPS and OPS[("", op)].gradient is None)
    _model_with(here / "odd.onnx", [no_gradient, no_kernel])
    code, out, err = odtrain_main(capsys, "check", "odd.onnx")
    assert code == 1
    assert f"no kernel: {no_kernel} node '{no_kernel.lower()}_1'" in out
    assert f"no gradient rule: {no_gradient} node '{no_gradient.lower()}_0'" in out
    assert "cannot be trained" in one_line(err)

    _model_with(here / "piecewise.onnx", [no_gradient])
    code, out, err = odtrain_main(capsys, "check", "piecewise.onnx", "--json")
    report = json.loads(out)
    assert code == 1 and [n["node"] for n in report["no_gradient"]] == [f"{no_gradient.lower()}_0"]
    assert "--train-last" in one_line(err)
    code, out, err = odtrain_main(capsys, "check", "piecewise.onnx", "--train-last", "1")
    assert code == 0 and not err and "80 trainable in 1 tensor (w2); 512 frozen" in out


def test_check_exits_1_for_every_untrainable_model_as_the_docstring_says(here, capsys):
    """A foreign op and an op without a gradient rule both make a model untrainable: exit 1, not 2 (a user error)."""
    _model_with(here / "foreign.onnx", ["Relu"])
    model = onnx.load(str(here / "foreign.onnx"))
    model.graph.node[1].domain = "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    onnx.save(model, str(here / "foreign.onnx"))
    code, _, err = odtrain_main(capsys, "check", "foreign.onnx")
    assert code == 1 and "com.example" in one_line(err) and "relu_0" in err
    code, out, _ = odtrain_main(capsys, "check", "foreign.onnx", "--json")
    assert code == 1 and json.loads(out)["trainable"] is False
    no_gradient = next(op for op in ("Sign", "Floor", "Ceil", "Round")
                       if ("", op) in OPS and OPS[("", op)].gradient is None)
    _model_with(here / "step.onnx", [no_gradient])
    assert odtrain_main(capsys, "check", "step.onnx")[0] == 1
    assert "1 when `check` finds\nthe model untrainable" in cli.__doc__
    code, _, err = odtrain_main(capsys, "check", "absent.onnx")
    assert code == 2, err  # a model that is not there is the user's error, not an untrainable model


def test_check_s_choice_and_walk_are_in_the_python_api(here):
    """What check and prepare decide, odtrain.artifacts offers on a loaded graph."""
    from odtrain.artifacts import choose_parameters, missing_support
    from odtrain.graph.onnx_io import load_graph

    no_gradient = next(op for op in ("Sign", "Floor", "Ceil", "Round")
                       if ("", op) in OPS and OPS[("", op)].gradient is None)
    _model_with(here / "step.onnx", [no_gradient])
    graph = load_graph(str(here / "step.onnx"), "model")
    choice = choose_parameters(graph, graph.outputs, train_last=1)
    assert (choice.trainable, choice.frozen) == (["w2"], ["w1"])
    assert missing_support(graph, choice.trainable, graph.outputs) == ([], [])
    no_kernel, without_rule = missing_support(graph, ["w1", "w2"], graph.outputs)
    assert not no_kernel and [node.name for node, _ in without_rule] == [f"{no_gradient.lower()}_0"]
    with pytest.raises(odtrain.ArgumentError, match="cannot train the last 3 layers: the model has 2 layers"):
        choose_parameters(graph, graph.outputs, train_last=3)


def test_check_lists_the_supported_ops(capsys):
    code, out, _ = odtrain_main(capsys, "check", "--ops")
    assert code == 0 and any(line.startswith("Gemm ") and "gradient rule" in line for line in out.splitlines())


def test_an_unsupported_op_points_to_the_command_that_lists_the_supported_ones(capsys):
    from odtrain.graph.ir import Node
    from odtrain.graph.ops import check_supported

    with pytest.raises(odtrain.UnsupportedOpError) as refusal:
        check_supported([Node("Det", ["x"], ["y"], {}, "det_0")], "model 'm.onnx'")
    command = re.search(r"Run `(odtrain [^`]+)`", str(refusal.value)).group(1).split()[1:]
    code, out, _ = odtrain_main(capsys, *command)  # the command the message names lists the ops
    assert code == 0 and any(line.startswith("Gemm ") for line in out.splitlines())


# ---- prepare ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("selection", [["--requires-grad", "fc2.*"], ["--freeze", "fc1.*"], ["--train-last", "1"]])
def test_prepare_freezes_all_but_the_last_layer(here, capsys, selection):
    shutil.rmtree(here / "partial", ignore_errors=True)
    code, out, err = odtrain_main(capsys, "prepare", "mlp.onnx", "-o", "partial", "--optimizer", "sgd",
                                  "--lr", "0.05", "--json", *selection)
    assert code == 0 and not err
    result = json.loads(out)
    assert result["trainable"] == ["fc2.weight", "fc2.bias"] and result["frozen"] == ["fc1.weight", "fc1.bias"]
    contents = checkpoint_file.load(here / "partial" / "checkpoint")
    assert contents.trainable == ["fc2.weight", "fc2.bias"] and set(contents.parameters) == {
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert contents.properties == {"learning_rate": 0.05, "loss": "ce", "optimizer": "sgd"}


def test_prepare_text_output_and_refusal_to_overwrite(here, capsys):
    shutil.rmtree(here / "again", ignore_errors=True)
    code, out, _ = odtrain_main(capsys, "prepare", "mlp.onnx", "-o", "again")
    assert code == 0
    assert "artifacts written to again/: training_model.onnx, eval_model.onnx, optimizer_model.onnx, checkpoint" in out
    assert "training data feeds: input float32[batch, 64], labels int64[batch]" in out
    code, _, err = odtrain_main(capsys, "prepare", "mlp.onnx", "-o", "again")
    assert code == 2 and "--force" in one_line(err)
    assert odtrain_main(capsys, "prepare", "mlp.onnx", "-o", "again", "--force")[0] == 0


def test_long_parameter_lists_are_summarised_unless_verbose(here, capsys):
    """40 parameters: prepare, check and a selection error show a count and the first and last three."""
    nodes, value = [], "input"
    for index in range(39):
        nodes.append(helper.make_node("Add", [value, f"b{index:02d}"], [f"h{index}"], name=f"shift{index}"))
        value = f"h{index}"
    nodes.append(helper.make_node("Gemm", [value, "w"], ["output"], transB=1, name="head"))
    weights = [numpy_helper.from_array(np.zeros(64, np.float32), f"b{index:02d}") for index in range(39)]
    weights.append(numpy_helper.from_array(np.ones((10, 64), np.float32), "w"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", 1, ["batch", 64])],
                              [helper.make_tensor_value_info("output", 1, ["batch", 10])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(here / "many.onnx"))
    summary = "b00, b01, b02, ... 33 more (--verbose lists all) ..., b36, b37, b38"
    everything = ", ".join(f"b{index:02d}" for index in range(39))

    shutil.rmtree(here / "many", ignore_errors=True)
    code, out, _ = odtrain_main(capsys, "prepare", "many.onnx", "-o", "many", "--train-last", "1")
    assert code == 0 and f"frozen: 2,496 values in 39 tensors ({summary})" in out.splitlines()
    assert max(map(len, out.splitlines())) < 160
    code, out, _ = odtrain_main(capsys, "prepare", "many.onnx", "-o", "many", "--train-last", "1", "--force", "-v")
    assert code == 0 and f"frozen: 2,496 values in 39 tensors ({everything})" in out.splitlines()

    code, out, _ = odtrain_main(capsys, "check", "many.onnx", "--freeze", "w")
    assert code == 0 and f"2,496 trainable in 39 tensors ({summary}); 640 frozen in 1 tensor (w)" in out
    code, out, _ = odtrain_main(capsys, "check", "many.onnx", "--freeze", "w", "--verbose")
    assert code == 0 and f"2,496 trainable in 39 tensors ({everything}); 640 frozen in 1 tensor (w)" in out

    code, _, err = odtrain_main(capsys, "check", "many.onnx", "--requires-grad", "fc*")
    assert code == 2 and "'fc*' matches no parameter; the 40 parameters are: b00, b01, b02, ... 34 more" in one_line(err)


# ---- train, eval, export, inspect --------------------------------------------------------------------------


def test_a_model_given_for_artifacts_gets_the_prepare_command_that_works(here, capsys):
    shutil.rmtree(here / "mlp-artifacts", ignore_errors=True)
    code, _, err = odtrain_main(capsys, "train", "mlp.onnx", "--data", "train.npz", "--epochs", "1")
    advice = re.search(r"`odtrain (prepare [^`]+)`, then give '([^']+)' instead", one_line(err))
    assert code == 2 and "'mlp.onnx' is an ONNX model, not an artifact folder" in err and advice, err
    assert odtrain_main(capsys, *advice.group(1).split())[0] == 0
    code, out, err = odtrain_main(capsys, "train", advice.group(2), "--data", "train.npz", "--epochs", "1", "--json")
    assert code == 0 and json.loads(out)["global_step"] == 10, err
    code, _, err = odtrain_main(capsys, "prepare", "mlp.onnx", "-o", "train.npz")
    assert code == 2 and "'train.npz' is a file: -o names the folder" in one_line(err)
    for argv in (["eval", "mlp.onnx", "--data", "val.npz"], ["inspect", "mlp.onnx"], ["warmup", "mlp.onnx"],
                 ["memory", "mlp.onnx", "--batch-size", "2"], ["export", "mlp.onnx", "-o", "out.onnx"]):
        code, _, err = odtrain_main(capsys, *argv)
        assert code == 2 and f"{advice.group(0)}" in one_line(err), argv


def test_an_out_of_range_label_names_the_file_the_sample_its_value_and_the_classes(here, capsys):
    data = np.load("train.npz")
    labels = data["labels"].copy()
    labels[7], labels[9] = 10, -3
    np.savez("bad-labels.npz", input=data["input"], labels=labels)
    for command in ("train", "eval"):
        code, _, err = odtrain_main(capsys, command, "art", "--data", "bad-labels.npz")
        assert code == 2 and "data file 'bad-labels.npz': sample 7 has label 10, outside the model's 10 classes " \
            f"[0, 10) (2 of {TRAIN_SAMPLES} labels outside)" in one_line(err)


def test_more_threads_than_cores_are_accepted_with_a_note(here, capsys, monkeypatch):
    from odtrain import threads

    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    code, out, err = odtrain_main(capsys, "eval", "art", "--data", "val.npz", "--threads", "64")
    assert code == 0 and "on 100 samples" in out
    assert one_line(err) == ("odtrain eval: note: --threads 64 with 2 cores for this process: each step is split into "
                             "64 parts, as on 64 cores (the same results), and they run on the 2 cores: no faster "
                             "than --threads 2")
    code, _, err = odtrain_main(capsys, "eval", "art", "--data", "val.npz", "--threads", "2")
    assert code == 0 and not err


def test_counts_agree_with_their_nouns():
    from odtrain.graph.wording import count

    assert [count(1, "epoch"), count(3, "epoch"), count(1, "batch"), count(36, "batch"), count(1151, "sample")] == \
        ["1 epoch", "3 epochs", "1 batch", "36 batches", "1,151 samples"]
    assert count(2, "entry", "entries") == "2 entries"


def test_counts_of_one_are_singular(here, capsys):
    folder = fresh_artifacts(here, "single")
    code, out, err = odtrain_main(capsys, "train", folder, "--data", "train.npz", "--epochs", "1", "--batch-size",
                                  str(TRAIN_SAMPLES))
    assert code == 0, err
    assert f"training on {TRAIN_SAMPLES} samples (1 batch of {TRAIN_SAMPLES}) for 1 epoch; " in out
    assert f"checkpoint: {folder}/checkpoint (1 epoch, 1 step)" in out
    np.savez("one.npz", input=np.load("val.npz")["x"][:1], labels=np.load("val.npz")["y"][:1])
    code, out, _ = odtrain_main(capsys, "eval", folder, "--data", "one.npz")
    assert code == 0 and out.rstrip().endswith("on 1 sample")


def test_walkthrough_through_python_m_odtrain(workspace):
    folder = fresh_artifacts(workspace, "walk")
    result = python_m_odtrain(workspace, "train", folder, "--data", "train.npz", "--val", "val.npz", "--epochs", "3",
                              "--batch-size", BATCH, "--lr-schedule", "cosine", "--warmup", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("training on 320 samples (10 batches of 32) for 3 epochs; learning rate 0.01, cosine after "
                        "5 warm-up steps; validating on 100 samples")
    assert [line.split(":")[0] for line in lines[1:4]] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert "val accuracy" in lines[3] and "samples/s" in lines[3]
    assert lines[4] == f"checkpoint: {folder}/checkpoint (3 epochs, 30 steps)"
    accuracy = float(lines[3].split("val accuracy ")[1].split("%")[0])

    result = python_m_odtrain(workspace, "eval", folder, "--data", "val.npz")
    assert result.returncode == 0 and result.stdout.startswith("loss ")
    assert f"accuracy {accuracy:.1f}% on 100 samples" in result.stdout

    result = python_m_odtrain(workspace, "export", folder, "-o", "walk.onnx")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("inference model written to walk.onnx: input float32[batch, 64] -> "
                                     "output float32[batch, 10]")
    onnxruntime = pytest.importorskip("onnxruntime")
    val = np.load(workspace / "val.npz")
    (logits,) = onnxruntime.InferenceSession(str(workspace / "walk.onnx")).run(["output"], {"input": val["x"]})
    assert abs((logits.argmax(axis=1) == val["y"]).mean() * 100 - accuracy) < 0.051

    result = python_m_odtrain(workspace, "inspect", folder, "--json")
    report = json.loads(result.stdout)
    assert report["properties"]["global_step"] == 30 and report["properties"]["finished"] == 1
    assert report["optimizer"]["kind"] == "AdamW" and report["optimizer"]["step"] == 30
    assert [p["name"] for p in report["parameters"]] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    plan = report["memory_plan"]["training step"]
    assert plan["arena_bytes"] >= plan["lower_bound"] > 0


def test_inspect_into_a_pipe_its_reader_closed_says_nothing(workspace):
    """`odtrain inspect DIR --json | head -c 10`: the reader leaves before the output is written; no "Broken pipe"
    error (exit 2), no traceback, as any Unix tool writing into a closed pipe (exit 141, 128 + SIGPIPE). Both with
    stdout buffered (the default: the write fails when Python flushes at exit) and unbuffered (PYTHONUNBUFFERED:
    each print fails), whatever the environment running the tests sets."""
    buffered = {k: v for k, v in _env().items() if k != "PYTHONUNBUFFERED"}
    for env in (buffered, dict(buffered, PYTHONUNBUFFERED="1")):
        for argv in (["inspect", "art", "--json"], ["inspect", "art"]):
            process = subprocess.Popen([sys.executable, "-m", "odtrain", *argv], cwd=workspace, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            process.stdout.close()  # before the first write: every write meets a closed pipe
            err = _without_compile_note(process.stderr.read().decode())
            assert process.wait(timeout=600) == 141 and err == "", (argv, err, "PYTHONUNBUFFERED" in env)
        result = subprocess.run(f"'{sys.executable}' -m odtrain inspect art --json | head -c 10", shell=True,
                                cwd=workspace, env=env, capture_output=True, text=True, timeout=600)
        assert len(result.stdout) == 10 and result.stdout.startswith("{")
        assert _without_compile_note(result.stderr) == ""


def _without_compile_note(err: str) -> str:
    """stderr less the note a cold kernel cache prints (the mutation audit's scratch copies start cold)."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("odtrain: compiling "))


def test_inspect_text_of_a_folder_and_of_a_checkpoint_file(here, capsys):
    code, out, _ = odtrain_main(capsys, "inspect", "art", "--batch-size", "8", "--plan")
    assert code == 0
    assert "  fc1.weight  float32  [32, 64]" in out and "learning_rate  0.01" in out
    assert "optimizer: no state saved yet" in out
    assert "memory plan at batch size 8:" in out and "training step:  arena" in out and "lower bound" in out
    code, out, _ = odtrain_main(capsys, "inspect", os.path.join("art", "checkpoint"))
    assert code == 0 and "memory plan at batch size 32" in out


def test_resume_after_a_stop_mid_epoch_gives_the_uninterrupted_result(here, capsys):
    settings = ["--data", "train.npz", "--val", "val.npz", "--epochs", "3", "--batch-size", BATCH, "--lr-schedule",
                "linear", "--warmup", "4", "--seed", "7", "--checkpoint-every", "4"]
    whole, pieces = fresh_artifacts(here, "whole"), fresh_artifacts(here, "pieces")
    code, out, _ = odtrain_main(capsys, "train", whole, *settings, "--json")
    assert code == 0
    uninterrupted = json.loads(out)

    code, out, err = odtrain_main(capsys, "train", pieces, *settings, "--stop-after-steps", "13")
    assert code == 130 and "stopped by stop_after_steps at epoch 2, step 3" in one_line(err)
    assert "epoch 1/3:" in out and "epoch 2/3" not in out
    code, out, err = odtrain_main(capsys, "train", pieces, "--data", "train.npz", "--val", "val.npz", "--resume",
                                  "--stop-after-steps", "4")
    assert code == 130 and "at epoch 2, step 7" in one_line(err)
    assert "resuming at epoch 2, step 3 of 10 (global step 13)" in out
    code, out, err = odtrain_main(capsys, "train", pieces, "--data", "train.npz", "--val", "val.npz", "--resume",
                                  "--json")
    assert code == 0 and not err
    resumed = json.loads(out)
    assert resumed["history"] == [dict(r, seconds=h["seconds"], samples_per_second=h["samples_per_second"])
                                  for r, h in zip(uninterrupted["history"][1:], resumed["history"])]
    assert_same_state(here / whole, here / pieces)

    code, out, _ = odtrain_main(capsys, "train", pieces, "--data", "train.npz", "--resume")
    assert code == 0 and "already finished its 3 epochs" in out
    code, out, _ = odtrain_main(capsys, "train", pieces, "--data", "train.npz", "--resume", "--epochs", "4")
    assert code == 0 and "epoch 4/4:" in out and "(4 epochs, 40 steps)" in out


def test_resume_with_fewer_epochs_than_done_is_refused_and_writes_nothing(here, capsys):
    """A run stopped in its 3rd of 5 epochs, resumed with --epochs 1: refused (exit 2), the checkpoint untouched."""
    pieces = fresh_artifacts(here, "fewer")
    code, _, _ = odtrain_main(capsys, "train", pieces, "--data", "train.npz", "--epochs", "5", "--batch-size", BATCH,
                              "--stop-after-steps", "23")
    assert code == 130
    checkpoint = here / pieces / "checkpoint"
    before, stamp = checkpoint.read_bytes(), checkpoint.stat().st_mtime_ns
    folder_before = sorted(os.listdir(here / pieces))
    code, out, err = odtrain_main(capsys, "train", pieces, "--data", "train.npz", "--resume", "--epochs", "1")
    assert code == 2 and "already finished" not in out
    message = one_line(err)
    assert "trained 2 of its 5 epochs" in message and "at least 2 epochs" in message, message
    assert checkpoint.read_bytes() == before and checkpoint.stat().st_mtime_ns == stamp
    assert sorted(os.listdir(here / pieces)) == folder_before
    code, out, _ = odtrain_main(capsys, "train", pieces, "--data", "train.npz", "--resume", "--epochs", "2")
    assert code == 0 and "epoch 2/2" not in out  # at least the epochs done: allowed, ends the run where it stands


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_run_resumes_to_the_uninterrupted_result(here, capsys, signum):
    settings = ["--data", "train.npz", "--epochs", "60", "--batch-size", BATCH, "--seed", "3", "--lr-schedule",
                "cosine", "--checkpoint-every", "3"]
    name = f"killed_{signum.name}"
    killed, whole = fresh_artifacts(here, name), fresh_artifacts(here, name + "_whole")
    process = subprocess.Popen([sys.executable, "-m", "odtrain", "train", killed, *map(str, settings)], cwd=here,
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and process.poll() is None:
            properties = checkpoint_file.load(here / killed / "checkpoint").properties
            if properties.get("global_step", 0) >= 5:
                break
            time.sleep(0.01)
        assert process.poll() is None, f"the run ended before it could be stopped: {process.communicate()}"
        process.send_signal(signum)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    properties = checkpoint_file.load(here / killed / "checkpoint").properties
    assert properties["finished"] == 0 and properties["global_step"] < 600
    if signum != signal.SIGKILL:
        assert process.returncode == 128 + signum
        line = one_line(err)
        assert line.startswith(f"odtrain train: stopped by {signum.name} at epoch ") and "--resume" in line
        assert f"epoch {properties['epoch'] + 1}, step {properties['step_in_epoch']};" in line
    else:
        assert process.returncode == -signal.SIGKILL
        assert properties["global_step"] % 3 == 0 or properties["step_in_epoch"] == 0

    code, _, err = odtrain_main(capsys, "train", killed, "--data", "train.npz", "--resume")
    assert code == 0, err
    assert odtrain_main(capsys, "train", whole, *settings)[0] == 0
    assert_same_state(here / whole, here / killed)


def test_a_new_run_over_an_unfinished_one_says_so(here, capsys):
    folder = fresh_artifacts(here, "unfinished")
    assert odtrain_main(capsys, "train", folder, "--data", "train.npz", "--stop-after-steps", "3")[0] == 130
    code, _, err = odtrain_main(capsys, "train", folder, "--data", "train.npz")
    assert code == 0 and "holds an unfinished run (epoch 1, step 3)" in one_line(err)


# ---- data forms --------------------------------------------------------------------------------------------


def test_npy_files_named_arrays_and_image_shaped_samples_give_the_same_metrics(here, capsys):
    val = np.load(here / "val.npz")
    np.save(here / "val_x.npy", val["x"].reshape(-1, 8, 8).astype(np.float64))
    np.save(here / "val_y.npy", val["y"].astype(np.int32))
    np.savez(here / "val_named.npz", pixels=val["x"], digit=val["y"], extra=np.zeros(3))
    results = [json.loads(odtrain_main(capsys, "eval", "art", "--json", *data)[1]) for data in (
        ["--data", "val.npz"], ["--data", "val_x.npy", "--data", "val_y.npy"],
        ["--data", "val_named.npz", "--x", "pixels", "--y", "digit"])]
    assert results[0]["samples"] == 100 and set(results[0]) == {"samples", "loss", "accuracy"}
    assert results[1] == results[0] and results[2] == results[0]


def _digit_folder(root, count=60):
    from PIL import Image

    images, labels = load_digits()
    for index in range(count):
        folder = root / f"digit_{labels[index]}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (images[index].reshape(8, 8) * 255).round().astype(np.uint8)
        Image.fromarray(pixels).resize((16, 16)).save(folder / f"{index}.png")
    return sorted(set(labels[:count]))


def test_a_folder_of_images_trains_a_classifier(here, capsys):
    pytest.importorskip("PIL")
    classes = _digit_folder(here / "digit_images")
    if len(classes) != 10:
        pytest.skip("the first images do not cover every class")
    folder = fresh_artifacts(here, "from_images")
    code, out, err = odtrain_main(capsys, "train", folder, "--data", "digit_images", "--epochs", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["global_step"] == 2 * 2  # 60 images, batches of 32
    properties = checkpoint_file.load(here / folder / "checkpoint").properties
    assert json.loads(properties["classes"]) == [f"digit_{c}" for c in classes]
    code, out, _ = odtrain_main(capsys, "eval", folder, "--data", "digit_images")
    assert code == 0 and "on 60 samples" in out


def test_an_image_folder_counts_what_it_skips_and_skips_unreadable_images_when_told(here, capsys):
    pytest.importorskip("PIL")
    root = here / "messy_images"
    shutil.rmtree(root, ignore_errors=True)
    _digit_folder(root, count=40)
    first = sorted(p for p in root.iterdir())[0]
    (first / "notes.txt").write_text("not an image")
    (first / ".DS_Store").write_bytes(b"hidden: ignored")
    (first / "more").mkdir()
    (root / "README.md").write_text("the digits")
    (first / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    code, _, err = odtrain_main(capsys, "eval", "art", "--data", str(root))
    assert code == 2 and f"image '{first / 'broken.png'}' cannot be read" in err and "--skip-unreadable" in err
    code, out, err = odtrain_main(capsys, "eval", "art", "--data", str(root), "--skip-unreadable")
    assert code == 0 and "on 40 samples" in out
    assert one_line(err).startswith(f"odtrain eval: note: image folder '{root}': read 40 images (.png, ")
    for part in (f"skipped 4 entries: 1 other file (e.g. '{first.name}/notes.txt')",
                 f"1 folder inside a class folder (e.g. '{first.name}/more')",
                 "1 file beside the class folders (e.g. 'README.md')",
                 f"1 unreadable image (e.g. '{first.name}/broken.png')"):
        assert part in err
    code, _, err = odtrain_main(capsys, "eval", "art", "--data", "val.npz", "--skip-unreadable")
    assert code == 2 and "--skip-unreadable leaves out unreadable images of a folder" in one_line(err)


def test_a_folder_of_images_without_pillow_is_one_clear_line(here, capsys, monkeypatch):
    (here / "no_pillow" / "cat").mkdir(parents=True, exist_ok=True)
    monkeypatch.setitem(sys.modules, "PIL", None)
    code, _, err = odtrain_main(capsys, "eval", "art", "--data", "no_pillow")
    assert code == 2 and 'needs Pillow: pip install Pillow' in one_line(err)


def test_a_regression_model_reports_mse(here, capsys):
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(1, 4)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gemm", ["features", "w"], ["value"], transB=1, name="linear")], "r",
                              [helper.make_tensor_value_info("features", 1, ["batch", 4])],
                              [helper.make_tensor_value_info("value", 1, ["batch", 1])],
                              [numpy_helper.from_array(np.zeros((1, 4), np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(here / "linear.onnx"))
    features = rng.normal(size=(200, 4)).astype(np.float32)
    np.savez(here / "regression.npz", x=features, y=features @ weight.T)
    shutil.rmtree(here / "linear", ignore_errors=True)
    assert odtrain_main(capsys, "prepare", "linear.onnx", "-o", "linear", "--loss", "mse", "--lr", "0.05")[0] == 0
    code, out, _ = odtrain_main(capsys, "train", "linear", "--data", "regression.npz", "--val", "regression.npz",
                                "--epochs", "20", "--json")
    assert code == 0 and json.loads(out)["history"][-1]["val_mse"] < 0.01
    code, out, _ = odtrain_main(capsys, "eval", "linear", "--data", "regression.npz")
    assert code == 0 and "MSE " in out and "MAE " in out and "accuracy" not in out


# ---- errors: one line, non-zero -----------------------------------------------------------------------------


ERRORS = [
    (["train", "nowhere", "--data", "train.npz"], "artifact folder 'nowhere' does not exist"),
    (["train", "art", "--data", "missing.npz"], "data file 'missing.npz' does not exist"),
    (["train", "art"], "the following arguments are required: --data"),
    (["train", "art", "--data", "train.npz", "--batch-size", "0"], "batch size must be at least 1"),
    (["train", "art", "--data", "train.npz", "--lr-schedule", "step"], "invalid choice: 'step'"),
    (["train", "art", "--data", "train.npz", "--epochs", "two"], "invalid int value: 'two'"),
    (["train", "art", "--data", "train.npz", "--resume"], "holds no run to resume"),
    (["train", "art", "--data", "mixed.npz"], "none is clearly the model's input 'input'"),
    (["eval", "art", "--data", "train.npz", "--x", "pixels"], "has no array 'pixels'"),
    (["eval", "art", "--data", "val_bad_labels.npz"], "holds non-integer values"),
    (["check", "missing.onnx"], "model file 'missing.onnx' does not exist"),
    (["check", "mlp.onnx", "--requires-grad", "conv*"], "'conv*' matches no parameter; the 4 parameters are: fc1.weight, fc1.bias, fc2.weight, fc2.bias"),
    (["prepare", "mlp.onnx", "-o", "x", "--train-last", "3"], "give a number from 1 to 2"),
    (["prepare", "mlp.onnx", "-o", "x", "--freeze", "fc1.*", "--train-last", "1"], "not allowed with argument"),
    (["export", "art", "-o", "out.onnx", "--outputs", "logits"], "graph_output_names ['logits']"),
    (["export", "art", "-o", os.path.join("no", "such", "folder", "m.onnx")], "No such file or directory"),
    (["inspect", "nowhere"], "'nowhere' is neither an artifact folder nor a checkpoint file"),
    (["inspect", "train.npz"], "checkpoint 'train.npz' is"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv, message", ERRORS, ids=[" ".join(a)[:40] for a, _ in ERRORS])
def test_errors_are_one_line_and_non_zero(here, capsys, argv, message):
    np.savez(here / "mixed.npz", a=np.zeros((4, 64), np.float32), b=np.zeros(4, np.int64))
    np.savez(here / "val_bad_labels.npz", x=np.zeros((4, 64), np.float32), y=np.full(4, 0.5))
    code, out, err = odtrain_main(capsys, *argv)
    assert code == 2
    line = one_line(err)
    assert line.startswith(f"odtrain {argv[0]}: error: ") or line.startswith("odtrain: error: "), line
    assert message in line


def test_errors_through_python_m_odtrain(workspace):
    result = python_m_odtrain(workspace, "eval", "art", "--data", "nothing.npz")
    assert result.returncode == 2 and not result.stdout
    assert one_line(result.stderr) == "odtrain eval: error: data file 'nothing.npz' does not exist"


# ---- the pieces under the commands -------------------------------------------------------------------------


def test_learning_rate_schedules():
    from odtrain.training import lr_multiplier

    assert [lr_multiplier("constant", s, 10, 2) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_multiplier("linear", s, 10, 2) for s in (2, 6, 9)] == [1.0, 0.5, 0.125]
    assert lr_multiplier("cosine", 2, 10, 2) == 1.0 and lr_multiplier("cosine", 6, 10, 2) == pytest.approx(0.5)
    with pytest.raises(odtrain.ArgumentError, match="unknown learning-rate schedule"):
        lr_multiplier("step", 5, 10, 0)


def test_progress_bar_without_tqdm_redraws_one_line_on_a_terminal(monkeypatch):
    import io

    from odtrain.progress import Progress, progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setitem(sys.modules, "tqdm", None)
    stream = Terminal()
    bar = progress_bar(64, "epoch 1/2", stream, unit="samples", leave=False)
    assert isinstance(bar, Progress)
    bar.update(32, loss=0.5)
    bar.close()
    drawn = stream.getvalue()
    assert drawn.startswith("\repoch 1/2 [") and "32/64" in drawn and "samples/s loss=0.5" in drawn
    assert drawn.endswith("\r") and "\n" not in drawn


def test_memory_budget_flag_recomputes_and_trains_identically_or_names_what_works(here, capsys, monkeypatch):
    """An MLP with Sigmoid and Tanh between its layers, whose arena recomputation can shrink: trained under
    the smallest budget odtrain names, its training step recomputes activations in a smaller arena and
    ends with the loss and parameters of an unconstrained run, bit for bit."""
    from odtrain import executor

    _model_with(here / "deep.onnx", ["Sigmoid", "Tanh", "Sigmoid", "Tanh"], width=128)
    for folder in ("deep_free", "deep_tight"):
        shutil.rmtree(here / folder, ignore_errors=True)
        assert odtrain_main(capsys, "prepare", "deep.onnx", "-o", folder, "--lr", "0.01")[0] == 0
    settings = ["--data", "train.npz", "--epochs", "1", "--batch-size", BATCH, "--seed", "3", "--json"]
    code, _, err = odtrain_main(capsys, "train", "deep_tight", *settings, "--memory-budget", "64")
    assert code == 2 and "at least" in one_line(err)
    smallest = int(re.search(r"at least ([\d,]+)", err).group(1).replace(",", ""))
    bound = []
    original = executor.ExecutableStep.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        bound.append(self)

    monkeypatch.setattr(executor.ExecutableStep, "__init__", recording)
    code, out, _ = odtrain_main(capsys, "train", "deep_free", *settings)
    assert code == 0 and bound and not any(b.recomputed for b in bound)
    unconstrained, bound[:] = max(b.plan.arena_bytes for b in bound), []
    code, out_budget, _ = odtrain_main(capsys, "train", "deep_tight", *settings, "--memory-budget", smallest)
    assert code == 0
    recomputing = [b for b in bound if b.recomputed]
    assert recomputing and all(b.plan.arena_bytes <= smallest < unconstrained for b in recomputing)
    assert [e["loss"] for e in json.loads(out_budget)["history"]] == [e["loss"] for e in json.loads(out)["history"]]
    free, tight = trained_state(here / "deep_free")[0], trained_state(here / "deep_tight")[0]
    for name in free:
        np.testing.assert_array_equal(tight[name], free[name], err_msg=name)
    code, _, err = odtrain_main(capsys, "train", "deep_tight", *settings, "--memory-budget", "lots")
    assert code == 2 and "'lots' is not a size" in one_line(err)


def test_memory_profile_and_inspect_take_whole_input_shapes(tmp_path, capsys):
    """An image model exported with a symbolic height and width: `--seq-len` would give both one length, so the
    reports take a non-square photo's whole shape with --input-shape, and without either they say which to give."""
    from odtrain import artifacts

    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, ["batch", 3, "height", "width"])],
                              [helper.make_tensor_value_info("y", 1, ["batch", 3, "height", "width"])],
                              [numpy_helper.from_array(np.ones((3, 1, 1), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder = str(tmp_path / "photo")
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
    code, _, err = odtrain_main(capsys, "memory", folder, "--batch-size", 2)
    assert code == 2 and "--input-shape x=D0,D1,..." in err and "--seq-len N" in err
    shapes = ["--input-shape", "x=2,3,5,7", "target=2,3,5,7"]
    code, out, _ = odtrain_main(capsys, "memory", folder, "--batch-size", 2, "--json", *shapes)
    assert code == 0
    assert [plan["inputs"]["x"] for plan in json.loads(out)["plans"]] == [[2, 3, 5, 7]] * 2  # training, eval
    code, out, _ = odtrain_main(capsys, "profile", folder, "--batch-size", 2, "--steps", 1, "--json", *shapes)
    assert code == 0 and json.loads(out)["batch_size"] == 2
    code, out, _ = odtrain_main(capsys, "inspect", folder, "--batch-size", 2, "--json", *shapes)
    assert code == 0 and json.loads(out)["memory_plan"]["training step"]["arena_bytes"] >= 2 * 210 * 4
