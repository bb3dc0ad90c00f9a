"""A training loop over artifacts: `fit` trains, `evaluate` scores, both usable from Python and the CLI.

    from odtrain.training import fit, evaluate
    result = fit("artifacts", "train.npz", val="val.npz", epochs=10, batch_size=32, checkpoint_every=100)
    print(evaluate("artifacts", "test.npz"))

The loop:
- Each epoch visits the training samples in the order
  `numpy.random.default_rng([seed, epoch]).permutation(n)`, in batches of
  `batch_size` (the last one smaller). The order is a function of the seed
  and the epoch alone, so a resumed run regenerates it.
- Before each optimizer step the learning rate is set from the schedule
  (constant, linear decay or cosine, after a linear warm-up) at the run's
  global step.
- The checkpoint (`<artifacts>/checkpoint`, with optimizer state) is saved
  every `checkpoint_every` steps, at each epoch's end, when the run ends and
  when it is stopped. Its property bag holds the run's settings (seed,
  epochs, batch size, learning rate, schedule, warm-up, sample count) and
  position (`epoch` epochs done, `step_in_epoch` batches of the next one,
  `global_step`, the epoch's loss sum so far), so `resume=True` continues
  with the same batches, optimizer state and learning rates: the final
  parameters equal those of an uninterrupted run.
- Validation (odtrain/validation.py): each set of `val` is scored after
  every epoch; with `keep_best` the epoch best by the first set's metric is
  saved to `checkpoint.best`, and `early_stop` ends the run after that many
  epochs without improvement. `replay` mixes base samples into every batch
  (odtrain/replay.py); `plot` draws the curves (odtrain/curves.py).
- A NaN or infinity in any data set is refused as it is loaded, before the
  first step, naming the file and sample (odtrain/data_loading.py): met in a
  step, it would read as divergence.
- An epoch's samples/s leaves out the call's first step (planning the step,
  compiling kernels), unless the epoch has no other.
- SIGINT (Ctrl-C) and SIGTERM stop the loop after the step in progress: the
  checkpoint is saved and the result says where it stopped. A second Ctrl-C
  stops at once, leaving the last saved checkpoint; so does a first one
  before the run's first step has ended (its kernels may be compiling, and
  nothing has changed yet).
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import data_loading as data_files
from .api import DEFAULT_LEARNING_RATE, CheckpointState, Module, Optimizer
from .artifact_paths import OPTIMIZER_MODEL, ArtifactPaths
from .allocation import AUTO
from .graph.errors import ArgumentError, ArtifactNotFoundError, InputError, StateError
from .graph.losses import cross_entropy_classes, cross_entropy_layout
from .graph import wording
from .progress import progress_bar
from .curves import plot_history, require_matplotlib
from .replay import DEFAULT_SHARE, ReplayMix, new_samples, replay_count
from .validation import BestKeeper, describe_sets, epoch_metrics, epoch_text, validation_sets
from .audio import AudioSource
from .text import TextSource

SCHEDULES = ("constant", "linear", "cosine")
LOSS_KINDS = {"SoftmaxCrossEntropyLoss": "ce"}
EVAL_BATCH_SIZE = 256
DEFAULTS = {"epochs": 1, "batch_size": 32, "lr_schedule": "constant", "warmup_steps": 0, "seed": 0}
# Property names: the run's settings, and its position.
SETTINGS = ("seed", "epochs", "batch_size", "learning_rate", "lr_schedule", "warmup_steps", "samples")
POSITION = ("epoch", "step_in_epoch", "global_step", "epoch_loss_sum", "finished")
_LABEL_INPUT = re.compile(r"(labels|target)(_\d+)?$")


class Session:
    """Loaded artifacts: the CheckpointState, a Module, and an Optimizer when one is wanted."""

    def __init__(self, directory, checkpoint=None, with_optimizer: bool = True, fresh_optimizer: bool = False,
                 memory_budget: int | str | None = AUTO):
        self.paths = ArtifactPaths.find(directory, checkpoint)
        self.state = CheckpointState.load_checkpoint(self.paths.checkpoint)
        self.module = Module(self.paths.training_model, self.state, self.paths.eval_model, memory_budget=memory_budget)
        self.optimizer = None
        if with_optimizer:
            if not self.paths.has("optimizer_model"):
                raise ArtifactNotFoundError(f"artifact folder '{self.paths.directory}' has no {OPTIMIZER_MODEL}; "
                                            "generate the artifacts with an optimizer (odtrain prepare does)")
            self.optimizer = Optimizer(self.paths.optimizer_model, self.module)
            if fresh_optimizer:
                self.optimizer.reset_state()

    @property
    def inputs(self) -> list[data_files.InputSpec]:
        """The training model's inputs; the last one is the label input when it is named labels or target."""
        types = self.module.input_types(training=True)
        names = list(types)
        specs = []
        for index, name in enumerate(names):
            declared = types[name]
            is_label = index == len(names) - 1 and len(names) > 1 and bool(_LABEL_INPUT.match(name))
            specs.append(data_files.InputSpec(name, declared.dtype, declared.shape, is_label))
        return specs

    @property
    def loss_kind(self) -> str | None:
        """ce, bce, mse or l1: from the checkpoint's `loss` property, else read off the eval model."""
        kind = self.state.properties.get("loss")
        if kind:
            return str(kind)
        graph = self.module.graph(training=False)
        if any(node.op_type in LOSS_KINDS for node in graph.nodes):
            return "ce"
        values = {o for node in graph.nodes for o in node.outputs}
        for prefix, found in (("bce_", "bce"), ("loss_sq", "mse"), ("loss_abs", "l1")):
            if any(v.startswith(prefix) for v in values):
                return found
        return None

    @property
    def prediction_outputs(self) -> list[str]:
        """The eval model's outputs besides the loss: what the model predicts."""
        return list(self.module.graph(training=False).outputs[1:])

    def dataset(self, source, x=None, y=None) -> data_files.Dataset:
        """A Dataset for this model from paths, a Dataset, a text.TextSource, a data_loading.ImageFolder, an audio.AudioSource, a dict of
        arrays or arrays in input order."""
        if isinstance(source, data_files.Dataset):
            dataset = source
        elif isinstance(source, (TextSource, data_files.ImageFolder)):
            dataset = source.dataset(self.inputs)
        elif isinstance(source, AudioSource):
            dataset = data_files.load_audio_folder(source, self.inputs)
        elif isinstance(source, (str, os.PathLike)) or (isinstance(source, (list, tuple)) and source
                                                          and all(isinstance(s, (str, os.PathLike)) for s in source)):
            dataset = data_files.load(source, self.inputs, x, y)
        else:
            dataset = data_files.from_arrays(source, self.inputs)
        self._check_labels(dataset)
        return dataset

    def _check_labels(self, dataset: data_files.Dataset) -> None:
        """Refuse class labels outside the model's classes before any step, naming the first such sample."""
        graph = self.module.graph(training=False)
        classes, layout = cross_entropy_classes(graph), cross_entropy_layout(graph)
        labels = dataset.labels
        if classes is None or layout is None or labels is None or labels.dtype.kind not in "iu":
            return
        ignore_index = layout[1]
        outside = (labels < 0) | (labels >= classes)
        if ignore_index is not None:
            outside &= labels != ignore_index
        if outside.any():
            where = tuple(int(i) for i in np.argwhere(outside)[0])
            position = f"sample {where[0]}" + (f" (position {', '.join(map(str, where[1:]))})" if len(where) > 1 else "")
            ignored = f", nor the ignored label {ignore_index}" if ignore_index is not None else ""
            raise InputError(f"{dataset.source}: {position} has label {labels[where]}, outside the model's "
                             f"{classes} classes [0, {classes}){ignored} ({int(outside.sum()):,} of {labels.size:,} labels "
                             "outside); relabel the data, or give a model with as many classes as the labels")

    def save(self) -> None:
        CheckpointState.save_checkpoint(self.state, self.paths.checkpoint,
                                        include_optimizer_state=self.optimizer is not None)


def lr_multiplier(schedule: str, step: int, total_steps: int, warmup_steps: int) -> float:
    """The learning-rate factor for optimizer step `step` (0-based) of `total_steps`.

    Warm-up rises linearly to 1 over the first `warmup_steps` steps; then
    constant stays at 1, linear falls towards 0 at `total_steps`, cosine
    follows half a cosine from 1 towards 0.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    raise ArgumentError(f"unknown learning-rate schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")


def epoch_order(seed: int, epoch: int, count: int) -> np.ndarray:
    """The order in which epoch `epoch` (0-based) visits `count` samples."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(count)


def evaluate(artifacts, data, batch_size: int = EVAL_BATCH_SIZE, checkpoint=None, x=None, y=None) -> dict:
    """Loss and accuracy (classification) or MSE and MAE (regression) of the eval model on `data`.

    `artifacts` is an artifact folder or a Session; `data` a path, Dataset or arrays. For cross-entropy the
    loss and accuracy are means over the labels that count (ignored labels, such as padding, do not), and a
    model scoring classes on the last axis (a language model) also gets its perplexity, exp(loss).
    """
    session = artifacts if isinstance(artifacts, Session) else Session(artifacts, checkpoint, with_optimizer=False)
    dataset = session.dataset(data, x, y)
    if batch_size < 1:
        raise ArgumentError(f"batch size must be at least 1, got {batch_size}")
    module = session.module
    was_training = module.training
    module.eval()
    kind = session.loss_kind
    label_index = next((i for i, s in enumerate(dataset.inputs) if s.is_label), None)
    layout = cross_entropy_layout(module.graph(training=False)) if kind == "ce" else None
    class_axis, ignore_index = layout if layout is not None else (1, None)
    scored = kind == "ce" and label_index is not None
    total, loss_sum, correct, squared, absolute, elements = 0, 0.0, 0, 0.0, 0.0, 0
    try:
        for batch in dataset.batches(batch_size):
            outputs = module(*batch)
            outputs = outputs if isinstance(outputs, list) else [outputs]
            count = len(batch[0])
            total += count
            if scored:  # the loss is a mean over the labels that count: weigh it by them
                labels = batch[label_index]
                counted = labels != ignore_index if ignore_index is not None else np.ones(labels.shape, bool)
                weight = int(counted.sum())
                elements += weight
                if len(outputs) > 1:
                    predicted = outputs[1].argmax(axis=class_axis)
                    correct += int(((predicted == labels) & counted).sum())
            else:
                weight = count
            loss_sum += float(outputs[0]) * weight
            if scored or len(outputs) < 2 or label_index is None:
                continue
            predicted, labels = outputs[1], batch[label_index]
            if kind == "bce":
                correct += int(((predicted > 0) == (labels > 0.5)).sum())
                elements += labels.size
            elif predicted.shape == labels.shape:
                difference = predicted.astype(np.float64) - labels
                squared += float((difference ** 2).sum())
                absolute += float(np.abs(difference).sum())
                elements += difference.size
    finally:
        module.train(was_training)
    denominator = elements if scored else total
    metrics = {"samples": total, "loss": loss_sum / denominator if denominator else 0.0}
    if scored:
        if class_axis == -1 or ignore_index is not None:  # labels are tokens, or some do not count
            metrics["labels"] = elements
        if session.prediction_outputs:
            metrics["accuracy"] = correct / elements if elements else 0.0
        if class_axis == -1:
            metrics["perplexity"] = math.exp(metrics["loss"])
    elif kind == "bce" and elements:
        metrics["accuracy"] = correct / elements
    elif elements:
        metrics["mse"], metrics["mae"] = squared / elements, absolute / elements
    return metrics


@dataclass
class FitResult:
    checkpoint: str
    epochs: int  # epochs completed
    global_step: int
    step_in_epoch: int
    finished: bool
    stopped_by: str | None = None  # SIGINT, SIGTERM, stop_after_steps or early_stop when the run stopped early
    history: list[dict] = field(default_factory=list)  # one entry per epoch finished in this call
    best: dict | None = None  # with keep_best or early_stop: the best epoch, its metric and value, its checkpoint

    def to_dict(self) -> dict:
        return asdict(self)


class _StopRequests:
    """SIGINT/SIGTERM set a flag that the loop reads between steps; a second SIGINT interrupts at once, and so
    does a first one while `at_once` (before the run's first step has ended: its kernels may be compiling for
    minutes, and nothing has changed that a save would keep). `says` hears that a stop waits for the step."""

    def __init__(self, enabled: bool, says=None):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested: str | None = None
        self.previous = {}
        self.at_once = True
        self.says = says

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and (self.requested or self.at_once):
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        if self.says:
            self.says(f"{self.requested}: stopping after the step in progress, then saving"
                      + (" (Ctrl-C again stops at once, keeping the last saved checkpoint)"
                         if signum == signal.SIGINT else ""))

    def __enter__(self):
        if self.enabled:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _write_now(line: str) -> None:
    """Write a line to stdout's descriptor: a signal handler must not print through sys.stdout, which it may have
    interrupted inside a write (stdout without a descriptor, as under a capturing test, hears nothing)."""
    try:
        os.write(sys.stdout.fileno(), f"{line}\n".encode())
    except (AttributeError, ValueError, OSError):
        pass


def _settings(properties, resume: bool, given: dict, checkpoint: str) -> dict:
    """The run's settings: those given, else the resumed run's, else the defaults."""
    settings = {}
    for key, value in given.items():
        stored = properties.get(key) if resume else None
        if resume and value is not None and stored is not None and key != "epochs" and value != stored:
            raise ArgumentError(f"{key.replace('_', ' ')} {value} differs from the interrupted run's {stored} "
                                f"(in '{checkpoint}'); leave it out to resume exactly, or train anew without resume")
        if value is None:
            value = stored if stored is not None else DEFAULTS.get(key)
        settings[key] = value
    if settings["learning_rate"] is None:
        settings["learning_rate"] = float(properties.get("learning_rate", DEFAULT_LEARNING_RATE))
    return settings


def _checked_settings(properties, resume: bool, given: dict, checkpoint: str, checkpoint_every) -> dict:
    """The run's settings (_settings), once each is in range and a resumed run can reach them."""
    settings = _settings(properties, resume, given, checkpoint)
    for key in ("epochs", "batch_size"):
        if int(settings[key]) < 1:
            raise ArgumentError(f"{key.replace('_', ' ')} must be at least 1, got {settings[key]}")
    if int(settings["warmup_steps"]) < 0 or (checkpoint_every is not None and checkpoint_every < 1):
        raise ArgumentError("warm-up steps must be >= 0 and checkpoint_every >= 1")
    if settings["lr_schedule"] not in SCHEDULES:
        raise ArgumentError(f"unknown learning-rate schedule {settings['lr_schedule']!r}; "
                            f"use one of {', '.join(SCHEDULES)}")
    if resume and int(settings["epochs"]) < int(properties["epoch"]):
        raise ArgumentError(f"the run to resume has trained {properties['epoch']} of its {properties['epochs']} "
                            f"epochs; {settings['epochs']} epochs would end it before where it stands: resume with "
                            f"at least {properties['epoch']} epochs (or leave the count out to keep "
                            f"{properties['epochs']})")
    return settings


class _Run:
    """One call of fit: the session and its data, the run's settings, where it stands (epoch, step_in_epoch,
    global_step, the epoch's loss_sum), and the FitResult that save() keeps in step with the checkpoint."""

    def __init__(self, session: Session, settings: dict, train_set, val_sets, resume: bool, best: BestKeeper):
        self.session, self.train_set, self.val_sets, self.best = session, train_set, val_sets, best
        properties = session.state.properties
        self.samples = len(train_set)
        self.epochs, self.batch_size, self.seed = int(settings["epochs"]), int(settings["batch_size"]), \
            int(settings["seed"])
        self.base_lr, self.schedule = float(settings["learning_rate"]), settings["lr_schedule"]
        self.warmup = int(settings["warmup_steps"])
        self.batches = (self.samples + self.batch_size - 1) // self.batch_size
        self.total_steps = self.epochs * self.batches
        if resume:
            self.epoch, self.step_in_epoch = int(properties["epoch"]), int(properties["step_in_epoch"])
            self.global_step, self.loss_sum = int(properties["global_step"]), float(properties["epoch_loss_sum"])
        else:
            self.epoch, self.step_in_epoch, self.global_step, self.loss_sum = 0, 0, 0, 0.0
            session.state.random_seed = self.seed  # Dropout's streams; a resumed run continues them from the checkpoint
        for key in SETTINGS:
            properties[key] = settings[key]
        if train_set.classes:
            properties["classes"] = json.dumps(train_set.classes)
        self.result = FitResult(session.paths.checkpoint, self.epoch, self.global_step, self.step_in_epoch,
                                self.epoch >= self.epochs)
        self.steps_this_call = 0

    def save(self, finished: bool = False) -> None:
        position = (self.epoch, self.step_in_epoch, self.global_step, self.loss_sum, int(finished))
        for key, value in zip(POSITION, position):
            self.session.state.properties[key] = value
        self.session.save()
        self.result.epochs, self.result.global_step = self.epoch, self.global_step
        self.result.step_in_epoch, self.result.finished = self.step_in_epoch, finished

    def start_lines(self, resume: bool) -> list[str]:
        """What the run says before its first step: its data, length and learning rate; where it resumes."""
        schedule_text = self.schedule + (f" after {self.warmup} warm-up steps" if self.warmup else "")
        validating = f"; {describe_sets(self.val_sets)}" if self.val_sets else ""
        batching = (f"{wording.count(self.batches, 'batch')} of {self.batch_size}" if self.batch_size <= self.samples
                    else f"1 batch of all of them: the batch size {self.batch_size} is larger than the data")
        lines = [f"training on {wording.count(self.samples, 'sample')} ({batching}) for "
                 f"{wording.count(self.epochs, 'epoch')}; learning rate {self.base_lr:g}, {schedule_text}{validating}"]
        if isinstance(self.train_set, ReplayMix):
            batch = min(self.batch_size, self.samples)
            share = self.train_set.share
            lines.append(f"replaying {self.train_set.base.source} ({wording.count(len(self.train_set.base), 'sample')})"
                         f": {replay_count(batch, share)} base samples in each batch of {batch} new ones "
                         f"({share:.0%} of the batch)")
        if resume:
            lines.append(f"resuming at epoch {self.epoch + 1}, step {self.step_in_epoch} of {self.batches} "
                         f"(global step {self.global_step})")
        return lines

    def train_epoch(self, stop: _StopRequests, bar, checkpoint_every, stop_after_steps) -> int | None:
        """Train on the rest of the epoch's batches, saving every `checkpoint_every` steps: the new samples seen, or
        None when a stop request or `stop_after_steps` ended the run (saved, result.stopped_by says which).
        Sets `timed_from` and `timed_seen`, where the epoch's speed is counted from: after the call's first step
        (planning the step, compiling kernels) unless the epoch has no other."""
        module, optimizer = self.session.module, self.session.optimizer
        order = epoch_order(self.seed, self.epoch, self.samples)
        seen = 0
        self.timed_from, self.timed_seen = time.perf_counter(), 0
        self.first_of_call = self.steps_this_call == 0
        for batch in self.train_set.batches(self.batch_size, order, start=self.step_in_epoch):
            optimizer.set_learning_rate(self.base_lr * lr_multiplier(self.schedule, self.global_step, self.total_steps,
                                                                     self.warmup))
            outputs = module(*batch)
            loss = float(outputs[0] if isinstance(outputs, list) else outputs)
            if not math.isfinite(loss):
                if bar:
                    bar.close()
                raise StateError(f"training diverged: the loss is {loss} at epoch {self.epoch + 1}, step "
                                 f"{self.step_in_epoch + 1}; the checkpoint keeps the last saved state. "
                                 "Lower the learning rate")
            optimizer.step()
            module.lazy_reset_grad()
            stop.at_once = False  # from now on a stop saves this step first
            count = new_samples(self.train_set, batch)
            self.step_in_epoch, self.global_step = self.step_in_epoch + 1, self.global_step + 1
            self.steps_this_call += 1
            seen, self.loss_sum = seen + count, self.loss_sum + loss * count
            if self.steps_this_call == 1 and self.step_in_epoch < self.batches:
                self.timed_from, self.timed_seen = time.perf_counter(), seen
            if bar:
                bar.update(count, loss=self.loss_sum / min(self.step_in_epoch * self.batch_size, self.samples))
            stopping = stop.requested or (stop_after_steps is not None and self.steps_this_call >= stop_after_steps)
            if stopping or (checkpoint_every and self.global_step % checkpoint_every == 0):
                self.save()
            if stopping:
                if bar:
                    bar.close()
                self.result.stopped_by = stop.requested or "stop_after_steps"
                return None
        if bar:
            bar.close()
        return seen

    def epoch_record(self, seen: int, started: float) -> tuple[dict, bool]:
        """The finished epoch's entry of the history (with the validation metrics, also kept as properties), and
        whether it is the best so far."""
        ended = time.perf_counter()
        timed = ended - self.timed_from
        record = {"epoch": self.epoch + 1, "loss": self.loss_sum / self.samples, "seconds": ended - started,
                  "samples_per_second": (seen - self.timed_seen) / timed if timed > 0 else 0.0}
        if self.first_of_call and self.timed_seen == 0:
            record["includes_setup"] = True  # the call's first step was its only one: its speed includes it
        record.update(epoch_metrics(self.val_sets, lambda dataset: evaluate(self.session, dataset)))
        for key in ("val_loss", "val_accuracy", "val_mse"):
            if key in record:
                self.session.state.properties[key] = float(record[key])
        improved = self.best.judge(record)
        self.result.history.append(record)
        return record, improved

    def end_epoch(self, improved: bool, keep_best: bool, log) -> bool:
        """Save the finished epoch (and the best checkpoint where it improved); True when the early stop ends the
        run here."""
        self.epoch, self.step_in_epoch, self.loss_sum = self.epoch + 1, 0, 0.0
        best = self.best
        self.save(finished=self.epoch >= self.epochs or best.should_stop)
        if improved and keep_best:
            best.save_best(self.session.state, include_optimizer_state=True)
        if best.active:
            self.result.best = best.summary()
        if not best.should_stop:
            return False
        if log:
            log(f"stopping early: {wording.count(best.waited, 'epoch')} without a better val {best.metric} than "
                f"epoch {best.best_epoch}'s {best.best_value:.4g}")
        self.result.stopped_by = "early_stop"
        return True


def fit(artifacts, train, val=None, *, epochs: int | None = None, batch_size: int | None = None,
        learning_rate: float | None = None, lr_schedule: str | None = None, warmup_steps: int | None = None,
        seed: int | None = None, checkpoint_every: int | None = None, resume: bool = False, x=None, y=None,
        log=print, progress: bool = True, progress_stream=None, stop_after_steps: int | None = None,
        handle_signals: bool = True, memory_budget: int | str | None = AUTO, keep_best: bool = False,
        best_metric: str = "loss", early_stop: int | None = None, plot=None, replay=None,
        replay_share: float = DEFAULT_SHARE) -> FitResult:
    """Train the artifacts in folder `artifacts` on `train` (a path, Dataset or arrays); see the module docstring.

    Settings left as None come from the interrupted run when resuming, else from the defaults
    (1 epoch, batch size 32, the checkpoint's `learning_rate` property, constant schedule, seed 0).
    `log` receives one line per epoch; `stop_after_steps` stops (as Ctrl-C would) after that many steps.
    `memory_budget` (bytes; "auto", the default; None: no budget) caps a training step's arena, recomputing
    activations (see odtrain.api.Module).

    `val` may name several sets (a list, or a dict {name: source}): each is scored every epoch (odtrain.validation).
    `keep_best` keeps the checkpoint of the epoch best by the first set's `best_metric` ("loss", lower is better,
    or "accuracy") in `<artifacts>/checkpoint.best`; `early_stop=N` ends the run after N epochs without improvement.
    `plot` (a path such as "curves.png") draws the loss and accuracy per epoch when the run ends (odtrain.curves).
    `replay` (base data) mixes `replay_share` of base samples into every batch (odtrain.replay).
    """
    session = Session(artifacts, fresh_optimizer=not resume, memory_budget=memory_budget)
    properties = session.state.properties
    if resume and "global_step" not in properties:
        raise StateError(f"checkpoint '{session.paths.checkpoint}' holds no run to resume (it has not been trained "
                         "by odtrain's training loop); train without resume")
    given = {"epochs": epochs, "batch_size": batch_size, "learning_rate": learning_rate, "lr_schedule": lr_schedule,
             "warmup_steps": warmup_steps, "seed": seed}
    settings = _checked_settings(properties, resume, given, session.paths.checkpoint, checkpoint_every)
    session.optimizer.set_learning_rate(settings["learning_rate"])  # validates it

    if plot is not None:
        require_matplotlib(plot)
    train_set = session.dataset(train, x, y)
    val_sets = validation_sets(session, val, x, y)
    best = BestKeeper(properties, best_metric, keep_best, early_stop, resume, bool(val_sets), session.paths.directory,
                      session.loss_kind)
    samples = len(train_set)
    if resume and int(properties.get("samples", samples)) != samples:
        raise ArgumentError(f"the training data holds {samples} samples; the interrupted run trained on "
                            f"{properties['samples']}: resume with the same data")
    settings["samples"] = samples
    if replay is not None:
        train_set = ReplayMix(train_set, session.dataset(replay, x, y), replay_share, settings["seed"])
    run = _Run(session, settings, train_set, val_sets, resume, best)
    if run.epoch >= run.epochs:
        run.save(finished=True)
        return run.result
    for line in run.start_lines(resume) if log else ():
        log(line)
    with _StopRequests(handle_signals, _write_now if log else None) as stop:
        while run.epoch < run.epochs:
            session.module.train()
            bar = progress_bar(samples, f"epoch {run.epoch + 1:>{len(str(run.epochs))}}/{run.epochs}", progress_stream,
                               unit="samples", initial=min(run.step_in_epoch * run.batch_size, samples),
                               leave=False) if progress else None
            started = time.perf_counter()
            seen = run.train_epoch(stop, bar, checkpoint_every, stop_after_steps)
            if seen is None:
                return run.result
            record, improved = run.epoch_record(seen, started)
            if log:
                log(_epoch_line(record, run.epochs))
            if run.end_epoch(improved, keep_best, log):
                break
            if stop.requested:
                run.result.stopped_by = stop.requested
                return run.result
    if plot is not None:
        plot_history(run.result.history, plot)
    return run.result


def _epoch_line(record: dict, epochs: int) -> str:
    width = len(str(epochs))
    parts = [f"epoch {record['epoch']:>{width}}/{epochs}: loss {record['loss']:.4f}"]
    validated = epoch_text(record)
    if validated:
        parts.append(validated)
    setup = ", including the first step's planning and compiling" if record.get("includes_setup") else ""
    best = "; best so far" if record.get("best_epoch") == record["epoch"] else ""
    return ", ".join(parts) + f" ({record['samples_per_second']:,.0f} samples/s{setup}){best}"
