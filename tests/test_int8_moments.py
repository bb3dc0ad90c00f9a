"""AdamW with 8-bit moments through the API: `Optimizer(..., state_dtype="int8")` or the optimizer model's
`state_dtype` attribute, the checkpoint round trip of codes and absmax values, the test decoder trained along
float32 AdamW, and the refusal where an optimizer has no such state."""
import numpy as np
import onnx
import pytest

from odtrain import artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.graph.errors import ArgumentError
from test_decoders import decoder
from test_sequence_loss import batch, tiny_lm


def artifacts_of(model, directory, optimizer, **options):
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1, ignore_index=-100,
                                 optimizer=optimizer, artifact_directory=directory, **options)
    return directory


def session(directory, checkpoint="checkpoint", **options):
    state = CheckpointState.load_checkpoint(directory / checkpoint)
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    optimizer = Optimizer(directory / "optimizer_model.onnx", module, **options)
    optimizer.set_learning_rate(0.05)
    return state, module, optimizer


def steps(module, optimizer, count, feeds):
    losses = []
    for _ in range(count):
        losses.append(float(module(*feeds)))
        optimizer.step()
        module.lazy_reset_grad()
    return losses


def test_the_optimizer_model_says_int8_and_the_checkpoint_keeps_codes_and_scales(tmp_path):
    model, params = tiny_lm()
    directory = artifacts_of(model, tmp_path, artifacts.AdamW(state_dtype="int8"), requires_grad=list(params))
    (node,) = onnx.load(str(directory / "optimizer_model.onnx")).graph.node
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["state_dtype"] == b"int8" and attributes["state_block"] == 2048
    state, module, optimizer = session(directory)  # no state_dtype: the model's
    steps(module, optimizer, 3, batch())
    moments = {key: value.copy() for key, value in state._optimizer.moments.items()}
    assert moments["momentum0"].dtype == np.uint8 and moments["momentum1_absmax"].dtype == np.float32
    CheckpointState.save_checkpoint(state, directory / "saved", include_optimizer_state=True)

    restored, module2, optimizer2 = session(directory, "saved")
    assert restored._optimizer.state_dtype == "int8" and restored._optimizer.step == 3
    for key, value in moments.items():
        np.testing.assert_array_equal(restored._optimizer.moments[key], value, err_msg=key)
    steps(module, optimizer, 1, batch())
    steps(module2, optimizer2, 1, batch())
    for name in params:
        np.testing.assert_array_equal(restored.parameters[name].data, state.parameters[name].data)

    as_float, _, _ = session(directory, "saved", state_dtype="float32")  # converted: the dequantized moments
    assert as_float._optimizer.state_dtype == "float32"
    assert as_float._optimizer.moments["momentum0"].dtype == np.float32
    np.testing.assert_allclose(np.abs(as_float._optimizer.moments["momentum0"]).max(),
                               moments["momentum0_absmax"].max(), rtol=1e-6)


def test_int8_moments_convert_to_float32_each_through_its_own_code_map(tmp_path):
    """Loading 8-bit moments as float32 gives each value its code map's value times its block's absmax: the
    signed map for the first moment, the unsigned one for the second, which stays non-negative."""
    from odtrain.kernels.optim import CODE_MAPS
    from odtrain.state import moment_blocks

    model, params = tiny_lm()
    directory = artifacts_of(model, tmp_path, artifacts.AdamW(state_dtype="int8"), requires_grad=list(params))
    state, module, optimizer = session(directory)
    steps(module, optimizer, 3, batch())
    CheckpointState.save_checkpoint(state, directory / "saved", include_optimizer_state=True)
    codes = {key: value.copy() for key, value in state._optimizer.moments.items()}
    as_float, _, _ = session(directory, "saved", state_dtype="float32")
    starts, _ = moment_blocks(state._store.trainable_sizes(), 2048)
    block_of = np.repeat(np.arange(starts.size - 1), np.diff(starts))
    for index, name in enumerate(("momentum0", "momentum1")):
        values = as_float._optimizer.moments[name]
        expected = CODE_MAPS[index][codes[name]] * codes[name + "_absmax"][block_of]
        np.testing.assert_array_equal(values, expected.astype(np.float32), err_msg=name)
    assert (as_float._optimizer.moments["momentum1"] >= 0).all()
    assert (as_float._optimizer.moments["momentum0"] < 0).any()  # a signed first moment: the maps differ here


def test_an_8bit_step_keeps_each_block_s_largest_magnitude_whatever_its_sign():
    """One adamw8_update on two blocks whose largest first moment is negative: the new absmax is the largest
    |moment| of the block (float32 moments as the update computes them), and each stored moment decodes within
    its code map's spacing of that value."""
    from odtrain.kernels.optim import CODE_MAPS, CODE_TABLES, adamw8_update

    rng = np.random.default_rng(6)
    size = 64
    starts = np.array([0, 32, 64], np.int64)
    g = rng.standard_normal(size).astype(np.float32)
    g[5], g[40] = -9.0, -7.0  # the largest gradients, negative: the largest first moments too
    m_codes, v_codes = np.full(size, np.searchsorted(CODE_MAPS[0], 0.0), np.uint8), np.zeros(size, np.uint8)
    m_absmax, v_absmax = np.zeros(2, np.float32), np.zeros(2, np.float32)
    w = rng.standard_normal(size).astype(np.float32)
    adamw8_update(w, g, m_codes, v_codes, m_absmax, v_absmax, CODE_MAPS, CODE_TABLES, starts, 1e-3, 0.9, 0.999,
                  1e-8, 0.0, 1.0, True)
    m, v = np.float32(0.1) * g, np.float32(0.001) * g * g  # from zero moments
    for j in range(2):
        block = slice(starts[j], starts[j + 1])
        np.testing.assert_allclose(m_absmax[j], np.abs(m[block]).max(), rtol=1e-6)
        np.testing.assert_allclose(v_absmax[j], v[block].max(), rtol=1e-6)
        decoded_m = CODE_MAPS[0][m_codes[block]] * m_absmax[j]
        decoded_v = CODE_MAPS[1][v_codes[block]] * v_absmax[j]
        # nearest codes: the maps' gaps are at most 0.9/64 of the absmax (the signed map's top decade)
        assert np.all(np.abs(decoded_m - m[block]) <= 0.9 / 128 * m_absmax[j] * 1.0001)
        assert np.all(np.abs(decoded_v - v[block]) <= 0.9 / 128 * v_absmax[j] * 1.0001)


def test_state_dtype_is_refused_where_an_optimizer_has_no_moments(tmp_path):
    model, params = tiny_lm()
    directory = artifacts_of(model, tmp_path, artifacts.OptimType.SGD, requires_grad=list(params))
    with pytest.raises(ArgumentError, match="applies to AdamW's moments; SGD keeps its state in float32"):
        session(directory, state_dtype="int8")
    with pytest.raises(ArgumentError, match=r"state_dtype must be one of \['float32', 'int8'\], got 'int4'"):
        artifacts.AdamW(state_dtype="int4")


@pytest.mark.slow
def test_int8_moments_train_the_test_decoder_along_float32_adamw(tmp_path):
    """Full fine-tuning of the llama test decoder, 100 AdamW steps over its 10 batches: the last loss within 1% of
    float32 AdamW's (measured -0.15%), in at most 0.3x the state bytes (measured 0.25x)."""
    folder, meta, golden = decoder("llama")
    directory = artifacts_of(str(folder / "torchscript17.onnx"), tmp_path, artifacts.OptimType.AdamW,
                             requires_grad=meta["requires_grad"])
    feeds = [(golden["input_ids"][i], golden["attention_mask"][i], golden["labels"][i]) for i in range(10)]
    results = {}
    for dtype in ("float32", "int8"):
        state, module, optimizer = session(directory, state_dtype=dtype)
        optimizer.set_learning_rate(meta["adamw"]["lr"])
        losses = [steps(module, optimizer, 1, feeds[step % 10])[0] for step in range(100)]
        results[dtype] = losses[0], losses[-1], sum(state.buffer_bytes().optimizer_state_bytes.values())
    (first, loss32, bytes32), (_, loss8, bytes8) = results["float32"], results["int8"]
    assert loss32 < 0.6 * first  # trained far enough for the comparison to mean something
    assert abs(loss8 / loss32 - 1) < 0.01
    assert bytes8 <= 0.3 * bytes32


def test_updates_fused_with_backward_give_the_step_loop_bits(tmp_path):
    """Each parameter's 8-bit moments are a slice of the codes and of the blocks: updating them inside the backward
    pass gives the bits of the optimizer step over the whole buffer."""
    model, params = tiny_lm()
    directory = artifacts_of(model, tmp_path, artifacts.OptimType.AdamW, requires_grad=list(params))
    states = []
    for fused in (False, True):
        state, module, optimizer = session(directory, state_dtype="int8", fuse_with_backward=fused)
        steps(module, optimizer, 3, batch())
        states.append(state)
    for name in params:
        np.testing.assert_array_equal(states[0].parameters[name].data, states[1].parameters[name].data)
