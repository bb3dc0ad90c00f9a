"""Signal ops: DFT, STFT, the windows and MelWeightMatrix against ONNX's backend node cases, and the
gradients of DFT and STFT against float64 finite differences."""
import sys
import pathlib
import warnings

import numpy as np
import pytest
from onnx import helper

from oracles import GradientCase

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
from conformance import _odtrain_run, check  # noqa: E402

SIGNAL_OPS = {"DFT", "STFT", "MelWeightMatrix", "HannWindow", "HammingWindow", "BlackmanWindow"}


def _signal_cases():
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [case for case in load_model_tests(kind="node")
                if {n.op_type for n in case.model.graph.node} & SIGNAL_OPS]


CASES = _signal_cases()


def test_every_signal_op_has_node_cases():
    assert {n.op_type for case in CASES for n in case.model.graph.node} == SIGNAL_OPS
    assert len(CASES) == 19


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_node_case(case):
    assert check(case, _odtrain_run) is None


def node(op_type, inputs, outputs=("y",), **attrs):
    return helper.make_node(op_type, list(inputs), list(outputs), **attrs)


_rng = np.random.default_rng(0)


def rand(*shape):
    return _rng.standard_normal(shape).astype(np.float32)


GRADIENT_CASES = {
    "DFT real, axis 1, dft_length padding": GradientCase(
        [node("DFT", ["x", "length"], axis=1)], {"x": rand(2, 5, 3, 1)}, {"length": np.array(7, np.int64)}),
    "DFT complex inverse, axis 2, cut": GradientCase(
        [node("DFT", ["x", "length", "axis"], inverse=1)], {"x": rand(2, 3, 6, 2)},
        {"length": np.array(4, np.int64), "axis": np.array(2, np.int64)}, opset=20),
    "DFT one-sided": GradientCase([node("DFT", ["x"], axis=1, onesided=1)], {"x": rand(2, 6, 1)}),
    "DFT inverse one-sided": GradientCase([node("DFT", ["x"], axis=1, onesided=1, inverse=1)], {"x": rand(2, 4, 2)}),
    "STFT with window, overlapping frames": GradientCase(
        [node("STFT", ["x", "step", "window"])], {"x": rand(2, 20, 1)},
        {"step": np.array(3, np.int64), "window": np.hanning(8).astype(np.float32)}),
    "STFT two-sided, complex": GradientCase(
        [node("STFT", ["x", "step", "", "length"], onesided=0)], {"x": rand(1, 12, 2)},
        {"step": np.array(4, np.int64), "length": np.array(5, np.int64)}),
}


@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_gradient(name, tmp_path):
    GRADIENT_CASES[name].check(tmp_path)


def test_a_reversing_constant_slice_folds_whole():
    # torch.onnx's STFT export reverses its pads with Slice(starts -1, ends -INT64_MAX, steps -1)
    from odtrain.inference import InferenceSession
    from oracles import make_model, reference_outputs

    nodes = [node("Slice", ["table", "starts", "ends", "axes", "steps"], ["reversed"]),
             node("Add", ["x", "reversed"])]
    constants = {"table": np.arange(6, dtype=np.float32).reshape(3, 2), "starts": np.array([-1]),
                 "ends": np.array([-2**63 + 1]), "axes": np.array([0]), "steps": np.array([-1])}
    model = make_model(nodes, constants, inputs=[("x", np.float32, (3, 2))],
                       outputs=[("y", np.float32, [3, 2])])
    x = np.ones((3, 2), np.float32)
    expected = reference_outputs(model, {"x": x})[0]
    np.testing.assert_array_equal(InferenceSession(model).run(None, {"x": x})[0], expected)
    assert expected[0, 0] == 5


def _dft(x, out_shape, length=None, **attrs):
    """odtrain's DFT kernel on x (its binding, as a step calls it; float64 arrays: numpy's precision)."""
    from odtrain.kernels import BINDINGS, SCRATCH

    inputs = [x] + ([np.array(length, np.int64)] if length is not None else [])
    out = np.full(out_shape, np.nan, x.dtype)
    scratch = np.zeros(SCRATCH[("", "DFT")]([(x.shape, x.dtype)], [(out.shape, out.dtype)]), np.uint8)
    for kernel, args in BINDINGS[("", "DFT")](inputs, [out], scratch=scratch, **attrs):
        kernel(*args)
    return out


def _complex(x):
    return x[..., 0] + 1j * x[..., 1]


@pytest.mark.parametrize("length", [7, 8, 12])
def test_an_inverse_dft_longer_than_its_input_is_numpys_zero_padded_ifft(length):
    """dft_length beyond the input's rows: the input counts as zero-padded to it (numpy.fft.ifft(x, n))."""
    x = _rng.standard_normal((2, 5, 3, 2))
    out = _dft(x, (2, length, 3, 2), length, axis=1, inverse=1)
    np.testing.assert_allclose(_complex(out), np.fft.ifft(_complex(x), n=length, axis=1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("length", [7, 8, 9, 10])
def test_the_one_sided_inverse_dft_is_numpys_irfft_at_odd_and_even_lengths(length):
    """onesided=1, inverse=1 reads the length // 2 + 1 bins of a symmetric spectrum and gives length real samples;
    at an odd length there is no Nyquist bin: every bin but the zeroth counts twice."""
    bins = length // 2 + 1
    x = _rng.standard_normal((2, bins, 2))
    out = _dft(x, (2, length, 1), length, axis=1, inverse=1, onesided=1)
    np.testing.assert_allclose(out[..., 0], np.fft.irfft(_complex(x), n=length, axis=1), rtol=1e-12, atol=1e-12)
