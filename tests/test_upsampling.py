"""Upsampling ops and a model built from them: ConvTranspose, Resize, Upsample.

- forward: each op against onnx.reference.ReferenceEvaluator; where ONNX's reference is wrong or
  silent (grouped ConvTranspose with C != M, output_shape smaller than the natural output, Resize of
  opset 10, fractional Upsample), against onnxruntime; the ONNX backend node cases with their
  scales, sizes and roi given as constants;
- backward: every gradient against float64 finite differences (oracles.gradient_check; a naive
  float64 ConvTranspose where the reference cannot group);
- a small UNet (Conv, MaxPool down; Resize and ConvTranspose up; Concat skips) learns a segmentation
  mask with BCEWithLogits and AdamW, and its exported inference model agrees with onnxruntime.
"""
import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from oracles import GradientCase, make_model, reference_outputs

from odtrain import OdtrainError, artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.inference import InferenceSession

rng = np.random.default_rng(11)


def rand(*shape, low=-1.0, high=1.0):
    return rng.uniform(low, high, shape).astype(np.float32)


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), **attrs)


def floats(*values):
    return np.array(values, dtype=np.float32)


def ints(*values):
    return np.array(values, dtype=np.int64)


EMPTY = np.zeros(0, dtype=np.float32)


def odtrain_outputs(model, x):
    return InferenceSession(model).run(None, {"x": x})


def onnxruntime_outputs(model, x):
    onnxruntime = pytest.importorskip("onnxruntime")
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def assert_matches(got, expected, rtol=1e-5, atol=1e-5):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)


# ---- forward against the reference evaluator ----------------------------------------------------

X4 = rand(2, 3, 5, 4)

CONV_TRANSPOSE_CASES = {
    "bias_strides": ([node("ConvTranspose", ["x", "w", "b"], strides=[2, 2])], {"w": rand(3, 2, 3, 3), "b": rand(2)}),
    "pads_output_padding_dilations": ([node("ConvTranspose", ["x", "w"], strides=[2, 3], pads=[1, 0, 0, 2],
                                            output_padding=[1, 2], dilations=[1, 2])], {"w": rand(3, 4, 3, 2)}),
    "kernel2_stride2": ([node("ConvTranspose", ["x", "w", "b"], strides=[2, 2], kernel_shape=[2, 2])],
                        {"w": rand(3, 5, 2, 2), "b": rand(5)}),
    "depthwise": ([node("ConvTranspose", ["x", "w"], group=3, strides=[2, 2], pads=[1, 1, 1, 1])],
                  {"w": rand(3, 1, 3, 3)}),
    "depthwise_wide_rows": ([node("ConvTranspose", ["x", "w"], group=2, strides=[1, 2], pads=[1, 1, 0, 1])],
                            {"w": rand(2, 1, 3, 3)}, rand(2, 2, 3, 30)),
    "same_upper": ([node("ConvTranspose", ["x", "w"], auto_pad="SAME_UPPER", strides=[2, 2])], {"w": rand(3, 2, 3, 3)}),
    "same_lower": ([node("ConvTranspose", ["x", "w"], auto_pad="SAME_LOWER", strides=[2, 2])], {"w": rand(3, 2, 4, 3)}),
    "valid": ([node("ConvTranspose", ["x", "w"], auto_pad="VALID", strides=[2, 1])], {"w": rand(3, 2, 3, 2)}),
    "output_shape_larger": ([node("ConvTranspose", ["x", "w"], strides=[3, 2], output_shape=[15, 10])],
                            {"w": rand(3, 2, 3, 3)}),
    "pointwise": ([node("ConvTranspose", ["x", "w", "b"])], {"w": rand(3, 4, 1, 1), "b": rand(4)}),
    "1d": ([node("ConvTranspose", ["x", "w", "b"], strides=[2], pads=[1, 0], output_padding=[1])],
           {"w": rand(3, 2, 3), "b": rand(2)}, rand(2, 3, 6)),
    "3d": ([node("ConvTranspose", ["x", "w"], strides=[2, 1, 2], pads=[1, 0, 0, 0, 1, 1])],
           {"w": rand(2, 3, 2, 3, 3)}, rand(1, 2, 3, 4, 3)),
}


@pytest.mark.parametrize("name", sorted(CONV_TRANSPOSE_CASES))
def test_conv_transpose_matches_reference(name):
    nodes, initializers, *x = CONV_TRANSPOSE_CASES[name]
    x = x[0] if x else X4
    model = make_model(nodes, initializers, inputs=[("x", np.float32, x.shape)], opset=19)
    assert_matches(odtrain_outputs(model, x), reference_outputs(model, {"x": x}))


ONNXRUNTIME_CONV_TRANSPOSE_CASES = {
    # ONNX's reference slices grouped weights by output channel (wrong whenever C != M) and gives every group
    # the first group's biases
    "depthwise_bias": ([node("ConvTranspose", ["x", "w", "b"], group=3, strides=[2, 2], pads=[1, 1, 1, 1])],
                       {"w": rand(3, 1, 3, 3), "b": rand(3)}, X4),
    "groups": ([node("ConvTranspose", ["x", "w", "b"], group=2, strides=[2, 1], dilations=[1, 2])],
               {"w": rand(4, 3, 3, 2), "b": rand(6)}, rand(2, 4, 3, 5)),
    # output_shape below the natural size: the padding is derived, as the spec says (the reference fails)
    "output_shape_smaller": ([node("ConvTranspose", ["x", "w"], strides=[2, 2], output_shape=[8, 6])],
                             {"w": rand(3, 2, 3, 3)}, X4),
    "output_shape_same_upper": ([node("ConvTranspose", ["x", "w"], strides=[2, 2], output_shape=[8, 7],
                                      auto_pad="SAME_UPPER")], {"w": rand(3, 2, 3, 3)}, X4),
}


@pytest.mark.parametrize("name", sorted(ONNXRUNTIME_CONV_TRANSPOSE_CASES))
def test_conv_transpose_matches_onnxruntime(name):
    nodes, initializers, x = ONNXRUNTIME_CONV_TRANSPOSE_CASES[name]
    model = make_model(nodes, initializers, inputs=[("x", np.float32, x.shape)], opset=17)
    assert_matches(odtrain_outputs(model, x), onnxruntime_outputs(model, x))


def resize(scales=None, sizes=None, roi=None, **attrs):
    """A Resize node of opset 13+ and its constants: roi, scales and sizes inputs as PyTorch exports them."""
    inputs = ["x", "roi" if roi is not None else "", "scales" if scales is not None else ""]
    constants = {"roi": roi, "scales": scales}
    if sizes is not None:
        inputs.append("sizes")
        constants["sizes"] = sizes
    return [node("Resize", inputs, **attrs)], {k: v for k, v in constants.items() if v is not None}


def resize_case(scales=None, sizes=None, roi=None, x=None, **attrs) -> GradientCase:
    """A gradient row: x through `resize(...)` at opset 19."""
    nodes, constants = resize(scales, sizes, roi, **attrs)
    return GradientCase(nodes, {"x": x}, constants, opset=19)


UP = floats(1, 1, 2, 2)
FRACTIONAL = floats(1, 1, 1.7, 0.6)
COORDINATES = ("asymmetric", "half_pixel", "align_corners", "pytorch_half_pixel", "half_pixel_symmetric")
NEAREST = ("floor", "ceil", "round_prefer_floor", "round_prefer_ceil")

RESIZE_CASES = {f"nearest_{c}_{n}_{label}": resize(s, mode="nearest", coordinate_transformation_mode=c, nearest_mode=n)
                for c, n, (label, s) in itertools.product(COORDINATES, NEAREST, [("up", UP), ("fractional", FRACTIONAL)])}
RESIZE_CASES.update({f"{mode}_{c}_{label}": resize(s, mode=mode, coordinate_transformation_mode=c)
                     for mode, c, (label, s) in itertools.product(("linear", "cubic"), COORDINATES,
                                                                  [("up", UP), ("fractional", FRACTIONAL)])})
RESIZE_CASES.update({
    "nearest_sizes": resize(sizes=ints(2, 3, 9, 7), mode="nearest"),
    "linear_sizes_pytorch": resize(sizes=ints(2, 3, 10, 3), mode="linear",
                                   coordinate_transformation_mode="pytorch_half_pixel"),
    "linear_sizes_to_one": resize(sizes=ints(2, 3, 1, 1), mode="linear",
                                  coordinate_transformation_mode="pytorch_half_pixel"),
    "linear_antialias": resize(sizes=ints(2, 3, 2, 3), mode="linear", antialias=1),
    "cubic_antialias_exclude_outside": resize(floats(1, 1, 0.5, 0.7), mode="cubic", antialias=1, exclude_outside=1,
                                              cubic_coeff_a=-0.5),
    "nearest_axes": resize(floats(3, 2), mode="nearest", axes=[3, 2], coordinate_transformation_mode="asymmetric",
                           nearest_mode="floor"),
    "linear_not_larger": resize(sizes=ints(8, 9), mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_larger"),
    "nearest_not_smaller": resize(sizes=ints(8, 9), mode="nearest", axes=[2, 3],
                                  keep_aspect_ratio_policy="not_smaller"),
    "tf_crop_and_resize": resize(sizes=ints(2, 3, 6, 5), roi=floats(0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3), mode="linear",
                                 coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=2.5),
    "channels_and_space": resize(floats(1, 2, 1.5, 0.5), mode="linear"),
    "identity": resize(floats(1, 1, 1, 1), mode="linear"),
})


@pytest.mark.parametrize("name", sorted(RESIZE_CASES))
def test_resize_matches_reference(name):
    nodes, initializers = RESIZE_CASES[name]
    model = make_model(nodes, initializers, inputs=[("x", np.float32, X4.shape)], opset=19)
    assert_matches(odtrain_outputs(model, X4), reference_outputs(model, {"x": X4}))


@pytest.mark.parametrize("opset", [11, 13])
def test_resize_as_older_exporters_write_it(opset):
    """Opset 11 needs roi and scales even with sizes: PyTorch gives empty constants; 1-D and 5-D inputs."""
    for x, sizes, mode in [(rand(2, 3, 7), ints(2, 3, 12), "linear"), (X4, ints(2, 3, 11, 9), "nearest"),
                           (rand(1, 2, 3, 4, 3), ints(1, 2, 6, 8, 5), "linear")]:
        model = make_model([node("Resize", ["x", "roi", "scales", "sizes"], mode=mode,
                                 coordinate_transformation_mode="pytorch_half_pixel")],
                           {"roi": EMPTY, "scales": EMPTY, "sizes": sizes}, inputs=[("x", np.float32, x.shape)],
                           opset=opset)
        assert_matches(odtrain_outputs(model, x), reference_outputs(model, {"x": x}))


@pytest.mark.parametrize("scale", [2.0, 1.5, 0.6, 0.4])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_of_opset_10_and_upsample_match_onnxruntime(scale, mode):
    """Opset 10's Resize(X, scales) and Upsample use asymmetric coordinates; onnxruntime picks the nearest cell
    by floor when enlarging and ceil when shrinking (ONNX's reference evaluates neither)."""
    x = rand(2, 3, 7, 6)
    scales = floats(1, 1, scale, 2.0)
    ops = [("Resize", 10)] + ([("Upsample", 9)] if scale >= 1 else [])  # Upsample may only enlarge
    for op_type, opset in ops:
        model = make_model([node(op_type, ["x", "scales"], mode=mode)], {"scales": scales},
                           inputs=[("x", np.float32, x.shape)], opset=opset)
        assert_matches(odtrain_outputs(model, x), onnxruntime_outputs(model, x))


def _backend_cases():
    from onnx.backend.test.loader import load_model_tests

    cases = []
    for case in load_model_tests(kind="node"):
        if {n.op_type for n in case.model.graph.node} & {"Resize", "Upsample", "ConvTranspose"} and case.data_sets:
            cases.append(pytest.param(case, id=case.name))
    return cases


@pytest.mark.parametrize("case", _backend_cases())
def test_backend_node_case_with_constant_inputs(case):
    """ONNX's backend cases feed scales, sizes and roi as graph inputs (which odtrain declines: the output shape
    must be known before running); here they are initializers, as exporters write them."""
    inputs, outputs = case.data_sets[0]
    arrays = [numpy_helper.to_array(t) if isinstance(t, TensorProto) else np.asarray(t) for t in inputs]
    expected = [numpy_helper.to_array(t) if isinstance(t, TensorProto) else np.asarray(t) for t in outputs]
    model = onnx.ModelProto.FromString(case.model.SerializeToString())
    graph_inputs = list(model.graph.input)
    feeds = {graph_inputs[0].name: arrays[0]}
    for value_info, array in zip(graph_inputs[1:], arrays[1:]):
        if model.graph.node[0].op_type == "ConvTranspose":  # X and W stay inputs
            feeds[value_info.name] = array
            continue
        model.graph.initializer.append(numpy_helper.from_array(array, value_info.name))
        model.graph.input.remove(value_info)
    got = InferenceSession(model).run(None, feeds)
    assert_matches(got, expected, rtol=1e-4)


def test_unsupported_forms_are_declined_clearly():
    x = rand(1, 2, 4, 4)
    negative = make_model([node("ConvTranspose", ["x", "w"], auto_pad="SAME_UPPER", strides=[3, 3])],
                          {"w": rand(2, 2, 2, 2)}, inputs=[("x", np.float32, x.shape)])
    with pytest.raises(OdtrainError, match="negative padding"):
        InferenceSession(negative).run(None, {"x": x})
    too_large = make_model([node("ConvTranspose", ["x", "w"], strides=[2, 2], output_shape=[11, 9])],
                           {"w": rand(2, 2, 3, 3)}, inputs=[("x", np.float32, x.shape)])
    with pytest.raises(OdtrainError, match="output_shape"):
        InferenceSession(too_large).run(None, {"x": x})
    both = make_model([node("Resize", ["x", "", "s", "z"])], {"s": UP, "z": ints(1, 2, 8, 8)},
                      inputs=[("x", np.float32, x.shape)])
    with pytest.raises(OdtrainError, match="exactly one of scales and sizes"):
        InferenceSession(both).run(None, {"x": x})
    bad_mode = make_model([node("Resize", ["x", "", "s"], mode="bicubic")], {"s": UP},
                          inputs=[("x", np.float32, x.shape)])
    with pytest.raises(OdtrainError, match="mode='bicubic'"):
        InferenceSession(bad_mode).run(None, {"x": x})


def test_scales_fed_as_an_input_bind_one_plan_per_value():
    """Scales fed by the caller set the output shape: each distinct value binds its own plan."""
    x = rand(1, 2, 4, 4)
    model = make_model([node("Resize", ["x", "", "s"])], {},
                       inputs=[("x", np.float32, x.shape), ("s", np.float32, [4])])
    session = InferenceSession(model)
    for scales in (UP, floats(1, 1, 0.5, 1.5), UP):
        got = session.run(None, {"x": x, "s": scales})
        assert_matches(got, reference_outputs(model, {"x": x, "s": scales}))
    assert len(session._plans) == 2


def test_scales_that_train_or_freeze_are_refused_with_the_way_out(tmp_path):
    """Frozen parameters live in the checkpoint, not in the model, so Resize could not read its scales."""
    model = make_model([node("Resize", ["input", "", "scales"], ["up"]), node("Conv", ["up", "w"], ["output"])],
                       {"scales": UP, "w": rand(2, 2, 1, 1)}, inputs=[("input", np.float32, ["batch", 2, 3, 3])],
                       outputs=["output"])
    for selection in ({"requires_grad": ["scales", "w"]}, {"requires_grad": ["w"], "frozen_params": ["scales"]}):
        with pytest.raises(OdtrainError, match="leave it out of requires_grad and frozen_params"):
            artifacts.generate_artifacts(model, loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path,
                                         **selection)


# ---- gradients against float64 finite differences -----------------------------------------------

GRADIENT_CASES = {
    **{f"grid_sample_{mode}_{padding}_align{align}": GradientCase(
        [node("GridSample", ["x", "grid"], mode=mode, padding_mode=padding, align_corners=align)],
        {"x": rand(2, 2, 3, 4)}, {"grid": rand(2, 3, 5, 2, low=-1.3, high=1.3)}, opset=20)
       for mode, padding, align in (("linear", "zeros", 0), ("linear", "border", 1), ("linear", "reflection", 0),
                                    ("nearest", "zeros", 1), ("cubic", "reflection", 1))},
    **{f"affine_grid_{len(size) - 2}d_align{align}": GradientCase(
        # the Cast, made float64 in the float64 reference, where ONNX's AffineGrid gives float32 from float64; a large
        # step (the grid is linear in theta) keeps that float32 rounding out of the differences
        [node("AffineGrid", ["theta", "size"], ["g"], align_corners=align), node("Cast", ["g"], to=TensorProto.FLOAT)],
        {"theta": rand(2, len(size) - 2, len(size) - 1)},
        {"size": np.array(size, np.int64)}, opset=20, step=0.05)
       for size, align in (((2, 3, 4, 5), 0), ((2, 1, 2, 3, 4), 1))},
    "grid_sample_volume": GradientCase(
        [node("GridSample", ["x", "grid"], padding_mode="border")], {"x": rand(1, 2, 3, 2, 3)},
        {"grid": rand(1, 2, 2, 3, 3, low=-1.2, high=1.2)}, opset=22),
    "conv_transpose_bias_pads_output_padding": GradientCase(
        [node("ConvTranspose", ["x", "w", "b"], strides=[2, 2], pads=[1, 0, 0, 1], output_padding=[1, 0])],
        {"x": rand(2, 3, 3, 2), "w": rand(3, 2, 3, 2), "b": rand(2)}, opset=19),
    "conv_transpose_dilations_strides": GradientCase(
        [node("ConvTranspose", ["x", "w"], strides=[1, 2], dilations=[2, 1])],
        {"x": rand(2, 2, 3, 3), "w": rand(2, 3, 2, 2)}, opset=19),
    # dX is a convolution of dY (8 channels, K = 72) into 4 channels: its product runs transposed
    "conv_transpose_few_inputs_deep_kernel": GradientCase(
        [node("ConvTranspose", ["x", "w"], strides=[2, 2], pads=[1, 1, 1, 1])],
        {"x": rand(2, 4, 3, 3), "w": rand(4, 8, 3, 3)}, opset=19),
    "conv_transpose_kernel2_stride2": GradientCase(
        [node("ConvTranspose", ["x", "w", "b"], strides=[2, 2])],
        {"x": rand(3, 3, 2, 2), "w": rand(3, 2, 2, 2), "b": rand(2)}, opset=19),
    "conv_transpose_depthwise": GradientCase(
        [node("ConvTranspose", ["x", "w"], group=3, strides=[2, 2], pads=[1, 1, 1, 1])],
        {"x": rand(2, 3, 3, 3), "w": rand(3, 1, 3, 3)}, opset=19),
    "conv_transpose_depthwise_rows": GradientCase(
        [node("ConvTranspose", ["x", "w"], group=2, pads=[1, 1, 0, 1], strides=[1, 2])],
        {"x": rand(1, 2, 2, 25), "w": rand(2, 1, 2, 3)}, opset=19),
    "conv_transpose_same_upper": GradientCase(
        [node("ConvTranspose", ["x", "w"], auto_pad="SAME_UPPER", strides=[2, 2])],
        {"x": rand(1, 2, 3, 2), "w": rand(2, 2, 3, 3)}, opset=19),
    "conv_transpose_output_shape": GradientCase(
        [node("ConvTranspose", ["x", "w"], strides=[2, 2], output_shape=[8, 5])],
        {"x": rand(1, 2, 3, 2), "w": rand(2, 2, 3, 2)}, opset=19),
    "conv_transpose_pointwise": GradientCase(
        [node("ConvTranspose", ["x", "w"])], {"x": rand(2, 3, 2, 3), "w": rand(3, 2, 1, 1)}, opset=19),
    "conv_transpose_1d": GradientCase(
        [node("ConvTranspose", ["x", "w", "b"], strides=[3], pads=[1, 2], output_padding=[2])],
        {"x": rand(2, 3, 4), "w": rand(3, 2, 3), "b": rand(2)}, opset=19),
    "conv_transpose_3d": GradientCase(
        [node("ConvTranspose", ["x", "w"], strides=[2, 1, 2], pads=[1, 0, 0, 0, 1, 0])],
        {"x": rand(1, 2, 2, 2, 2), "w": rand(2, 2, 2, 2, 3)}, opset=19),
    "resize_nearest_asymmetric_floor": resize_case(
        UP, mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor", x=rand(2, 3, 3, 2)),
    "resize_nearest_half_pixel_fractional": resize_case(floats(1, 1, 1.5, 0.6), mode="nearest", x=rand(2, 2, 3, 5)),
    "resize_nearest_sizes_round_prefer_ceil": resize_case(
        sizes=ints(1, 2, 7, 2), mode="nearest", nearest_mode="round_prefer_ceil",
        coordinate_transformation_mode="align_corners", x=rand(1, 2, 3, 4)),
    "resize_bilinear_pytorch_half_pixel": resize_case(
        UP, mode="linear", coordinate_transformation_mode="pytorch_half_pixel", x=rand(2, 2, 3, 3)),
    "resize_bilinear_align_corners_sizes": resize_case(
        sizes=ints(2, 2, 5, 4), mode="linear", coordinate_transformation_mode="align_corners", x=rand(2, 2, 3, 3)),
    "resize_linear_half_pixel_down": resize_case(floats(1, 1, 0.6, 1.4), mode="linear", x=rand(1, 2, 5, 3)),
    "resize_linear_antialias": resize_case(floats(1, 1, 0.5, 0.6), mode="linear", antialias=1, x=rand(1, 2, 6, 5)),
    "resize_cubic": resize_case(floats(1, 1, 1.6, 0.8), mode="cubic", exclude_outside=1, x=rand(1, 2, 3, 5)),
    "resize_linear_channels_and_space": resize_case(floats(1, 1.5, 2, 0.7), mode="linear", x=rand(1, 2, 2, 4)),
    "resize_linear_1d_axes": resize_case(floats(2.5), mode="linear", axes=[2], x=rand(2, 3, 4)),
    "resize_tf_crop_and_resize": resize_case(
        sizes=ints(1, 2, 4, 4), roi=floats(0, 0, -0.3, 0.2, 1, 1, 0.8, 1.2), mode="linear",
        coordinate_transformation_mode="tf_crop_and_resize", x=rand(1, 2, 3, 4)),
    # opset 9, where the reference evaluates Upsample for integer nearest scales
    "upsample_nearest": GradientCase([node("Upsample", ["x", "scales"], mode="nearest")], {"x": rand(2, 2, 3, 2)},
                                     {"scales": floats(1, 1, 2, 3)}, opset=9),
}


@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_gradient(name, tmp_path):
    GRADIENT_CASES[name].check(tmp_path)


def _naive_conv_transpose(x, w, b, strides, begin, dilations, group, out_spatial):
    """y[n, g·M/G + m, i·s + k·d - p] += x[n, c, i] · w[c, m, k] for every c of group g, in float64."""
    channels, per_group = x.shape[1], w.shape[1]
    y = np.zeros((x.shape[0], per_group * group) + tuple(out_spatial))
    for c in range(channels):
        g = c // (channels // group)
        for i in np.ndindex(*x.shape[2:]):
            for k in np.ndindex(*w.shape[2:]):
                o = tuple(i[a] * strides[a] + k[a] * dilations[a] - begin[a] for a in range(len(i)))
                if all(0 <= o[a] < out_spatial[a] for a in range(len(o))):
                    y[(slice(None), slice(g * per_group, (g + 1) * per_group)) + o] += np.outer(x[(slice(None), c) + i],
                                                                                                w[(c, slice(None)) + k])
    return y + b.reshape((1, -1) + (1,) * len(out_spatial))


def test_conv_transpose_input_gradient_in_one_image_products(tmp_path):
    """dX of a stride-1 ConvTranspose is the convolution of dY by W. From 8 channels into 4 over 24x24 cells
    (one image per product) that product runs transposed, in the work memory its scratch rule reserves."""
    x, w, r = rand(1, 4, 24, 24), rand(4, 8, 3, 3), rand(1, 8, 24, 24)
    nodes = [node("ConvTranspose", ["x", "w"], ["t"], pads=[1, 1, 1, 1]), node("Mul", ["t", "r"], ["tr"]),
             node("ReduceSum", ["tr"], ["loss"], keepdims=0)]
    model = make_model(nodes, {"x": x, "w": w, "r": r}, outputs=[("loss", np.float32, [])], opset=19)
    artifacts.generate_artifacts(model, requires_grad=["x"], loss=None, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    Module(tmp_path / "training_model.onnx", state)()
    r64, w64 = r.astype(np.float64), w.astype(np.float64)
    expected = reference_outputs(make_model([node("Conv", ["r", "w"], pads=[1, 1, 1, 1])], {"r": r64, "w": w64}))[0]
    # float32 sums of 72 products of values in [-1, 1] (|dX| up to ~10): measured within 3.2e-6 of float64 (3 seeds)
    np.testing.assert_allclose(state.parameters["x"].grad, expected, rtol=0, atol=2e-5)


def test_gradient_of_grouped_conv_transpose(tmp_path):
    """Groups with C != M and biases, which ONNX's reference gets wrong: a naive float64 ConvTranspose is the
    oracle."""
    x, w, b = rand(2, 4, 3, 2), rand(4, 3, 2, 3), rand(6)
    attrs = dict(group=2, strides=[2, 1], pads=[1, 0, 0, 1], dilations=[1, 2])
    weights = rand(2, 6, 5, 5)
    model = make_model([node("ConvTranspose", ["x", "w", "b"], **attrs), node("Mul", ["y", "r"], ["yr"]),
                        node("ReduceSum", ["yr"], ["loss"], keepdims=0)], {"x": x, "w": w, "b": b, "r": weights},
                       outputs=[("loss", np.float32, [])])
    artifacts.generate_artifacts(model, requires_grad=["x", "w", "b"], loss=None, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    loss = Module(tmp_path / "training_model.onnx", state)()

    def loss64(values):
        y = _naive_conv_transpose(values["x"], values["w"], values["b"], [2, 1], [1, 0], [1, 2], 2, (5, 5))
        return float(np.sum(y * weights))

    params = {"x": x.astype(np.float64), "w": w.astype(np.float64), "b": b.astype(np.float64)}
    np.testing.assert_allclose(float(loss), loss64(params), rtol=1e-5)
    for name, value in params.items():
        numeric = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            for sign in (1, -1):
                shifted = value.copy()
                shifted[index] += sign * 1e-3  # the loss is linear in each parameter
                numeric[index] += sign * loss64({**params, name: shifted}) / 2e-3
        np.testing.assert_allclose(state.parameters[name].grad, numeric, rtol=1e-4, atol=1e-5, err_msg=name)


def _op_types(path):
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def test_gradients_are_emitted_only_where_wanted(tmp_path):
    """An image fed to the model needs no input gradient; a frozen bias no bias gradient; a Resize of the image
    none at all."""
    nodes = [node("Resize", ["input", "", "scales"], ["big"], mode="nearest"),
             node("ConvTranspose", ["big", "w", "b"], ["output"], strides=[2, 2])]
    model = make_model(nodes, {"scales": UP, "w": rand(2, 3, 2, 2), "b": rand(3)},
                       inputs=[("input", np.float32, ["batch", 2, 3, 3])], outputs=["output"])
    artifacts.generate_artifacts(model, requires_grad=["w"], frozen_params=["b"],
                                 loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    ops = _op_types(tmp_path / "training_model.onnx")
    assert "ConvTransposeWeightGrad" in ops
    assert not {"ConvTransposeInputGrad", "ConvBiasGrad", "ResizeGrad"} & set(ops)


# ---- a small UNet learns a segmentation mask ---------------------------------------------------

SIDE = 16


def _conv(name, cin, cout, k=3):
    scale = np.sqrt(2.0 / (cin * k * k))
    return {f"{name}.weight": (rng.standard_normal((cout, cin, k, k)) * scale).astype(np.float32),
            f"{name}.bias": np.zeros(cout, np.float32)}


def build_unet(up_mode: str) -> onnx.ModelProto:
    """Conv-Relu-MaxPool twice down, a bottleneck, then up by Resize (nearest as PyTorch's nn.Upsample exports it,
    or bilinear) and by a stride-2 ConvTranspose, each followed by a Concat skip and Conv-Relu; logits [N, 1, H, W]."""
    params = {}
    for name, cin, cout in [("enc1", 1, 8), ("enc2", 8, 16), ("mid", 16, 16), ("dec2", 32, 16), ("dec1", 16, 8)]:
        params.update(_conv(name, cin, cout))
    params.update(_conv("head", 8, 1, k=1))
    params["up1.weight"] = (rng.standard_normal((16, 8, 2, 2)) * 0.25).astype(np.float32)  # [C, M, kh, kw]
    params["up1.bias"] = np.zeros(8, np.float32)
    params["up2.scales"] = UP

    def conv_relu(name, source):
        return [node("Conv", [source, f"{name}.weight", f"{name}.bias"], [f"{name}.conv"], pads=[1, 1, 1, 1]),
                node("Relu", [f"{name}.conv"], [name])]

    if up_mode == "nearest":
        up2 = node("Resize", ["mid", "", "up2.scales"], ["up2"], mode="nearest",
                   coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    else:
        up2 = node("Resize", ["mid", "", "up2.scales"], ["up2"], mode="linear",
                   coordinate_transformation_mode="pytorch_half_pixel")
    nodes = (conv_relu("enc1", "input")
             + [node("MaxPool", ["enc1"], ["pool1"], kernel_shape=[2, 2], strides=[2, 2])]
             + conv_relu("enc2", "pool1")
             + [node("MaxPool", ["enc2"], ["pool2"], kernel_shape=[2, 2], strides=[2, 2])]
             + conv_relu("mid", "pool2")
             + [up2, node("Concat", ["up2", "enc2"], ["cat2"], axis=1)]
             + conv_relu("dec2", "cat2")
             + [node("ConvTranspose", ["dec2", "up1.weight", "up1.bias"], ["up1"], strides=[2, 2]),
                node("Concat", ["up1", "enc1"], ["cat1"], axis=1)]
             + conv_relu("dec1", "cat1")
             + [node("Conv", ["dec1", "head.weight", "head.bias"], ["output"])])
    return make_model(nodes, params, inputs=[("input", np.float32, ["batch", 1, SIDE, SIDE])],
                      outputs=[("output", np.float32, ["batch", 1, SIDE, SIDE])], opset=17)


def segmentation_batch(generator, count):
    """Noisy images with 1 to 3 bright rectangles; the mask marks the rectangles' pixels."""
    images = generator.normal(0.0, 0.35, (count, 1, SIDE, SIDE)).astype(np.float32)
    masks = np.zeros((count, 1, SIDE, SIDE), np.float32)
    for n in range(count):
        for _ in range(generator.integers(1, 4)):
            top, left = generator.integers(0, SIDE - 3, size=2)
            height, width = generator.integers(3, 8, size=2)
            masks[n, 0, top:top + height, left:left + width] = 1.0
    return images + masks, masks


@pytest.mark.parametrize("up_mode", ["nearest", "linear"])
def test_unet_learns_a_mask_and_exports(up_mode, tmp_path):
    model = build_unet(up_mode)
    trainable = [t.name for t in model.graph.initializer if not t.name.endswith("scales")]  # scales stay constant
    artifacts.generate_artifacts(model, requires_grad=trainable,
                                 loss=artifacts.LossType.BCEWithLogitsLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path, additional_output_names=["output"])
    ops = _op_types(tmp_path / "training_model.onnx")
    assert {"ResizeGrad", "ConvTransposeInputGrad", "ConvTransposeWeightGrad"} <= set(ops)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.01)
    generator = np.random.default_rng(3)
    module.train()
    losses = []
    for _ in range(60):
        images, masks = segmentation_batch(generator, 8)
        loss, _ = module(images, masks)
        losses.append(float(loss))
        optimizer.step()
        module.lazy_reset_grad()
    start, end = np.mean(losses[:3]), np.mean(losses[-5:])
    assert end < 0.5 * start, losses

    images, masks = segmentation_batch(np.random.default_rng(99), 6)
    module.eval()
    _, logits = module(images, masks)
    assert ((logits > 0) == (masks > 0.5)).mean() > 0.9
    path = tmp_path / "inference.onnx"
    module.export_model_for_inferencing(path, ["output"])
    assert {"Resize", "ConvTranspose"} <= set(_op_types(path)) and not {"ResizeGrad"} & set(_op_types(path))
    onnxruntime = pytest.importorskip("onnxruntime")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"input": images})
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_unet_training_step_allocates_nothing(tmp_path):
    """Counted by Numba's runtime (NUMBA_NRT_STATS=1) in a fresh process, as tests/test_planner.py does: each
    kernel call registers its array arguments and allocates nothing of its own."""
    for up_mode in ("nearest", "linear"):
        trainable = [t.name for t in build_unet(up_mode).graph.initializer if not t.name.endswith("scales")]
        artifacts.generate_artifacts(build_unet(up_mode), requires_grad=trainable,
                                     loss=artifacts.LossType.BCEWithLogitsLoss, artifact_directory=tmp_path / up_mode)
    images, masks = segmentation_batch(np.random.default_rng(5), 4)
    np.savez(tmp_path / "batch.npz", images=images, masks=masks)
    script = textwrap.dedent(f"""
        import numpy as np
        from numba.core.runtime import rtsys
        from odtrain.api import CheckpointState, Module
        batch = np.load({str(tmp_path / "batch.npz")!r})
        x, y = batch["images"], batch["masks"]
        for mode in ("nearest", "linear"):
            d = {str(tmp_path)!r} + "/" + mode
            module = Module(d + "/training_model.onnx", CheckpointState.load_checkpoint(d + "/checkpoint"))
            for _ in range(2):
                module(x, y)
            bound = next(iter(module._train.plans.values()))
            for view, value in zip(bound.feed_views, (x, y)):
                view[...] = value
            extra = []
            for kernel, args in bound.calls:
                before = rtsys.get_allocation_stats().alloc
                kernel(*args)
                extra.append(rtsys.get_allocation_stats().alloc - before - sum(isinstance(a, np.ndarray) for a in args))
            print(len(extra), max(extra), min(extra))
    """)
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for line in result.stdout.split("\n")[:2]:
        calls, most, least = (int(v) for v in line.split())
        assert calls > 20 and most == 0 and least == 0, result.stdout


def test_every_parameter_default_leaves_resize_scales_as_constants(tmp_path):
    """requires_grad=None trains every parameter a gradient reaches; Resize's float scales stay in the model."""
    from onnx import helper

    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module
    from oracles import make_model

    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["c", "", "scales"], ["y"], mode="nearest")]
    model = make_model(nodes, {"w": np.full((2, 1, 3, 3), 0.1, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)},
                       inputs=[("x", np.float32, ["batch", 1, 4, 4])], outputs=[("y", np.float32, ["batch", 2, 8, 8])])
    artifacts.generate_artifacts(model, loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert list(state.parameters) == ["w"]
    module = Module(tmp_path / "training_model.onnx", state)
    module(np.ones((2, 1, 4, 4), np.float32), np.zeros((2, 2, 8, 8), np.float32))
    assert np.abs(state.parameters["w"].grad).sum() > 0
