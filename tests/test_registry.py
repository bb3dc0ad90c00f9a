"""The op registry and the kernel bindings agree: every op that can run has a kernel, every rule a test."""
import dataclasses
import importlib
import pathlib
import re

from odtrain.graph.ops import OPS
from odtrain.kernels import BINDINGS


def no_kernel() -> set[tuple[str, str]]:
    """The ops registered as never reaching a kernel (`@op(..., no_kernel=why)`: views, constants that fold
    when shapes bind, ApplyUpdate, which the executor runs through the optimizer)."""
    return {key for key, opdef in OPS.items() if opdef.no_kernel}


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


def ops_without_a_kernel(ops: dict, bindings: dict) -> list:
    """The registered ops that have neither a binding nor a registered reason for having none."""
    return sorted(key for key, opdef in ops.items() if key not in bindings and not opdef.no_kernel)


def test_every_registered_op_has_a_kernel():
    missing = ops_without_a_kernel(OPS, BINDINGS)
    assert not missing, f"ops with a type rule but neither a kernel binding nor `no_kernel=` (why): {missing}"


def test_an_op_without_kernel_or_reason_is_caught():
    relu = OPS[("", "Relu")]
    ops = {**OPS, ("", "Unbound"): dataclasses.replace(relu, op_type="Unbound")}
    assert ops_without_a_kernel(ops, BINDINGS) == [("", "Unbound")]
    ops[("", "Unbound")] = dataclasses.replace(relu, op_type="Unbound", no_kernel="a view")
    assert ops_without_a_kernel(ops, BINDINGS) == []


def test_ops_registered_without_a_kernel_have_none():
    """The no-kernel fact is stated only where it holds: no such op has a binding too."""
    both = sorted(no_kernel() & set(BINDINGS))
    assert not both, f"ops registered with `no_kernel=` that have a kernel binding: {both}"
    assert {("", "Reshape"), ("", "Constant"), ("ai.odtrain", "ApplyUpdate")} <= no_kernel()


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
