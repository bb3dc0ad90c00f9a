"""The layers of the design: kernels import nothing of ours; graph never imports kernels or odtrain."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent


def imported_modules(folder: str, package: str):
    for path in (ROOT / folder).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # resolve a relative import against the package's dotted name
                    parts = package.split(".") + list(path.relative_to(ROOT / folder).parts[:-1])
                    base = parts[:len(parts) - node.level + 1] if node.level > 1 else parts
                    yield path, ".".join(base + ([node.module] if node.module else []))
                else:
                    yield path, node.module


# kernels/blas.py registers the library behind the products' symbols with Numba's code generator (llvmlite);
# kernels/blas_library.py finds numpy's OpenBLAS and holds its threads (ctypes, os, threading); kernels/jit.py
# loads Numba when a kernel compiles (sys, threading); kernels/__init__.py imports the modules of its folder
# (importlib, pkgutil)
STANDARD_LIBRARY = {"blas.py": {"llvmlite"}, "blas_library.py": {"ctypes", "os", "threading"},
                    "jit.py": {"sys", "threading"}, "__init__.py": {"importlib", "pkgutil"}}


def test_kernels_import_only_numpy_and_numba():
    for path, module in imported_modules("kernels", "odtrain.kernels"):
        root = module.split(".")[0]
        allowed = {"numpy", "numba", "math", "__future__"} | STANDARD_LIBRARY.get(path.name, set())
        assert root in allowed or module.startswith("odtrain.kernels"), (path, module)


def test_kernel_modules_load_numba_only_when_a_kernel_compiles():
    """At module level a kernel module takes Numba's names from kernels/jit.py: an `import numba` there would
    bring the compiler into a process whose steps run in the kernel library."""
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for statement in ast.parse(path.read_text()).body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in statement.names] if isinstance(statement, ast.Import) else [statement.module]
                assert not any((n or "").split(".")[0] in ("numba", "llvmlite") for n in names), \
                    f"{path.name}:{statement.lineno} imports Numba at module level: take its names from .jit"


def test_graph_never_imports_kernels_or_odtrain():
    allowed = {"numpy", "onnx", "__future__", "dataclasses", "typing", "itertools", "enum", "os", "math", "struct",
               "fnmatch", "sys", "mmap", "importlib", "pkgutil"}  # sys: whether onnx is loaded already (graph/onnx_io.py
    # writes a model without it if not); mmap: graph/onnx_wire.py lets the kernel drop the mapped model's pages of
    # weights converted; importlib, pkgutil: graph/ops/__init__.py imports the family modules of its folder
    for path, module in imported_modules("graph", "odtrain.graph"):
        if module.startswith("odtrain."):
            assert module.startswith("odtrain.graph"), (path, module)
        else:
            assert module.split(".")[0] in allowed, (path, module)


def test_only_the_executor_joins_graph_nodes_to_kernels():
    users = {(path.name, module) for path, module in imported_modules("odtrain", "odtrain")
             if module.startswith("odtrain.kernels")}
    # besides the executor: the runtime loads the compiler for the kernels, the kernel library hands its
    # code numpy's BLAS and keeps the compiler unloaded, its build reads the table of parallel twins; none
    # sees a node
    others = {("runtime.py", "odtrain.kernels.jit"), ("kernel_library.py", "odtrain.kernels.blas_library"),
              ("kernel_library.py", "odtrain.kernels.jit"), ("kernel_build.py", "odtrain.kernels.parallel_split")}
    assert {name for name, _ in users - others} <= {"executor.py"}, users


PACKAGES = {"odtrain": "odtrain", "graph": "odtrain.graph", "kernels": "odtrain.kernels"}


def module_imports() -> dict[str, set[str]]:
    """Each of our modules -> the modules of ours it imports anywhere in its file (deferred imports inside
    functions too: they hide a cycle, they do not break it). A package importing its own submodules is
    how it registers them, not a dependency, and is left out."""
    paths = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = package.split(".") + list(path.relative_to(ROOT / folder).with_suffix("").parts)
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import module`
        graph[name] = {m for m in found if m in paths and m != name and not m.startswith(name + ".")}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while not component or module not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                cycles.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [{"a", "b", "c"}]
    assert import_cycles({**graph, "c": set()}) == []


def test_no_import_cycles():
    graph = module_imports()
    assert "odtrain.graph.ops.registry" in graph["odtrain.graph.ops.nn"] and "odtrain.executor" in graph["odtrain.api"]
    cycles = import_cycles(graph)
    assert not cycles, [sorted(cycle) for cycle in cycles]


REGISTRIES = {"odtrain.graph.ops": ("graph", "ops"), "odtrain.kernels": ("kernels",)}


def test_no_family_module_imports_its_own_package():
    """The family modules of graph/ops and kernels take the registry from their package's leaf module
    (`.registry`), never from the package, which imports them: no module points up at its package."""
    graph = module_imports()
    upward = sorted(f"{module} imports {package}" for package in REGISTRIES for module, imported in graph.items()
                    if module.startswith(package + ".") and package in imported)
    assert not upward, upward
    assert "odtrain.kernels.registry" in graph["odtrain.kernels.conv"]  # the check sees the leaf's arrow


def test_the_registries_import_every_module_on_disk():
    """Each package imports the modules its folder holds, whatever they are (private `_` modules and the
    registry itself excepted): a family module registers by being there."""
    import importlib
    import sys

    for package, folder in REGISTRIES.items():
        module = importlib.import_module(package)
        on_disk = sorted(path.stem for path in ROOT.joinpath(*folder).glob("*.py")
                         if not path.stem.startswith("_") and path.stem != "registry")
        assert module.submodules() == on_disk, package
        assert all(f"{package}.{name}" in sys.modules for name in on_disk), package


def test_a_family_module_is_registered_by_being_in_the_folder(tmp_path):
    """A new module in a folder of the package's path, importing the registry from `.registry`, is imported
    and registered with no list edited (here a second folder on `__path__`, as a source checkout's mapping
    adds one): a subprocess loads graph/ops and kernels with a probe family beside each."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "probe_family.py").write_text(textwrap.dedent("""
        from .registry import no_grad, op, same_as_input

        op("ProbeOp", domain="probe")(same_as_input())
        """))
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "probe_family.py").write_text(textwrap.dedent("""
        from .registry import binding

        @binding("ProbeOp", domain="probe")
        def ProbeOp(inputs, outputs):
            return []
        """))
    script = textwrap.dedent(f"""
        import importlib.util, sys
        import odtrain.graph

        def load(name, folder, extra):
            spec = importlib.util.spec_from_file_location(name, folder + "/__init__.py",
                                                          submodule_search_locations=[folder, extra])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            return module

        ops = load("odtrain.graph.ops", {str(ROOT / "graph" / "ops")!r}, {str(tmp_path / "ops")!r})
        kernels = load("odtrain.kernels", {str(ROOT / "kernels")!r}, {str(tmp_path / "kernels")!r})
        assert ("probe", "ProbeOp") in ops.OPS and ("probe", "ProbeOp") in kernels.BINDINGS
        assert "probe_family" in ops.submodules() and ("", "Conv") in ops.OPS and ("", "Conv") in kernels.BINDINGS
        print("registered")
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "registered", done.stderr[-3000:]


def test_no_module_reaches_into_the_sessions_or_parameter_store_of_the_api():
    """`Module._train`/`_eval` and `CheckpointState._store` belong to odtrain/api.py; everything else uses
    its public seams (Module.bind_at, bound_steps, input_types, graph, state; CheckpointState.buffer_bytes)."""
    private = {"_train", "_eval", "_store"}
    for folder in ("odtrain", "graph", "kernels", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "odtrain" / "api.py":
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            reached = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                              and node.attr in private})
            assert not reached, (str(path.relative_to(ROOT)), reached)


# Private names of other libraries that have no public equivalent, each with where and why.
FOREIGN_PRIVATE = {
    ("odtrain/threads.py", "_is_initialized"): "Numba's parallel module: whether its thread pool has started",
    ("benchmarks/decoders/make_models.py", "_attn_implementation"): "transformers' documented way to pick attention",
    ("odtrain/kernel_build.py", "_getvalue"): "Numba's array structure as an LLVM value, what its own intrinsics return",
    ("odtrain/kernel_build.py", "_cache"): "a dispatcher's cache, switched off so that every kernel's IR is at hand",
    ("odtrain/kernel_build.py", "_get_host_cpu_name"): "the CPU Numba's JIT compiles for, so the library's code is the JIT's",
    ("odtrain/kernel_build.py", "_tm_features"): "the CPU features Numba's JIT compiles with, recorded in the manifest",
}


def private_names() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(each `_name` -> the modules that define it: functions, classes, module or class names, attributes set on
    self or cls; each `obj._name` read or written on an object that is not self or cls, as (module, name, line))."""
    defined, reached = {}, []
    for folder in ("odtrain", "graph", "kernels", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            module = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                name = None
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = node.name
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    name = node.id
                elif isinstance(node, ast.Attribute) and not node.attr.startswith("__"):
                    on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                    if on_self and isinstance(node.ctx, ast.Store):
                        name = node.attr
                    elif not on_self and node.attr.startswith("_"):
                        reached.append((module, node.attr, node.lineno))
                if name and name.startswith("_") and not name.startswith("__"):
                    defined.setdefault(name, set()).add(module)
    return defined, reached


def test_no_module_reaches_into_another_modules_private_names():
    """`obj._name` is a module's own business: another module uses the public seams (properties such as
    Optimizer.state and CheckpointState.optimizer_state, Module.input_types, GradContext.dtype)."""
    defined, reached = private_names()
    foreign = [f"{module}:{line}: ._{name[1:]}" for module, name, line in reached
               if module not in defined.get(name, ()) and (module, name) not in FOREIGN_PRIVATE]
    assert not foreign, foreign


def test_the_private_name_check_sees_a_reach():
    defined, reached = private_names()
    assert "odtrain/api.py" in defined["_optimizer"] and "odtrain/api.py" in defined["_store"]
    assert ("odtrain/threads.py", "_is_initialized") in {(m, n) for m, n, _ in reached}
