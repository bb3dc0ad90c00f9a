"""Functions a reader can hold: none over MAX_LINES lines in odtrain/, graph/ or kernels/, except the kernels
below, whose loops are one algorithm that would read worse cut in pieces (Numba inlines nothing across a cut
for free, and the pieces would pass a dozen arrays each).

A function's length runs from its `def` line to its last line, docstring and comments included, nested
functions included in their parent's; classes are not functions (their methods are).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("odtrain", "graph", "kernels")
MAX_LINES = 80

# (file, function) -> why it stays whole
LONG_KERNELS = {
    ("kernels/recurrent.py", "_gru_backward"): "backpropagation through time of a GRU direction: one reverse loop "
    "over the steps, whose gate gradients feed the next iteration's carried state",
    ("kernels/recurrent.py", "_lstm_backward"): "backpropagation through time of an LSTM direction: one reverse loop "
    "over the steps, carrying the hidden and cell gradients from one iteration to the next",
}


def function_lengths(root: Path = ROOT) -> dict[tuple[str, str], int]:
    """(file relative to the checkout, qualified function name) -> its lines, for every function of PACKAGES."""
    lengths = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            relative = path.relative_to(root).as_posix()

            def visit(node, prefix=""):
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lengths[(relative, prefix + child.name)] = child.end_lineno - child.lineno + 1
                        visit(child, f"{prefix}{child.name}.")
                    elif isinstance(child, ast.ClassDef):
                        visit(child, f"{prefix}{child.name}.")
                    else:
                        visit(child, prefix)

            visit(tree)
    return lengths


def test_no_function_is_longer_than_a_reader_holds():
    long = {key: lines for key, lines in function_lengths().items() if lines > MAX_LINES and key not in LONG_KERNELS}
    assert not long, (f"functions over {MAX_LINES} lines: "
                      + "; ".join(f"{path}: {name} ({lines} lines)" for (path, name), lines in sorted(long.items()))
                      + ". Cut them along their steps; a kernel whose loop is one algorithm goes into LONG_KERNELS "
                      "with the reason")


def test_the_allowed_kernels_are_long_kernels_that_exist():
    """An entry of LONG_KERNELS names a function of kernels/ that is still over the limit (else it goes)."""
    lengths = function_lengths()
    for (path, name), reason in LONG_KERNELS.items():
        assert path.startswith("kernels/") and reason, (path, name)
        assert lengths.get((path, name), 0) > MAX_LINES, f"{path}: {name} is gone or short now: leave it out of LONG_KERNELS"


def test_a_long_function_is_found(tmp_path):
    """The measure sees a long method of a class and a long nested function."""
    package = tmp_path / "odtrain"
    package.mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES))
    (package / "long.py").write_text(f"class C:\n    def method(self):\n{body}\n\ndef outer():\n    def inner():\n"
                                     f"{body}    return inner\n")
    for name in ("graph", "kernels"):
        (tmp_path / name).mkdir()
    lengths = function_lengths(tmp_path)
    assert lengths[("odtrain/long.py", "C.method")] == MAX_LINES + 1
    assert lengths[("odtrain/long.py", "outer.inner")] == MAX_LINES + 1
    assert lengths[("odtrain/long.py", "outer")] == MAX_LINES + 3
