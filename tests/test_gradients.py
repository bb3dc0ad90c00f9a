"""Every gradient rule against float64 finite differences of ONNX's reference evaluator: one table.

`GRADIENT_CASES` maps a case name to a `GradientCase` row (tests/oracles.py): nodes, parameters,
constants. tests/test_registry.py reads the op types of its rows (and of the vision and upsampling
tables) to prove that every gradient rule has a case.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from oracles import OPSET, GradientCase

rng = np.random.default_rng(42)


def rand(*shape, low=-1.0, high=1.0):
    return rng.uniform(low, high, shape).astype(np.float32)


def away_from_zero(*shape):
    x = rand(*shape)
    return (np.sign(x) * (np.abs(x) + 0.2)).astype(np.float32)


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), **attrs)


def i64(*values):
    return np.array(values, np.int64)


def f32(value):
    return np.array(value, np.float32)


GRADIENT_CASES: dict[str, GradientCase] = {}

# ---- arithmetic, with broadcasting ----------------------------------------------------------------

for _op in ("Add", "Sub", "Mul", "Div"):
    for _a, _b in [((2, 3), (2, 3)), ((2, 3), (3,)), ((2, 1, 3), (4, 1)), ((1,), (2, 3))]:
        GRADIENT_CASES[f"{_op} {_a} {_b}"] = GradientCase(
            [node(_op, ["a", "b"])], {"a": rand(*_a), "b": away_from_zero(*_b) if _op == "Div" else rand(*_b)})

for _slope in ((3, 1, 1), (2, 3, 4, 5)):
    GRADIENT_CASES[f"PRelu slope {_slope}"] = GradientCase(
        [node("PRelu", ["x", "slope"])], {"x": away_from_zero(2, 3, 4, 5), "slope": rand(*_slope)})

# One input per unary op, inside its domain and away from its kinks.
UNARY_INPUTS = {
    "Neg": rand(2, 3), "Abs": away_from_zero(2, 3), "Exp": rand(2, 3), "Log": rand(2, 3, low=0.5, high=2.0),
    "Sqrt": rand(2, 3, low=0.5, high=2.0), "Reciprocal": away_from_zero(2, 3), "Relu": away_from_zero(2, 3),
    "Sigmoid": rand(2, 3, low=-3, high=3), "Tanh": rand(2, 3, low=-2, high=2), "Identity": rand(2, 3),
    "Erf": rand(2, 3, low=-2, high=2), "Atan": rand(2, 3, low=-2, high=2), "Sin": rand(2, 3, low=-4, high=4),
    "Cos": rand(2, 3, low=-4, high=4), "Tan": rand(2, 3, low=-1.2, high=1.2), "Sinh": rand(2, 3, low=-2, high=2),
    "Cosh": rand(2, 3, low=-2, high=2), "Asin": rand(2, 3, low=-0.8, high=0.8), "Acos": rand(2, 3, low=-0.8, high=0.8),
    "Atanh": rand(2, 3, low=-0.8, high=0.8), "Asinh": rand(2, 3, low=-2, high=2), "Acosh": rand(2, 3, low=1.2, high=3),
    "Softplus": rand(2, 3, low=-3, high=3), "Softsign": away_from_zero(2, 3), "Mish": rand(2, 3, low=-3, high=3),
}
for _op, _x in UNARY_INPUTS.items():
    # ONNX's reference Erf rounds to float32: a larger step keeps its rounding out of the differences
    GRADIENT_CASES[_op] = GradientCase([node(_op, ["x"])], {"x": _x}, step=1e-3 if _op == "Erf" else 1e-6,
                                       opset=18 if _op == "Mish" else OPSET)  # Mish is an op from opset 18

GRADIENT_CASES["Sum of three, broadcast"] = GradientCase(
    [node("Sum", ["a", "b", "c"])], {"a": rand(2, 3), "b": rand(3), "c": rand(2, 1)})
GRADIENT_CASES["chain with fan-out"] = GradientCase(  # x feeds Mul and Add: it receives the sum of both gradients
    [node("Mul", ["x", "w"], ["h"]), node("Tanh", ["h"], ["t"]), node("Add", ["t", "x"], ["y"])],
    {"x": rand(2, 3), "w": rand(3)})
GRADIENT_CASES["Pow"] = GradientCase([node("Pow", ["a", "b"])],
                                     {"a": rand(2, 3, low=0.5, high=2.0), "b": rand(3, low=-1.5, high=2.0)})
for _op in ("Max", "Min"):
    GRADIENT_CASES[f"{_op} of three, broadcast"] = GradientCase(
        [node(_op, ["a", "b", "c"])], {"a": rand(2, 3), "b": rand(3), "c": rand(2, 1)})
for _approximate in ("none", "tanh"):  # the reference's erf rounds to float32
    GRADIENT_CASES[f"Gelu {_approximate}"] = GradientCase(
        [node("Gelu", ["x"], approximate=_approximate)], {"x": rand(2, 5, low=-3, high=3)}, opset=20, step=1e-3)
GRADIENT_CASES["Erf GELU as exported"] = GradientCase(  # PyTorch's exact GELU: x · (erf(x / √2) + 1) · 0.5
    [node("Div", ["x", "root2"], ["d"]), node("Erf", ["d"], ["e"]), node("Add", ["e", "one"], ["a"]),
     node("Mul", ["x", "a"], ["m"]), node("Mul", ["m", "half"])], {"x": rand(3, 4, low=-3, high=3)},
    {"root2": f32(1.4142135), "one": f32(1.0), "half": f32(0.5)}, step=1e-3, fuses_into=("Gelu",))
for _order in (["x", "s"], ["s", "x"]):  # PyTorch's SiLU before opset 24: x · sigmoid(x), either operand first
    GRADIENT_CASES[f"SiLU as exported, Mul({', '.join(_order)})"] = GradientCase(
        [node("Sigmoid", ["x"], ["s"]), node("Mul", _order)], {"x": rand(3, 4, low=-6, high=6)}, fuses_into=("Swish",))
GRADIENT_CASES["comparison mask"] = GradientCase(  # x · Where(x > 0, 1, 0): Greater has no gradient, Where passes it
    [node("Greater", ["x", "zero"], ["positive"]), node("Where", ["positive", "one", "zero"], ["mask"]),
     node("Mul", ["x", "mask"])], {"x": away_from_zero(2, 3)}, {"zero": f32(0.0), "one": f32(1.0)})
GRADIENT_CASES["Cast between float types"] = GradientCase(  # through float64 kernels
    [node("Cast", ["x"], ["x64"], to=TensorProto.DOUBLE), node("Mul", ["x64", "w"], ["m"]),
     node("Cast", ["m"], to=TensorProto.FLOAT)], {"x": rand(2, 3)}, {"w": rng.uniform(-1, 1, 3)})

# ---- products -------------------------------------------------------------------------------------

for _trans_a in (0, 1):
    for _trans_b in (0, 1):
        for _bias in [(4,), (3, 4), (1, 4), (3, 1), None]:
            _params = {"a": rand(*((2, 3) if _trans_a else (3, 2))), "b": rand(*((4, 2) if _trans_b else (2, 4)))}
            if _bias is not None:
                _params["c"] = rand(*_bias)
            GRADIENT_CASES[f"Gemm transA={_trans_a} transB={_trans_b} bias {_bias}"] = GradientCase(
                [node("Gemm", list(_params), transA=_trans_a, transB=_trans_b, alpha=0.7, beta=1.3)], _params)
for _a, _b in [((3, 4), (4, 2)), ((2, 3, 4), (4, 2)), ((2, 3, 4), (2, 4, 5)), ((1, 3, 4), (2, 4, 2)),
               ((3, 4), (2, 4, 2)), ((2, 1, 3, 4), (1, 3, 4, 2)), ((2, 2, 3, 4), (2, 2, 4, 3)), ((4,), (2, 4, 3)),
               ((2, 3, 4), (4,)), ((4,), (4,)), ((1, 3, 4), (4, 2))]:
    GRADIENT_CASES[f"MatMul {_a} {_b}"] = GradientCase([node("MatMul", ["a", "b"])], {"a": rand(*_a), "b": rand(*_b)})

# ---- shapes and reductions ------------------------------------------------------------------------

GRADIENT_CASES["Reshape"] = GradientCase([node("Reshape", ["x", "shape"])], {"x": rand(2, 3, 2)}, {"shape": i64(3, -1)})
GRADIENT_CASES["Flatten"] = GradientCase([node("Flatten", ["x"], axis=2)], {"x": rand(2, 3, 2, 2)})
GRADIENT_CASES["Transpose"] = GradientCase([node("Transpose", ["x"], perm=[2, 0, 1])], {"x": rand(2, 3, 4)})
for _keepdims in (0, 1):
    for _axes in ([1], [0, 2], None):  # ReduceSum's axes as an input
        GRADIENT_CASES[f"ReduceSum axes={_axes} keepdims={_keepdims}"] = GradientCase(
            [node("ReduceSum", ["x"] + (["axes"] if _axes else []), keepdims=_keepdims)], {"x": rand(2, 3, 4)},
            {"axes": i64(*_axes)} if _axes else {})
    for _axes in ([-1], [0, 1], None):
        GRADIENT_CASES[f"ReduceMean axes={_axes} keepdims={_keepdims}"] = GradientCase(
            [node("ReduceMean", ["x"], keepdims=_keepdims, **({"axes": _axes} if _axes else {}))], {"x": rand(2, 3, 4)})
    for _op in ("ReduceMax", "ReduceMin", "ReduceL2"):
        GRADIENT_CASES[f"{_op} keepdims={_keepdims}"] = GradientCase(
            [node(_op, ["x"], axes=[1], keepdims=_keepdims)], {"x": rand(2, 3, 4)})
GRADIENT_CASES["ReduceMax shares the gradient among ties"] = GradientCase(
    [node("Relu", ["x"], ["r"]), node("ReduceMax", ["r"], keepdims=0, axes=[1])],
    {"x": np.array([[-1.0, -2.0, -0.5], [0.3, -1.0, 0.7]], np.float32)})
GRADIENT_CASES["Squeeze, Unsqueeze, Expand"] = GradientCase(
    [node("Unsqueeze", ["x", "ax0"], ["u"]), node("Expand", ["u", "shape"], ["e"]), node("Squeeze", ["e", "ax3"])],
    {"x": rand(3, 1, 1)}, {"ax0": i64(0), "shape": i64(2, 3, 4, 1), "ax3": i64(3)})
for _label, _starts, _ends, _steps in (("forward", [0, 1], [3, 4], [1, 2]),
                                       ("negative steps", [-1, 3], [-10, 0], [-1, -2])):
    GRADIENT_CASES[f"Slice {_label}"] = GradientCase(
        [node("Slice", ["x", "starts", "ends", "axes", "steps"])], {"x": rand(3, 5, 2)},
        {"starts": i64(*_starts), "ends": i64(*_ends), "axes": i64(0, 1), "steps": i64(*_steps)})
GRADIENT_CASES["Concat, Split, Tile"] = GradientCase(
    [node("Concat", ["a", "b", "a"], ["c"], axis=1), node("Split", ["c", "sizes"], ["s0", "s1", "s2"], axis=1),
     node("Tile", ["s1", "repeats"], ["t"]), node("Mul", ["t", "s2"])], {"a": rand(2, 2), "b": rand(2, 3)},
    {"sizes": i64(3, 2, 2), "repeats": i64(1, 1)})
GRADIENT_CASES["Tile"] = GradientCase([node("Tile", ["x", "repeats"])], {"x": rand(2, 1, 3)}, {"repeats": i64(2, 3, 1)})
for _upper in (0, 1):  # a causal mask as exported from torch.triu, after a CastLike to the type it already has
    GRADIENT_CASES[f"CastLike, Trilu upper={_upper}"] = GradientCase(
        [node("CastLike", ["x", "like"], ["c"]), node("Trilu", ["c", "k"], upper=_upper)], {"x": rand(2, 3, 4)},
        {"like": np.zeros(1, np.float32), "k": np.array(1 if _upper else -1, np.int64)})

# ---- losses, normalisation, attention -------------------------------------------------------------

for _reduction in ("mean", "sum", "none"):
    for _weighted in (False, True):
        _constants = {"labels": np.array([[0, 2], [1, 3], [3, 3]], np.int64)}  # [N=3, D=2], C=4, 2 ignored
        if _weighted:
            _constants["weights"] = np.array([0.5, 1.0, 2.0, 1.5], np.float32)
        GRADIENT_CASES[f"SoftmaxCrossEntropyLoss {_reduction}{' weighted' if _weighted else ''}"] = GradientCase(
            [node("SoftmaxCrossEntropyLoss", ["scores", *_constants], reduction=_reduction, ignore_index=2)],
            {"scores": rand(3, 4, 2, low=-2, high=2)}, _constants)
for _axis in (-1, 1):
    for _bias in (True, False):
        _x = rand(2, 2, 3, 4) if _axis == 1 else rand(2, 3, 4)
        _normalised = _x.shape[_axis:]
        _params = {"x": _x, "scale": rand(*_normalised, low=0.5, high=1.5)}
        if _bias:
            _params["bias"] = rand(*_normalised)
        GRADIENT_CASES[f"LayerNormalization axis={_axis}{' bias' if _bias else ''}"] = GradientCase(
            [node("LayerNormalization", list(_params), axis=_axis, epsilon=1e-3)], _params)
    for _op in ("Softmax", "LogSoftmax"):
        GRADIENT_CASES[f"{_op} axis={_axis}"] = GradientCase(
            [node(_op, ["x"], axis=_axis)], {"x": rand(2, 3, 4, low=-2, high=2)})
GRADIENT_CASES["LayerNormalization with statistics outputs, broadcast scale"] = GradientCase(
    [node("LayerNormalization", ["x", "scale", "bias"], ["y", "mean", "inv_std_dev"], axis=1)],
    {"x": rand(2, 3, 4), "scale": rand(4, low=0.5, high=1.5), "bias": rand(1)})
GRADIENT_CASES["RMS normalisation from primitives"] = GradientCase(  # as exported: x / sqrt(mean(x²) + ε) · scale
    [node("Pow", ["x", "two"], ["sq"]), node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
     node("Add", ["ms", "eps"], ["ms_eps"]), node("Sqrt", ["ms_eps"], ["rms"]), node("Div", ["x", "rms"], ["normed"]),
     node("Mul", ["normed", "scale"])], {"x": rand(2, 3, 4), "scale": rand(4)}, {"two": f32(2.0), "eps": f32(1e-5)})
_mask = np.zeros((2, 1, 1, 3), np.float32)
_mask[1, ..., 2] = -1e4
GRADIENT_CASES["attention block"] = GradientCase(  # scaled dot-product on [batch, heads, seq, dim], a padding mask
    [node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["s"]),
     node("Mul", ["s", "scale"], ["ss"]), node("Add", ["ss", "mask"], ["sm"]), node("Softmax", ["sm"], ["p"], axis=-1),
     node("MatMul", ["p", "v"])], {"q": rand(2, 2, 3, 4), "k": rand(2, 2, 3, 4), "v": rand(2, 2, 3, 4)},
    {"scale": f32(0.5), "mask": _mask})
GRADIENT_CASES["Where with a padding mask"] = GradientCase(  # masked_fill as exported: Where(Equal(tokens, pad), ...)
    [node("Equal", ["tokens", "pad"], ["is_pad"]), node("Where", ["is_pad", "big", "a"], ["w"]),
     node("Where", ["is_pad", "b", "w"])], {"a": rand(2, 3), "b": rand(3)},
    {"tokens": np.array([[5, 0, 3], [0, 0, 7]], np.int64), "pad": np.array(0, np.int64), "big": f32(-1e4)})


def _exported_attention_heads():
    """Multi-head attention as PyTorch exports it: nn.Linear with a transposed weight, heads split by
    Reshape + Transpose, scores scaled, heads merged by Transpose + Reshape."""
    batch, seq, heads, dim = 2, 3, 2, 2
    width = heads * dim
    nodes = [node("Transpose", ["wq"], ["wq_t"], perm=[1, 0]), node("MatMul", ["x", "wq_t"], ["q"]),
             node("Transpose", ["wk"], ["wk_t"], perm=[1, 0]), node("MatMul", ["x", "wk_t"], ["k"]),
             node("Reshape", ["q", "split"], ["q4"]), node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
             node("Reshape", ["k", "split"], ["k4"]), node("Transpose", ["k4"], ["kh"], perm=[0, 2, 3, 1]),
             node("Reshape", ["x", "split"], ["v4"]), node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
             node("MatMul", ["qh", "kh"], ["s"]), node("Mul", ["s", "scale"], ["ss"]),
             node("Softmax", ["ss"], ["p"], axis=-1), node("MatMul", ["p", "vh"], ["o"]),
             node("Transpose", ["o"], ["o_t"], perm=[0, 2, 1, 3]), node("Reshape", ["o_t", "merge"])]
    return GradientCase(nodes, {"x": rand(batch, seq, width), "wq": rand(width, width), "wk": rand(width, width)},
                        {"split": i64(batch, seq, heads, dim), "merge": i64(batch, seq, width), "scale": f32(0.7)},
                        fuses_into=("FusedMatMul",))


GRADIENT_CASES["exported attention heads"] = _exported_attention_heads()

# ---- indexing ---------------------------------------------------------------------------------------

GRADIENT_CASES["Gather embedding with repeated indices"] = GradientCase(  # the scatter-add sums repeated rows
    [node("Gather", ["emb", "ids"])], {"emb": rand(5, 3)}, {"ids": np.array([[0, 2, 2], [4, 0, 2]], np.int64)})
GRADIENT_CASES["Gather on an axis with negative indices"] = GradientCase(
    [node("Gather", ["x", "ids"], axis=1)], {"x": rand(2, 4, 3)}, {"ids": i64(3, -1, 0, 3)})
GRADIENT_CASES["GatherElements"] = GradientCase(
    [node("GatherElements", ["x", "ids"], axis=1)], {"x": rand(2, 4)},
    {"ids": np.array([[0, 2, 2], [1, 1, 0]], np.int64)})
for _reduction, _ids in (("none", [[1, 0], [2, 3]]), ("add", [[1, 0], [2, 2]])):
    GRADIENT_CASES[f"ScatterElements reduction={_reduction}"] = GradientCase(
        [node("ScatterElements", ["data", "ids", "updates"], axis=1, reduction=_reduction)],
        {"data": rand(2, 4), "updates": rand(2, 2)}, {"ids": np.array(_ids, np.int64)})
for _axis in (1, None):
    GRADIENT_CASES[f"Compress axis={_axis}"] = GradientCase(
        [node("Compress", ["x", "keep"], **({} if _axis is None else {"axis": _axis}))], {"x": rand(2, 4)},
        {"keep": np.array([True, False, True], np.bool_)})
GRADIENT_CASES["CenterCropPad, cropping one axis and padding another"] = GradientCase(
    [node("CenterCropPad", ["x", "shape"], axes=[0, 2])], {"x": rand(5, 2, 3)}, {"shape": i64(2, 6)}, opset=18)
for _time, _batch in ((0, 1), (1, 0)):
    GRADIENT_CASES[f"ReverseSequence time_axis={_time}"] = GradientCase(
        [node("ReverseSequence", ["x", "lengths"], time_axis=_time, batch_axis=_batch)], {"x": rand(4, 3, 2)},
        {"lengths": i64(*([4, 1, 3] if _time == 0 else [2, 0, 3, 1]))})
GRADIENT_CASES["TensorScatter circular"] = GradientCase(
    [node("TensorScatter", ["cache", "update", "at"], mode="circular")],
    {"cache": rand(2, 3, 4, 2), "update": rand(2, 3, 2, 2)}, {"at": i64(3, 1)}, opset=24)
GRADIENT_CASES["TensorScatter without write indices"] = GradientCase(
    [node("TensorScatter", ["cache", "update"], axis=1)], {"cache": rand(2, 5, 3), "update": rand(2, 2, 3)}, opset=24)
for _mode in ("DCR", "CRD"):
    GRADIENT_CASES[f"DepthToSpace {_mode}, SpaceToDepth"] = GradientCase(
        [node("DepthToSpace", ["x"], ["d"], blocksize=2, mode=_mode), node("Mul", ["d", "x2"], ["m"]),
         node("SpaceToDepth", ["m"], blocksize=2)], {"x": rand(2, 8, 2, 3), "x2": rand(2, 2, 4, 6)})
GRADIENT_CASES["ScatterND, GatherND"] = GradientCase(
    [node("ScatterND", ["data", "ids", "updates"], ["s"]), node("GatherND", ["s", "pick"])],
    {"data": rand(4, 3), "updates": rand(2, 3)},
    {"ids": np.array([[1], [3]], np.int64), "pick": np.array([[0, 1], [1, 2], [1, 2], [3, 0]], np.int64)})

# ---- recurrent layers -------------------------------------------------------------------------------


def _recurrent_case(kind, direction="forward", layout=0, hidden=3, with_state=True, **attrs):
    dirs = 2 if direction == "bidirectional" else 1
    gates = 3 if kind == "GRU" else 4
    steps, batch, features = 3, 2, 2
    x = rand(steps, batch, features) if layout == 0 else rand(batch, steps, features)
    state_shape = (dirs, batch, hidden) if layout == 0 else (batch, dirs, hidden)
    params = {"x": x, "w": rand(dirs, gates * hidden, features), "r": rand(dirs, gates * hidden, hidden),
              "b": rand(dirs, 2 * gates * hidden)}
    inputs = ["x", "w", "r", "b", ""]
    if with_state:
        params["h0"] = rand(*state_shape)
        inputs.append("h0")
    outputs = ["Y", "Yh"]
    if kind == "LSTM":
        if with_state:
            params["c0"] = rand(*state_shape)
            params["p"] = rand(dirs, 3 * hidden)
            inputs += ["c0", "p"]
        outputs.append("Yc")
    nodes = [node(kind, inputs, outputs, hidden_size=hidden, direction=direction, layout=layout, **attrs)]
    final = "Yh" if layout == 0 else "Yh_1"
    if layout == 1:
        nodes.append(node("Unsqueeze", ["Yh", "axis1"], ["Yh_1"]))
    nodes.append(node("Add", ["Y", final], ["y0"] if kind == "LSTM" else ["y"]))
    if kind == "LSTM":
        nodes.append(node("Unsqueeze", ["Yc", "axis1"], ["Yc_1"]) if layout == 1 else node("Identity", ["Yc"], ["Yc_1"]))
        nodes.append(node("Add", ["y0", "Yc_1"]))
    return GradientCase(nodes, params, {"axis1": i64(1)})


for _direction in ("forward", "reverse", "bidirectional"):
    for _linear_before_reset in (0, 1):
        GRADIENT_CASES[f"GRU {_direction} linear_before_reset={_linear_before_reset}"] = _recurrent_case(
            "GRU", _direction, linear_before_reset=_linear_before_reset)
    GRADIENT_CASES[f"LSTM {_direction}"] = _recurrent_case("LSTM", _direction)
GRADIENT_CASES["GRU batch first, no initial state"] = _recurrent_case(
    "GRU", "bidirectional", layout=1, with_state=False, linear_before_reset=1)
GRADIENT_CASES["LSTM batch first, no initial state"] = _recurrent_case("LSTM", "forward", layout=1, with_state=False)


# ---- ops of exported decoders and the conformance suite -------------------------------------------------

for _fmod in (0, 1):  # away from the jumps (where A/B is whole): dA = dY, dB = -dY · (A - Y) / B
    GRADIENT_CASES[f"Mod fmod={_fmod}"] = GradientCase(
        [node("Mod", ["a", "b"], fmod=_fmod)],
        {"a": np.array([[2.3, -2.3, 5.1], [-4.7, 0.6, 3.3]], np.float32), "b": np.array([1.5, -1.1, 2.0], np.float32)})
GRADIENT_CASES["Mean of three, broadcast"] = GradientCase(
    [node("Mean", ["a", "b", "c"])], {"a": rand(2, 3), "b": rand(3), "c": rand(2, 1)})
for _axis in (1, -1):
    for _reverse in (0, 1):
        for _exclusive in (0, 1):
            GRADIENT_CASES[f"CumSum axis={_axis} reverse={_reverse} exclusive={_exclusive}"] = GradientCase(
                [node("CumSum", ["x", "axis"], exclusive=_exclusive, reverse=_reverse)], {"x": rand(2, 3, 4)},
                {"axis": np.array(_axis, np.int64)})
# p=1 on positive values: ONNX's reference sums x, not |x| (odtrain and onnxruntime take |x|)
for _p, _axis, _x in ((2, -1, away_from_zero(3, 4)), (1, 0, rand(3, 4, low=0.2, high=2))):
    GRADIENT_CASES[f"LpNormalization p={_p} axis={_axis}"] = GradientCase(
        [node("LpNormalization", ["x"], p=_p, axis=_axis)], {"x": _x})
for _axis, _largest in ((1, 1), (0, 0)):
    GRADIENT_CASES[f"TopK axis={_axis} largest={_largest}"] = GradientCase(
        [node("TopK", ["x", "k"], ["y", "positions"], axis=_axis, largest=_largest)], {"x": rand(3, 5, 2)},
        {"k": i64(2)}, opset=11)
for _equation, _shapes in [("ij,jk->ik", [(3, 4), (4, 2)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]),
                           ("bhid,bhjd->bhij", [(2, 2, 3, 4), (2, 2, 5, 4)]), ("ij->ji", [(3, 4)]),
                           ("i,j->ij", [(3,), (4,)]), ("ij->i", [(3, 4)]),
                           ("...ij,...jk->...ik", [(2, 1, 3, 4), (3, 4, 2)]), ("ijk,jl->il", [(2, 3, 4), (3, 5)]),
                           ("ij,kj", [(3, 4), (2, 4)])]:
    _params = {f"x{i}": rand(*shape) for i, shape in enumerate(_shapes)}
    GRADIENT_CASES[f"Einsum {_equation}"] = GradientCase(
        [node("Einsum", list(_params), equation=_equation)], _params, opset=12)
for _reduction in ("mean", "sum", "none"):
    for _weighted in (False, True):
        _labels = np.array([[0, 2], [1, 3], [3, 3]], dtype=np.int64)  # [N=3, D=2], C=4, one ignored label
        _inputs, _constants = ["log_prob", "labels"], {"labels": _labels}
        if _weighted:
            _constants["weights"] = np.array([0.5, 1.0, 2.0, 1.5], dtype=np.float32)
            _inputs.append("weights")
        GRADIENT_CASES[f"NegativeLogLikelihoodLoss after LogSoftmax {_reduction}{' weighted' if _weighted else ''}"] = \
            GradientCase([node("LogSoftmax", ["scores"], ["log_prob"], axis=1),
                          node("NegativeLogLikelihoodLoss", _inputs, reduction=_reduction, ignore_index=2)],
                         {"scores": rand(3, 4, 2, low=-2, high=2)}, _constants)
# a vocabulary product scored by cross-entropy fuses into LinearCrossEntropy: a tied embedding (its gradient the sum of
# the Gather's and the product's) with the classes last and padding ignored, and a [N, C] product summed
GRADIENT_CASES["LinearCrossEntropy tied embedding, classes last, mean"] = GradientCase(
    [node("Gather", ["emb", "ids"], ["h"]), node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]),
     node("MatMul", ["h", "emb_t"], ["logits"]), node("Reshape", ["logits", "rows_shape"], ["rows"]),
     node("Reshape", ["labels", "flat_shape"], ["flat"]),
     node("SoftmaxCrossEntropyLoss", ["rows", "flat"], reduction="mean", ignore_index=-100)],
    {"emb": rand(7, 3, low=-2, high=2)},
    {"ids": np.array([[0, 2, 6, 1, 5], [4, 0, 2, 3, 3]], np.int64), "rows_shape": i64(-1, 7), "flat_shape": i64(-1),
     "labels": np.array([[2, 6, 1, 5, -100], [0, 2, 3, 3, 4]], np.int64)}, fuses_into=("LinearCrossEntropy",))
GRADIENT_CASES["LinearCrossEntropy [N, C] sum"] = GradientCase(
    [node("MatMul", ["x", "w"], ["scores"]), node("SoftmaxCrossEntropyLoss", ["scores", "labels"], reduction="sum")],
    {"x": rand(4, 3), "w": rand(3, 5, low=-2, high=2)}, {"labels": np.array([4, 0, 1, 1], np.int64)},
    fuses_into=("LinearCrossEntropy",))
for _op in ("ReduceL1", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"):
    for _keepdims in (0, 1):
        GRADIENT_CASES[f"{_op} axes as input keepdims={_keepdims}"] = GradientCase(
            [node(_op, ["x", "axes"], keepdims=_keepdims)],
            {"x": rand(2, 3, 4, low=0.5, high=2.0) if _op == "ReduceLogSum" else away_from_zero(2, 3, 4)},
            {"axes": np.array([0, -1], np.int64)}, opset=18)


@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_gradient(name, tmp_path):
    GRADIENT_CASES[name].check(tmp_path)


def test_exported_attention_heads_fuse_into_strided_products(tmp_path):
    """Training fuses the weight and head transposes and the scale into FusedMatMul (graph/fusion.py);
    the gradients stay those of the exported graph (its row above)."""
    GRADIENT_CASES["exported attention heads"].check(tmp_path)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "training_model.onnx")).graph.node]
    assert "Transpose" not in ops and "MatMul" not in ops and "Mul" not in ops[:ops.index("Softmax")], ops


@pytest.mark.parametrize("x_shape, bias_shape, fuses", [
    ((2, 3, 4), (5,), True), ((2, 3, 4), (3, 1), True), ((2, 3, 4), (2, 3, 5), True),
    ((3, 4), (2, 3, 5), False),  # the bias would enlarge the product: it stays an Add
])
@pytest.mark.parametrize("bias_first", [False, True])
def test_a_bias_added_to_a_product_moves_into_it(x_shape, bias_shape, fuses, bias_first, tmp_path):
    """nn.Linear on three axes exports MatMul(x, Transpose(W)), then Add(bias). Training fuses the bias into
    the product (its output starts as the broadcast bias, BLAS adds onto it); the gradients must not change."""
    nodes = [node("Transpose", ["w"], ["w_t"], perm=[1, 0]), node("MatMul", ["x", "w_t"], ["p"]),
             node("Add", ["b", "p"] if bias_first else ["p", "b"])]
    GradientCase(nodes, {"x": rand(*x_shape), "w": rand(5, 4), "b": rand(*bias_shape)}).check(tmp_path)
    training = onnx.load(str(tmp_path / "training_model.onnx"))
    with_bias = [n for n in training.graph.node if n.op_type == "FusedMatMul" and len(n.input) == 4]
    assert [list(n.input[2:]) for n in with_bias] == ([["", "b"]] if fuses else [])
    assert ("Add" in [n.op_type for n in training.graph.node]) != fuses


def test_scatter_gradients_are_scatter_elements(tmp_path):
    """Scatter (opsets 9 and 10, which ONNX's reference evaluator does not run) is ScatterElements under another
    name: its gradients equal those of the ScatterElements row, which finite differences check."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module
    from oracles import make_model, with_weighted_sum

    case = GRADIENT_CASES["ScatterElements reduction=none"]
    expected = case.check(tmp_path / "elements")
    weights = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)  # gradient_check's
    nodes = with_weighted_sum([node("Scatter", ["data", "ids", "updates"], axis=1)], "y", weights)
    model = make_model(nodes, {**case.params, **case.constants, "gc_weights": weights},
                       outputs=[("loss", np.float32, [])], opset=10)
    artifacts.generate_artifacts(model, requires_grad=list(case.params), loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path / "scatter")
    state = CheckpointState.load_checkpoint(tmp_path / "scatter" / "checkpoint")
    Module(tmp_path / "scatter" / "training_model.onnx", state, tmp_path / "scatter" / "eval_model.onnx")()
    for name in case.params:
        np.testing.assert_array_equal(state.parameters[name].grad, expected[name], err_msg=name)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, normalised", [((4, 6, 33), 1), ((4, 6, 2, 5), 2)])
def test_layer_norm_gradient_reads_the_forward_statistics(shape, normalised, threads, monkeypatch):
    """LayerNormalizationGrad given the forward's Mean and InvStdDev (what the training model passes) against
    the same kernel computing them again from X (artifacts written before): within float32 rounding (the
    forward's statistics may differ from the recomputed ones in their last bit), and dX the same bits at 1 and
    2 threads (its rows are independent)."""
    from odtrain.kernels import BINDINGS, ODTRAIN_DOMAIN, parallel_split

    monkeypatch.setattr(parallel_split, "MIN_PARALLEL_WORK", 0)
    values = np.random.default_rng(3)
    x = (values.standard_normal(shape) * 2 + 3).astype(np.float32)
    scale, bias = (values.standard_normal(shape[-normalised:]).astype(np.float32) for _ in range(2))
    dy = values.standard_normal(shape).astype(np.float32)
    statistics = [np.empty(shape[:-normalised] + (1,) * normalised, np.float32) for _ in range(2)]

    def run(calls):
        for kernel, args in calls:
            kernel(*args)

    run(BINDINGS[("", "LayerNormalization")]([x, scale, bias], [np.empty_like(x)] + statistics, axis=-normalised))
    results = {}
    for label, extra in (("recomputed", []), ("read", statistics)):
        for count in (1, threads):
            outputs = [np.empty_like(x), np.empty_like(scale), np.empty_like(scale)]
            run(BINDINGS[(ODTRAIN_DOMAIN, "LayerNormalizationGrad")]([dy, x, scale] + extra, outputs,
                                                                     axis=-normalised, threads=count))
            results[label, count] = outputs
    np.testing.assert_array_equal(results["read", threads][0], results["read", 1][0])
    for got, expected in zip(results["read", threads], results["recomputed", 1]):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * float(np.max(np.abs(expected))))

GRADIENT_ORACLES = {"Scatter": test_scatter_gradients_are_scatter_elements}
