"""Audio: the clip loader and the signal ops.

AudioLoading: reading the keyword clips of tests/data/keywords (16 WAV files of 1 s at 16 kHz) into
waveforms, or into log-mel features (40 bands, 25 ms windows, 10 ms hop, n_fft 512); resampling 1 s
from 44.1 kHz to 16 kHz (fixed-seed noise).
SignalOps: one op in a graph of its own through odtrain.InferenceSession, at the keyword spotter's sizes:
STFT of [16, 16000] samples (n_fft 400 in 512 with a Hann window, hop 160, as benchmarks/audio/kws.onnx
computes its features), a DFT of [16, 512, 1] along axis 1, and DFT's gradient (the adjoint product).
"""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

from . import common



def _specs(features: bool):
    from odtrain.data_loading import InputSpec

    shape = ("batch", 1, 40, 101) if features else ("batch", 16000)
    return [InputSpec("audio", np.dtype(np.float32), shape),
            InputSpec("labels", np.dtype(np.int64), ("batch",), True)]


class AudioLoading:
    params = ["waveform", "log-mel"]
    param_names = ["input"]

    def setup(self, kind):
        from odtrain.audio import LogMel

        self.folder = str(common.DATA_DIR / "keywords")
        self.features = LogMel() if kind == "log-mel" else None
        self.specs = _specs(self.features is not None)
        self.noise = np.random.default_rng(common.SEED).standard_normal(44100).astype(np.float32)

    def time_load_folder(self, kind):
        from odtrain.audio import AudioSource
        from odtrain.data_loading import load_audio_folder

        load_audio_folder(AudioSource(self.folder, self.features), self.specs)

    def time_resample_44k1_to_16k(self, kind):
        from odtrain.audio import resample

        resample(self.noise, 44100, 16000)


def _model(node, inputs, initializers):
    graph = helper.make_graph(
        [node], "signal", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs],
        [helper.make_empty_tensor_value_info(node.output[0])],
        [numpy_helper.from_array(np.asarray(v), name=k) for k, v in initializers.items()])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.odtrain", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


class SignalOps:
    params = ["STFT", "DFT", "DFTGrad"]
    param_names = ["op"]

    def setup(self, op):
        from odtrain.inference import InferenceSession

        rng = np.random.default_rng(common.SEED)
        window = np.zeros(512, np.float32)
        window[56:456] = np.hanning(402)[1:-1]
        if op == "STFT":
            node = helper.make_node("STFT", ["x", "step", "window"], ["y"])
            inputs, constants = [("x", (16, 16000))], {"step": np.array(160, np.int64), "window": window}
        elif op == "DFT":
            node = helper.make_node("DFT", ["x"], ["y"], axis=1)
            inputs, constants = [("x", (16, 512, 1))], {}
        else:
            node = helper.make_node("DFTGrad", ["dy", "x"], ["y"], domain="ai.odtrain", axis=1)
            inputs, constants = [("dy", (16, 512, 2))], {"x": np.zeros((16, 512, 1), np.float32)}
        self.feeds = {name: rng.uniform(0.5, 1.5, shape).astype(np.float32) for name, shape in inputs}
        self.session = InferenceSession(_model(node, inputs, constants))
        self.session.run(None, self.feeds)  # compiles or loads the kernels, binds the plan

    def time_run(self, op):
        self.session.run(None, self.feeds)
