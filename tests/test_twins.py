"""The one table of parallel twins (kernels/parallel_split.py): every `_parts` kernel is registered, every twin's
parameters follow from its serial kernel's by the one rule, and the chooser keeps the serial call at one part.
Nothing compiles: the kernels' Python functions are read, not run.
"""
import importlib
import pkgutil

import numpy as np
import pytest

import odtrain.kernels as kernels
from odtrain.kernels.parallel_split import TWINS, on_parts, parallel_twin, parameters, part_bounds, split, twin_source


def kernel_modules():
    return [importlib.import_module(f"{kernels.__name__}.{info.name}")
            for info in pkgutil.iter_modules(kernels.__path__)]


def defined_kernels():
    """(module name, kernel name, kernel) of every Numba kernel defined in kernels/."""
    found = []
    for module in kernel_modules():
        for name, value in vars(module).items():
            function = getattr(value, "py_func", None)
            if function is not None and function.__module__ == module.__name__:
                found.append((module.__name__, name, value))
    return found


def test_every_parts_kernel_is_a_registered_twin():
    registered = {twin.parallel for twin in TWINS.values()}
    unregistered = [f"{module}.{name}" for module, name, kernel in defined_kernels()
                    if name.endswith("_parts") and kernel not in registered]
    assert not unregistered, f"parallel kernels missing from kernels/parallel_split.py's TWINS (twin_of): {unregistered}"
    assert len(TWINS) >= 50


@pytest.mark.parametrize("twin", list(TWINS.values()), ids=lambda twin: twin.parallel.__name__)
def test_twin_signature_is_its_serial_kernels_plus_bounds(twin):
    assert parameters(twin.parallel) == twin.parameters()
    serial = parameters(twin.serial)
    assert serial[len(serial) - len(twin.range):] == twin.range
    assert set(twin.replaces) <= set(serial)


def test_the_chooser_keeps_the_serial_call_at_one_part_and_cuts_fixed_parts():
    from odtrain.kernels.normalization import _layer_norm_grad, _softmax
    from odtrain.kernels.nn import _batch_norm_infer

    x, out = np.zeros(12, np.float32), np.zeros(12, np.float32)
    call = (_softmax, (x, out, 4, 3, 1))
    assert split(call, 4, 12, threads=2) is call  # too little work for a parallel region
    assert split(call, 1, 1 << 20, threads=2) is call and split(call, 4, 1 << 20, threads=1) is call
    kernel, args = split(call, 4, 1 << 20, threads=3)
    assert kernel is TWINS[_softmax].parallel and args[:-1] == call[1]
    np.testing.assert_array_equal(args[-1], [0, 1, 2, 4])
    # a ranged serial call: its (first, last) give way to the bounds
    ranged = (_batch_norm_infer, tuple(range(11)) + (0, 7))
    kernel, args = on_parts(ranged, 7, 2)
    assert args[:-1] == tuple(range(11)) and list(args[-1]) == list(part_bounds(7, 2)) == [0, 3, 7]
    # the twin's own arguments, here made for its parts
    grad = (_layer_norm_grad, tuple(range(13)))
    kernel, args = on_parts(grad, 6, 3, lambda count: (np.zeros((count, 2, 5)),))
    assert args[13].shape == (3, 2, 5) and list(args[14]) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="partial"):
        on_parts(grad, 6, 3)


WRITTEN = [twin for twin in TWINS.values() if twin.written]


def test_written_twins_are_their_records_loop_in_the_serial_kernels_file():
    """A twin written from its record (parallel_twin) is one parallel loop calling its serial kernel, compiled as
    part of the serial kernel's file and module (what Numba's on-disk cache needs), with the twins' options."""
    assert len(WRITTEN) >= 25
    for twin in WRITTEN:
        serial, parallel = twin.serial.py_func, twin.parallel.py_func
        assert parallel.__name__ == serial.__name__ + "_parts" and parallel.__module__ == serial.__module__
        assert parallel.__code__.co_filename == serial.__code__.co_filename
        assert parallel.__globals__ is serial.__globals__
        assert twin.parallel.options == {"cache": True, "error_model": "numpy", "parallel": True}
        assert not twin.replaces and not twin.takes
    from odtrain.kernels.elementwise import _binary_scalar
    from odtrain.kernels.nn import _batch_norm_infer

    assert twin_source(_binary_scalar, sliced=("a", "out")) == (
        "def _binary_scalar_parts(code, a, b, out, bounds):\n"
        "    for p in prange(bounds.size - 1):\n"
        "        _binary_scalar(code, a[bounds[p]:bounds[p + 1]], b, out[bounds[p]:bounds[p + 1]])\n")
    assert twin_source(_batch_norm_infer, range=("c0", "c1")).endswith(
        "_batch_norm_infer(x, scale, bias, mean, var, y, epsilon, stats, low, high, in_place, bounds[p], bounds[p + 1])\n")


def test_a_twin_is_written_only_from_a_record_it_can_follow():
    from odtrain.kernels.elementwise import _binary_scalar, _unary

    with pytest.raises(ValueError, match="cut some of its arrays"):
        twin_source(_binary_scalar, sliced=("nothing",))
    with pytest.raises(ValueError, match="under a name of its own"):
        parallel_twin(_unary, sliced=("x", "out"))  # its module has _unary_parts already


def test_a_kernel_without_a_twin_is_refused_by_name():
    from odtrain.kernels.optim import add_into

    assert on_parts((add_into, ()), 8, 1) == (add_into, ())
    with pytest.raises(KeyError, match="add_into has no parallel twin"):
        on_parts((add_into, ()), 8, 2)


def test_recording_a_small_product_records_the_twin_a_larger_batch_runs():
    """A Gemm of 32 rows (at most SMALL_PRODUCT multiply-adds) runs serial; at 2048 rows it runs in blocks of
    rows. Recorded at 32 with every_split, it must be the twin's call too: the kernel library's build records at
    batch 32 and its library serves batch 2048 (the reference CNN's classifier, 64 -> 10)."""
    from odtrain.kernels.blas import gemm_batched_parts
    from odtrain.kernels.linalg import gemm_calls
    from odtrain.kernel_library import signature_of
    from odtrain.kernels.parallel_split import every_split

    def calls(batch):
        a, b = np.ones((batch, 64), np.float32), np.ones((64, 10), np.float32)
        return gemm_calls(a, b, np.zeros((batch, 10), np.float32), threads=2)

    [(large, large_args)] = calls(2048)
    assert large is gemm_batched_parts
    [(small, _)] = calls(32)
    assert small is not gemm_batched_parts  # unchanged where nothing records
    with every_split():
        [(recorded, recorded_args)] = calls(32)
    assert recorded is gemm_batched_parts and signature_of(recorded_args) == signature_of(large_args)


def test_every_twin_written_out_says_why_parallel_twin_cannot_write_it():
    """parallel_twin writes every twin that is one loop over cut arrays or a range of units; a twin written out
    does more (its own work memory, partial sums, a check before the parts) and says what, in a line."""
    unexplained = [twin.parallel.__name__ for twin in TWINS.values() if not twin.written and not twin.because]
    assert not unexplained, unexplained
    assert all("\n" not in twin.because and len(twin.because) <= 110 for twin in TWINS.values())


def test_a_unit_of_several_elements_scales_the_cut_and_counts_the_parts_units():
    """The softmax family's twins: a part's rows are n·inner elements each, and `outer` gets their number."""
    from odtrain.kernels.normalization import _softmax

    assert twin_source(_softmax, sliced=("x", "out"), unit=("n", "inner"), count="outer") == (
        "def _softmax_parts(x, out, outer, n, inner, bounds):\n"
        "    for p in prange(bounds.size - 1):\n"
        "        _softmax(x[bounds[p] * n * inner:bounds[p + 1] * n * inner], "
        "out[bounds[p] * n * inner:bounds[p + 1] * n * inner], bounds[p + 1] - bounds[p], n, inner)\n")
    with pytest.raises(ValueError, match="counting the units"):
        twin_source(_softmax, sliced=("x", "out"), unit=("n", "inner"))
    with pytest.raises(ValueError, match="counting the units"):
        twin_source(_softmax, sliced=("x", "out"), unit=("rows",), count="outer")
    assert TWINS[_softmax].written and TWINS[_softmax].count == "outer"
