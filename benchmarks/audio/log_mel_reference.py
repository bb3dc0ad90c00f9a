"""Reference log-mel features for tests/test_audio.py, from PyTorch: torch.stft and torchaudio's mel filter
bank, as torchaudio.transforms.MelSpectrogram computes them (center=True, reflect padding, periodic Hann
window, power 2, HTK mel scale, norm None).

    /work/torchref/bin/python benchmarks/audio/log_mel_reference.py tests/data/log_mel_reference.npz

torchaudio's compiled extension does not load in that environment, so `melscale_fbanks` and its helpers are
taken from the installed torchaudio's source file at run time (they are pure torch). Writes the waveforms,
the settings and the float64 mel power of each case.
"""
import ast
import pathlib
import sys

import numpy as np
import torch

CASES = {  # sample rate, n_mels, win_length, hop_length, n_fft, seconds
    "16k": (16000, 40, 400, 160, 512, 0.5),
    "8k": (8000, 20, 256, 64, 256, 0.4),
}


def _torchaudio_functions():
    import importlib.util

    spec = importlib.util.find_spec("torchaudio")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "functional" / "functional.py"
    tree = ast.parse(path.read_text())
    wanted = {"_hz_to_mel", "_mel_to_hz", "_create_triangular_filterbank", "melscale_fbanks"}
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace = {"torch": torch, "math": __import__("math"), "Tensor": torch.Tensor,
                 "Optional": __import__("typing").Optional, "warnings": __import__("warnings")}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["melscale_fbanks"]


def main(out: str) -> None:
    melscale_fbanks = _torchaudio_functions()
    rng = np.random.default_rng(7)
    arrays = {}
    for name, (rate, n_mels, win, hop, n_fft, seconds) in CASES.items():
        t = np.arange(int(rate * seconds)) / rate
        wave = (0.5 * np.sin(2 * np.pi * (200 * t + 1500 * t * t)) + 0.05 * rng.standard_normal(t.size))
        wave = wave.astype(np.float32)
        x = torch.from_numpy(wave.astype(np.float64))
        spec = torch.stft(x, n_fft, hop_length=hop, win_length=win,
                          window=torch.hann_window(win, periodic=True, dtype=torch.float64), center=True,
                          pad_mode="reflect", normalized=False, onesided=True, return_complex=True).abs() ** 2
        bank = melscale_fbanks(n_fft // 2 + 1, 0.0, rate / 2, n_mels, rate, None, "htk").to(torch.float64)
        mel = torch.matmul(spec.transpose(-1, -2), bank).transpose(-1, -2)
        arrays[f"{name}/wave"] = wave
        arrays[f"{name}/settings"] = np.array([rate, n_mels, win, hop, n_fft], np.int64)
        arrays[f"{name}/mel_power"] = mel.numpy()
    np.savez_compressed(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
