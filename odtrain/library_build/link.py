"""Building the kernel library (odtrain/kernel_library/): Numba compiles, llvmlite links, a C compiler links.

Targets (targets.py): this machine's CPU, or a named one: an aarch64 core (a Raspberry Pi's,
built on an x86_64 desktop) or a baseline x86-64 level. For each (kernel, signature) entry:
1. a generated `cfunc` wrapper with one C signature, `int32 k(void **arguments)`, rebuilds each argument
   from its record (`_loader`: an array of exactly the type Numba's typeof gives the bound view, strided
   and read-only views included; a scalar read from its slot), calls the kernel inside
   `try/except Exception` and returns 0, or 1 when the kernel raised;
2. its LLVM module gets every definition but the wrapper made internal and the wrapper renamed to its
   symbol, and is linked into one module:
   - for this machine's CPU, as Numba optimised it for the JIT (the same code the JIT runs: the same bits);
   - for a named CPU, as Numba emitted it unoptimised (NUMBA_OPT=0: Numba's optimised host IR does not
     retarget, LLVM aborts), with the host's CPU attributes removed, the target's triple and data layout
     set, and Numba's function passes run for the target CPU (O3, loop vectorisation on, SLP off); the
     linked module then gets the module passes once.
   Both routes give the JIT's bits on x86_64 (the twin tests of the reference MLP and CNN), but the second
   ran the CNN's steps slower than Numba's own optimisation (benchmarks/README.md,
   "Figures moved out of the code"): this machine's library keeps the first.
The module is emitted as one position-independent object for the target CPU and linked with
launcher.c (the parallel launcher on OpenMP, the runner, the helpers Numba's code calls)
by the target's C compiler (`cc`; for aarch64 `aarch64-linux-gnu-gcc` or ODTRAIN_CROSS_CC) with
`-shared -Wl,-z,defs`: a symbol nobody defines fails the build. References to CPython and Numba's error
reporting, reached only when a kernel raises past the wrapper's `except` (never), are bound to stubs
that abort.

The build runs in its own process (`python -m odtrain.library_build SPEC OUT`), where no kernel was
compiled or loaded from Numba's cache (a cached kernel has no LLVM module to link) and caching is off;
a cross build's process has NUMBA_OPT=0 (read when Numba is imported) and its own NUMBA_CACHE_DIR.

Numba internals this relies on (tests/test_kernel_library.py compares every kernel with its JIT twin):
`CFunc.inspect_llvm()` holding the wrapper and every callee, `CFunc.native_name`, the array data model
and `numba.np.arrayobj.populate_array`, the names and signatures of the parallel launcher's symbols
(launcher.c), the codegen's `_get_host_cpu_name`/`_tm_features`; for a cross build, that IR at
NUMBA_OPT=0 carries no host-only intrinsics (tests/test_kernel_targets.py emits an aarch64 object).
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from .. import __version__
from ..graph.errors import ArgumentError
from ..jit.cache import sources_digest
from ..kernel_library import LIBRARY_FILE, MANIFEST_FILE, kernel_name
from ..kernel_library.cpu import DEFAULT_CPU, TARGETS, host_arch
from ..kernels import fused_elementwise
from .targets import (NoCompiler, c_compiler, cpu_features, optimise, optimise_functions, target_machine,
                      without_host_cpu)

# Numba's helpers that only raise or report an exception: past the wrapper's `except`, never reached
ERROR_PATH = {"numba_do_raise", "numba_unpickle", "numba_runtime_build_excinfo_struct", "numba_fatal_error"}
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.c")
# what launcher.c defines for the kernels' code
LAUNCHER_SYMBOLS = {"odtrain_cblas_sgemm", "odtrain_cblas_dgemm", "numba_parallel_for", "get_num_threads",
                    "get_thread_id", "set_num_threads", "get_parallel_chunksize", "set_parallel_chunksize",
                    "get_sched_size", "allocate_sched", "deallocate_sched", "do_scheduling_signed",
                    "do_scheduling_unsigned", "numba_gil_ensure", "numba_gil_release", "PyEval_SaveThread",
                    "PyEval_RestoreThread", "NRT_MemInfo_alloc_aligned", "NRT_MemInfo_alloc_safe_aligned",
                    "NRT_MemInfo_call_dtor", "NRT_Allocate", "NRT_Free", "numba_attempt_nocopy_reshape"}
OBJECT_FILE, OBJECT_MANIFEST_FILE = "kernels.o", "kernels.json"  # build(object_only=True)


def build(entries, out_dir, out=print, target: str | None = None, cpu: str | None = None,
          object_only: bool = False, artifacts: list | None = None) -> dict:
    """Build the library of `entries` ((kernel name, signature) pairs) into `out_dir`, in a fresh process, for
    `target` (an architecture of TARGETS; default this machine's) and `cpu` (default: this machine's CPU for
    its own architecture, DEFAULT_CPU for another); returns the manifest. `object_only`: stop at the object
    (OBJECT_FILE and OBJECT_MANIFEST_FILE), with no C compiler. `artifacts`: what the manifest records of the
    artifact folders the entries were recorded on ({"folder", "digest"}: odtrain.kernel_library.artifacts_digest)."""
    target, cpu, features, compiler = build_target(target, cpu, object_only)
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    entries = sorted(set(map(tuple, entries)))
    spec = {"entries": entries, "target": target, "cpu": cpu, "features": features,
            "compiler": compiler, "artifacts": artifacts or [], "sources": generated_sources(entries)}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as spec_file:
        json.dump(spec, spec_file)
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="odtrain-build-cache-") as cache:
        if cpu:  # Numba's unoptimised IR, retargeted; its own cache, the host's untouched
            environment.update(NUMBA_OPT="0", NUMBA_CACHE_DIR=cache)
            environment.pop("ODTRAIN_CACHE_DIR", None)
        try:
            started = time.perf_counter()
            # its own session: Ctrl-C reaches this process alone, which stops the build (subprocess.run kills
            # it) and says so in one line, instead of the build printing its traceback
            subprocess.run([sys.executable, "-m", "odtrain.library_build", spec_file.name, os.fspath(out_dir)],
                           check=True, env=environment, start_new_session=True)
        except BaseException:
            if created:  # no empty or half-built library folder left behind
                shutil.rmtree(out_dir, ignore_errors=True)
            raise
        finally:
            os.unlink(spec_file.name)
    made = os.path.join(out_dir, OBJECT_FILE if object_only else LIBRARY_FILE)
    with open(os.path.join(out_dir, OBJECT_MANIFEST_FILE if object_only else MANIFEST_FILE)) as file:
        manifest = json.load(file)
    out(f"kernel library: {len(manifest['entries'])} kernels for {target} ({manifest['cpu']}), "
        f"{os.path.getsize(made) / 2 ** 20:.1f} MiB, built in {time.perf_counter() - started:.1f} s: {made}")
    return manifest


def build_target(target: str | None, cpu: str | None, object_only: bool = False) -> tuple:
    """(architecture, CPU or None for this machine's, its LLVM features, the C compiler command or None) of a
    build; ArgumentError names what is unknown or missing."""
    target = target or host_arch()
    if target not in TARGETS:
        raise ArgumentError(f"no kernel library target '{target}': choose one of {', '.join(TARGETS)}")
    if cpu is None and target != host_arch():
        cpu = DEFAULT_CPU[target]
    try:
        features = cpu_features(target, cpu) if cpu else None
        compiler = None if object_only else c_compiler(target)
    except (ValueError, NoCompiler) as error:
        raise ArgumentError(f"odtrain compile --target {target}: {error}") from None
    return target, cpu, features, compiler


def numba_type(text: str):
    """The Numba type of one argument's signature text (odtrain.kernel_library.argument_type)."""
    import numpy as np
    from numba import types
    from numba.np.numpy_support import from_dtype

    if text.startswith("("):
        items = [numba_type(t) for t in text[1:-1].split(",") if t]
        return types.UniTuple(items[0], len(items)) if items and len(set(items)) == 1 else types.Tuple(items)
    if "[" not in text:
        return types.boolean if text == "bool" else from_dtype(np.dtype(text))
    dtype, rest = text[:-1].split("[")
    ndim = int("".join(c for c in rest if c.isdigit()))
    flags = rest.lstrip("0123456789")
    return types.Array(from_dtype(np.dtype(dtype)), ndim, flags[0], readonly="r" in flags,
                       aligned="u" not in flags)


def argument_types(signature: str) -> list[str]:
    """The argument types of a signature text, split at the commas outside parentheses."""
    found, depth, start = [], 0, 0
    for index, char in enumerate(signature + ","):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            if index > start:
                found.append(signature[start:index])
            start = index + 1
    return found


_loaders: dict = {}


def _loader(index: int, kind):
    """An intrinsic that reads argument `index` of a wrapper's `void **` as a value of Numba type `kind`."""
    key = (index, kind)
    if key in _loaders:
        return _loaders[key]
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
    from numba.np.arrayobj import populate_array

    word = ir.IntType(64)

    def codegen(context, builder, signature, arguments):
        slot = builder.load(builder.gep(arguments[0], [ir.Constant(word, index)]))
        if isinstance(kind, types.Array):
            record = builder.bitcast(slot, word.as_pointer())

            def field(i):
                return builder.load(builder.gep(record, [ir.Constant(word, i)]))

            array = context.make_array(kind)(context, builder)
            data = builder.inttoptr(field(0), context.get_data_type(kind.dtype).as_pointer())
            shape = cgutils.pack_array(builder, [field(1 + d) for d in range(kind.ndim)], ty=word)
            strides = cgutils.pack_array(builder, [field(1 + kind.ndim + d) for d in range(kind.ndim)], ty=word)
            itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(kind.dtype)))
            populate_array(array, data=data, shape=shape, strides=strides, itemsize=itemsize, meminfo=None)
            return array._getvalue()
        if isinstance(kind, types.BaseTuple):  # a word per item
            record = builder.bitcast(slot, word.as_pointer())
            items = [context.data_model_manager[t].load_from_data_pointer(
                builder, builder.bitcast(builder.gep(record, [ir.Constant(word, i)]), context.get_data_type(t).as_pointer()))
                for i, t in enumerate(kind.types)]
            return context.make_tuple(builder, kind, items)
        pointer = builder.bitcast(slot, context.get_data_type(kind).as_pointer())
        return context.data_model_manager[kind].load_from_data_pointer(builder, pointer)

    def typer(typingctx, arguments):
        return kind(arguments), codegen

    _loaders[key] = intrinsic(typer)
    return _loaders[key]


def wrapper(kernel, argument_types):
    """The cfunc `int32 k(void **arguments)` that calls `kernel` with arguments of `argument_types`."""
    from numba import cfunc, types

    names = [f"load{i}" for i in range(len(argument_types))]
    namespace = {"kernel": kernel, **{n: _loader(i, t) for i, (n, t) in enumerate(zip(names, argument_types))}}
    source = ("def call(arguments):\n    try:\n        kernel(" + ", ".join(f"{n}(arguments)" for n in names)
              + ")\n    except Exception:\n        return 1\n    return 0\n")
    exec(compile(source, f"<wrapper of {kernel.py_func.__qualname__}>", "exec"), namespace)
    return cfunc(types.int32(types.CPointer(types.voidptr)), error_model="numpy")(namespace["call"])


def generated_sources(entries) -> dict[str, str]:
    """The texts of the generated kernels (fused element-wise chains) that `entries` name, as this process made
    them: the build's own process compiles them from these (kernels/fused_elementwise.py, install)."""
    module = fused_elementwise.__name__ + ":"
    names = {name[len(module):].removesuffix("_parts") for name, _ in entries if name.startswith(module)}
    return {name: fused_elementwise.SOURCES[name] for name in sorted(names) if name in fused_elementwise.SOURCES}


def resolve(name: str):
    """The kernel named 'module:qualified name'."""
    module, _, qualified = name.partition(":")
    value = importlib.import_module(module)
    for part in qualified.split("."):
        value = getattr(value, part)
    return value


def raised_messages(kernel) -> list[str]:
    """The constant messages that a kernel and the kernels it calls raise (what the library reports when
    one of its calls stops on its data: the wrapper returns a status, not the exception)."""
    import inspect
    import re

    messages, seen, pending = [], set(), [kernel.py_func]
    while pending:
        function = pending.pop()
        if function in seen:
            continue
        seen.add(function)
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            continue
        for message in re.findall(r'raise \w+\("([^"{}]*)"\)', source):
            if message not in messages:
                messages.append(message)
        for name in function.__code__.co_names:
            callee = getattr(function.__globals__.get(name), "py_func", None)
            if callee is not None:
                pending.append(callee)
    return messages


def _stub(name: str) -> str:
    return f'__attribute__((visibility("hidden"))) void {name}(void) {{ odtrain_unreachable("{name}"); }}\n'


def build_here(spec_path: str, out_dir: str) -> None:
    """The build itself, in the process `build` started: the spec's entries into `out_dir`."""
    started = time.perf_counter()
    from llvmlite import binding as llvm
    from numba.core.caching import NullCache
    from numba.core.registry import cpu_target

    from ..jit.cache import kernel_dispatchers
    from ..kernels.parallel_split import TWINS

    serial_of = {twin.parallel: twin.serial for twin in TWINS.values()}

    with open(spec_path) as file:
        spec = json.load(file)
    entries = [tuple(e) for e in spec["entries"]]
    fused_elementwise.install(spec.get("sources", {}))
    for dispatcher in kernel_dispatchers():
        dispatcher._cache = NullCache()
    retarget = spec["cpu"] is not None  # Numba's unoptimised IR (NUMBA_OPT=0), for a named CPU
    if retarget:
        triple, cpu, features = TARGETS[spec["target"]], spec["cpu"], spec["features"]
    else:
        codegen = cpu_target.target_context.codegen()
        triple, cpu, features = llvm.get_process_triple(), codegen._get_host_cpu_name(), codegen._tm_features
    machine = target_machine(triple, cpu, features)
    linked = llvm.parse_assembly("")
    linked.triple, linked.data_layout = triple, str(machine.target_data)
    manifest_entries, skipped = [], []
    for index, (name, signature) in enumerate(entries):
        symbol = f"odtrain_kernel_{index}"
        try:
            kernel = resolve(name)
            function = wrapper(kernel, tuple(numba_type(t) for t in argument_types(signature)))
            text = function.inspect_llvm()
            module = llvm.parse_assembly(without_host_cpu(text) if retarget else text)
        except Exception as error:  # a kernel that does not compile at these types: the JIT's, as before
            skipped.append(f"{name}({signature}): {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        module.triple, module.data_layout = linked.triple, linked.data_layout
        if retarget:
            optimise_functions(module, machine)
        for value in list(module.functions) + list(module.global_variables):
            if value.is_declaration:
                continue
            if value.name == function.native_name:
                value.name = symbol
            else:
                value.linkage = "internal"
        linked.link_in(module)
        manifest_entries.append({"kernel": name, "signature": signature, "symbol": symbol,
                                 "errors": raised_messages(kernel)})
        if kernel in serial_of:  # a parallel twin: the kernel its parts run (kernels/parallel_split.py)
            manifest_entries[-1]["twin_of"] = kernel_name(serial_of[kernel])
    linked.verify()
    if retarget:
        optimise(linked, machine)
    undefined = sorted(f.name for f in linked.functions if f.is_declaration and not f.name.startswith("llvm."))
    # only the error path is stubbed: any other helper nobody defines fails the link, by name
    stubs = [n for n in undefined if n not in LAUNCHER_SYMBOLS and (n.startswith(("Py", "_Py")) or n in ERROR_PATH)]
    data_stubs = sorted(g.name for g in linked.global_variables if g.is_declaration and g.name.startswith(("Py", "_Py")))
    import llvmlite
    import numba

    manifest = {"odtrain": __version__, "numba": numba.__version__, "llvmlite": llvmlite.__version__,
                "triple": triple, "cpu": cpu, "features": features, "kernel_sources": sources_digest(),
                "optimised": "llvmlite O3 from Numba's NUMBA_OPT=0 IR" if retarget else "by Numba's JIT",
                "artifacts": spec.get("artifacts", []), "entries": manifest_entries, "skipped": skipped,
                "stubs": {"functions": stubs, "data": data_stubs}}
    if spec["compiler"] is None:
        with open(os.path.join(out_dir, OBJECT_FILE), "wb") as file:
            file.write(machine.emit_object(linked))
        manifest_path = os.path.join(out_dir, OBJECT_MANIFEST_FILE)
    else:
        link(machine.emit_object(linked), manifest, spec["compiler"], os.path.join(out_dir, LIBRARY_FILE))
        manifest_path = os.path.join(out_dir, MANIFEST_FILE)
    manifest["build_seconds"] = round(time.perf_counter() - started, 1)
    with open(manifest_path, "w") as file:
        json.dump(manifest, file, indent=1)
    for line in skipped:
        print(f"odtrain compile: left to the JIT: {line}", file=sys.stderr)


def link(kernels: bytes, manifest: dict, compiler: list[str], library: str) -> None:
    """Link the kernels' object with the launcher and the stubs of its error path (the manifest's) into
    `library`, replaced whole."""
    with tempfile.TemporaryDirectory(prefix="odtrain-build-") as scratch:
        objects = os.path.join(scratch, "kernels.o")
        with open(objects, "wb") as file:
            file.write(kernels)
        stub_source = os.path.join(scratch, "stubs.c")
        with open(stub_source, "w") as file:
            file.write('#include <stdio.h>\n#include <stdlib.h>\n'
                       'static void odtrain_unreachable(const char *name) {\n'
                       '    fprintf(stderr, "odtrain kernel library: %s reached\\n", name); abort();\n}\n')
            file.writelines(_stub(n) for n in manifest["stubs"]["functions"])
            file.writelines(f'__attribute__((visibility("hidden"))) void *{n} = 0;\n' for n in manifest["stubs"]["data"])
        partial = f"{library}.{os.getpid()}"
        subprocess.run([*compiler, "-shared", "-O2", "-fPIC", "-fopenmp", "-Wl,-z,defs", "-o", partial, objects,
                        LAUNCHER, stub_source, "-lm"], check=True)
        os.replace(partial, library)

