"""Convolutions on the tap kernels (kernels/conv/taps.py: one product per kernel tap over the padded image):
forward, input gradient and weight gradient against a float64 numpy oracle written from the definition,
serial and in parallel parts, float32 and float64, with asymmetric pads, dilations, groups and non-square
kernels; a stride-1 ConvTranspose (run on the same kernels, X and Y exchanged) against its definition;
which convolutions the layout sends there; and shapes on either side of each size that picks a convolution's
strategy (the taps' channels and widths, depthwise's plane width), each side against the definition.

Tolerances: float32 results against the float64 oracle differ by at most 1.8e-7 of the largest magnitude
here (sums of 16-240 products); 2e-6 leaves a factor of 10 and still fails a wrong tap, pad or channel,
which moves whole terms. float64: 1e-12 (measured 7e-16).
"""
import numpy as np
import pytest

from odtrain.kernels import BINDINGS, SCRATCH
from odtrain.kernels.conv import _plan, conv_scratch, strategy
from odtrain.kernels.conv.depthwise import PLANE_WIDTH
from odtrain.kernels.conv.taps import TAP_MIN_CHANNELS, TAP_MIN_WEIGHT_WIDTH, TAP_MIN_WIDTH, TapPlan
from odtrain.kernels.windows import FORWARD, WEIGHT_GRADIENT, Convolution

ODTRAIN = "ai.odtrain"
TOLERANCE = {np.float32: 2e-6, np.float64: 1e-12}
CASES = [  # x shape, w shape, pads (ONNX order: top, left, bottom, right), dilations, group, bias
    ((2, 16, 20, 18), (16, 16, 3, 3), (1, 1, 1, 1), (1, 1), 1, True),
    ((3, 16, 17, 21), (24, 16, 3, 3), (0, 2, 1, 0), (1, 1), 1, False),
    ((2, 32, 20, 24), (8, 16, 5, 3), (2, 1, 2, 1), (2, 1), 2, True),
    ((4, 16, 18, 30), (16, 16, 1, 3), (0, 1, 0, 1), (1, 2), 1, True),
    ((3, 32, 9, 10), (64, 32, 3, 3), (1, 1, 1, 1), (1, 1), 1, False),  # 10 wide: dW on im2col
]


def oracle(x, w, pads, dilations, group, dy):
    """(y, dx, dw) in float64 from the definition: y[n, m] = Σ_c Σ_(i, j) w[m, c, i, j] · xpad[n, c, shifted]."""
    batch, channels, height, width = x.shape
    out_channels, per_group, kh, kw = w.shape
    out_per_group = out_channels // group
    top, left, bottom, right = pads
    xpad = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    out_h = height + top + bottom - (kh - 1) * dilations[0]
    out_w = width + left + right - (kw - 1) * dilations[1]
    y, dw, dxpad = np.zeros((batch, out_channels, out_h, out_w)), np.zeros(w.shape), np.zeros_like(xpad)
    for g in range(group):
        ins, outs = slice(g * per_group, (g + 1) * per_group), slice(g * out_per_group, (g + 1) * out_per_group)
        d = dy[:, outs].astype(np.float64)
        for i in range(kh):
            for j in range(kw):
                rows = slice(i * dilations[0], i * dilations[0] + out_h)
                cols = slice(j * dilations[1], j * dilations[1] + out_w)
                tap = w[outs, :, i, j].astype(np.float64)
                y[:, outs] += np.einsum("mc,nchw->nmhw", tap, xpad[:, ins, rows, cols])
                dw[outs, :, i, j] += np.einsum("nmhw,nchw->mc", d, xpad[:, ins, rows, cols])
                dxpad[:, ins, rows, cols] += np.einsum("mc,nmhw->nchw", tap, d)
    return y, dxpad[:, :, top:top + height, left:left + width], dw


def chosen(op, x_shape, w_shape, y_shape, threads=1, **attrs):
    """The plan that kernels/conv/__init__.py's one choice (`strategy`) gives `op` of the convolution of X by W into Y."""
    return strategy(op, Convolution(x_shape, w_shape, y_shape, **attrs), threads)


def run(op, inputs, out_shape, attrs, dtype):
    out = np.full(out_shape, np.nan, dtype)
    scratch = np.zeros(conv_scratch(op)([(a.shape, a.dtype) for a in inputs], [(out_shape, dtype)], **attrs),
                       np.uint8)
    domain = "" if op == "Conv" else ODTRAIN
    for kernel, args in BINDINGS[(domain, op)](inputs, [out], scratch=scratch, **attrs):
        kernel(*args)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("x_shape, w_shape, pads, dilations, group, has_bias", CASES)
def test_tap_kernels_match_the_definition(x_shape, w_shape, pads, dilations, group, has_bias, dtype, threads):
    rng = np.random.default_rng(sum(x_shape) + sum(w_shape))
    x, w = rng.standard_normal(x_shape).astype(dtype), rng.standard_normal(w_shape).astype(dtype)
    bias = rng.standard_normal(w_shape[0]).astype(dtype)
    attrs = dict(pads=list(pads), dilations=list(dilations), group=group, kernel_shape=list(w_shape[2:]),
                 strides=[1, 1], threads=threads)
    out_h = x_shape[2] + pads[0] + pads[2] - (w_shape[2] - 1) * dilations[0]
    out_w = x_shape[3] + pads[1] + pads[3] - (w_shape[3] - 1) * dilations[1]
    dy = rng.standard_normal((x_shape[0], w_shape[0], out_h, out_w)).astype(dtype)
    forward, weights = (chosen(op, x_shape, w_shape, dy.shape, **attrs) for op in (FORWARD, WEIGHT_GRADIENT))
    weights_by_taps = isinstance(weights, TapPlan)
    assert isinstance(forward, TapPlan) and weights_by_taps == (dy.shape[3] >= 16)
    assert forward.parts == min(threads, x_shape[0])
    y_expected, dx_expected, dw_expected = oracle(x, w, pads, dilations, group, dy)
    if has_bias:
        y_expected += bias[None, :, None, None]
    y = run("Conv", [x, w, bias] if has_bias else [x, w], dy.shape, attrs, dtype)
    dx = run("ConvInputGrad", [dy, w], x_shape, attrs, dtype)
    checks = [(y, y_expected), (dx, dx_expected)]
    if weights_by_taps or dtype == np.float32:  # float64 runs only forward on im2col (integer convs)
        checks.append((run("ConvWeightGrad", [dy, x], w_shape, attrs, dtype), dw_expected))
    for got, expected in checks:
        assert np.abs(got - expected).max() <= TOLERANCE[dtype] * np.abs(expected).max()


def _definition_checks(x_shape, w_shape, group, threads):
    """(plans of the forward and weight gradient, [(got, expected)] of Y, dX and dW) of a float32 convolution
    of X by W (3x3, pads 1, stride 1) through the bindings, against the float64 oracle."""
    rng = np.random.default_rng(sum(x_shape) + sum(w_shape))
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    dy = rng.standard_normal((x_shape[0], w_shape[0]) + x_shape[2:]).astype(np.float32)
    attrs = dict(pads=[1, 1, 1, 1], group=group, kernel_shape=[3, 3], strides=[1, 1], threads=threads)
    plans = {op: chosen(op, x_shape, w_shape, dy.shape, **attrs) for op in (FORWARD, WEIGHT_GRADIENT)}
    expected = oracle(x, w, (1, 1, 1, 1), (1, 1), group, dy)
    got = (run("Conv", [x, w], dy.shape, attrs, np.float32), run("ConvInputGrad", [dy, w], x_shape, attrs, np.float32),
           run("ConvWeightGrad", [dy, x], w_shape, attrs, np.float32))
    return plans, list(zip(got, expected))


# Each size that sends a convolution to another strategy, crossed: the shapes one below and at the threshold
# (kernels/conv/taps.py's TAP_MIN_CHANNELS, TAP_MIN_WIDTH, TAP_MIN_WEIGHT_WIDTH) take the two strategies, and
# both compute the definition.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("below, at, which", [
    ((2, TAP_MIN_CHANNELS - 1, 9, 12), (2, TAP_MIN_CHANNELS, 9, 12), FORWARD),
    ((2, 16, 9, TAP_MIN_WIDTH - 1), (2, 16, 9, TAP_MIN_WIDTH), FORWARD),
    ((2, 16, 5, TAP_MIN_WEIGHT_WIDTH - 1), (2, 16, 5, TAP_MIN_WEIGHT_WIDTH), WEIGHT_GRADIENT),
])
def test_convolutions_either_side_of_a_tap_threshold_match_the_definition(below, at, which, threads):
    for x_shape, taps in ((below, False), (at, True)):
        plans, checks = _definition_checks(x_shape, (8, x_shape[1], 3, 3), 1, threads)
        assert isinstance(plans[which], TapPlan) == taps, x_shape
        for got, expected in checks:
            assert np.abs(got - expected).max() <= TOLERANCE[np.float32] * np.abs(expected).max(), x_shape


@pytest.mark.parametrize("threads", [1, 2])
def test_depthwise_convolutions_either_side_of_the_plane_width_match_the_definition(threads):
    """kernels/conv/depthwise.py runs outputs narrower than PLANE_WIDTH channels-last, wider ones in planes."""
    for width, channels_last in ((PLANE_WIDTH - 1, True), (PLANE_WIDTH, False)):
        plans, checks = _definition_checks((2, 8, 5, width), (8, 1, 3, 3), 8, threads)
        assert all(plan.channels_last == channels_last for plan in plans.values()), width
        for got, expected in checks:
            assert np.abs(got - expected).max() <= TOLERANCE[np.float32] * np.abs(expected).max(), width


def test_the_parts_give_the_bits_of_each_thread_count_every_time():
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((5, 16, 18, 18)).astype(np.float32), rng.standard_normal((5, 16, 18, 18))
    attrs = dict(pads=[1, 1, 1, 1], kernel_shape=[3, 3], threads=2)
    first, second = (run("ConvWeightGrad", [dy.astype(np.float32), x], (16, 16, 3, 3), attrs, np.float32)
                     for _ in range(2))
    assert np.array_equal(first, second)


def conv_transpose_oracle(x, w, pads, dilations, output_padding):
    """Stride-1 ConvTranspose in float64 from its definition (one group): y[n, o, i + ki·d - top, ...] +=
    x[n, c, i, j] · w[c, o, ki, kj], on a plane large enough for every term, then cut to the output."""
    batch, _, height, width = x.shape
    _, outs, kh, kw = w.shape
    top, left, bottom, right = pads
    out_h = height - 1 + (kh - 1) * dilations[0] + 1 + output_padding[0] - top - bottom
    out_w = width - 1 + (kw - 1) * dilations[1] + 1 + output_padding[1] - left - right
    full = np.zeros((batch, outs, height + (kh - 1) * dilations[0] + out_h, width + (kw - 1) * dilations[1] + out_w))
    for ki in range(kh):
        for kj in range(kw):
            full[:, :, ki * dilations[0]:ki * dilations[0] + height, kj * dilations[1]:kj * dilations[1] + width] += (
                np.einsum("nchw,co->nohw", x.astype(np.float64), w[:, :, ki, kj].astype(np.float64)))
    return full[:, :, top:top + out_h, left:left + out_w]


@pytest.mark.parametrize("pads, output_padding, taps", [([1, 0, 1, 2], [0, 0], True), ([1, 0, 1, 2], [1, 1], True),
                                                        ([1, 1, 0, 0], [1, 1], False)])
def test_stride_one_conv_transpose_matches_its_definition(pads, output_padding, taps):
    """A stride-1 ConvTranspose is a convolution's input gradient (X and Y exchanged). Output padding past
    the end pads (allowed with a dilation of 2) leaves its last cells outside the padded planes, which the
    tap kernels do not hold: the layout keeps that one on im2col."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((2, 16, 17, 19)).astype(np.float32), rng.standard_normal((16, 16, 3, 3)).astype(
        np.float32)
    attrs = dict(pads=pads, dilations=[2, 2], output_padding=output_padding)
    expected = conv_transpose_oracle(x, w, pads, [2, 2], output_padding)
    assert isinstance(_plan("ConvTranspose", x.shape, w.shape, expected.shape, **attrs)[2], TapPlan) == taps
    out = np.full(expected.shape, np.nan, np.float32)
    size = SCRATCH[("", "ConvTranspose")]([(x.shape, x.dtype), (w.shape, w.dtype)], [(expected.shape, np.float32)],
                                          **attrs)
    for kernel, args in BINDINGS[("", "ConvTranspose")]([x, w], [out], scratch=np.zeros(size, np.uint8), **attrs):
        kernel(*args)
    assert np.abs(out - expected).max() <= TOLERANCE[np.float32] * np.abs(expected).max()


@pytest.mark.parametrize("x_shape, w_shape, strides, taps", [
    ((8, 16, 32, 32), (16, 16, 3, 3), [1, 1], (True, True)),  # the cnn model's first block
    ((8, 16, 8, 8), (64, 16, 3, 3), [1, 1], (True, False)),  # 8 wide: the weight gradient on im2col
    ((8, 16, 4, 4), (64, 16, 3, 3), [1, 1], (False, False)),  # 4 wide: im2col
    ((8, 3, 32, 32), (16, 3, 3, 3), [1, 1], (False, False)),  # 3 input channels: products too thin
    ((8, 16, 32, 32), (16, 16, 3, 3), [2, 2], (False, False)),  # strided
    ((8, 16, 32, 32), (16, 16, 1, 1), [1, 1], (False, False)),  # pointwise: one product already
    ((8, 32, 32, 32), (32, 1, 3, 3), [1, 1], (False, False)),  # depthwise
])
def test_which_convolutions_run_on_taps(x_shape, w_shape, strides, taps):
    out = [(x_shape[2] + 2 - w_shape[2]) // strides[0] + 1, (x_shape[3] + 2 - w_shape[3]) // strides[1] + 1]
    pads = [1, 1, 1, 1] if w_shape[2] == 3 else [0, 0, 0, 0]
    if w_shape[2] == 1:
        out = [x_shape[2], x_shape[3]]
    plans = (chosen(op, x_shape, w_shape, (x_shape[0], w_shape[0], *out), group=x_shape[1] // w_shape[1],
                    pads=pads, strides=strides, threads=2) for op in (FORWARD, WEIGHT_GRADIENT))
    assert tuple(isinstance(plan, TapPlan) for plan in plans) == taps
