"""The layers of the design: kernels import nothing of ours; graph never imports kernels or odtrain."""
import ast
import functools
import os
import pathlib

ROOT = pathlib.Path(__file__).parent.parent


def parsed(path) -> ast.Module:
    """A file's syntax tree, parsed once a run: a dozen checks read every module, and late in a long run of the
    suite each parse is slow (the garbage collector scans the suite's whole heap as the nodes are made)."""
    stat = os.stat(path)
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _parsed(path: str, modified: int, size: int) -> ast.Module:
    return ast.parse(pathlib.Path(path).read_text(), filename=path)


def walked(path) -> tuple[ast.AST, ...]:
    """Every node of a file's syntax tree (ast.walk's order), listed once a run."""
    stat = os.stat(path)
    return _walked(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _walked(path: str, modified: int, size: int) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(_parsed(path, modified, size)))


def imported_modules(folder: str, package: str | None = None):
    """(file, module it imports) for every import of every file under a top folder; relative imports resolved
    against the package an install makes of the folder (PACKAGES, from pyproject.toml)."""
    package = package or PACKAGES[folder]
    for path in (ROOT / folder).rglob("*.py"):
        for node in walked(path):
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


# The one module of odtrain's that both op layers import: a leaf of the standard library holding what they share
# (the domain of odtrain's ops, the import of every family module of a folder)
SHARED_LEAF = "odtrain.op_families"

# kernels/blas.py registers the library behind the products' symbols with Numba's code generator (llvmlite);
# kernels/blas_library.py finds numpy's OpenBLAS and holds its threads (ctypes, os, threading); kernels/jit.py
# loads Numba when a kernel compiles (sys, threading); kernels/__init__.py binds the shared leaf's submodules to
# its own folder (functools)
STANDARD_LIBRARY = {"blas.py": {"llvmlite"}, "blas_library.py": {"ctypes", "os", "threading"},
                    "jit.py": {"sys", "threading"}, "__init__.py": {"functools"}}


def test_kernels_import_only_numpy_and_numba():
    for path, module in imported_modules("kernels"):
        root = module.split(".")[0]
        allowed = {"numpy", "numba", "math", "__future__"} | STANDARD_LIBRARY.get(path.name, set())
        assert root in allowed or module.startswith("odtrain.kernels") or module == SHARED_LEAF, (path, module)


def test_kernel_modules_load_numba_only_when_a_kernel_compiles():
    """At module level a kernel module takes Numba's names from kernels/jit.py: an `import numba` there would
    bring the compiler into a process whose steps run in the kernel library."""
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for statement in parsed(path).body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in statement.names] if isinstance(statement, ast.Import) else [statement.module]
                assert not any((n or "").split(".")[0] in ("numba", "llvmlite") for n in names), \
                    f"{path.name}:{statement.lineno} imports Numba at module level: take its names from .jit"


def test_graph_never_imports_kernels_or_odtrain():
    allowed = {"numpy", "onnx", "__future__", "dataclasses", "typing", "itertools", "enum", "os", "math", "struct",
               "fnmatch", "sys", "mmap", "functools", "ml_dtypes"}  # sys: whether onnx is loaded already
    # (graph/onnx_io.py writes a model without it if not); mmap: graph/onnx_wire.py lets the kernel drop the mapped
    # model's pages of weights converted; ml_dtypes: the types numpy lacks (bfloat16, int4), onnx's own dependency
    for path, module in imported_modules("graph"):
        if module == SHARED_LEAF:
            continue
        if module.startswith("odtrain."):
            assert module.startswith("odtrain.graph"), (path, module)
        else:
            assert module.split(".")[0] in allowed, (path, module)


def test_the_shared_leaf_imports_nothing_of_ours():
    """odtrain/op_families.py is allowed below both layers because it stands on the standard library alone."""
    for path, module in imported_modules("odtrain"):
        if path.name == "op_families.py":
            assert module.split(".")[0] in {"__future__", "importlib", "pkgutil"}, (path.name, module)


def test_only_the_executor_joins_graph_nodes_to_kernels():
    users = {(str(path.relative_to(ROOT / "odtrain")), module) for path, module in imported_modules("odtrain")
             if module.startswith("odtrain.kernels")}
    # besides the executor and the optimizer's update (the two that call kernels): the JIT loads the compiler
    # for the kernels, the kernel library hands its code numpy's BLAS and keeps the compiler unloaded, its
    # build reads the table of parallel twins and records split calls; none sees a node
    others = {("jit/__init__.py", "odtrain.kernels.jit"), ("kernel_library/loader.py", "odtrain.kernels.blas_library"),
              ("kernel_library/loader.py", "odtrain.kernels.jit"), ("library_build/link.py", "odtrain.kernels.parallel_split"),
              ("library_build/record.py", "odtrain.kernels.parallel_split"),
              ("library_build/link.py", "odtrain.kernels")}  # the texts of generated kernels, for the build
    assert {name for name, _ in users - others} <= {"executor.py", "optimizer_update.py"}, users


def odtrain_imports(folder: str) -> set[tuple[str, str]]:
    """(file under odtrain/, odtrain module it imports) for every file of odtrain/`folder` (a package, or a file)."""
    found = set()
    for path, module in imported_modules("odtrain"):
        name = str(path.relative_to(ROOT / "odtrain"))
        if (name == folder or name.startswith(folder + "/")) and module.startswith("odtrain."):
            found.add((name, module))
    return found


def test_the_device_side_kernel_library_sits_under_the_executor():
    """A device loads a kernel library with numpy and ctypes: the loader reaches nothing above the executor's
    floor (no API, no build tool, no warmup), and imports no compiler at module level (it reads the JIT's
    source digest and its note, which load nothing)."""
    above = ("odtrain.api", "odtrain.executor", "odtrain.library_build", "odtrain.cli", "odtrain.trial_steps",
             "odtrain.training", "odtrain.artifacts", "odtrain.inference")
    reached = sorted((name, module) for name, module in odtrain_imports("kernel_library") if module.startswith(above))
    assert not reached, reached
    for path in (ROOT / "odtrain" / "kernel_library").glob("*.py"):
        for statement in parsed(path).body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in statement.names] if isinstance(statement, ast.Import) else [statement.module]
                assert not any((n or "").split(".")[0] in ("numba", "llvmlite", "scipy", "onnx") for n in names), \
                    (path.name, statement.lineno)


def test_the_build_tool_sits_above_the_api_and_only_the_command_line_reaches_it():
    """`odtrain compile` records steps through the API (the trial steps, which load artifacts as a user's script
    does); below it, nothing imports the build (the device side never loads the build tool)."""
    assert ("library_build/record.py", "odtrain.trial_steps") in odtrain_imports("library_build")
    assert ("trial_steps.py", "odtrain.api") in odtrain_imports("trial_steps.py")
    users = {name for path, module in imported_modules("odtrain") if module.startswith("odtrain.library_build")
             for name in [str(path.relative_to(ROOT / "odtrain"))]}
    assert {name for name in users if not name.startswith(("library_build/", "cli/"))} == set(), users


def test_the_jit_cache_imports_no_api():
    """The JIT's cache folder, its stale-source check, the compile-ahead note and its BLAS serve the executor
    and the device's loader: none of them reaches up to them, the API, the artifacts or a tool (warmup, which
    runs steps through the API, is odtrain/trial_steps.py)."""
    above = ("odtrain.api", "odtrain.executor", "odtrain.artifacts", "odtrain.training", "odtrain.trial_steps",
             "odtrain.library_build", "odtrain.cli", "odtrain.inference", "odtrain.kernel_library", "odtrain.demo")
    for name, module in odtrain_imports("jit"):
        assert not module.startswith(above), (name, module)


def test_import_odtrain_imports_nothing_tool_level():
    """`import odtrain` chooses the JIT's cache folder and defines the errors; no tool, no numpy."""
    import subprocess
    import sys

    code = "import sys, odtrain; print(sorted(m for m in sys.modules if m.startswith(('odtrain', 'numpy'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert eval(loaded) == ["odtrain", "odtrain.graph", "odtrain.graph.errors", "odtrain.jit", "odtrain.jit.cache"]


def test_no_module_of_a_package_imports_its_own_package():
    """A package's __init__ may import its modules (to gather or register them); a module importing its own
    package's __init__ would be an arrow running back up."""
    graph = module_imports()
    # the root package is left out: it holds the version, which the kernel library's manifest records, and loads
    # nothing else a module could depend on (test_import_odtrain_imports_nothing_tool_level)
    packages = {name for name in graph if any(other.startswith(name + ".") for other in graph)} - {"odtrain"}
    upward = sorted((module, package) for module, imported in graph.items() for package in imported & packages
                    if module.startswith(package + ".") and module.rpartition(".")[0] == package)
    assert not upward, upward
    # the family modules of graph/ops and kernels take the registry from their package's leaf module
    assert "odtrain.kernels.registry" in graph["odtrain.kernels.conv"]  # the check sees the leaf's arrow


def package_folders() -> dict[str, str]:
    """Each top folder of the repository -> the package an install makes of it: pyproject.toml's
    [tool.setuptools.package-dir] (a package nested in a mapped folder follows its parent there)."""
    import tomllib

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {folder: package for package, folder in mapping.items() if "/" not in folder}


PACKAGES = package_folders()


def test_a_checkout_maps_exactly_the_installs_packages():
    """Run from a checkout, odtrain.graph and odtrain.kernels are graph/ and kernels/ (odtrain's finder, the same
    table as the install's), and no other top folder of the repository is part of odtrain: tests/ and
    benchmarks/ do not import as odtrain's subpackages."""
    import json
    import subprocess
    import sys

    import odtrain

    assert PACKAGES == {"odtrain": "odtrain", **{folder: package for package, folder in odtrain.CHECKOUT_PACKAGES.items()}}
    code = ("import importlib, json, odtrain, odtrain.graph.ops, odtrain.kernels\n"
            "print(json.dumps([list(m.__path__) for m in (odtrain, odtrain.graph, odtrain.graph.ops, odtrain.kernels)]))\n"
            "for name in ('odtrain.tests', 'odtrain.benchmarks', 'odtrain.odtrain'):\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "        print('imported', name)\n"
            "    except ImportError:\n"
            "        pass\n")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    paths = [[str(ROOT / folder)] for folder in ("odtrain", "graph", "graph/ops", "kernels")]
    assert shown.splitlines() == [json.dumps(paths)], shown


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
        for node in walked(path):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                submodules = {f"{base}.{alias.name}" for alias in node.names} & set(paths)  # `from . import module`
                found.update(submodules)
                if len(submodules) < len(node.names):  # names defined in `base` itself
                    found.add(base)
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


def test_the_registries_import_every_module_on_disk():
    """Each package imports the modules its folder holds, whatever they are (private `_` modules and the
    registry itself excepted): a family module registers by being there."""
    import importlib
    import sys

    for package, folder in REGISTRIES.items():
        module = importlib.import_module(package)
        on_disk = sorted([path.stem for path in ROOT.joinpath(*folder).glob("*.py")
                          if not path.stem.startswith("_") and path.stem != "registry"]
                         + [path.parent.name for path in ROOT.joinpath(*folder).glob("*/__init__.py")])
        assert module.submodules() == on_disk, package
        assert all(f"{package}.{name}" in sys.modules for name in on_disk), package


def test_a_family_module_is_registered_by_being_in_the_folder(tmp_path):
    """A new module in a folder of the package's path, importing the registry from `.registry`, is imported
    and registered with no list edited (here a second folder on `__path__`, so that the probe stays out of the
    checkout): a subprocess loads graph/ops and kernels with a probe family beside each."""
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
            reached = sorted({node.attr for node in walked(path) if isinstance(node, ast.Attribute)
                              and node.attr in private})
            assert not reached, (str(path.relative_to(ROOT)), reached)


# Private names of other libraries that have no public equivalent, each with where and why.
FOREIGN_PRIVATE = {
    ("odtrain/threads.py", "_is_initialized"): "Numba's parallel module: whether its thread pool has started",
    ("benchmarks/decoders/make_models.py", "_attn_implementation"): "transformers' documented way to pick attention",
    ("odtrain/library_build/link.py", "_getvalue"): "Numba's array structure as an LLVM value, what its own intrinsics return",
    ("odtrain/library_build/link.py", "_cache"): "a dispatcher's cache, switched off so that every kernel's IR is at hand",
    ("odtrain/library_build/link.py", "_get_host_cpu_name"): "the CPU Numba's JIT compiles for, so the library's code is the JIT's",
    ("odtrain/library_build/link.py", "_tm_features"): "the CPU features Numba's JIT compiles with, recorded in the manifest",
}


def private_names() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(each `_name` -> the modules that define it: functions, classes, module or class names, attributes set on
    self or cls; each `obj._name` read or written on an object that is not self or cls, as (module, name, line))."""
    defined, reached = {}, []
    for folder in ("odtrain", "graph", "kernels", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            module = str(path.relative_to(ROOT))
            for node in walked(path):
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


def private_imports(root=ROOT, folders=("odtrain", "graph", "kernels", "benchmarks")) -> list[str]:
    """Each `from module import _name` whose module is another of ours, as 'importer imports _name from module'
    (a module's private names are its own business: a shared thing is public in the module that holds it)."""
    graph_paths = {}
    for folder, package in PACKAGES.items():
        for path in (root / folder).rglob("*.py"):
            parts = package.split(".") + list(path.relative_to(root / folder).with_suffix("").parts)
            graph_paths[path] = parts[:-1] if parts[-1] == "__init__" else parts
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            name = graph_paths.get(path)
            package = (name if path.name == "__init__.py" else name[:-1]) if name else []
            for node in walked(path):
                if not isinstance(node, ast.ImportFrom):
                    continue
                source = (".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                          if node.level else node.module or "")
                if not source.startswith("odtrain") or (name and source == ".".join(name)):
                    continue
                found += [f"{path.relative_to(root)}:{node.lineno} imports {alias.name} from {source}"
                          for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


# Private imports still to make public, outside kernels/ (each shared check or record is public where it lives
# once its module's owner moves it): graph/ops/windows.py's checks shared by the image families, and
# odtrain/onnxblock/blocks.py's building state. An entry that goes must leave this list too.
PRIVATE_IMPORTS_TO_MAKE_PUBLIC = {
    ("odtrain/onnxblock/__init__.py", "_BUILDING"), ("odtrain/onnxblock/__init__.py", "_build_into"),
    ("odtrain/onnxblock/__init__.py", "_output_names"),
    ("graph/ops/conv.py", "_auto_pad"), ("graph/ops/conv.py", "_ints"), ("graph/ops/conv.py", "_require_float32"),
    ("graph/ops/conv.py", "_spatial_rank"), ("graph/ops/nn.py", "_input_shaped"), ("graph/ops/nn.py", "_require_float32"),
    ("graph/ops/pool.py", "_auto_pad"), ("graph/ops/pool.py", "_input_shaped"), ("graph/ops/pool.py", "_require_float32"),
    ("graph/ops/pool.py", "_spatial_rank"), ("graph/ops/resize.py", "_input_shaped"),
    ("graph/ops/resize.py", "_require_float32"),
}


def test_no_module_imports_another_modules_private_names():
    """`from .x import _y` reaches into x as `x._y` does: the shared thing is made public where it lives
    (kernels/scalar.py's fast_exp, kernels/copies.py's sum_call, ...)."""
    reached = private_imports()
    pairs = {(found.split(":")[0], found.split(" imports ")[1].split(" ")[0]) for found in reached}
    known = {found for found in reached for module, name in PRIVATE_IMPORTS_TO_MAKE_PUBLIC
             if found.startswith(f"{module}:") and f" imports {name} from " in found}
    assert not [found for found in reached if found not in known], [found for found in reached if found not in known]
    assert PRIVATE_IMPORTS_TO_MAKE_PUBLIC <= pairs, sorted(PRIVATE_IMPORTS_TO_MAKE_PUBLIC - pairs)


def test_the_private_import_check_sees_one(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "family.py").write_text("from .elementwise import _unary, unary_call\n"
                                                     "from ._own import _helper\n")
    assert private_imports(tmp_path, ("kernels",)) == [
        "kernels/family.py:1 imports _unary from odtrain.kernels.elementwise",
        "kernels/family.py:2 imports _helper from odtrain.kernels._own"]


def kernel_modules() -> dict[str, pathlib.Path]:
    """The modules of kernels/ (a family's folder as one module: its __init__.py) -> their files."""
    folder = ROOT / "kernels"
    files = {path.stem: path for path in folder.glob("*.py") if path.name != "__init__.py"}
    return files | {path.parent.name: path for path in folder.glob("*/__init__.py")}


def kernel_families() -> set[str]:
    """The modules of kernels/ that register bindings (they import `binding` from the registry): the families;
    the others are the base they share."""
    return {name for name, path in kernel_modules().items()
            if any(isinstance(node, ast.ImportFrom) and node.module == "registry"
                   and node.level == (2 if path.name == "__init__.py" else 1)
                   and "binding" in {alias.name for alias in node.names}
                   for node in parsed(path).body)}


# A base module that stands on another base module, and why (kernels/__init__.py): its families then stand one
# floor higher than the rest.
BASE_ON_BASE = {("stored_weights", "blas"): "a panel dequantized and multiplied by BLAS in one loop, for two families",
                ("scalar_expressions", "scalar"): "the table's rows call the float32 approximations of erf, exp, tanh"}


def test_kernels_stand_on_three_floors():
    """The ground (modules that import nothing of kernels/), the base (what families share: it imports the
    ground only) and the families (they import the ground and the base): no base module builds on another one
    beyond BASE_ON_BASE, and a family's own parts live in its folder (conv/)."""
    graph = module_imports()
    names = kernel_modules()
    imports = {name: {other.split(".")[2] for other in graph[f"odtrain.kernels.{name}"]
                      if other.startswith("odtrain.kernels.") and other.split(".")[2] != name} for name in names}
    ground = {name for name, imported in imports.items() if not imported}
    base = set(names) - kernel_families() - ground
    assert {"jit", "layout", "registry", "parallel_split"} <= ground and {"blas", "copies", "windows"} <= base
    on_base = sorted((name, other) for name in base for other in imports[name] - ground
                     if (name, other) not in BASE_ON_BASE)
    assert not on_base, on_base
    assert set(BASE_ON_BASE) <= {(name, other) for name in base for other in imports[name]}, "a stale exception"


def test_no_kernel_family_imports_another():
    """kernels/ is one floor of families over a base (jit, registry, layout, blas, parallel_split, windows, scalar,
    copies, ...): a family imports the base only, so a reader of one family reads no other. A family that
    runs another op's kernels (quantize.py's integer products on Conv and MatMul) takes its binding from the
    registry when a node is bound."""
    families = kernel_families()
    assert {"elementwise", "conv", "quantize", "tensor"} <= families and not {"jit", "copies", "scalar"} & families
    graph = module_imports()
    crossing = sorted((family, other.rpartition(".")[2]) for family in families
                      for other in graph[f"odtrain.kernels.{family}"]
                      if other.rpartition(".")[2] in families - {family})
    assert not crossing, crossing
