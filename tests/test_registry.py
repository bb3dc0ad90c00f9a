"""The op registry and the kernel bindings agree: every op that can run has a kernel, every rule a test."""
from odtrain.graph.ops import OPS
from odtrain.kernels import BINDINGS

# Ops that never reach a kernel: views share their input's bytes, constants fold when shapes bind.
NO_KERNEL = {("", "Reshape"), ("", "Flatten"), ("", "Identity"), ("", "Shape"), ("", "Constant")}
NO_KERNEL |= {("ai.odtrain", "ApplyUpdate")}  # the executor calls the optimizer for it
NO_KERNEL |= {("", "Squeeze"), ("", "Unsqueeze")}  # views

# The op types whose gradient rules tests/test_gradients.py checks against finite differences.
GRADIENT_CHECKED = {"Add", "Sub", "Mul", "Div", "Sum", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Relu",
                    "Sigmoid", "Tanh", "Identity", "Gemm", "MatMul", "Reshape", "Flatten", "Transpose", "ReduceSum",
                    "ReduceMean", "SoftmaxCrossEntropyLoss"}
# text and sequence ops (tests/test_gradients.py; Cast in tests/test_text.py)
GRADIENT_CHECKED |= {"Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "LayerNormalization",
                     "Softmax", "LogSoftmax", "Erf", "Atan", "Gelu", "Pow", "Max", "Min", "ReduceMax", "ReduceMin",
                     "ReduceL2", "Squeeze", "Unsqueeze", "Expand", "Where", "Slice", "Concat", "Split", "Tile", "Cast",
                     "GRU", "LSTM", "CastLike", "Trilu", "FusedMatMul"}
# vision ops (tests/test_vision.py; Dropout, being random, against its own mask there)
GRADIENT_CHECKED |= {"Conv", "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool",
                     "Clip", "LeakyRelu", "HardSigmoid", "HardSwish", "Pad", "Dropout", "BatchNormalizationActivation"}
# upsampling ops (tests/test_upsampling.py)
GRADIENT_CHECKED |= {"ConvTranspose", "Resize", "Upsample"}
# decoder ops (tests/test_attention.py, the fused forms through their decomposed patterns)
GRADIENT_CHECKED |= {"RMSNormalization", "RotaryEmbedding", "Attention"}


def test_every_registered_op_has_a_kernel():
    missing = sorted(key for key in OPS if key not in BINDINGS and key not in NO_KERNEL)
    assert not missing, f"ops with a type rule but no kernel binding: {missing}"


def test_every_kernel_has_a_type_rule():
    assert not sorted(set(BINDINGS) - set(OPS))


def test_every_gradient_rule_is_checked_numerically():
    with_rules = {op for (domain, op), opdef in OPS.items() if opdef.gradient is not None}
    assert with_rules == GRADIENT_CHECKED


def test_ops_without_gradient_say_why():
    for key, opdef in OPS.items():
        if opdef.gradient is None and key[0] == "":
            assert opdef.no_grad_reason, f"{key}: neither a gradient rule nor a stated reason"
