"""Federated LoRA on a decoder: three simulated clients, each with its own text, exchange adapters only.

    python federated_lora.py [MODEL.onnx] [--clients 3 --rounds 3 --epochs 1 --seq 32 --batch 8]

MODEL.onnx defaults to the Llama-style decoder of tests/data/decoders (vocabulary 256, hidden 64, 2
layers). A byte-level BPE tokenizer of the model's vocabulary size is trained on the text odtrain
ships (odtrain/data/coriolanus.txt); its first 90% is cut into one contiguous part per client (each
device holds its own user's text), the rest is held out. The artifacts carry LoRA adapters of rank 8
(alpha 16) on every projection; each round, every client starts from the global adapters, trains
on its part (odtrain.federated.train_local) and returns its difference; the server applies their
example-weighted mean (odtrain.federated.fedavg).

Printed, one JSON object: the bytes a client uploads (and downloads) per round, which is the float32
trainable buffer (odtrain.federated.get_parameters: the adapters), against the float32 bytes of the
parameters full fine-tuning would train and send; and the held-out loss and perplexity before and
after the rounds (odtrain.training.evaluate). The frozen weights are checked unchanged.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "data" / "decoders" / "llama" / "torchscript17.onnx"
CORPUS = ROOT / "odtrain" / "data" / "coriolanus.txt"
RANK, ALPHA, TARGETS, LR = 8, 16.0, ["*proj.weight"], 3e-3
HELD_OUT = 0.1


def train_tokenizer(text_path, vocab_size: int, path) -> None:
    """A byte-level BPE tokenizer of exactly the model's vocabulary size, trained on the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(text_path)], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))


def split_text(folder: pathlib.Path, clients: int) -> tuple[list[pathlib.Path], pathlib.Path]:
    """One contiguous part of the text's first 90% per client, and the held-out rest (whole lines)."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    cut = int(len(lines) * (1 - HELD_OUT))
    bounds = np.linspace(0, cut, clients + 1).astype(int)
    parts = []
    for k in range(clients):
        parts.append(folder / f"client{k}.txt")
        parts[-1].write_text("".join(lines[bounds[k]:bounds[k + 1]]), encoding="utf-8")
    held_out = folder / "held_out.txt"
    held_out.write_text("".join(lines[cut:]), encoding="utf-8")
    return parts, held_out


def full_fine_tuning_bytes(model) -> int:
    """The float32 bytes of the parameters full fine-tuning trains (the default selection): what it would send."""
    from odtrain.graph.onnx_io import load_graph
    from odtrain.graph.parameters import default_selection

    graph = load_graph(str(model), "model")
    return sum(4 * int(np.asarray(graph.initializers[n]).size) for n in default_selection(graph).trainable)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(MODEL))
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)

    from odtrain import artifacts, federated as fl
    from odtrain.api import CheckpointState
    from odtrain.graph.onnx_io import load_graph
    from odtrain.text import TextSource
    from odtrain.training import Session, evaluate

    with tempfile.TemporaryDirectory() as scratch:
        folder = pathlib.Path(scratch)
        vocab = load_graph(args.model, "model").value_types["logits"].shape[-1]
        train_tokenizer(CORPUS, vocab, folder / "tokenizer.json")
        parts, held_out = split_text(folder, args.clients)
        directory = folder / "artifacts"
        generated = artifacts.generate_artifacts(
            args.model, loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1, ignore_index=-100,
            optimizer=artifacts.OptimType.AdamW, artifact_directory=directory,
            lora=artifacts.LoraConfig(RANK, ALPHA, TARGETS))
        trainer = fl.open_artifacts(directory)
        frozen = {n: trainer.state.parameters[n].data.copy() for n in generated.frozen}
        inputs = Session(directory, with_optimizer=False).inputs
        datasets = [TextSource(str(p), str(folder / "tokenizer.json"), args.seq).dataset(inputs) for p in parts]
        held = TextSource(str(held_out), str(folder / "tokenizer.json"), args.seq)

        def held_out_metrics():
            CheckpointState.save_checkpoint(trainer.state, directory / "checkpoint")
            result = evaluate(directory, held, batch_size=args.batch)
            return {"loss": round(result["loss"], 4), "perplexity": round(result["perplexity"], 2)}

        before = held_out_metrics()
        global_buffer = fl.get_parameters(trainer.module)
        trainer.optimizer.set_learning_rate(LR)
        rounds = []
        for round_ in range(args.rounds):
            deltas, counts, losses, uploads = [], [], [], []
            for k, dataset in enumerate(datasets):
                fl.set_parameters(trainer.module, global_buffer)  # the download
                *x, y = dataset.arrays
                delta, count, metrics = fl.train_local(trainer.module, trainer.optimizer, tuple(x), y, args.epochs,
                                                       args.batch, seed=[0, round_, k])
                uploads.append(fl.apply_difference(global_buffer, delta).nbytes)  # float32 parameters, as Flower's
                deltas.append(delta)
                counts.append(count)
                losses.append(round(metrics["train_loss"], 4))
            global_buffer = fl.apply_difference(global_buffer, fl.fedavg(deltas, counts))
            rounds.append({"round": round_ + 1, "client_train_loss": losses, "upload_bytes_per_client": uploads})
        fl.set_parameters(trainer.module, global_buffer)
        after = held_out_metrics()
        unchanged = all(np.array_equal(trainer.state.parameters[n].data, v) for n, v in frozen.items())
        adapters = global_buffer.nbytes
        full = full_fine_tuning_bytes(args.model)
        print(json.dumps({
            "model": str(args.model), "clients": args.clients, "windows_per_client": [len(d) for d in datasets],
            "seq_len": args.seq, "lora": {"rank": RANK, "alpha": ALPHA, "targets": TARGETS},
            "trainable_tensors": len(generated.trainable), "frozen_weights_unchanged": unchanged,
            "bytes_per_client_per_round": {"upload": adapters, "download": adapters},
            "full_fine_tuning_bytes_per_client_per_round": {"upload": full, "download": full},
            "ratio": round(full / adapters, 1), "held_out_before": before, "held_out_after": after,
            "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
