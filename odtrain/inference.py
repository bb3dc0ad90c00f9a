"""Inference with odtrain's own runtime: `InferenceSession(model).run(output_names, feeds)`.

The call mirrors onnxruntime.InferenceSession.run, so an exported model runs on
the same device, with the same kernels and planned arena, without a second runtime,
on odtrain's default thread count (odtrain.threads.get_num_threads).

A plan is bound per signature of the feeds: their shapes and dtypes, and the
values of the inputs that configure an op (axes, pads, target shapes, sizes, k
fed as inputs: `graph.schedule.configuring_inputs`), which bind as constants,
and the thread count. The last PLAN_CACHE_SIZE plans are kept.

A model whose Loop and If bodies build sequences (graph/sequences.py) takes a sequence input as a list
of arrays and an empty optional as None, and returns a sequence output as a list; it is expanded into
tensors when its plan binds, so its scalar integer and boolean inputs (trip counts, conditions) bind as
constants, one plan per value.

A model file whose folder holds a kernel library (`kernels/`, odtrain/kernel_library/), or the one
ODTRAIN_KERNEL_LIBRARY names, runs its kernels there, as a Module of that folder does.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .graph.control_flow import walk
from .graph.errors import InputError
from .graph.ir import TensorType
from .graph.onnx_io import load_graph
from .graph.ops import check_supported
from .graph.schedule import configuring_inputs
from .graph.sequences import check_sequences, expand_sequences, tensor_nodes, uses_sequences
from .kernel_library import find as find_library
from .threads import get_num_threads, usable

PLAN_CACHE_SIZE = 4
_ONNX_TYPE_NAMES = {"float32": "float", "float64": "double", "int64": "int64", "int32": "int32", "bool": "bool",
                    "uint8": "uint8", "int8": "int8", "float16": "float16"}


@dataclass(frozen=True)
class NodeArg:
    """An input or output of the model, as onnxruntime describes it: name, shape (symbolic dims as
    strings) and type (e.g. 'tensor(float)')."""

    name: str
    shape: list | None
    type: str | None


class InferenceSession:
    def __init__(self, model, providers=None):
        self._graph = load_graph(model, "model")
        self._sequences = uses_sequences(self._graph)
        if self._sequences:
            check_sequences(self._graph, "model")
            check_supported(tensor_nodes(self._graph), "model")
            # what a sequence holds depends on its trip counts and conditions: they bind as constants
            self._configuring = frozenset(n for n in self._graph.inputs if _scalar_flag(self._graph.value_types.get(n)))
        else:
            check_supported(list(walk(self._graph)), "model")  # the nodes of If, Loop and Scan bodies too
            self._configuring = frozenset(configuring_inputs(self._graph))
        self._plans: OrderedDict = OrderedDict()
        folder = os.path.dirname(os.path.abspath(model)) if isinstance(model, (str, os.PathLike)) else None
        self._folder = folder
        self._library = find_library(folder)  # None: the JIT's kernels

    def get_inputs(self) -> list["NodeArg"]:
        return [self._arg(name) for name in self._graph.inputs]

    def get_outputs(self) -> list["NodeArg"]:
        return [self._arg(name) for name in self._graph.outputs]

    def _arg(self, name: str) -> "NodeArg":
        t = self._graph.value_types.get(name)
        return NodeArg(name, None if t is None else (None if t.shape is None else list(t.shape)),
                       None if t is None else f"tensor({_ONNX_TYPE_NAMES.get(t.dtype.name, t.dtype.name)})")

    def run(self, output_names, input_feed: dict) -> list:
        graph = self._graph
        missing = [n for n in graph.inputs if n not in input_feed]
        if missing:
            raise InputError(f"missing inputs {missing}; the model takes {graph.inputs}")
        feeds = {n: _feed(n, input_feed[n], graph.value_types.get(n), self._sequences) for n in graph.inputs}
        sequenced = self._sequences or any(v is None or isinstance(v, (list, tuple)) for v in feeds.values())
        threads = usable(get_num_threads())
        signature = tuple(_signature(a, n in self._configuring) for n, a in feeds.items()) + (threads,)
        bound = self._plans.get(signature)
        if bound is None:
            bound = self._plans[signature] = self._bind(feeds, threads, sequenced)
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(signature)
        step, expanded = bound
        if expanded is not None:  # a sequence fed is its elements
            for name, elements in expanded.inputs.items():
                feeds.update(zip(elements or [], [np.asarray(a) for a in feeds[name]]))
        step.run([feeds[n] for n in step.feeds])
        names = output_names or graph.outputs
        if expanded is None:
            return [step.output(name) for name in names]
        return [[step.output(e) for e in expanded.outputs[name]] if expanded.outputs.get(name) is not None
                else (None if name in expanded.outputs else step.output(name)) for name in names]

    def _bind(self, feeds: dict, threads: int, sequenced: bool):
        """(the step planned for `feeds`, the sequences' expansion or None)."""
        from .executor import ExecutableStep

        graph, expanded = self._graph, None
        values = {n: np.array(a) for n, a in feeds.items() if n in self._configuring}  # a copy: the plan keeps it
        if sequenced:  # a model with sequence ops, or a sequence fed (an Identity passes it on)
            expanded = expand_sequences(graph, feeds, values, "model")
            graph = expanded.graph
            feeds = dict(feeds)
            for name, elements in expanded.inputs.items():
                feeds.update(zip(elements or [], [np.asarray(a) for a in feeds[name]]))
        types = {n: TensorType(feeds[n].dtype, feeds[n].shape) for n in graph.inputs}
        step = ExecutableStep(graph, feed_types=types, external={}, bound_feeds=values, threads=threads,
                              library=self._library, artifact_folder=self._folder)
        return step, expanded


def _scalar_flag(t) -> bool:
    return t is not None and t.shape == () and t.dtype.kind in "biu"


def _feed(name: str, value, declared, sequences: bool):
    """A feed as the session keeps it: an array, or a list of arrays or None for an input of a model with
    sequences, or one declared as no tensor (a sequence or an optional)."""
    if (sequences or declared is None) and (value is None or isinstance(value, (list, tuple))):
        return value
    array = np.asarray(value)
    if declared is not None and array.dtype != declared.dtype:
        raise InputError(f"input '{name}' must be {declared.dtype}, got {array.dtype}")
    return array


def _signature(feed, configuring: bool) -> tuple:
    if feed is None:
        return ("none",)
    if isinstance(feed, (list, tuple)):
        return ("sequence",) + tuple((np.asarray(a).dtype.str, np.shape(a)) for a in feed)
    return (feed.dtype.str, feed.shape, feed.tobytes() if configuring else None)
