"""Every module a comment, a docstring or a README names exists: no stale names.

What is read: the comments and docstrings of every Python file of the repository (odtrain/, graph/, kernels/,
tests/, benchmarks/, setup.py) and the whole text of README.md, tests/README.md and benchmarks/README.md.
What is checked, wherever it appears there:
- a path `odtrain/...py`, `graph/...py` or `kernels/...py` names a file of the checkout (an installed
  layout's `odtrain/graph/...py` and `odtrain/kernels/...py` through pyproject.toml's package-dir);
- a dotted name (`odtrain.` and names joined by dots) resolves: the longest part that is a module or package of ours (found on
  disk through the same mapping), then each further part an attribute of it (a name its source defines at
  the top or in a class, else one the imported module has, for names made at run time).
Names that moved leave readers looking for files that are not there (a module that became a package, one
renamed): this test makes the next move fix its mentions. `test_the_check_sees_a_stale_name` shows it
failing on such names.
"""
from __future__ import annotations

import ast
import importlib
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
READMES = ("README.md", "tests/README.md", "benchmarks/README.md")
SOURCE_FOLDERS = ("odtrain", "graph", "kernels", "tests", "benchmarks")

PATH = re.compile(r"(?<![\w/.-])(?:odtrain|graph|kernels)/[\w/]*\w\.py\b")
DOTTED = re.compile(r"(?<![\w/.-])odtrain(?:\.\w+)+")


def package_dirs() -> dict[str, pathlib.Path]:
    """Each package pyproject.toml maps -> its folder in the checkout."""
    import tomllib

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in mapping.items()}


PACKAGE_DIRS = package_dirs()


def comments_and_docstrings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of each comment and each line of each docstring of a Python file."""
    source = path.read_text()
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return found


def texts() -> list[tuple[str, int, str]]:
    """(file relative to the checkout, line, text) of everything this test reads."""
    found = []
    for name in READMES:
        found += [(name, number, line) for number, line in enumerate((ROOT / name).read_text().splitlines(), 1)]
    paths = [path for folder in SOURCE_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]
    for path in [*paths, ROOT / "setup.py"]:
        found += [(str(path.relative_to(ROOT)), number, text) for number, text in comments_and_docstrings(path)]
    return found


def path_exists(path: str) -> bool:
    """Whether a path a text names is a file of the checkout, directly or through the install's mapping."""
    if (ROOT / path).is_file():
        return True
    parts = path.split("/")
    for length in range(len(parts) - 1, 0, -1):  # the longest mapped package the path starts with
        folder = PACKAGE_DIRS.get(".".join(parts[:length]))
        if folder is not None:
            return folder.joinpath(*parts[length:]).is_file()
    return False


def defined_names(tree: ast.Module) -> dict[str, ast.AST | None]:
    """The names a module's source defines at its top: functions, classes, assignments, imports, `__all__`
    (each with its class node, where it is a class, for the next part)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.setdefault(node.name, node if isinstance(node, ast.ClassDef) else None)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.setdefault(node.id, None)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.setdefault(alias.asname or alias.name.split(".")[0], None)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.setdefault(node.attr, None)  # self.x = ...: an attribute of the class's instances
    return names


def module_file(name: str) -> pathlib.Path | None:
    """The source file of one of our modules or packages by its dotted name, or None."""
    if name in PACKAGE_DIRS:
        init = PACKAGE_DIRS[name] / "__init__.py"
        return init if init.is_file() else None
    parent, _, last = name.rpartition(".")
    folder = PACKAGE_DIRS.get(parent) if parent in PACKAGE_DIRS else None
    if folder is None and parent:
        parent_file = module_file(parent)
        folder = parent_file.parent if parent_file is not None and parent_file.name == "__init__.py" else None
    if folder is None:
        return None
    for candidate in (folder / f"{last}.py", folder / last / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def resolves(dotted: str) -> bool:
    """Whether a dotted odtrain name is a module of ours, or a module and attributes of it."""
    parts = dotted.split(".")
    length = max(n for n in range(1, len(parts) + 1) if module_file(".".join(parts[:n])) is not None)
    module, rest = ".".join(parts[:length]), parts[length:]
    if not rest:
        return True
    names = defined_names(ast.parse(module_file(module).read_text()))
    if rest[0] in names:
        node = names[rest[0]]
        return len(rest) == 1 or not isinstance(node, ast.ClassDef) or rest[1] in defined_names(node)
    try:  # a name made at run time (a module's __getattr__, a registry filled on import)
        value = importlib.import_module(module)
        for part in rest:
            value = getattr(value, part)
        return True
    except (ImportError, AttributeError):
        return False


def stale_names(found: list[tuple[str, int, str]]) -> list[str]:
    stale = []
    for file, line, text in found:
        stale += [f"{file}:{line}: {path}" for path in PATH.findall(text) if not path_exists(path)]
        stale += [f"{file}:{line}: {name}" for name in DOTTED.findall(text) if not resolves(name)]
    return stale


def test_every_module_a_comment_docstring_or_readme_names_exists():
    stale = stale_names(texts())
    assert not stale, "names of modules that do not exist (moved or renamed: name the new place):\n" + \
        "\n".join(stale)


@pytest.mark.parametrize("text, stale", [
    ("# loaded by odtrain/kernel_library.py", True),  # a module that became a package
    ("(odtrain.runtime.load)", True),  # a module renamed
    ("see odtrain.kernel_library.no_such_name", True),  # an attribute that is not there
    ("odtrain.api.Module.no_such_method", True),
    ("odtrain/kernel_library/loader.py and kernels/jit.py", False),
    ("odtrain/graph/ir.py, as installed", False),
    ("odtrain.kernel_library.find, odtrain.api.Module.get_contiguous_parameters, odtrain.InferenceSession", False),
    ("odtrain.graph.ops.registry.OPS", False),
])
def test_the_check_sees_a_stale_name(text, stale):
    assert bool(stale_names([("probe.py", 1, text)])) == stale, text
