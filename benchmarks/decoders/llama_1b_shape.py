"""Llama-3.2-1B's shape with random weights (no download), exported as users export it: the TorchScript
exporter at opset 17 (make_models.export_torchscript), its 4.9 GB of float32 weights as external data.

    python llama_1b_shape.py OUT/llama1b.onnx         # a venv with torch and transformers; about 9 GiB at its peak

Then, in odtrain's venv (peaks read from /proc/self/status, VmHWM, of a process of their own):

    odtrain prepare OUT/llama1b.onnx -o art --lora-rank 8 --lora-alpha 16 \\
        --lora-targets '*q_proj*' '*k_proj*' '*v_proj*' '*o_proj*' --frozen-dtype int4
    odtrain compile art --batch-size 1 --seq-len 256           # the kernel library: no Numba in training
    odtrain memory art --batch-size 1 --seq-len 256 --budget 180867136
    python memory_stages.py art --batch 1 --seq 256 --steps 10 --export-dtype int4 --memory-budget 180867136

Config: vocabulary 128,256, hidden 2,048, 16 layers, 32 heads, 8 key/value heads, MLP 8,192, tied embedding,
rope_theta 500,000; eager attention (plain MatMul/Softmax), no cache.
"""
import sys
import time

import make_models


SIZES = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0,
             max_position_embeddings=2048, rms_norm_eps=1e-5)


def main(path: str) -> None:
    started = time.time()
    model = make_models.build("llama", "eager", SIZES, seed=0)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, built in {time.time() - started:.0f} s")
    make_models.export_torchscript(model, path, 17)
    print(f"exported in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
