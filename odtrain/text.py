"""Text for language models: a text file, a `tokenizers` tokenizer, and windows of next-token prediction.

    odtrain.training.fit("artifacts", TextSource("corpus.txt", "tokenizer.json", seq_len=128), epochs=1)
    dataset = odtrain.text.load_text("corpus.txt", "tokenizer.json", inputs, seq_len=128)

The file is read as UTF-8 (or the `encoding` given) and encoded whole by a Hugging Face `tokenizers` tokenizer (a
tokenizer.json; the optional package, `pip install tokenizers`). Its ids are cut into
consecutive, non-overlapping windows of seq_len + 1 tokens; a window's first seq_len tokens are
the inputs and its last seq_len the labels (each token's next token). A trailing piece shorter
than a window is dropped. Training visits the windows in the seeded order of
odtrain.training.epoch_order, like any other Dataset.

The model's inputs are fed by name: the token input (`input_ids`, else the only integer data
input) gets the windows, `attention_mask` ones and `position_ids` 0..seq_len-1 (every window is
whole), the label input the next tokens. Any other input is refused, naming it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .data_loading import Dataset, InputSpec, from_arrays
from .graph.errors import ArgumentError, ArtifactNotFoundError, InputError

TOKEN_INPUTS = ("input_ids", "ids", "tokens", "input")


@dataclass(frozen=True)
class TextSource:
    """A text file to train or evaluate on, as `fit` and `evaluate` take data: windows of `seq_len` tokens."""

    path: str
    tokenizer: str
    seq_len: int
    encoding: str = "utf-8"

    def dataset(self, inputs: list[InputSpec]) -> Dataset:
        return load_text(self.path, self.tokenizer, inputs, self.seq_len, self.encoding)


def load_tokenizer(path):
    """A `tokenizers.Tokenizer` from a tokenizer.json file."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ArgumentError("reading text needs the tokenizers package: pip install tokenizers") from None
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArtifactNotFoundError(f"tokenizer file '{path}' does not exist")
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises its own Exception subclass
        raise InputError(f"tokenizer file '{path}' is not a tokenizers JSON file ({error})") from None


def token_ids(text_path, tokenizer, encoding: str = "utf-8") -> np.ndarray:
    """The ids of the whole text file, read in `encoding`, int64."""
    import codecs

    text_path = os.fspath(text_path)
    if not os.path.isfile(text_path):
        raise ArtifactNotFoundError(f"text file '{text_path}' does not exist")
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ArgumentError(f"'{encoding}' is not a text encoding Python knows (e.g. utf-8, latin-1, cp1252, "
                            "utf-16)") from None
    try:
        with open(text_path, encoding=encoding) as handle:
            text = handle.read()
    except UnicodeDecodeError as error:
        raise InputError(f"text file '{text_path}' is not {encoding} (byte {error.start}: {error.reason}); give "
                         "its encoding with --encoding (encoding=...), e.g. latin-1, cp1252 or utf-16") from None
    return np.asarray(tokenizer.encode(text).ids, dtype=np.int64)


def windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels), each [windows, seq_len]: consecutive windows of seq_len + 1 tokens, labels one ahead."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ArgumentError(f"the sequence length must be a positive integer, got {seq_len!r}")
    count = (len(ids) - 1) // seq_len
    if count < 1:
        raise InputError(f"the text has {len(ids)} tokens, too few for one window of {seq_len + 1}; give more text "
                         "or a shorter --seq-len")
    inputs = ids[:count * seq_len].reshape(count, seq_len)
    labels = ids[1:count * seq_len + 1].reshape(count, seq_len)
    return inputs, labels


def _token_input(inputs: list[InputSpec]) -> InputSpec:
    data = [s for s in inputs if not s.is_label]
    for name in TOKEN_INPUTS:
        for spec in data:
            if spec.name == name:
                return spec
    integers = [s for s in data if np.dtype(s.dtype).kind in "iu" and s.name not in ("attention_mask", "position_ids")]
    if len(integers) != 1:
        raise InputError(f"none of the model's inputs ({', '.join(s.describe() for s in inputs)}) is clearly its "
                         "token ids; name it input_ids")
    return integers[0]


def load_text(text_path, tokenizer_path, inputs: list[InputSpec], seq_len: int, encoding: str = "utf-8") -> Dataset:
    """A Dataset of next-token windows of `text_path` (read in `encoding`) for a language model with these inputs."""
    labels = [s for s in inputs if s.is_label]
    if len(labels) != 1:
        raise ArgumentError(f"text trains a model with one label input (next tokens); this one takes "
                            f"{', '.join(s.describe() for s in inputs)}")
    tokenizer = load_tokenizer(tokenizer_path)
    tokens, next_tokens = windows(token_ids(text_path, tokenizer, encoding), seq_len)
    token_input = _token_input(inputs)
    arrays = {token_input.name: tokens, labels[0].name: next_tokens}
    for spec in inputs:
        if spec.name == "attention_mask":
            arrays[spec.name] = np.ones_like(tokens)
        elif spec.name == "position_ids":
            arrays[spec.name] = np.broadcast_to(np.arange(seq_len, dtype=np.int64), tokens.shape).copy()
        elif spec.name not in arrays:
            raise InputError(f"text feeds token ids, attention_mask and position_ids; the model's input "
                             f"{spec.describe()} is none of them")
    return from_arrays(arrays, inputs, source=f"text file '{os.fspath(text_path)}'")
