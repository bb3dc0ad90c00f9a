"""Inference with odtrain's own runtime: `InferenceSession(model).run(output_names, feeds)`.

The call mirrors onnxruntime.InferenceSession.run, so an exported model runs on
the same device, with the same kernels and planned arena, without a second runtime,
on odtrain's default thread count (odtrain.threads.get_num_threads).

A plan is bound per signature of the feeds: their shapes and dtypes, and the
values of the inputs that configure an op (axes, pads, target shapes, sizes, k
fed as inputs: `graph.schedule.configuring_inputs`), which bind as constants,
and the thread count. The last PLAN_CACHE_SIZE plans are kept.

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

    def run(self, output_names, input_feed: dict) -> list[np.ndarray]:
        from .executor import ExecutableStep

        graph = self._graph
        missing = [n for n in graph.inputs if n not in input_feed]
        if missing:
            raise InputError(f"missing inputs {missing}; the model takes {graph.inputs}")
        arrays = [np.asarray(input_feed[n]) for n in graph.inputs]
        for name, array in zip(graph.inputs, arrays):
            declared = graph.value_types.get(name)
            if declared is not None and array.dtype != declared.dtype:
                raise InputError(f"input '{name}' must be {declared.dtype}, got {array.dtype}")
        feeds = dict(zip(graph.inputs, arrays))
        threads = usable(get_num_threads())
        signature = tuple((a.dtype.str, a.shape, a.tobytes() if n in self._configuring else None)
                          for n, a in feeds.items()) + (threads,)
        bound = self._plans.get(signature)
        if bound is None:
            types = {n: TensorType(a.dtype, a.shape) for n, a in feeds.items()}
            values = {n: np.array(a) for n, a in feeds.items() if n in self._configuring}  # a copy: the plan keeps it
            bound = self._plans[signature] = ExecutableStep(graph, feed_types=types, external={}, bound_feeds=values, threads=threads,
                                                                library=self._library, artifact_folder=self._folder)
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(signature)
        bound.run([feeds[n] for n in bound.feeds])
        return [bound.output(name) for name in (output_names or graph.outputs)]
