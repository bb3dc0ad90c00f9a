"""The keyword spotter of README's "Personalise a keyword spotter" (benchmarks/audio/kws.onnx, its log-mel
front end inside the graph): odtrain's signal kernels match onnxruntime on the front end and the logits,
and the walk-through's commands run on a few shipped clips (tests/data/keywords, two a word of the voice
the model never heard), ending in an export that onnxruntime runs to the same predictions."""
import pathlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from odtrain.audio import AudioSource
from odtrain.data_loading import InputSpec, load_audio_folder
from odtrain.inference import InferenceSession
from conftest import odtrain_main

ROOT = pathlib.Path(__file__).parents[1]
MODEL = ROOT / "benchmarks" / "audio" / "kws.onnx"
CLIPS = pathlib.Path(__file__).parent / "data" / "keywords"
ort = pytest.importorskip("onnxruntime")


def _waveforms():
    specs = [InputSpec("audio", np.dtype(np.float32), ("batch", 16000)),
             InputSpec("labels", np.dtype(np.int64), ("batch",), True)]
    return load_audio_folder(AudioSource(str(CLIPS)), specs).arrays


def _onnxruntime(model: onnx.ModelProto, feeds: dict) -> list:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_front_end_and_logits_match_onnxruntime():
    model = onnx.load(str(MODEL))
    log = next(n for n in model.graph.node if n.op_type == "Log")  # log(mel + 1e-6): the features
    model.graph.output.append(helper.make_tensor_value_info(log.output[0], TensorProto.FLOAT, None))
    audio, _ = _waveforms()
    ours = InferenceSession(model).run(None, {"audio": audio})
    theirs = _onnxruntime(model, {"audio": audio})
    # measured: log-mel features (-13.2 to 4.4) 4.4e-5 apart, logits 2.7e-6 (float32 sums in another order)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=0, atol=2e-4)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=0, atol=2e-5)


def test_walk_through_commands_end_in_a_model_onnxruntime_agrees_with(tmp_path, capsys):
    art, personal = tmp_path / "kws", tmp_path / "kws-personal.onnx"
    assert odtrain_main(capsys, "prepare", MODEL, "-o", art, "--train-last", "3", "--lr", "0.003")[0] == 0
    code, out, err = odtrain_main(capsys, "train", art, "--data", CLIPS, "--epochs", "1", "--batch-size", "8")
    assert code == 0 and "training on 16 samples" in out, err
    assert odtrain_main(capsys, "export", art, "-o", personal)[0] == 0
    audio, labels = _waveforms()
    exported = onnx.load(str(personal))
    ours = InferenceSession(exported).run(None, {"audio": audio})[0]
    theirs = _onnxruntime(exported, {"audio": audio})[0]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    assert (ours.argmax(1) == theirs.argmax(1)).all()
