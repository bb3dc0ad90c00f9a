"""Text and sequence models.

TransformerTraining: one warm AdamW step of the reference 2-layer encoder (tests/data/transformer:
Gather embedding, attention, LayerNorm, Erf GELU), one eval step, peak memory and the arena size.
RecurrentTraining: one warm step of a GRU or LSTM next-token predictor built with onnx.helper
(embedding, recurrent layer, per-position logits, CrossEntropy over [batch, vocab, seq]).
MixerTraining: the same predictor with its positions mixed by one op instead: Einsum attention
("bid,bjd->bij" scores, "bij,bjd->bid" mixing) or CumSum running sums.
"""
import numpy as np

from . import common

MODEL = "transformer"
VOCAB, SEQ, CLASSES = 1000, 64, 4
WARMUP_STEPS = 2


def token_batch(batch: int, seq: int, vocab: int, classes: int, seed: int = common.SEED):
    """int64 tokens [batch, seq] in 0..vocab-1 and int64 labels [batch] in 0..classes-1."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (batch, seq), dtype=np.int64), rng.integers(0, classes, batch, dtype=np.int64)


class _Steps:
    def _train_step(self):
        self.module(*self.feeds)
        self.optimizer.step()
        self.module.lazy_reset_grad()

    def _eval_step(self):
        self.module.eval()
        self.module(*self.feeds)
        self.module.train()

    def _warm_up(self):
        for _ in range(WARMUP_STEPS):  # compiles or loads the kernels, binds the plans
            self._train_step()
            self._eval_step()


class TransformerTraining(_Steps):
    params = [4, 16]
    param_names = ["batch"]

    def setup(self, batch):
        self.module, self.optimizer = common.open_training(common.artifacts(MODEL))
        self.feeds = token_batch(batch, SEQ, VOCAB, CLASSES)
        self._warm_up()

    def time_train_step(self, batch):
        self._train_step()

    def time_eval_step(self, batch):
        self._eval_step()

    def peakmem_train_step(self, batch):
        self._train_step()

    def track_arena_bytes(self, batch):
        return common.last_plan(self.module).arena_bytes

    track_arena_bytes.unit = "bytes"


def _recurrent_model(kind: str, vocab=64, embed=32, hidden=64):
    from onnx import helper

    rng = np.random.default_rng(common.SEED)
    gates = 3 if kind == "GRU" else 4
    init = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    params = {"emb": init(vocab, embed), "W": init(1, gates * hidden, embed), "R": init(1, gates * hidden, hidden),
              "B": np.zeros((1, 2 * gates * hidden), np.float32), "head": init(hidden, vocab),
              "axes": np.array([1], np.int64)}
    nodes = [helper.make_node("Gather", ["emb", "tokens"], ["e"]),
             helper.make_node("Transpose", ["e"], ["e_t"], perm=[1, 0, 2]),
             helper.make_node(kind, ["e_t", "W", "R", "B"], ["Y"], hidden_size=hidden),
             helper.make_node("Squeeze", ["Y", "axes"], ["h"]), helper.make_node("MatMul", ["h", "head"], ["l"]),
             helper.make_node("Transpose", ["l"], ["output"], perm=[1, 2, 0])]
    return _next_token_model("recurrent", nodes, params, vocab), vocab


def _next_token_model(name: str, nodes, params: dict, vocab: int):
    """A model from tokens [batch, seq] to logits [batch, vocab, seq] ('output')."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", vocab, "seq"])],
        [numpy_helper.from_array(v, name=k) for k, v in params.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


class RecurrentTraining(_Steps):
    params = ["GRU", "LSTM"]
    param_names = ["layer"]
    build = staticmethod(_recurrent_model)

    def setup(self, layer):
        from odtrain import artifacts

        model, vocab = self.build(layer)
        directory = common.scratch_dir(f"{layer}-artifacts")
        params = [t.name for t in model.graph.initializer if t.name != "axes"]
        artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=directory)
        self.module, self.optimizer = common.open_training(directory)
        rng = np.random.default_rng(common.SEED)
        tokens = rng.integers(0, vocab, (32, 24), dtype=np.int64)
        self.feeds = (tokens, np.roll(tokens, -1, axis=1))
        self._warm_up()

    def time_train_step(self, layer):
        self._train_step()


def _mixer_model(kind: str, vocab=64, embed=32):
    from onnx import helper

    rng = np.random.default_rng(common.SEED)
    init = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    params = {"emb": init(vocab, embed), "wq": init(embed, embed), "head": init(embed, vocab)}
    if kind == "Einsum":
        params["wk"] = init(embed, embed)
        mixing = [helper.make_node("MatMul", ["e", "wq"], ["q"]), helper.make_node("MatMul", ["e", "wk"], ["k"]),
                  helper.make_node("Einsum", ["q", "k"], ["scores"], equation="bid,bjd->bij"),
                  helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
                  helper.make_node("Einsum", ["p", "e"], ["h"], equation="bij,bjd->bid")]
    else:
        params["axes"] = np.array(1, np.int64)
        mixing = [helper.make_node("MatMul", ["e", "wq"], ["q"]), helper.make_node("CumSum", ["q", "axes"], ["c"]),
                  helper.make_node("Tanh", ["c"], ["h"])]
    nodes = [helper.make_node("Gather", ["emb", "tokens"], ["e"]), *mixing,
             helper.make_node("MatMul", ["h", "head"], ["l"]),
             helper.make_node("Transpose", ["l"], ["output"], perm=[0, 2, 1])]
    return _next_token_model("mixer", nodes, params, vocab), vocab


class MixerTraining(RecurrentTraining):
    params = ["Einsum", "CumSum"]
    param_names = ["mixer"]
    build = staticmethod(_mixer_model)
