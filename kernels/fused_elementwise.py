"""Fused element-wise chains (graph/elementwise_fusion.py): one generated Numba loop per chain and layout.

A fused node's `steps` name element-wise ops by op type and attributes; each is a row of the table
(kernels/scalar_expressions.py), whose expression is written into the loop's text over locals, so every
intermediate lives in a register and only the node's outputs are stored. Two layouts:
- flat: every input has the output's shape or one element; the units are elements, each input and
  output a slice of [first, last), so the loop vectorises;
- rows: some input broadcasts along an axis (a bias, a scale); the iteration space is coalesced to four
  axes (kernels/layout.py), the units are rows of the last axis, and each input is a run of that row or one
  value repeated along it.
The loop's text is a function of the steps, the results, the layout and each input's kind (run or value),
and its name is a hash of that text and of the table's digest: an edit of the table names new kernels,
which compile anew. Kernels are compiled with `cache=True` under this file's name, so Numba's disk cache
keeps them like any other kernel. The name's module is this one: `SOURCES` holds the text of every kernel
made in this process, which a kernel library's build hands its own process (`install`, then
`fused_elementwise.<name>` rebuilds the kernel: odtrain/library_build/link.py).

With threads, each kernel has a twin written by kernels/parallel_split.py from its range of units: every
value is as in one thread (each element is computed by one expression whichever part runs it).
"""
from __future__ import annotations

import numpy as np  # noqa: F401 (the rows' texts call numpy)

from .jit import njit, prange  # noqa: F401 (njit and prange: the generated kernels and their twins)
from .copies import same_buffer
from .layout import coalesce, element_strides, flat
from .parallel_split import parallel_twin, split
from .registry import ODTRAIN_DOMAIN, binding
from . import scalar_expressions as expressions

SOURCES: dict[str, str] = {}  # kernel name -> its text, for every kernel made (or installed) in this process
_MADE: dict[str, object] = {}  # kernel name -> kernel, made in this process
globals().update({k: v for k, v in expressions.names().items() if k != "np"})  # what the rows' texts call


def _rows_of(steps) -> list[str]:
    rows = []
    for op_type, attrs, _ in steps:
        row = op_type if op_type in expressions.ROWS and not attrs else expressions.row_of(op_type, dict(attrs))
        if row is None:
            raise ValueError(f"{op_type} with attributes {dict(attrs)} is not a row of kernels/scalar_expressions.py")
        rows.append(row)
    return rows


def kernel_text(steps, results, kinds: tuple[str, ...], outputs: int, layout: str, dtype: str,
                over: tuple = ()) -> tuple[str, str]:
    """(name, source) of the kernel computing `steps` for inputs of `kinds` ("run": one element per point,
    "value": one value for the whole run) in `layout` ("flat" or "rows"), on values of `dtype`. `over[j]`: the
    input that output j overwrites (the planner put it there; -1: none), whose own name then writes it: LLVM
    vectorises a loop over one buffer only through one name (two names fail its run-time overlap check, and
    the loop runs scalar).

    Each step's value is rounded to `dtype` as its own kernel's store would round it: a row's integer constant
    (`1 - y`) makes Numba compute in float64, and an intermediate kept so would differ from the unfused bits."""
    rows = _rows_of(steps)
    xs = [f"x{k}" for k in range(len(kinds))]
    ys = [f"y{k}" for k in range(outputs)]
    if layout == "flat":
        params, head = xs + ys + ["first", "last"], ["    n = last - first"]
        head += [f"    r{k} = x{k}[first:last]" if kind == "run" else f"    v{k} = x{k}[0]" for k, kind in enumerate(kinds)]
        head += [f"    w{k} = r{over[k]}" if over and over[k] >= 0 else f"    w{k} = y{k}[first:last]"
                 for k in range(outputs)]
        body_indent, loop = "        ", ["    for k in range(n):"]
    else:
        params = xs + ys + ["dims"] + [f"s{k}" for k in range(len(kinds))] + ["first", "last"]
        head = ["    n = dims[3]", "    for row in range(first, last):",
                "        i2 = row % dims[2]", "        i1 = (row // dims[2]) % dims[1]",
                "        i0 = row // (dims[2] * dims[1])"]
        for k, kind in enumerate(kinds):
            start = f"i0 * s{k}[0] + i1 * s{k}[1] + i2 * s{k}[2]"
            head.append(f"        r{k} = x{k}[{start}:{start} + n]" if kind == "run" else f"        v{k} = x{k}[{start}]")
        head += [f"        w{k} = r{over[k]}" if over and over[k] >= 0 else f"        w{k} = y{k}[row * n:(row + 1) * n]"
                 for k in range(outputs)]
        body_indent, loop = "            ", ["        for k in range(n):"]
    body = [f"{body_indent}a{k} = r{k}[k]" if kind == "run" else f"{body_indent}a{k} = v{k}"
            for k, kind in enumerate(kinds)]
    for j, ((_, _, operands), row) in enumerate(zip(steps, rows)):
        terms = [f"a{k}" if where == "input" else f"t{k}" for where, k in operands]
        body.append(f"{body_indent}t{j} = np.{dtype}({expressions.scalar_source(row, terms)})")
    body += [f"{body_indent}w{k}[k] = t{j}" for k, j in enumerate(results)]
    text = "\n".join(head + loop + body) + "\n"
    name = "fused_" + expressions.text_hash((expressions.table_digest() + "\n" + ",".join(params) + "\n" + text)
                                            .encode())
    return name, f"def {name}({', '.join(params)}):\n    \"\"\"A fused element-wise chain.\"\"\"\n{text}"


def _make(name: str, source: str):
    """The kernel `name` compiled from `source` (and its parallel twin registered), made once a process."""
    kernel = _MADE.get(name)
    if kernel is not None:
        return kernel
    scratch: dict = {}
    exec(compile(source, __file__, "exec"), globals(), scratch)  # our own text, from the table's rows
    kernel = njit(cache=True, error_model="numpy")(scratch[name])
    globals()[name] = kernel  # the twin is written in this module's namespace, under the kernel's name
    globals()[f"{name}_parts"] = parallel_twin(kernel, range=("first", "last"))
    _MADE[name] = kernel
    SOURCES[name] = source
    return kernel


def install(sources: dict[str, str]) -> None:
    """Make the texts of kernels another process made known here (a library build), by name."""
    SOURCES.update(sources)


def __getattr__(name: str):
    """A kernel whose text was installed, or its twin, made on first use."""
    base = name.removesuffix("_parts")
    if base not in SOURCES:
        raise AttributeError(name)
    _make(base, SOURCES[base])
    return globals()[name]


def fused_calls(inputs, outputs, steps, results, threads: int = 1) -> list:
    """The call computing a fused chain: flat when no input broadcasts along an axis, else by rows."""
    shape = outputs[0].shape
    size = outputs[0].size
    over = tuple(next((k for k, x in enumerate(inputs) if x.shape == shape and same_buffer(x, y)), -1) for y in outputs)
    over = over if size > 1 and any(k >= 0 for k in over) else ()
    flat_layout = all(x.shape == shape or x.size == 1 for x in inputs)
    if flat_layout:
        kinds = tuple("run" if x.shape == shape and size > 1 else "value" for x in inputs)
        name, source = kernel_text(steps, results, kinds, len(outputs), "flat", outputs[0].dtype.name, over)
        kernel = _make(name, source)
        args = tuple(flat(x) for x in inputs) + tuple(flat(y) for y in outputs) + (0, size)
        return [split((kernel, args), size, size, threads)]
    dims, _, *strides = coalesce(tuple(shape), element_strides(shape, shape),
                                 *(element_strides(x.shape, shape) for x in inputs))
    kinds = tuple("run" if s[3] == 1 else "value" for s in strides)
    name, source = kernel_text(steps, results, kinds, len(outputs), "rows", outputs[0].dtype.name, over)
    kernel = _make(name, source)
    units = int(dims[0] * dims[1] * dims[2])
    args = tuple(flat(x) for x in inputs) + tuple(flat(y) for y in outputs) + (dims,) + tuple(strides) + (0, units)
    return [split((kernel, args), units, size, threads)]


@binding("FusedElementwise", ODTRAIN_DOMAIN, parallel=True)
def FusedElementwise(inputs, outputs, steps=(), results=(), threads=1):
    return fused_calls(inputs, outputs, steps, results, threads)



def row_binding(name: str):
    """A per-op binding for row `name` of the table: the row as a chain of one step (with broadcasting). What a
    row added to the table runs when kernels/elementwise.py has no loop of its own for it."""
    arity = expressions.ROWS[name].arity
    steps = ((name, (), tuple(("input", k) for k in range(arity))),)

    def bind(inputs, outputs, threads=1):
        return fused_calls(list(inputs[:arity]), list(outputs[:1]), steps, (0,), threads)

    return bind
