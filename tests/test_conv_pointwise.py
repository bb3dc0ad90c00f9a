"""Pointwise convolutions over small planes (kernels/conv/pointwise.py: several images gathered per product,
parts split channels): forward, input gradient and weight gradient against the float64 definition, serial
and in parts, float32 and float64, with groups, bias, batches that leave a last chunk of one image, and
ConvTranspose; which convolutions the layout sends there and how the parts split them.

Tolerances as in test_conv_taps.py (float32 sums of up to ~2000 products here: measured at most 3e-7 of the
largest magnitude; 2e-6 still fails a wrong channel or image, which moves whole terms).
"""
import numpy as np
import pytest

from odtrain.kernels import BINDINGS, SCRATCH, parallel_split
from odtrain.kernels.conv.pointwise import FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT, PointwisePlan
from odtrain.kernels.windows import Convolution
from test_conv_taps import ODTRAIN, TOLERANCE, chosen, oracle, run

CASES = [  # x shape, w shape, group, bias
    ((8, 16, 3, 3), (48, 16, 1, 1), 1, True),  # 3x3 planes: every image in one product
    ((8, 48, 6, 6), (16, 48, 1, 1), 1, False),  # more input than output channels: dW splits its columns
    ((5, 32, 10, 10), (64, 16, 1, 1), 2, True),  # 100 cells: one chunk of all 5 images; two groups
    ((4, 32, 20, 10), (32, 32, 1, 1), 1, False),  # 200 cells: chunks of 3 images, the last of one
    ((1, 32, 7, 7), (64, 32, 1, 1), 1, True),  # batch 1: views, nothing gathered
]


@pytest.fixture
def always_split(monkeypatch):
    """Parts whatever the work, so the small cases run the parallel twins."""
    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("x_shape, w_shape, group, has_bias", CASES)
def test_pointwise_kernels_match_the_definition(x_shape, w_shape, group, has_bias, dtype, threads, always_split):
    rng = np.random.default_rng(sum(x_shape) + sum(w_shape))
    x, w = rng.standard_normal(x_shape).astype(dtype), rng.standard_normal(w_shape).astype(dtype)
    bias = rng.standard_normal(w_shape[0]).astype(dtype)
    dy = rng.standard_normal((x_shape[0], w_shape[0]) + x_shape[2:]).astype(dtype)
    attrs = dict(pads=[0, 0, 0, 0], dilations=[1, 1], group=group, kernel_shape=[1, 1], strides=[1, 1],
                 threads=threads)
    assert all(isinstance(chosen(op, x_shape, w_shape, dy.shape, **attrs), PointwisePlan)
               for op in (FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT))
    y_expected, dx_expected, dw_expected = oracle(x, w, (0, 0, 0, 0), (1, 1), group, dy)
    if has_bias:
        y_expected += bias[None, :, None, None]
    y = run("Conv", [x, w, bias] if has_bias else [x, w], dy.shape, attrs, dtype)
    dx = run("ConvInputGrad", [dy, w], x.shape, attrs, dtype)
    dw = run("ConvWeightGrad", [dy, x], w.shape, attrs, dtype)
    for got, expected in ((y, y_expected), (dx, dx_expected), (dw, dw_expected)):
        scale = float(np.abs(expected).max())
        assert float(np.abs(got - expected).max()) <= TOLERANCE[dtype] * scale


def test_parts_split_the_channels_of_one_product(always_split):
    """Forward: Y's channels; input gradient: X's channels; weight gradient: the larger side of dW."""
    def plan(op, x_channels, y_channels, threads=2):
        conv = Convolution((8, x_channels, 3, 3), (y_channels, x_channels, 1, 1), (8, y_channels, 3, 3))
        return PointwisePlan(conv, threads).layout(op)

    assert list(plan(FORWARD, 16, 96).bounds) == [0, 48, 96]
    assert list(plan(INPUT_GRADIENT, 96, 16).bounds) == [0, 48, 96]
    assert not plan(WEIGHT_GRADIENT, 16, 96).split_inputs and plan(WEIGHT_GRADIENT, 96, 16).split_inputs
    assert plan(FORWARD, 16, 24).parts == 1  # fewer than 2 x MIN_CHANNELS output channels stay whole
    assert plan(FORWARD, 16, 96, threads=1).parts == 1
    assert plan(FORWARD, 16, 96).chunk == 8  # 8 images of 9 cells: one product of 72 columns


def test_the_layout_takes_only_small_pointwise_planes():
    small = dict(pads=[0, 0, 0, 0], dilations=[1, 1], group=1, kernel_shape=[1, 1], strides=[1, 1])
    def pointwise(x_shape, w_shape, y_shape, **attrs):
        return isinstance(chosen(FORWARD, x_shape, w_shape, y_shape, **attrs), PointwisePlan)

    assert pointwise((2, 8, 22, 23), (8, 8, 1, 1), (2, 8, 22, 23), **small)  # 506 cells
    assert not pointwise((2, 8, 24, 24), (8, 8, 1, 1), (2, 8, 24, 24), **small)  # 576 cells
    assert not pointwise((2, 8, 6, 6), (8, 8, 3, 3), (2, 8, 6, 6), **{**small, "pads": [1, 1, 1, 1]})
    assert not pointwise((2, 8, 6, 6), (8, 8, 1, 1), (2, 8, 3, 3), **{**small, "strides": [2, 2]})


@pytest.mark.parametrize("threads", [1, 2])
def test_a_pointwise_conv_transpose_runs_the_same_kernels(threads, always_split):
    """ConvTranspose(X, W) with a 1x1 kernel: Y[n, m] = Σ_c W[c, m] · X[n, c], and its gradients."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((6, 32, 4, 4)).astype(np.float32), rng.standard_normal((32, 48, 1, 1)).astype(np.float32)
    dy = rng.standard_normal((6, 48, 4, 4)).astype(np.float32)
    attrs = dict(kernel_shape=[1, 1], threads=threads)
    weights = w[:, :, 0, 0].astype(np.float64)
    expected = {
        "ConvTranspose": np.einsum("cm,nchw->nmhw", weights, x),
        "ConvTransposeInputGrad": np.einsum("cm,nmhw->nchw", weights, dy),
        "ConvTransposeWeightGrad": np.einsum("nchw,nmhw->cm", x, dy)[:, :, None, None],
    }
    operands = {"ConvTranspose": ([x, w], dy.shape), "ConvTransposeInputGrad": ([dy, w], x.shape),
                "ConvTransposeWeightGrad": ([dy, x], w.shape)}
    for op, (inputs, shape) in operands.items():
        domain = "" if op == "ConvTranspose" else ODTRAIN
        scratch = np.zeros(SCRATCH[(domain, op)]([(a.shape, a.dtype) for a in inputs], [(shape, np.float32)], **attrs),
                           np.uint8)
        out = np.full(shape, np.nan, np.float32)
        calls = BINDINGS[(domain, op)](inputs, [out], scratch=scratch, **attrs)
        assert all(kernel.__module__.endswith("conv.pointwise") for kernel, _ in calls)
        for kernel, args in calls:
            kernel(*args)
        scale = float(np.abs(expected[op]).max())
        assert float(np.abs(out - expected[op]).max()) <= TOLERANCE[np.float32] * scale, op

