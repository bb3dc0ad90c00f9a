"""The data-movement kernels (strided copies, sums to a shape, broadcasting binaries, in-place
accumulation) against numpy, on the layouts a decoder's step binds: grouped-query attention's
repeated key/value heads, head transposes, a mask broadcast over heads, runs repeated along the last
axis, an operand broadcast on the left of a non-commutative op, an output written over an input.
Each case runs serially and split into 3 parts of its rows (kernels/parallel_split.py), so a part starts in
the middle of an axis; float32 adds, products and copies are exact, so every case is equal to numpy's,
bit for bit. The ONNX backend node cases (tests/test_forward_ops.py) cover the ops' other attributes.
"""
import numpy as np
import pytest

from odtrain.kernels import BINDINGS, ODTRAIN_DOMAIN, parallel_split

rng = np.random.default_rng(11)


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def shape_input(shape):
    return np.array(shape, np.int64)


def repeat_heads(x):  # [b, kv, 1, t, d] -> [b, kv, 3, t, d]
    return np.broadcast_to(x, x.shape[:2] + (3,) + x.shape[3:])


# name: (op, inputs, output shape, attributes, numpy's result from the inputs)
CASES = {
    "expand_repeated_heads": ("Expand", [rand(2, 3, 1, 5, 4), shape_input((2, 3, 3, 5, 4))], (2, 3, 3, 5, 4), {},
                              lambda x, s: repeat_heads(x)),
    "expand_last_axis": ("Expand", [rand(2, 5, 1), shape_input((2, 5, 7))], (2, 5, 7), {},
                         lambda x, s: np.broadcast_to(x, (2, 5, 7))),
    "transpose_heads": ("Transpose", [rand(2, 5, 3, 4)], (2, 3, 5, 4), {"perm": [0, 2, 1, 3]},
                        lambda x: x.transpose(0, 2, 1, 3)),
    "transpose_last_two": ("Transpose", [rand(3, 5, 4)], (3, 4, 5), {"perm": [0, 2, 1]},
                           lambda x: x.transpose(0, 2, 1)),
    "slice_reversed": ("Slice", [rand(4, 6), shape_input([3, 0]), shape_input([-100, 6]), shape_input([0, 1]),
                                 shape_input([-1, 2])], (4, 3), {}, lambda x, *_: x[::-1, ::2]),
    "sum_repeated_heads": ("SumToShape", [rand(2, 3, 3, 5, 4), shape_input((2, 3, 1, 5, 4))], (2, 3, 1, 5, 4), {},
                           lambda g, s: g.sum(axis=2, keepdims=True, dtype=np.float64).astype(np.float32)),
    "sum_rows_to_bias": ("SumToShape", [rand(6, 5, 4), shape_input((4,))], (4,), {},
                         lambda g, s: g.sum(axis=(0, 1), dtype=np.float64).astype(np.float32)),
    "sum_last_axis": ("SumToShape", [rand(2, 5, 9), shape_input((2, 5, 1))], (2, 5, 1), {},
                      lambda g, s: g.sum(axis=2, keepdims=True, dtype=np.float64).astype(np.float32)),
    "add_mask_over_heads": ("Add", [rand(2, 9, 5, 6), rand(2, 1, 5, 6)], (2, 9, 5, 6), {}, np.add),
    "add_over_four_axes": ("Add", [rand(3, 4, 5, 6), rand(3, 1, 5, 1)], (3, 4, 5, 6), {}, np.add),
    "sub_column_on_the_left": ("Sub", [rand(2, 5, 1), rand(2, 5, 7)], (2, 5, 7), {}, np.subtract),
    "div_by_column": ("Div", [rand(2, 5, 7), rand(2, 5, 1)], (2, 5, 7), {}, np.divide),
    "max_row_and_column": ("Max", [rand(5, 1), rand(1, 7)], (5, 7), {}, np.maximum),
    "mul_transposed_operand": ("Mul", [rand(3, 1, 4), rand(3, 5, 1)], (3, 5, 4), {}, np.multiply),
}
# float32 sums of 3 numbers depend on their order; the kernels add in index order, as these do
SUMS = {"sum_repeated_heads", "sum_rows_to_bias", "sum_last_axis"}


def run(op, inputs, out, attrs, threads):
    domain = ODTRAIN_DOMAIN if op == "SumToShape" else ""
    binding = BINDINGS[(domain, op)]
    extra = {"threads": threads} if "threads" in binding.__code__.co_varnames else {}
    calls = binding(inputs, [out], **attrs, **extra)
    for kernel, args in calls:
        kernel(*args)
    return calls


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_kernel_matches_numpy(name, threads, monkeypatch):
    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)
    op, inputs, shape, attrs, expected = CASES[name]
    out = np.full(shape, np.nan, np.float32)
    calls = run(op, inputs, out, attrs, threads)
    want = expected(*inputs)
    if name in SUMS:  # summed in index order: within float32 rounding of the float64 sum
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(out, want)
    split = any(kernel.__name__.endswith("_parts") for kernel, _ in calls)
    assert split == (threads > 1 and op != "SumToShape"), [kernel.__name__ for kernel, _ in calls]


@pytest.mark.parametrize("op, ufunc", [("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply)])
def test_an_output_over_an_input_is_computed_in_place(op, ufunc):
    """The planner may put the output over either input: the in-place kernel reads the buffer through one name."""
    a, b = rand(4, 6), rand(4, 6)
    for over in (0, 1):
        inputs = [a.copy(), b.copy()]
        calls = run(op, inputs, inputs[over], {}, 1)
        np.testing.assert_array_equal(inputs[over], ufunc(a, b))
        assert [kernel.__name__ for kernel, _ in calls] == (
            ["_binary"] if op == "Sub" and over == 1 else ["_binary_into"])


def test_a_sum_of_many_accumulates_in_place():
    xs = [rand(3, 7) for _ in range(5)]
    out = np.empty((3, 7), np.float32)
    calls = run("Sum", xs, out, {}, 1)
    expected = xs[0] + xs[1]
    for x in xs[2:]:
        expected = expected + x
    np.testing.assert_array_equal(out, expected)
    assert [kernel.__name__ for kernel, _ in calls] == ["_binary"] + ["_binary_into"] * 3


@pytest.mark.parametrize("op, ufunc", [("Add", np.add), ("Mul", np.multiply), ("Div", np.divide)])
def test_a_broadcast_output_over_an_input_is_computed_in_place(op, ufunc):
    """Scores with a mask added over heads, or a product scaled by one value, written over the scores."""
    for a, b in ((rand(2, 3, 4, 5), rand(2, 1, 4, 5)), (rand(2, 3, 4), rand(1))):
        for over in (0, 1):
            if over == 1 and op == "Div":
                continue  # the output over the divisor, which is smaller: not in place
            inputs = [a.copy(), b.copy()] if over == 0 else [b.copy(), a.copy()]
            calls = run(op, inputs, inputs[over], {}, 1)
            np.testing.assert_array_equal(inputs[over], ufunc(*((a, b) if over == 0 else (b, a))))
            assert [kernel.__name__ for kernel, _ in calls] == ["_binary_strided"] and calls[0][1][7]
