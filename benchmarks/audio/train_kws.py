"""Pre-train the DS-CNN keyword spotter on the base voices and export it with its log-mel front end.

    /work/torchref/bin/python benchmarks/audio/train_kws.py DATA benchmarks/audio/kws.onnx

DATA is make_keywords.py's output (base_train, known_test). The model takes the waveform [batch, 16000]
at 16 kHz and computes its own features: torch.stft (n_fft 512, a 400-sample periodic Hann window, hop
160, centred with reflection: ONNX STFT), power, a [257, 40] HTK mel matrix (MatMul) and log(mel + 1e-6),
then BatchNorm over the features and a depthwise-separable CNN: a 3x3 convolution with stride 2 and four
depthwise 3x3 + pointwise 1x1 blocks of CHANNELS channels (BatchNorm and ReLU after each), average
pooling and a linear layer of 8 keywords. Exported by TorchScript at opset 17 in training mode (BatchNorm
keeps its training form) without constant folding.
"""
import os
import sys
import wave

import numpy as np
import torch
from torch import nn

WORDS = ("down", "go", "left", "no", "right", "stop", "up", "yes")  # sorted: odtrain numbers a folder's classes so
RATE, N_FFT, WIN, HOP, N_MELS, CHANNELS = 16000, 512, 400, 160, 40, 48


def mel_matrix() -> np.ndarray:
    """[n_fft//2 + 1, n_mels] HTK triangles, torchaudio's melscale_fbanks with norm None."""
    mel = lambda hz: 2595.0 * np.log10(1.0 + hz / 700.0)  # noqa: E731
    points = 700.0 * (10 ** (np.linspace(mel(0.0), mel(RATE / 2), N_MELS + 2) / 2595.0) - 1.0)
    freqs = np.linspace(0, RATE // 2, N_FFT // 2 + 1)
    slopes = points[None, :] - freqs[:, None]
    widths = np.diff(points)
    return np.maximum(0.0, np.minimum(-slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]))


class LogMel(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("window", torch.hann_window(WIN, periodic=True))
        self.register_buffer("mel", torch.tensor(mel_matrix(), dtype=torch.float32))

    def forward(self, audio):  # [batch, samples] -> [batch, 1, n_mels, frames]
        spec = torch.stft(audio, N_FFT, hop_length=HOP, win_length=WIN, window=self.window, center=True,
                          pad_mode="reflect", return_complex=False)
        power = spec.pow(2).sum(-1)  # [batch, bins, frames]
        mel = torch.matmul(power.transpose(1, 2), self.mel)  # [batch, frames, n_mels]
        return torch.log(mel + 1e-6).transpose(1, 2).unsqueeze(1)


def block(cin, cout, kernel, stride=1, groups=1):
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU()]


class KeywordSpotter(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = LogMel()
        layers = [nn.BatchNorm2d(1)] + block(1, CHANNELS, 3, stride=2)
        for _ in range(4):
            layers += block(CHANNELS, CHANNELS, 3, groups=CHANNELS) + block(CHANNELS, CHANNELS, 1)
        self.body = nn.Sequential(*layers)
        self.classifier = nn.Linear(CHANNELS, len(WORDS))

    def forward(self, audio):
        x = self.body(self.features(audio))
        return self.classifier(x.mean(dim=(2, 3)))


def load(folder):
    waves, labels = [], []
    for index, word in enumerate(WORDS):
        directory = os.path.join(folder, word)
        for name in sorted(os.listdir(directory)):
            with wave.open(os.path.join(directory, name)) as reader:
                waves.append(np.frombuffer(reader.readframes(reader.getnframes()), "<i2") / 32768.0)
            labels.append(index)
    return torch.tensor(np.stack(waves), dtype=torch.float32), torch.tensor(labels)


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(data, out, epochs=30):
    torch.manual_seed(0)
    x, y = load(os.path.join(data, "base_train"))
    known_x, known_y = load(os.path.join(data, "known_test"))
    model = KeywordSpotter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 3e-3, total_steps=epochs * (-(-len(y) // 32)))
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(y))
        for start in range(0, len(y), 32):
            batch = order[start:start + 32]
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}, known voices {accuracy(model, known_x, known_y):.1%}",
              flush=True)
    for split in ("new_test",):
        if os.path.isdir(os.path.join(data, split)):
            print(f"{split}: {accuracy(model, *load(os.path.join(data, split))):.1%}")
    model.train()
    torch.onnx.export(model, x[:2], out, dynamo=False, opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, input_names=["audio"], output_names=["logits"],
                      dynamic_axes={"audio": {0: "batch"}, "logits": {0: "batch"}})
    torch.save(model.state_dict(), out.replace(".onnx", ".pt"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
