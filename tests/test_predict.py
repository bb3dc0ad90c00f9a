"""Photos at a symbolic export size (train/eval/predict --image-size, --normalize, preprocessing.json), `odtrain
predict` against onnxruntime on the exported model, and data faults named at load (NaN, files that are not .npz).

The model: a small CNN whose input is float32[batch, 3, height, width], as torch.onnx.export writes one with
dynamic height and width; the photos: odtrain.shapes' circles, squares and triangles."""
import contextlib
import io
import json
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import odtrain_main
from odtrain import cli

Image = pytest.importorskip("PIL.Image")
SIZE = 16
CLASSES = ["circle", "square", "triangle"]


def symbolic_cnn() -> onnx.ModelProto:
    """Conv 3->4 (3x3) -> Relu -> GlobalAveragePool -> Flatten -> Gemm 4->3, image size symbolic."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "conv.weight"),
               numpy_helper.from_array(np.zeros(4, np.float32), "conv.bias"),
               numpy_helper.from_array(rng.normal(0, 0.5, (3, 4)).astype(np.float32), "fc.weight"),
               numpy_helper.from_array(np.zeros(3, np.float32), "fc.bias")]
    nodes = [helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["output"], transB=1)]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                           ["batch", 3, "height", "width"])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def here(tmp_path_factory):
    """A folder with cnn.onnx, photos/{train,val}/<class>/*.png and artifacts trained on them in trained/."""
    from odtrain.shapes import make

    folder = tmp_path_factory.mktemp("predict")
    onnx.save(symbolic_cnn(), folder / "cnn.onnx")
    make(folder / "photos", counts={"train": 4, "val": 2})
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        for argv in (("prepare", "cnn.onnx", "-o", "untrained", "--lr", "0.05"),):
            assert cli.main(list(argv)) == 0
        shutil.copytree(folder / "untrained", folder / "trained")
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["train", "trained", "--data", "photos/train", "--image-size", str(SIZE), "--normalize",
                             "imagenet", "--epochs", "2", "--batch-size", "4", "--json"]) == 0
    return folder


@pytest.fixture(autouse=True)
def _inside(here, monkeypatch):
    monkeypatch.chdir(here)


def fresh(here, name: str) -> str:
    shutil.rmtree(here / name, ignore_errors=True)
    shutil.copytree(here / "untrained", here / name)
    return name


def test_training_on_photos_records_size_normalisation_layout_and_class_names(here):
    stored = json.loads((here / "trained" / "preprocessing.json").read_text())
    assert {k: stored[k] for k in ("input", "layout", "channels", "height", "width", "normalize", "classes")} == \
        {"input": "input", "layout": "NCHW", "channels": 3, "height": SIZE, "width": SIZE, "normalize": "imagenet",
         "classes": CLASSES}
    assert stored["mean"] == [0.485, 0.456, 0.406] and stored["std"] == [0.229, 0.224, 0.225]


def test_eval_applies_the_recorded_preprocessing_without_the_options(here, capsys):
    code, recorded, err = odtrain_main(capsys, "eval", "trained", "--data", "photos/val", "--json")
    assert code == 0, err
    code, given, err = odtrain_main(capsys, "eval", "trained", "--data", "photos/val", "--image-size", SIZE,
                                    "--normalize", "imagenet", "--json")
    assert code == 0, err
    code, other, err = odtrain_main(capsys, "eval", "trained", "--data", "photos/val", "--image-size", SIZE,
                                    "--normalize", "none", "--json")
    assert json.loads(recorded) == json.loads(given) != json.loads(other)


def test_a_symbolic_size_without_the_option_or_a_record_is_refused_naming_it(here, capsys):
    code, out, err = odtrain_main(capsys, "train", fresh(here, "no_size"), "--data", "photos/train")
    assert code == 2 and "has no fixed image size: give the size to resize photos to with --image-size N" in err
    assert not (here / "no_size" / "preprocessing.json").exists()
    code, out, err = odtrain_main(capsys, "predict", "no_size", "photos/val/circle/00.png")
    assert code == 2 and "--image-size" in err


def test_image_options_without_photos_are_refused(here, capsys):
    np.savez(here / "arrays.npz", input=np.zeros((2, 3, 8, 8), np.float32), labels=np.zeros(2, np.int64))
    code, out, err = odtrain_main(capsys, "eval", "trained", "--data", "arrays.npz", "--image-size", "8")
    assert code == 2 and "--image-size preprocess photos: give a folder of images" in err


def onnxruntime_probabilities(model: str, paths: list[str]) -> np.ndarray:
    """The softmax of onnxruntime's logits on photos preprocessed by the recipe README states, written out here:
    shorter side to SIZE (the longer truncated), centre crop, /255, ImageNet mean and std, NCHW."""
    ort = pytest.importorskip("onnxruntime")
    samples = []
    for path in paths:
        with Image.open(path) as image:
            image = image.convert("RGB")
            w, h = image.size
            scaled = (w * SIZE // h, SIZE) if w >= h else (SIZE, h * SIZE // w)
            image = image.resize(scaled, Image.BILINEAR)
            left, top = int(round((scaled[0] - SIZE) / 2)), int(round((scaled[1] - SIZE) / 2))
            pixels = np.asarray(image.crop((left, top, left + SIZE, top + SIZE)), np.float32) / 255
        samples.append(((pixels - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).transpose(2, 0, 1))
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": np.stack(samples).astype(np.float32)})[0].astype(np.float64)
    exponentials = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exponentials / exponentials.sum(axis=1, keepdims=True)


def test_predict_gives_onnxruntimes_probabilities_of_the_exported_model_with_the_class_names(here, capsys):
    code, out, err = odtrain_main(capsys, "export", "trained", "-o", "trained.onnx")
    assert code == 0, err
    assert out.splitlines()[1] == ("its inputs' preprocessing written to trained.preprocessing.json: 16x16, "
                                   "normalize imagenet, classes circle, square, triangle")
    assert (here / "trained.preprocessing.json").read_text() == (here / "trained" / "preprocessing.json").read_text()
    code, out, err = odtrain_main(capsys, "predict", "trained", "photos/val", "--json", "--top", "3")
    assert code == 0, err
    results = json.loads(out)
    paths = [str(os.path.join("photos", "val", kind, f"{i:02d}.png")) for kind in CLASSES for i in range(2)]
    assert [r["input"] for r in results] == paths
    expected = onnxruntime_probabilities("trained.onnx", paths)
    for result, row in zip(results, expected):
        order = np.argsort(-row, kind="stable")
        assert [item["class"] for item in result["top"]] == order.tolist()
        assert [item["name"] for item in result["top"]] == [CLASSES[c] for c in order]
        np.testing.assert_allclose([item["probability"] for item in result["top"]], row[order], rtol=1e-5)


def test_predict_prints_one_line_an_input_most_probable_first(here, capsys):
    code, out, err = odtrain_main(capsys, "predict", "trained", "photos/val/square/01.png", "--top", "2")
    assert code == 0, err
    line, = out.splitlines()
    path, shown = line.split(": ")
    assert path == "photos/val/square/01.png"
    (first, p1), (second, p2) = (item.rsplit(" ", 1) for item in shown.split(", "))
    assert {first, second} <= set(CLASSES) and float(p1[:-1]) >= float(p2[:-1])
    code, out, err = odtrain_main(capsys, "predict", "trained", "photos/val/square/01.png")
    assert code == 0 and len(out.split(", ")) == 3  # by default as many as the named classes, up to 5


def test_predict_reads_npz_samples_and_names_classes_by_index_without_names(here, capsys):
    rng = np.random.default_rng(1)
    np.savez(here / "samples.npz", input=rng.normal(size=(3, 3, SIZE, SIZE)).astype(np.float32))
    code, out, err = odtrain_main(capsys, "predict", "untrained", "samples.npz", "--top", "1")
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split(": ")[0] for line in lines] == [f"samples.npz sample {i}" for i in range(3)]
    assert all(line.split(": ")[1].startswith("class ") for line in lines)


def test_nan_in_the_data_is_refused_at_load_naming_file_and_sample_and_the_checkpoint_is_untouched(here, capsys):
    folder = fresh(here, "nan")
    before = (here / folder / "checkpoint").read_bytes()
    images = np.zeros((6, 3, 8, 8), np.float32)
    images[4, 1, 2, 3] = np.nan
    images[5, 0, 0, 0] = np.inf
    np.savez(here / "nan.npz", input=images, labels=np.zeros(6, np.int64))
    message = ("data file 'nan.npz': sample 4 of input 'input' holds NaN at position 1, 2, 3 (2 of 6 samples hold "
               "NaN or infinite values); fix or drop those samples")
    for argv in (("train", folder, "--data", "nan.npz"), ("eval", folder, "--data", "nan.npz"),
                 ("predict", folder, "nan.npz")):
        code, out, err = odtrain_main(capsys, *argv)
        assert code == 2 and message in err, (argv, err)
    assert (here / folder / "checkpoint").read_bytes() == before


def test_a_file_that_is_not_an_npz_archive_is_called_that(here, capsys):
    (here / "notes.npz").write_text("input,labels\n1,2\n")
    np.save(here / "array.npy", np.zeros((2, 3), np.float32))
    os.replace(here / "array.npy", here / "array.npz")
    code, out, err = odtrain_main(capsys, "eval", "trained", "--data", "notes.npz")
    assert code == 2 and "data file 'notes.npz' is not an .npz archive (a zip of .npy arrays; the file starts" in err
    assert "pickl" not in err
    code, out, err = odtrain_main(capsys, "eval", "trained", "--data", "array.npz")
    assert code == 2 and "data file 'array.npz' is a single .npy array, not an .npz archive" in err


def float_wav(path, samples: np.ndarray, rate: int = 16000) -> None:
    """A mono IEEE-float WAV (format 3), which numpy's reader in odtrain/audio.py takes, NaN included."""
    import struct

    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def test_predict_reads_clips_and_names_a_clip_holding_nan(here, capsys):
    weights = [numpy_helper.from_array(np.random.default_rng(2).normal(0, 0.1, (1600, 3)).astype(np.float32), "w"),
               numpy_helper.from_array(np.zeros(3, np.float32), "b")]
    graph = helper.make_graph([helper.make_node("Gemm", ["audio", "w", "b"], ["logits"])], "kws",
                              [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", 1600])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), here / "kws.onnx")
    code, out, err = odtrain_main(capsys, "prepare", "kws.onnx", "-o", "kws")
    assert code == 0, err
    clips = here / "clips"
    clips.mkdir(exist_ok=True)
    tone = np.sin(np.arange(1600) / 5).astype(np.float32) * 0.5
    float_wav(clips / "tone.wav", tone)
    code, out, err = odtrain_main(capsys, "predict", "kws", "clips/tone.wav", "--json")
    assert code == 0, err
    result, = json.loads(out)
    assert result["input"] == "clips/tone.wav" and len(result["top"]) == 3
    assert abs(sum(item["probability"] for item in result["top"]) - 1) < 1e-9
    tone[700] = np.nan
    float_wav(clips / "broken.wav", tone)
    code, out, err = odtrain_main(capsys, "predict", "kws", "clips")
    assert code == 2 and "audio file 'clips/broken.wav' holds samples that are not finite numbers" in err


def test_a_second_run_keeps_the_recorded_settings_and_says_when_it_changes_them(here, capsys):
    folder = fresh(here, "second")
    code, out, err = odtrain_main(capsys, "train", folder, "--data", "photos/train", "--image-size", "12", "--json")
    assert code == 0 and "note" not in err, err
    code, out, err = odtrain_main(capsys, "train", folder, "--data", "photos/train", "--json")
    assert code == 0 and "note" not in err, err  # the recorded size, without the option
    assert json.loads((here / folder / "preprocessing.json").read_text())["height"] == 12
    code, out, err = odtrain_main(capsys, "train", folder, "--data", "photos/train", "--normalize", "0.5,0.5",
                                  "--json")
    assert code == 0 and ("odtrain train: note: this run changes normalisation 0.5,0.5 (was none) from "
                          "preprocessing.json") in err, err
    stored = json.loads((here / folder / "preprocessing.json").read_text())
    assert (stored["height"], stored["normalize"], stored["mean"]) == (12, "0.5,0.5", [0.5] * 3)


def test_predict_on_text_gives_onnxruntimes_next_tokens_after_each_window(here, capsys):
    """A language model's classes are tokens on the last axis: predict scores the next token after each window's
    last position, as onnxruntime's softmax of the exported model's logits there."""
    tokenizers = pytest.importorskip("tokenizers")
    ort = pytest.importorskip("onnxruntime")
    from odtrain.text import load_tokenizer, token_ids, windows

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = os.path.join(root, "tests", "data", "decoders", "llama", "torchscript17.onnx")
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(8))
    (here / "corpus.txt").write_text(text, encoding="utf-8")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.train([str(here / "corpus.txt")], tokenizers.trainers.BpeTrainer(
        vocab_size=256, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(here / "tokenizer.json"))
    code, out, err = odtrain_main(capsys, "prepare", model, "-o", "lm", "--lora-rank", "2", "--lora-targets",
                                  "*q_proj.weight")
    assert code == 0, err
    code, out, err = odtrain_main(capsys, "predict", "lm", "corpus.txt", "--tokenizer", "tokenizer.json",
                                  "--seq-len", "16", "--top", "3", "--json")
    assert code == 0, err
    results = json.loads(out)
    code, _, err = odtrain_main(capsys, "export", "lm", "-o", "lm.onnx")
    assert code == 0, err
    ids, _ = windows(token_ids(str(here / "corpus.txt"), load_tokenizer(str(here / "tokenizer.json"))), 16)
    session = ort.InferenceSession("lm.onnx", providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][:, -1].astype(np.float64)
    expected = np.exp(logits - logits.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    assert [r["input"] for r in results] == [f"corpus.txt window {i}" for i in range(len(ids))]
    for result, row in zip(results, expected):
        tokens = [item["class"] for item in result["top"]]
        np.testing.assert_allclose([item["probability"] for item in result["top"]], row[tokens], rtol=1e-4)
        assert row[tokens[-1]] >= np.sort(row)[-3] - 1e-6  # the three most probable (ties aside)
        assert result["top"][0]["name"] == repr(load_tokenizer(str(here / "tokenizer.json")).decode([tokens[0]]))
