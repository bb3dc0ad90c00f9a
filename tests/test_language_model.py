"""Training a language model on a text file: windows of a tokenized text as inputs and next-token labels,
`odtrain train --data corpus.txt --tokenizer tokenizer.json --seq-len N`, and `odtrain eval` reporting the loss
and perplexity. The tokenizer is trained with `tokenizers` on the text odtrain ships (odtrain/data/coriolanus.txt);
nothing is downloaded."""
import json
import math
import pathlib

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import odtrain_main
from odtrain.data_loading import InputSpec
from odtrain.graph.errors import ArgumentError, InputError
from odtrain.text import load_text, windows
from oracles import make_model

tokenizers = pytest.importorskip("tokenizers", reason="text needs the tokenizers package (pip install .[text])")
CORPUS = pathlib.Path(__file__).parent.parent / "odtrain" / "data" / "coriolanus.txt"
VOCAB, WIDTH = 320, 16  # byte-level BPE: 256 bytes and 64 merges


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A byte-level BPE tokenizer of VOCAB tokens trained on the shipped text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([str(CORPUS)], trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def tiny_lm(seed=0):
    """Embedding, attention_mask applied to it, a ReLU layer and a projection to the vocabulary."""
    rng = np.random.default_rng(seed)
    params = {"embed": (rng.standard_normal((VOCAB, WIDTH)) * 0.1).astype(np.float32),
              "w": (rng.standard_normal((WIDTH, WIDTH)) * 0.3).astype(np.float32),
              "head": (rng.standard_normal((WIDTH, VOCAB)) * 0.1).astype(np.float32),
              "axis": np.array([-1], np.int64)}
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h"]),
             helper.make_node("Cast", ["attention_mask"], ["mask"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mask", "axis"], ["mask3"]),
             helper.make_node("Mul", ["h", "mask3"], ["masked"]),
             helper.make_node("MatMul", ["masked", "w"], ["z"]), helper.make_node("Relu", ["z"], ["r"]),
             helper.make_node("Add", ["r", "masked"], ["residual"]),
             helper.make_node("MatMul", ["residual", "head"], ["logits"])]
    return make_model(nodes, params, inputs=[("input_ids", np.int64, ["batch", "seq"]),
                                             ("attention_mask", np.int64, ["batch", "seq"])],
                      outputs=[("logits", np.float32, ["batch", "seq", VOCAB])])


def test_windows_are_inputs_and_their_next_tokens():
    inputs, labels = windows(np.arange(10, dtype=np.int64), 3)
    np.testing.assert_array_equal(inputs, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    np.testing.assert_array_equal(labels, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    with pytest.raises(InputError, match="too few for one window"):
        windows(np.arange(3, dtype=np.int64), 3)
    with pytest.raises(ArgumentError, match="positive integer"):
        windows(np.arange(9, dtype=np.int64), 0)


def test_text_feeds_tokens_mask_positions_and_labels(tokenizer_file):
    specs = [InputSpec("input_ids", np.dtype(np.int64), ("batch", "seq")),
             InputSpec("attention_mask", np.dtype(np.int64), ("batch", "seq")),
             InputSpec("position_ids", np.dtype(np.int64), ("batch", "seq")),
             InputSpec("labels", np.dtype(np.int64), ("batch", "seq"), is_label=True)]
    dataset = load_text(CORPUS, tokenizer_file, specs, seq_len=32)
    tokens, mask, positions, labels = dataset.arrays
    ids = tokenizers.Tokenizer.from_file(str(tokenizer_file)).encode(CORPUS.read_text(encoding="utf-8")).ids
    assert len(dataset) == (len(ids) - 1) // 32 and tokens.shape == (len(dataset), 32)
    np.testing.assert_array_equal(tokens.reshape(-1), ids[:tokens.size])
    np.testing.assert_array_equal(labels.reshape(-1), ids[1:tokens.size + 1])
    assert mask.all() and (positions == np.arange(32)).all()
    with pytest.raises(InputError, match="none of them"):
        load_text(CORPUS, tokenizer_file, specs[:1] + [InputSpec("pixels", np.dtype(np.float32), ("batch", 3))]
                  + specs[3:], seq_len=32)


def test_train_on_a_text_file_lowers_perplexity(tmp_path, capsys, tokenizer_file):
    onnx.save(tiny_lm(), tmp_path / "lm.onnx")
    code, out, err = odtrain_main(capsys, "prepare", tmp_path / "lm.onnx", "-o", tmp_path / "a", "--lr", "0.01")
    assert code == 0, err
    text = ["--data", CORPUS, "--tokenizer", tokenizer_file, "--seq-len", "32"]
    code, out, err = odtrain_main(capsys, "eval", tmp_path / "a", *text, "--json")
    assert code == 0, err
    before = json.loads(out)
    assert before["perplexity"] == pytest.approx(math.exp(before["loss"]))
    assert before["labels"] == before["samples"] * 32
    code, out, err = odtrain_main(capsys, "train", tmp_path / "a", *text, "--epochs", "2", "--batch-size", "16",
                                  "--seed", "3")
    assert code == 0, err
    assert f"training on {before['samples']:,} samples" in out
    code, out, err = odtrain_main(capsys, "eval", tmp_path / "a", *text)
    assert code == 0, err
    after = float(out.split("perplexity ")[1].split(",")[0])
    assert after < 0.5 * before["perplexity"], (before, out)


def test_a_text_file_in_another_encoding_reads_with_encoding(tmp_path, capsys, tokenizer_file):
    text = "Caf\u00e9 na\u00efve \u00e0 la fa\u00e7on: " + CORPUS.read_text(encoding="utf-8")[:4000]
    (tmp_path / "latin.txt").write_bytes(text.encode("latin-1"))
    (tmp_path / "utf8.txt").write_text(text, encoding="utf-8")
    onnx.save(tiny_lm(), tmp_path / "lm.onnx")
    assert odtrain_main(capsys, "prepare", tmp_path / "lm.onnx", "-o", tmp_path / "a")[0] == 0
    window = ["--tokenizer", tokenizer_file, "--seq-len", "16", "--json"]
    code, _, err = odtrain_main(capsys, "eval", tmp_path / "a", "--data", tmp_path / "latin.txt", *window)
    assert code == 2 and f"text file '{tmp_path / 'latin.txt'}' is not utf-8 (byte 3: invalid continuation byte); " \
        "give its encoding with --encoding" in err and err.count("\n") == 1
    results = [json.loads(odtrain_main(capsys, "eval", tmp_path / "a", "--data", tmp_path / name, *window, *more)[1])
               for name, more in (("latin.txt", ["--encoding", "latin-1"]), ("utf8.txt", []))]
    assert results[0] == results[1]
    code, _, err = odtrain_main(capsys, "eval", tmp_path / "a", "--data", tmp_path / "latin.txt", *window,
                                "--encoding", "klingon")
    assert code == 2 and "'klingon' is not a text encoding" in err


@pytest.mark.parametrize("argv, message", [
    (["--data", CORPUS], "is text: give the tokenizer"),
    (["--data", CORPUS, "--tokenizer", "missing.json", "--seq-len", "8"], "tokenizer file 'missing.json' does not exist"),
    (["--data", CORPUS, "--tokenizer", "TOKENIZER"], "the window length (--seq-len N)"),
])
def test_text_errors_are_one_line(tmp_path, capsys, tokenizer_file, argv, message):
    onnx.save(tiny_lm(), tmp_path / "lm.onnx")
    assert odtrain_main(capsys, "prepare", tmp_path / "lm.onnx", "-o", tmp_path / "a")[0] == 0
    argv = [tokenizer_file if a == "TOKENIZER" else a for a in argv]
    code, _, err = odtrain_main(capsys, "eval", tmp_path / "a", *argv)
    assert code == 2 and message in err and err.count("\n") == 1
