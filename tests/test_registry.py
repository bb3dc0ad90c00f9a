"""The op registry and the kernel bindings agree: every op that can run has a kernel, every rule a test."""
import importlib
import pathlib
import re

from odtrain.graph.ops import OPS
from odtrain.kernels import BINDINGS

# Ops that never reach a kernel: views share their input's bytes, constants fold when shapes bind.
NO_KERNEL = {("", "Reshape"), ("", "Flatten"), ("", "Identity"), ("", "Shape"), ("", "Size"), ("", "Constant")}
NO_KERNEL |= {("", "BitCast"), ("", "EyeLike")}  # a view; a constant once shapes bind
# run where their input is a constant, and fold
NO_KERNEL |= {("", "Unique"), ("", "NonZero"), ("", "NonMaxSuppression")}
NO_KERNEL |= {("ai.odtrain", "ApplyUpdate")}  # the executor calls the optimizer for it
NO_KERNEL |= {("", "Squeeze"), ("", "Unsqueeze")}  # views
NO_KERNEL |= {("", "HannWindow"), ("", "HammingWindow"), ("", "BlackmanWindow"), ("", "MelWeightMatrix")}  # constants

TESTS = pathlib.Path(__file__).parent


def gradient_checked_ops() -> set[str]:
    """The op types whose gradients the test modules check: every op of a row of their GRADIENT_CASES
    tables (float64 finite differences, tests/oracles.py), and the keys of their GRADIENT_ORACLES (ops
    checked against an oracle of their own, with the test that does it)."""
    checked = set()
    for path in sorted(TESTS.glob("test_*.py")):
        if not re.search(r"^GRADIENT_(CASES|ORACLES)\b", path.read_text(), re.MULTILINE):
            continue
        module = importlib.import_module(path.stem)  # already imported when pytest collected it
        for case in getattr(module, "GRADIENT_CASES", {}).values():
            checked |= case.op_types
        checked |= set(getattr(module, "GRADIENT_ORACLES", {}))
    return checked


def test_every_registered_op_has_a_kernel():
    missing = sorted(key for key in OPS if key not in BINDINGS and key not in NO_KERNEL)
    assert not missing, f"ops with a type rule but no kernel binding: {missing}"


def test_every_kernel_has_a_type_rule():
    assert not sorted(set(BINDINGS) - set(OPS))


def test_every_gradient_rule_is_checked_numerically():
    with_rules = {op for (domain, op), opdef in OPS.items() if opdef.gradient is not None}
    unchecked = with_rules - gradient_checked_ops()
    assert not unchecked, f"gradient rules without a row in a GRADIENT_CASES table: {sorted(unchecked)}"


def test_ops_without_gradient_say_why():
    for key, opdef in OPS.items():
        if opdef.gradient is None and key[0] == "":
            assert opdef.no_grad_reason, f"{key}: neither a gradient rule nor a stated reason"
