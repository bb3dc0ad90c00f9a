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


def test_kernels_import_only_numpy_and_numba():
    for path, module in imported_modules("kernels", "odtrain.kernels"):
        root = module.split(".")[0]
        assert root in {"numpy", "numba", "math", "__future__"} or module.startswith("odtrain.kernels"), (path, module)


def test_graph_never_imports_kernels_or_odtrain():
    allowed = {"numpy", "onnx", "__future__", "dataclasses", "typing", "itertools", "enum", "os", "math", "struct"}
    for path, module in imported_modules("graph", "odtrain.graph"):
        if module.startswith("odtrain."):
            assert module.startswith("odtrain.graph"), (path, module)
        else:
            assert module.split(".")[0] in allowed, (path, module)


def test_only_the_executor_joins_graph_nodes_to_kernels():
    users = {path.name for path, module in imported_modules("odtrain", "odtrain")
             if module.startswith("odtrain.kernels")}
    assert users <= {"executor.py"}, users
