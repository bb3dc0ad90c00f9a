"""Audio data: WAV decoding of each encoding, refusals naming the file, resampling, length fitting and
log-mel features against PyTorch reference values (tests/data/log_mel_reference.npz, made by
benchmarks/audio/log_mel_reference.py)."""
import pathlib
import wave

import numpy as np
import pytest

from odtrain.audio import (AudioSource, LogMel, fit_length, log_mel, read_audio, read_wav, resample)
from odtrain.data_loading import InputSpec, load_audio_folder
from odtrain.graph.errors import InputError

DATA = pathlib.Path(__file__).parent / "data"
RATE = 16000


def wav_bytes(frames: bytes, channels: int, rate: int, bits: int, tag: int = 1, extensible: bool = False) -> bytes:
    """A RIFF/WAVE file: a 'fmt ' chunk (WAVE_FORMAT_EXTENSIBLE with `tag` as sub-format when asked), an odd
    'LIST' chunk to skip, and the data chunk."""
    align = channels * bits // 8
    fmt = (0xFFFE if extensible else tag).to_bytes(2, "little") + channels.to_bytes(2, "little") + \
        rate.to_bytes(4, "little") + (rate * align).to_bytes(4, "little") + align.to_bytes(2, "little") + \
        bits.to_bytes(2, "little")
    if extensible:
        fmt += (22).to_bytes(2, "little") + bits.to_bytes(2, "little") + (0).to_bytes(4, "little") + \
            tag.to_bytes(2, "little") + bytes(14)
    chunks = b"fmt " + len(fmt).to_bytes(4, "little") + fmt + b"LIST" + (3).to_bytes(4, "little") + b"abc\0" + \
        b"data" + len(frames).to_bytes(4, "little") + frames
    return b"RIFF" + (4 + len(chunks)).to_bytes(4, "little") + b"WAVE" + chunks


SIGNAL = np.array([[0.5, -0.25], [-1.0, 0.75], [0.125, 0.0]])  # 3 frames, 2 channels


def _encode(bits: int, tag: int) -> bytes:
    if tag == 3:
        return SIGNAL.astype("<f4" if bits == 32 else "<f8").tobytes()
    if bits == 8:
        return np.round(SIGNAL * 128 + 128).clip(0, 255).astype(np.uint8).tobytes()
    ints = np.round(SIGNAL * 2 ** (bits - 1)).clip(-2 ** (bits - 1), 2 ** (bits - 1) - 1).astype(np.int64)
    if bits == 24:
        return b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints.ravel())
    return ints.astype("<i2" if bits == 16 else "<i4").tobytes()


@pytest.mark.parametrize("bits,tag,extensible", [(8, 1, False), (16, 1, False), (24, 1, False), (32, 1, False),
                                                 (32, 3, False), (64, 3, False), (24, 1, True), (32, 3, True)])
def test_wav_encodings_decode_to_the_mean_of_the_channels(tmp_path, bits, tag, extensible):
    path = tmp_path / "clip.wav"
    path.write_bytes(wav_bytes(_encode(bits, tag), 2, 22050, bits, tag, extensible))
    samples, rate = read_wav(str(path))
    step = 1.0 / 2 ** (bits - 1) if tag == 1 else 0
    assert rate == 22050 and samples.dtype == np.float32
    np.testing.assert_allclose(samples, SIGNAL.clip(-1, 1 - step).mean(axis=1), atol=step + 1e-7)


def test_python_wave_module_files_read_the_same(tmp_path):
    values = (np.sin(np.arange(400) / 7) * 20000).astype("<i2")
    with wave.open(str(tmp_path / "mono.wav"), "wb") as out:
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(8000), out.writeframes(values.tobytes())
    samples, rate = read_audio(str(tmp_path / "mono.wav"))
    assert rate == 8000
    np.testing.assert_array_equal(samples, values / np.float32(32768))


BAD = {
    "empty": (b"", "is empty"),
    "not_riff": (b"ID3\x03" + bytes(40), "not a RIFF/WAVE"),
    "truncated": (wav_bytes(bytes(4000), 1, RATE, 16)[:-1000], "truncated"),
    "adpcm": (wav_bytes(bytes(400), 1, RATE, 4, tag=2), "Microsoft ADPCM"),
    "twelve_bit": (wav_bytes(bytes(400), 1, RATE, 12), "12-bit PCM"),
    "no_data": (wav_bytes(b"", 1, RATE, 16)[:-8], "no data chunk"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_files_are_refused_by_name(tmp_path, name):
    content, message = BAD[name]
    path = tmp_path / f"{name}.wav"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message) as error:
        read_wav(str(path))
    assert str(path) in str(error.value)


def test_other_formats_need_soundfile(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "soundfile", None)
    (tmp_path / "clip.flac").write_bytes(b"fLaC")
    with pytest.raises(InputError, match=r"clip.flac.*soundfile"):
        read_audio(str(tmp_path / "clip.flac"))


def _tone(freq, rate, seconds=0.5):
    t = np.arange(int(rate * seconds)) / rate
    return np.sin(2 * np.pi * freq * t).astype(np.float32), t


@pytest.mark.parametrize("source", [8000, 22050, 44100, 48000])
def test_resampling_keeps_tones_below_the_new_nyquist(source):
    tone, _ = _tone(1234.5, source)
    out = resample(tone, source, RATE)
    expected, _ = _tone(1234.5, RATE)
    assert len(out) == -(-len(tone) * RATE // source)
    middle = slice(200, len(expected) - 200)  # away from the edges, where the signal starts from silence
    np.testing.assert_allclose(out[middle], expected[:len(out)][middle], atol=1e-4)  # measured at most 1.3e-5


def test_resampling_removes_tones_above_the_new_nyquist():
    tone, _ = _tone(11000, 44100)
    out = resample(tone, 44100, RATE)
    # 11 kHz cannot exist at 16 kHz: it must not alias to 5 kHz (measured 3e-6 left)
    assert np.abs(out[200:-200]).max() < 1e-4


def test_fit_length_centres_pads_and_crops():
    x = np.arange(1, 6, dtype=np.float32)
    np.testing.assert_array_equal(fit_length(x, 8), [0, 1, 2, 3, 4, 5, 0, 0])
    np.testing.assert_array_equal(fit_length(x, 3), [2, 3, 4])
    np.testing.assert_array_equal(fit_length(x, 5), x)


@pytest.mark.parametrize("case", ["16k", "8k"])
def test_log_mel_matches_torch_stft_and_torchaudio_filters(case):
    reference = np.load(DATA / "log_mel_reference.npz")
    rate, n_mels, win, hop, n_fft = (int(v) for v in reference[f"{case}/settings"])
    settings = LogMel(rate, n_mels, 1000 * win / rate, 1000 * hop / rate, n_fft)
    assert (settings.win_length, settings.hop_length) == (win, hop)
    features = log_mel(reference[f"{case}/wave"], settings)
    power = reference[f"{case}/mel_power"]
    assert features.shape == power.shape == (n_mels, settings.frames(len(reference[f"{case}/wave"])))
    # 1e-4 relative in the mel power is 1e-4 absolute in its log; measured at most 2.2e-5
    np.testing.assert_allclose(features, np.log(power + 1e-6), rtol=0, atol=1e-4)


def _folder(tmp_path, clips: dict):
    for name, content in clips.items():
        path = tmp_path / "clips" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return str(tmp_path / "clips")


def _pcm(samples, rate=RATE):
    return wav_bytes((np.asarray(samples) * 32767).astype("<i2").tobytes(), 1, rate, 16)


SPECS = [InputSpec("audio", np.dtype(np.float32), ("batch", 1600)), InputSpec("labels", np.dtype(np.int64), ("batch",),
                                                                               True)]


def test_a_folder_of_clips_feeds_waveforms_and_labels(tmp_path):
    tone, _ = _tone(440, 8000, 0.1)  # 800 samples at 8 kHz: 1600 at 16 kHz, the model's length
    folder = _folder(tmp_path, {"no/a.wav": _pcm(tone, 8000), "yes/b.wav": _pcm(tone[:400], 8000),
                                "yes/notes.txt": b"not audio"})
    dataset = load_audio_folder(AudioSource(folder), SPECS)
    assert dataset.classes == ["no", "yes"] and dataset.arrays[0].shape == (2, 1600)
    np.testing.assert_array_equal(dataset.labels, [0, 1])
    assert not dataset.arrays[0][1, :400].any() and not dataset.arrays[0][1, -400:].any()  # padded, centred


def test_bad_clips_stop_the_run_by_name_or_are_skipped_and_counted(tmp_path):
    tone, _ = _tone(440, RATE, 0.1)
    folder = _folder(tmp_path, {"no/good.wav": _pcm(tone), "no/empty.wav": b"", "yes/short.wav": _pcm(tone[:100]),
                                "yes/good.wav": _pcm(tone)})
    with pytest.raises(InputError, match=r"empty\.wav' is empty.*--skip-unreadable"):
        load_audio_folder(AudioSource(folder), SPECS)
    lines = []
    source = AudioSource(folder, skip_unreadable=True, report=lines.append)
    dataset = load_audio_folder(source, SPECS)
    assert len(dataset) == 2 and [p.rsplit("/", 1)[1] for p, _ in source.skipped] == ["empty.wav", "short.wav"]
    assert "too short" in source.skipped[1][1]
    assert lines == [f"skipped 2 of 4 clips that cannot be read; the first: {source.skipped[0][1]}"]


def test_a_feature_input_gets_log_mel_of_the_fitted_clip(tmp_path):
    settings = LogMel(RATE, 8, 25, 10, 512)
    tone, _ = _tone(1000, RATE, 0.3)
    folder = _folder(tmp_path, {"a/x.wav": _pcm(tone)})
    specs = [InputSpec("mel", np.dtype(np.float32), ("batch", 1, 8, 21)), SPECS[1]]
    dataset = load_audio_folder(AudioSource(folder, settings), specs)
    assert dataset.arrays[0].shape == (1, 1, 8, 21)
    expected = log_mel(fit_length(read_wav(folder + "/a/x.wav")[0], 20 * 160), settings)
    np.testing.assert_array_equal(dataset.arrays[0][0, 0], expected)


def test_command_line_trains_a_log_mel_model_on_clips_and_skips_bad_ones(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from conftest import odtrain_main

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["mel"], ["flat"]), helper.make_node("Gemm", ["flat", "w", "b"], ["logits"])],
        "tiny", [helper.make_tensor_value_info("mel", TensorProto.FLOAT, ["batch", 8, 21])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array((rng.standard_normal((168, 2)) * 0.01).astype(np.float32), "w"),
         numpy_helper.from_array(np.zeros(2, np.float32), "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(tmp_path / "tiny.onnx"))
    low, _ = _tone(300, RATE, 0.2)
    high, _ = _tone(3000, RATE, 0.2)
    folder = _folder(tmp_path, {"high/a.wav": _pcm(high), "high/b.wav": _pcm(high * 0.5), "low/a.wav": _pcm(low),
                                "low/b.wav": _pcm(low * 0.5), "low/broken.wav": _pcm(low)[:-100]})
    art = tmp_path / "art"
    assert odtrain_main(capsys, "prepare", tmp_path / "tiny.onnx", "-o", art, "--lr", "0.1")[0] == 0
    features = ["--audio-features", "log-mel", "--n-mels", "8", "--win-ms", "25", "--hop-ms", "10", "--n-fft", "512"]
    code, out, err = odtrain_main(capsys, "train", art, "--data", folder, *features)
    assert code != 0 and "broken.wav' is truncated" in err and "--skip-unreadable" in err
    code, out, err = odtrain_main(capsys, "train", art, "--data", folder, *features, "--skip-unreadable",
                                  "--epochs", "20", "--batch-size", "4")
    assert code == 0 and "training on 4 samples" in out, err
    assert "skipped 1 of 5 clips that cannot be read; the first: audio file" in err
    code, out, err = odtrain_main(capsys, "eval", art, "--data", folder, *features, "--skip-unreadable")
    assert code == 0 and "accuracy 100.0% on 4 samples" in out, err
