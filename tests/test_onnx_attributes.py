"""An attribute name an op does not define is refused by name when the model is read, for every op.

Oracle: onnx's own op schemas (every version of every standard op) for graph/onnx_attributes.py's table; a
damaged attribute name (a flipped byte: Conv's `dilatiols`) through both readers, odtrain's own and onnx's.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from odtrain.graph.errors import ModelError
from odtrain.graph.ir import Node, TensorType
from odtrain.graph.onnx_attributes import ATTRIBUTES, from_schemas, unknown_attributes
from odtrain.graph.onnx_io import SHAPES_INFERRED, graph_from_model, load_graph, model_from_proto
from odtrain.graph.ops import OPS


def test_the_table_is_what_onnxs_schemas_define():
    assert ATTRIBUTES == from_schemas(), "run `python -m odtrain.graph.onnx_attributes` to write it again"


def conv_model(attribute: str = "dilations") -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 5, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 3, 3], np.ones(9, np.float32))
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="stem")
    node.attribute.append(helper.make_attribute(attribute, [1, 1]))
    return helper.make_model(helper.make_graph([node], "g", [x], [y], [w]), opset_imports=[helper.make_opsetid("", 17)])


def test_a_damaged_conv_attribute_is_refused_naming_the_node_and_the_name(tmp_path):
    """Through onnx (a forward model) and through odtrain's own reader (a file odtrain saved)."""
    assert load_graph(conv_model()).nodes[0].attrs["dilations"] == [1, 1]
    expected = (r"node 'stem' \(Conv\) has attribute 'dilatiols', which Conv does not define \(its attributes: "
                r"auto_pad, dilations, group, kernel_shape, pads, strides\); the file is damaged")
    with pytest.raises(ModelError, match=expected):
        load_graph(conv_model("dilatiols"))
    damaged = conv_model("dilatiols")
    helper.set_model_props(damaged, {SHAPES_INFERRED: "1"})
    path = tmp_path / "damaged.onnx"
    onnx.save(damaged, str(path))
    with pytest.raises(ModelError, match=expected):
        load_graph(str(path))  # the wire reader: no onnx involved


@pytest.mark.parametrize("op_type", sorted(t for d, t in OPS if d == ""))
def test_every_standard_op_refuses_an_attribute_it_does_not_define(op_type):
    """Each op odtrain registers reads only its own attributes: one named after none of them is refused when
    the model is read, before any rule or kernel sees it; its own names pass."""
    known = ATTRIBUTES[op_type]
    node = helper.make_node(op_type, ["a"], ["b"], name="n")
    for name in known[:1]:
        node.attribute.append(helper.make_attribute(name, 1))
    node.attribute.append(helper.make_attribute("not_an_attribute_of_any_op", 1))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    data = model_from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    with pytest.raises(ModelError, match=rf"node 'n' \({op_type}\) has attribute 'not_an_attribute_of_any_op', "
                                         rf"which {op_type} does not define"):
        graph_from_model(data, "m.onnx")
    assert unknown_attributes(op_type, known) == []


def test_an_odtrain_op_given_an_attribute_its_kernel_does_not_take_is_refused_by_node():
    """odtrain's own ops (ai.odtrain) are checked by their kernel bindings when a step is planned: a ModelError
    naming the node, not the binding's TypeError."""
    from odtrain.executor import scratch_bytes

    node = Node("ConvInputGrad", ["dy", "w"], ["dx"], {"dilatiols": [1, 1]}, "stem_grad", "ai.odtrain")
    types = {"dy": TensorType(np.dtype(np.float32), (1, 1, 3, 3)), "w": TensorType(np.dtype(np.float32), (1, 1, 3, 3)),
             "dx": TensorType(np.dtype(np.float32), (1, 1, 5, 5))}
    with pytest.raises(ModelError, match=r"ConvInputGrad node 'stem_grad'.*: unsupported attributes \['dilatiols'\]"):
        scratch_bytes(node, types)


def test_a_value_no_node_computes_is_refused_when_the_model_is_read():
    """A damaged name (a flipped byte in a node's input or in a graph output) leaves a value nothing computes:
    refused by name when the model is read, not a missing key when a step is planned."""
    model = conv_model()
    model.graph.node[0].input[1] = "v"  # the weight's name, damaged
    with pytest.raises(ModelError, match=r"Conv node 'stem' reads 'v', which no node computes and the graph neither "
                                         r"takes nor holds: the file is damaged"):
        graph_from_model(model_from_proto(model), "m.onnx")
    model = conv_model()
    model.graph.output[0].name = "z"
    with pytest.raises(ModelError, match=r"the graph outputs 'z', which no node computes"):
        graph_from_model(model_from_proto(model), "m.onnx")


def test_an_optimizer_model_lacking_a_hyper_parameter_is_refused_by_name():
    from odtrain.graph.ir import Graph
    from odtrain.graph.optimizers import read_optimizer_graph

    attrs = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.0, "bias_correction": 1,
             "parameters": ["w"]}
    node = Node("AdamW", ["w"], ["updated_flag"], attrs, "AdamW_update", "ai.odtrain")
    assert read_optimizer_graph(Graph([node], ["w"], ["updated_flag"]), "opt.onnx")[1] == ["w"]
    damaged = Node("AdamW", ["w"], ["updated_flag"], {**{k: v for k, v in attrs.items() if k != "beta2"}, "betb2": 0.999},
                   "AdamW_update", "ai.odtrain")
    with pytest.raises(ModelError, match=r"'opt.onnx': its AdamW node has no attribute 'beta2'; generate the "
                                         "optimizer model again"):
        read_optimizer_graph(Graph([damaged], ["w"], ["updated_flag"]), "opt.onnx")
