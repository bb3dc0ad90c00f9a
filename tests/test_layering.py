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


# kernels/blas.py chooses the library behind the products' symbols and registers it with Numba's code
# generator: it alone also needs the standard library's ctypes, os and threading, and llvmlite
BLAS_ROUTE_MODULES = {"ctypes", "os", "threading", "llvmlite"}


def test_kernels_import_only_numpy_and_numba():
    for path, module in imported_modules("kernels", "odtrain.kernels"):
        root = module.split(".")[0]
        allowed = {"numpy", "numba", "math", "__future__"} | (BLAS_ROUTE_MODULES if path.name == "blas.py" else set())
        assert root in allowed or module.startswith("odtrain.kernels"), (path, module)


def test_graph_never_imports_kernels_or_odtrain():
    allowed = {"numpy", "onnx", "__future__", "dataclasses", "typing", "itertools", "enum", "os", "math", "struct",
               "fnmatch"}
    for path, module in imported_modules("graph", "odtrain.graph"):
        if module.startswith("odtrain."):
            assert module.startswith("odtrain.graph"), (path, module)
        else:
            assert module.split(".")[0] in allowed, (path, module)


def test_only_the_executor_joins_graph_nodes_to_kernels():
    users = {path.name for path, module in imported_modules("odtrain", "odtrain")
             if module.startswith("odtrain.kernels")}
    assert users <= {"executor.py"}, users


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
    assert "odtrain.graph.ops" in graph["odtrain.graph.ops.nn"] and "odtrain.executor" in graph["odtrain.api"]
    cycles = import_cycles(graph)
    assert not cycles, [sorted(cycle) for cycle in cycles]


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
