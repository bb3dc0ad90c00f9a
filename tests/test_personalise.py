"""Personalisation's training loop: the best epoch kept, the early stop, the curves, several validation sets,
replayed base samples, frozen BatchNorm statistics, bias-only training, and data faults named as such.

Oracles: the best checkpoint equals a fresh run stopped at the best epoch (a run's bits are the same at a given
thread count); each validation set's last metrics equal `evaluate` on the final checkpoint; a frozen BatchNorm's
training loss equals the eval model's on the same batch, and its running statistics are the file's bytes.
"""
import os
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from odtrain import checkpoint as checkpoint_file
from odtrain import cli
from odtrain.api import CheckpointState, Module
from odtrain.datasets import load_digits, train_test_split
from odtrain.demo import build_classifier
from odtrain.graph.errors import ArgumentError, InputError
from odtrain.replay import ReplayMix, replay_count
from odtrain.training import Session, evaluate, fit
from conftest import odtrain_main

QUIET = {"log": None, "progress": False, "handle_signals": False}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """mlp.onnx, base (digits 0-4) and new (5-9) train/val files, and prepared artifacts in art/."""
    folder = tmp_path_factory.mktemp("personalise")
    images, labels = load_digits()
    for name, keep in (("base", labels < 5), ("new", labels >= 5)):
        train_x, val_x, train_y, val_y = train_test_split(images[keep], labels[keep], test_fraction=0.25, seed=0)
        np.savez(folder / f"{name}-train.npz", input=train_x[:200], labels=train_y[:200])
        np.savez(folder / f"{name}-val.npz", input=val_x[:100], labels=val_y[:100])
    onnx.save(build_classifier()[0], str(folder / "mlp.onnx"))
    assert cli.main(["prepare", str(folder / "mlp.onnx"), "-o", str(folder / "art"), "--lr", "0.05"]) == 0
    return folder


def fresh(workspace, name):
    import shutil

    target = workspace / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(workspace / "art", target)
    return str(target)


def parameters(path):
    return checkpoint_file.load(path).parameters


# ---- the best epoch, the early stop, the curves --------------------------------------------------------------


def test_the_best_checkpoint_is_the_run_stopped_at_its_best_epoch(workspace):
    """Training on 5-9 while judging on 0-4 makes the validation loss rise after the first epoch: the best is early,
    and checkpoint.best holds exactly what a run of that many epochs ends with."""
    folder = fresh(workspace, "best")
    result = fit(folder, workspace / "new-train.npz", val=workspace / "base-val.npz", epochs=4, keep_best=True,
                 **QUIET)
    losses = [r["val_loss"] for r in result.history]
    best_epoch = 1 + int(np.argmin(losses))
    assert result.best == {"epoch": best_epoch, "metric": "val_loss", "value": min(losses),
                           "checkpoint": os.path.join(folder, "checkpoint.best")}
    assert best_epoch < 4  # the run must make the best differ from the last, or this test proves nothing
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint.best"))  # loadable as a checkpoint
    assert state.properties["epoch"] == best_epoch and state.properties["best_epoch"] == best_epoch
    again = fresh(workspace, "best-again")
    fit(again, workspace / "new-train.npz", epochs=best_epoch, **QUIET)
    kept, reference = parameters(os.path.join(folder, "checkpoint.best")), parameters(os.path.join(again, "checkpoint"))
    for name in reference:
        np.testing.assert_array_equal(kept[name], reference[name], err_msg=name)
    last = parameters(os.path.join(folder, "checkpoint"))
    assert any(not np.array_equal(last[n], kept[n]) for n in kept)
    metrics = evaluate(folder, workspace / "base-val.npz", checkpoint=os.path.join(folder, "checkpoint.best"))
    assert metrics["loss"] == pytest.approx(min(losses), rel=1e-6)


def test_best_by_accuracy_keeps_the_most_accurate_epoch(workspace):
    folder = fresh(workspace, "best-accuracy")
    result = fit(folder, workspace / "new-train.npz", val=workspace / "new-val.npz", epochs=3, keep_best=True,
                 best_metric="accuracy", **QUIET)
    accuracies = [r["val_accuracy"] for r in result.history]
    assert result.best["epoch"] == 1 + int(np.argmax(accuracies)) and result.best["metric"] == "val_accuracy"


def test_early_stop_ends_the_run_after_n_epochs_without_improvement(workspace, capsys):
    folder = fresh(workspace, "early")
    code, out, err = odtrain_main(capsys, "train", folder, "--data", workspace / "new-train.npz", "--val",
                                  workspace / "base-val.npz", "--epochs", "20", "--early-stop", "2")
    assert code == 0, err
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    best = state.properties["best_epoch"]
    assert state.properties["epoch"] == best + 2 < 20 and state.properties["finished"] == 1
    assert "stopping early: 2 epochs without a better val loss than epoch" in out
    assert not os.path.exists(os.path.join(folder, "checkpoint.best"))  # kept only with --keep-best


def test_keep_best_and_early_stop_need_validation_data(workspace, capsys):
    folder = fresh(workspace, "no-val")
    for flag in (["--keep-best"], ["--early-stop", "3"]):
        code, out, err = odtrain_main(capsys, "train", folder, "--data", workspace / "new-train.npz", *flag)
        assert code == 2 and "--val" in err and flag[0] in err, err


def test_plot_draws_the_curves_to_a_png(workspace):
    pytest.importorskip("matplotlib")
    folder = fresh(workspace, "plot")
    fit(folder, workspace / "new-train.npz", val=[workspace / "new-val.npz", workspace / "base-val.npz"], epochs=2,
        plot=workspace / "curves.png", **QUIET)
    with open(workspace / "curves.png", "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_install_before_training(workspace, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    folder = fresh(workspace, "plot-missing")
    before = open(os.path.join(folder, "checkpoint"), "rb").read()
    code, out, err = odtrain_main(capsys, "train", folder, "--data", workspace / "new-train.npz", "--plot", "c.png")
    assert code == 2 and "pip install matplotlib" in err
    assert open(os.path.join(folder, "checkpoint"), "rb").read() == before


# ---- several validation sets, replay -------------------------------------------------------------------------


def test_each_validation_set_is_reported_by_its_file_name(workspace, capsys):
    folder = fresh(workspace, "two-val")
    code, out, err = odtrain_main(capsys, "train", folder, "--data", workspace / "new-train.npz", "--val",
                                  workspace / "new-val.npz", "--val", workspace / "base-val.npz", "--epochs", "2",
                                  "--json")
    assert code == 0, err
    import json

    last = json.loads(out)["history"][-1]
    assert list(last["validation"]) == ["new-val.npz", "base-val.npz"]
    for name in last["validation"]:  # the last epoch's metrics are the final checkpoint's
        assert last["validation"][name] == pytest.approx(
            {k: v for k, v in evaluate(folder, workspace / name).items() if k != "samples"})
    assert last["val_loss"] == last["validation"]["new-val.npz"]["loss"]
    code, out, err = odtrain_main(capsys, "train", fresh(workspace, "two-val-text"), "--data",
                                  workspace / "new-train.npz", "--val", workspace / "new-val.npz", "--val",
                                  workspace / "base-val.npz")
    assert "validating on new-val.npz (100 samples), base-val.npz (100 samples)" in out
    assert "new-val.npz: loss " in out and "; base-val.npz: loss " in out


def test_replay_puts_its_share_of_base_samples_in_every_batch_and_resumes_the_same(workspace):
    session = Session(str(workspace / "art"), with_optimizer=False)
    new, base = session.dataset(str(workspace / "new-train.npz")), session.dataset(str(workspace / "base-train.npz"))
    mix = ReplayMix(new, base, 0.25, seed=3)
    order = np.random.default_rng(0).permutation(len(new))
    batches = list(mix.batches(32, order))
    assert len(batches) == 7 and replay_count(32, 0.25) == 11  # 11 of 43 is a quarter
    for index, batch in enumerate(batches):
        fresh_count = len(order[index * 32:(index + 1) * 32])
        images, labels = batch
        assert len(labels) == fresh_count + replay_count(fresh_count, 0.25)
        np.testing.assert_array_equal(labels[:fresh_count], new.labels[order[index * 32:index * 32 + fresh_count]])
        assert (labels[fresh_count:] < 5).all() and (labels[:fresh_count] >= 5).all()
    later = list(mix.batches(32, order, start=4))  # a resumed run gets the same batches
    for a, b in zip(batches[4:], later):
        np.testing.assert_array_equal(a[0], b[0])


def test_replay_holds_back_forgetting_and_counts_new_samples(workspace):
    """The base set's accuracy after training on 5-9 is higher with replay than without, and the epoch's loss and
    samples are those of the new data."""
    without, with_replay = fresh(workspace, "forget"), fresh(workspace, "replay")
    base = workspace / "base-val.npz"
    fit(without, workspace / "base-train.npz", epochs=5, **QUIET)
    fit(with_replay, workspace / "base-train.npz", epochs=5, **QUIET)
    fit(without, workspace / "new-train.npz", epochs=3, **QUIET)
    original, steps = Module.__call__, []

    def recorded(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        if self.training:
            steps.append((float(loss), int((args[-1] >= 5).sum())))  # the step's loss, its new samples (5-9)
        return loss

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Module, "__call__", recorded)
        result = fit(with_replay, workspace / "new-train.npz", epochs=3, replay=workspace / "base-train.npz",
                     replay_share=0.5, **QUIET)
    assert evaluate(with_replay, base)["accuracy"] > evaluate(without, base)["accuracy"] + 0.3
    assert CheckpointState.load_checkpoint(os.path.join(with_replay, "checkpoint")).properties["samples"] == 200
    assert result.global_step == 3 * 7 and len(steps) == 21
    last_epoch = steps[14:]
    assert sum(n for _, n in last_epoch) == 200  # an epoch is one pass over the new data
    assert result.history[-1]["loss"] == pytest.approx(sum(loss * n for loss, n in last_epoch) / 200, rel=1e-9)


def test_replay_share_outside_zero_to_one_is_refused(workspace, capsys):
    code, out, err = odtrain_main(capsys, "train", fresh(workspace, "bad-share"), "--data",
                                  workspace / "new-train.npz", "--replay", workspace / "base-train.npz",
                                  "--replay-share", "1.5")
    assert code == 2 and "replay share" in err


# ---- prepare: frozen BatchNorm, biases -----------------------------------------------------------------------


def _batch_norm_model(path):
    """Conv -> BatchNormalization (training mode, as a TRAINING export) -> Relu -> pool -> Gemm, 3 classes."""
    rng = np.random.default_rng(0)

    def init(name, value):
        return numpy_helper.from_array(np.asarray(value, np.float32), name)

    nodes = [helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                              ["b", "bn.mean_out", "bn.var_out"], training_mode=1, momentum=0.9, name="bn"),
             helper.make_node("Relu", ["b"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["output"], transB=1, name="fc")]
    inits = [init("conv.weight", rng.normal(0, 0.3, (4, 1, 3, 3))), init("conv.bias", np.zeros(4)),
             init("bn.weight", np.ones(4)), init("bn.bias", np.zeros(4)),
             init("bn.running_mean", rng.normal(0, 0.1, 4)), init("bn.running_var", 1 + rng.random(4)),
             init("fc.weight", rng.normal(0, 0.3, (3, 4))), init("fc.bias", np.zeros(3))]
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 8, 8])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]), str(path))
    x = rng.random((12, 1, 8, 8)).astype(np.float32)
    return x, rng.integers(0, 3, 12)


@pytest.mark.parametrize("frozen", [True, False])
def test_freeze_batchnorm_trains_with_the_running_statistics_and_keeps_them(workspace, capsys, frozen):
    x, y = _batch_norm_model(workspace / "bn.onnx")
    folder = workspace / f"bn-{frozen}"
    code, out, err = odtrain_main(capsys, "prepare", workspace / "bn.onnx", "-o", folder, "--force",
                                  *(["--freeze-batchnorm"] if frozen else []))
    assert code == 0, err
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))
    module.eval()
    eval_loss = float(module(x[:4], y[:4])[0])
    module.train()
    train_loss = float(module(x[:4], y[:4]))
    # frozen: the batch is normalised by the running statistics, as the eval model does; else by its own
    assert (train_loss == pytest.approx(eval_loss, rel=1e-6)) == frozen
    before = {n: parameters(str(folder / "checkpoint"))[n].copy() for n in ("bn.running_mean", "bn.running_var")}
    np.savez(workspace / "bn.npz", input=x, labels=y)
    assert odtrain_main(capsys, "train", folder, "--data", workspace / "bn.npz", "--batch-size", "4")[0] == 0
    after = parameters(str(folder / "checkpoint"))
    for name, value in before.items():
        assert np.array_equal(after[name], value) == frozen, name


def test_train_biases_trains_the_biases_alone_or_beside_the_last_layers(workspace, capsys):
    _batch_norm_model(workspace / "bn.onnx")
    for extra, trainable in (([], ["conv.bias", "bn.bias", "fc.bias"]),
                             (["--train-last", "1"], ["conv.bias", "bn.bias", "fc.weight", "fc.bias"])):
        code, out, err = odtrain_main(capsys, "prepare", workspace / "bn.onnx", "-o", workspace / "biases", "--force",
                                      "--train-biases", *extra, "--json")
        assert code == 0, err
        import json

        assert json.loads(out)["trainable"] == trainable
    # an exported Linear layer: MatMul then Add of a vector
    graph_mlp = workspace / "mlp.onnx"
    code, out, err = odtrain_main(capsys, "prepare", graph_mlp, "-o", workspace / "mlp-biases", "--force",
                                  "--train-biases", "--json")
    assert code == 0 and json.loads(out)["trainable"] == ["fc1.bias", "fc2.bias"], err


# ---- data faults and wording ---------------------------------------------------------------------------------


def test_a_nan_in_the_data_stops_before_training_naming_the_file_and_sample(workspace, capsys):
    data = np.load(workspace / "new-train.npz")
    images = data["input"].astype(np.float32).copy()
    images[37, 5] = np.nan
    np.savez(workspace / "nan.npz", input=images, labels=data["labels"])
    folder = fresh(workspace, "nan")
    before = open(os.path.join(folder, "checkpoint"), "rb").read()
    for command in (["train", folder], ["eval", folder]):
        code, out, err = odtrain_main(capsys, *command, "--data", workspace / "nan.npz")
        assert code == 2, err
        assert "nan.npz" in err and "sample 37" in err and "nan" in err and "learning rate" not in err, err
    assert open(os.path.join(folder, "checkpoint"), "rb").read() == before
    images[37, 5] = np.inf
    np.savez(workspace / "inf.npz", input=images, labels=data["labels"])
    code, out, err = odtrain_main(capsys, "train", folder, "--data", workspace / "new-train.npz", "--val",
                                  workspace / "inf.npz")
    assert code == 2 and "inf.npz" in err and "sample 37" in err and "inf" in err, err


def test_eval_exits_non_zero_when_its_loss_is_not_finite(workspace, capsys):
    folder = fresh(workspace, "nan-weights")
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    state.parameters["fc2.bias"].data = np.full(10, np.nan, np.float32)
    CheckpointState.save_checkpoint(state, os.path.join(folder, "checkpoint"))
    for json_flag in ([], ["--json"]):
        code, out, err = odtrain_main(capsys, "eval", folder, "--data", workspace / "new-val.npz", *json_flag)
        assert code == 2 and "nan" in err and "not a score" in err, err


def test_a_batch_size_larger_than_the_data_says_so(workspace, capsys):
    code, out, err = odtrain_main(capsys, "train", fresh(workspace, "big-batch"), "--data",
                                  workspace / "new-train.npz", "--batch-size", "5000")
    assert code == 0, err
    assert "training on 200 samples (1 batch of all of them: the batch size 5000 is larger than the data)" in out
    assert "including the first step's planning and compiling" in out  # a one-step epoch cannot leave it out


def test_the_first_epoch_s_speed_leaves_out_the_first_step(workspace, monkeypatch):
    """A first step that takes a second (as compiling does) leaves the first epoch's samples/s where the others are."""
    folder = fresh(workspace, "speed")
    original, calls = Module.__call__, []

    def slow_first(self, *args, **kwargs):
        if self.training and not calls:
            time.sleep(1.0)
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Module, "__call__", slow_first)
    result = fit(folder, workspace / "new-train.npz", epochs=1, **QUIET)
    assert result.history[0]["samples_per_second"] > 200 / 0.5  # 200 samples: under 400/s if the second counted
    assert result.history[0]["seconds"] > 1.0


def test_check_of_a_two_output_model_names_every_untrainable_op_before_asking_for_the_loss_input(workspace, capsys):
    from odtrain.graph.ops import OPS

    no_kernel = next(op for op in ("Hardmax", "Det", "NonZero") if ("", op) not in OPS)
    no_gradient = next(op for op in ("Sign", "Floor", "Ceil", "Round")
                       if ("", op) in OPS and OPS[("", op)].gradient is None)
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gemm", ["input", "w1"], ["h"], transB=1, name="fc1"),
             helper.make_node(no_gradient, ["h"], ["rounded"], name="rounding"),
             helper.make_node("Gemm", ["rounded", "w2"], ["scores"], transB=1, name="fc2"),
             helper.make_node(no_kernel, ["scores"], ["picked"], name="picking")]
    weights = [numpy_helper.from_array(rng.normal(size=s).astype(np.float32), n) for n, s in (("w1", (8, 64)),
                                                                                                ("w2", (10, 8)))]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 10]) for n in ("scores", "picked")]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 64])],
                              outputs, weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(workspace / "two.onnx"))
    code, out, err = odtrain_main(capsys, "check", workspace / "two.onnx")
    assert code == 1, err
    assert f"no kernel: {no_kernel} node 'picking'" in out and f"{no_gradient} node 'rounding'" in out, out
    assert "--loss-input" in err
    _model = workspace / "two-clean.onnx"  # every op supported: the only question left is the loss input
    nodes[1] = helper.make_node("Relu", ["h"], ["rounded"], name="rounding")
    nodes[3] = helper.make_node("Relu", ["scores"], ["picked"], name="picking")
    graph = helper.make_graph(nodes, "two", graph.input, outputs, weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(_model))
    code, out, err = odtrain_main(capsys, "check", _model)
    assert code == 2 and "--loss-input" in err and "no kernel" not in out


def test_a_resumed_run_judges_against_the_best_before_the_stop(workspace):
    """Stopped mid-run and resumed, a run keeps the best epoch and checkpoint an uninterrupted run keeps."""
    whole, parts = fresh(workspace, "best-whole"), fresh(workspace, "best-parts")
    settings = dict(val=workspace / "base-val.npz", epochs=4, keep_best=True, early_stop=2, **QUIET)
    uninterrupted = fit(whole, workspace / "new-train.npz", **settings)
    stopped = fit(parts, workspace / "new-train.npz", stop_after_steps=17, **settings)  # in epoch 3 of 7-step epochs
    assert stopped.stopped_by == "stop_after_steps"
    resumed = fit(parts, workspace / "new-train.npz", resume=True, **settings)
    assert resumed.best == {**uninterrupted.best, "checkpoint": os.path.join(parts, "checkpoint.best")}
    assert resumed.epochs == uninterrupted.epochs and resumed.stopped_by == uninterrupted.stopped_by
    kept, reference = parameters(os.path.join(parts, "checkpoint.best")), parameters(os.path.join(whole, "checkpoint.best"))
    for name in reference:
        np.testing.assert_array_equal(kept[name], reference[name], err_msg=name)


def test_eval_of_a_best_checkpoint_not_written_says_what_writes_it(workspace, capsys):
    folder = fresh(workspace, "no-best")
    code, out, err = odtrain_main(capsys, "eval", folder, "--data", workspace / "new-val.npz", "--checkpoint",
                                  os.path.join(folder, "checkpoint.best"))
    assert code == 2 and "--keep-best" in err and "checkpoint.best" in err, err


def test_a_list_of_arrays_is_one_validation_set(workspace):
    data = np.load(workspace / "new-val.npz")
    result = fit(fresh(workspace, "arrays"), workspace / "new-train.npz", val=[data["input"], data["labels"]],
                 epochs=1, **QUIET)
    assert "val_loss" in result.history[0] and "validation" not in result.history[0]


def test_best_by_accuracy_is_refused_before_training_for_a_regression(workspace, capsys):
    folder = str(workspace / "regression")
    code, out, err = odtrain_main(capsys, "prepare", workspace / "mlp.onnx", "-o", folder, "--loss", "mse", "--force")
    assert code == 0, err
    rng = np.random.default_rng(0)
    np.savez(workspace / "targets.npz", input=rng.random((40, 64), np.float32), target=rng.random((40, 10), np.float32))
    before = open(os.path.join(folder, "checkpoint"), "rb").read()
    code, out, err = odtrain_main(capsys, "train", folder, "--data", workspace / "targets.npz", "--val",
                                  workspace / "targets.npz", "--keep-best", "--best-metric", "accuracy")
    assert code == 2 and "judge by loss" in err and "mse" in err, err
    assert open(os.path.join(folder, "checkpoint"), "rb").read() == before
