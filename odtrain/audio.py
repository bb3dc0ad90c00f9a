"""Audio clips as training data: WAV reading, resampling, length fitting and log-mel features, with numpy.

A folder `clips/<label>/*.wav` trains a classifier: one sub-folder per class, the label the class's
index in sorted order, as for images (odtrain/data_loading.py).

- Reading: WAV files are parsed here (RIFF chunks): PCM of 8 (unsigned), 16, 24 and 32 bits, IEEE float
  of 32 and 64 bits, WAVE_FORMAT_EXTENSIBLE of these; several channels are averaged to mono. Other
  formats (FLAC, OGG, ...) go through the optional `soundfile` package (pip install soundfile).
  A data chunk that declares more bytes than the file holds is truncated, unless its size is a
  streaming placeholder (`_STREAMED`). A file that is empty, truncated, not RIFF/WAVE, of another
  encoding (ADPCM, μ-law, 12-bit) or holding less than MIN_FRACTION of the model's length raises an
  InputError naming it; `skip_unreadable` skips such files instead and counts them.
- Resampling (`resample`) to the model's rate: band-limited interpolation with a Kaiser-windowed sinc
  (β = 8.6, 16 zero crossings each side, cut off at 0.95 of the lower Nyquist frequency), evaluated at
  each output instant; rational rates make the filter's phases repeat, so each is computed once.
- Length (`fit_length`): a clip shorter than the model's input is padded with zeros equally on both
  sides (the odd sample at the end); a longer one keeps its centre. Keyword clips hold the word in the
  middle, so centring keeps it whole.
- Features (`log_mel`): torchaudio's `MelSpectrogram` (periodic Hann window of win_length samples centred
  in n_fft, centre padding by reflection, power 2, HTK mel scale, no filter normalisation, 0 Hz to
  Nyquist) followed by log(mel + LOG_OFFSET); shape [n_mels, frames] with frames = 1 + samples // hop.
  It matches torch's stft and torchaudio's filter bank to 1e-4 relative in the mel power
  (tests/test_audio.py, reference values computed offline).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from .graph.errors import ArgumentError, InputError

AUDIO_EXTENSIONS = (".wav", ".wave", ".flac", ".ogg", ".oga", ".aiff", ".aif", ".mp3", ".opus")
MIN_FRACTION = 0.1  # a clip holding less than this share of the model's length is refused as too short
LOG_OFFSET = 1e-6
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
_STREAMED = (0xFFFFFFFF, 0x7FFFF000)  # data sizes of WAVs written to a pipe (sox, espeak-ng): read to the end
# The sample rates a clip may declare. Resampling holds a filter of about 16 input periods of the slower of
# the two rates, and the output grows by their ratio: a damaged rate field (1 Hz, 4 GHz) would make either
# gigabytes from a file of kilobytes. Recorders and codecs stay within these.
MIN_RATE, MAX_RATE = 1_000, 768_000
_FORMAT_NAMES = {2: "Microsoft ADPCM", 6: "A-law", 7: "μ-law", 17: "IMA ADPCM", 85: "MP3"}


def read_wav(path: str) -> tuple[np.ndarray, int]:
    """(float32 mono samples in [-1, 1], sample rate) of a WAV file; InputError naming the file otherwise."""
    with open(path, "rb") as file:
        data = file.read()
    if not data:
        raise InputError(f"audio file '{path}' is empty")
    if len(data) < 12 or data[:4] not in (b"RIFF", b"RIFX") or data[8:12] != b"WAVE":
        raise InputError(f"audio file '{path}' is not a RIFF/WAVE file (it starts {data[:12]!r}); convert it to WAV "
                         "or install soundfile (pip install soundfile)")
    if data[:4] == b"RIFX":
        raise InputError(f"audio file '{path}' is a big-endian WAV (RIFX); convert it to little-endian WAV")
    fmt, samples, offset = None, None, 12
    while offset + 8 <= len(data):
        chunk, size = data[offset:offset + 4], int.from_bytes(data[offset + 4:offset + 8], "little")
        body = data[offset + 8:offset + 8 + size]
        if chunk == b"fmt ":
            if len(body) < 16:
                raise InputError(f"audio file '{path}' has a damaged 'fmt ' chunk ({len(body)} bytes)")
            fmt = body
        elif chunk == b"data":
            if len(body) < size and size not in _STREAMED:
                raise InputError(f"audio file '{path}' is truncated: its data chunk declares {size} bytes, the file "
                                 f"holds {len(body)}")
            samples = body
            break
        offset += 8 + size + (size & 1)
    if fmt is None or samples is None:
        raise InputError(f"audio file '{path}' has no {'fmt ' if fmt is None else 'data'} chunk: it is damaged")
    return _decode(path, fmt, samples)


def _decode(path: str, fmt: bytes, body: bytes) -> tuple[np.ndarray, int]:
    tag, channels, rate = int.from_bytes(fmt[0:2], "little"), int.from_bytes(fmt[2:4], "little"), \
        int.from_bytes(fmt[4:8], "little")
    bits = int.from_bytes(fmt[14:16], "little")
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = int.from_bytes(fmt[24:26], "little")  # the sub-format GUID starts with the format tag
    width = bits // 8
    known = {_PCM: (8, 16, 24, 32), _FLOAT: (32, 64)}
    if tag not in known or bits not in known[tag]:
        encoding = _FORMAT_NAMES.get(tag, f"format tag {tag}")
        raise InputError(f"audio file '{path}' holds {encoding if tag not in known else ''}"
                         f"{f'{bits}-bit ' + ('PCM' if tag == _PCM else 'float') if tag in known else ''} samples; "
                         "odtrain reads 8/16/24/32-bit PCM and 32/64-bit float WAV (convert it, e.g. "
                         "`sox in.wav -b 16 out.wav`, or install soundfile: pip install soundfile)")
    if channels < 1 or not MIN_RATE <= rate <= MAX_RATE:
        raise InputError(f"audio file '{path}' declares {channels} channels at {rate} Hz: it is damaged (odtrain "
                         f"reads {MIN_RATE:,} to {MAX_RATE:,} Hz)")
    frame = width * channels
    count = len(body) // frame
    raw = np.frombuffer(body[:count * frame], dtype=np.uint8)
    if tag == _FLOAT:
        values = raw.view("<f4" if bits == 32 else "<f8").astype(np.float32)
    elif bits == 8:
        values = (raw.astype(np.float32) - 128) / 128
    elif bits == 24:
        triples = raw.reshape(-1, 3).astype(np.int32)
        values = ((triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 2**23
    else:
        values = raw.view("<i2" if bits == 16 else "<i4").astype(np.float32) / np.float32(2 ** (bits - 1))
    samples = values.reshape(count, channels).mean(axis=1, dtype=np.float32)
    if not np.isfinite(samples).all():
        raise InputError(f"audio file '{path}' holds samples that are not finite numbers")
    return samples, rate


def read_audio(path: str) -> tuple[np.ndarray, int]:
    """(float32 mono samples, rate) of a WAV file, or of another format through soundfile when installed."""
    if path.lower().endswith((".wav", ".wave")):
        return read_wav(path)
    try:
        import soundfile
    except ImportError:
        raise InputError(f"audio file '{path}' is not WAV; reading it needs soundfile: pip install soundfile "
                         "(or convert it to WAV)") from None
    try:
        values, rate = soundfile.read(path, dtype="float32", always_2d=True)
    except Exception as error:  # soundfile.LibsndfileError, RuntimeError
        raise InputError(f"audio file '{path}' cannot be read ({error})") from None
    if values.size == 0:
        raise InputError(f"audio file '{path}' is empty")
    return values.mean(axis=1, dtype=np.float32), int(rate)


def _kaiser_sinc(offsets: np.ndarray, cutoff: float, zeros: int, beta: float) -> np.ndarray:
    """The low-pass kernel at `offsets` (input samples): cutoff·sinc(cutoff·t) under a Kaiser window of
    `zeros` zero crossings of sinc(cutoff·t) each side."""
    half = zeros / cutoff
    inside = np.abs(offsets) < half
    window = np.where(inside, np.i0(beta * np.sqrt(np.clip(1 - (offsets / half) ** 2, 0, 1))) / np.i0(beta), 0)
    return cutoff * np.sinc(cutoff * offsets) * window


def resample(samples: np.ndarray, rate: int, target: int, zeros: int = 16, beta: float = 8.6) -> np.ndarray:
    """`samples` at `rate` Hz resampled to `target` Hz (module docstring); length ceil(n·target/rate)."""
    if rate == target:
        return np.asarray(samples, dtype=np.float32)
    g = math.gcd(int(rate), int(target))
    up, down = int(target) // g, int(rate) // g  # output n sits at input instant n·down/up
    cutoff = 0.95 * min(1.0, up / down)
    half = int(math.ceil(zeros / cutoff))
    count = -(-len(samples) * up // down)
    taps = np.arange(-half + 1, half + 1)
    phases = np.arange(up)
    weights = _kaiser_sinc(phases[:, None] / up - taps[None, :], cutoff, zeros, beta)  # [phase, tap]
    padded = np.concatenate([np.zeros(half), samples.astype(np.float64), np.zeros(half + 1)])
    n = np.arange(count)
    base, phase = n * down // up, n * down % up
    out = np.empty(count)
    for start in range(0, count, 4096):  # bounded memory: 4096 outputs by 2·half taps at a time
        part = slice(start, start + 4096)
        window = padded[base[part, None] + taps[None, :] + half]
        out[part] = (window * weights[phase[part]]).sum(axis=1)
    return out.astype(np.float32)


def fit_length(samples: np.ndarray, length: int) -> np.ndarray:
    """`samples` padded with zeros on both sides (the odd one at the end) or cropped around the centre."""
    have = len(samples)
    if have >= length:
        start = (have - length) // 2
        return samples[start:start + length]
    before = (length - have) // 2
    return np.concatenate([np.zeros(before, np.float32), samples, np.zeros(length - have - before, np.float32)])


def mel_filter_bank(n_freqs: int, n_mels: int, sample_rate: int, f_min: float = 0.0, f_max: float | None = None):
    """[n_freqs, n_mels] triangles on the HTK mel scale, as torchaudio's melscale_fbanks (norm None)."""
    f_max = sample_rate / 2 if f_max is None else f_max
    mel = lambda hz: 2595.0 * np.log10(1.0 + hz / 700.0)  # noqa: E731
    points = 700.0 * (10 ** (np.linspace(mel(f_min), mel(f_max), n_mels + 2) / 2595.0) - 1.0)
    freqs = np.linspace(0, sample_rate // 2, n_freqs)
    slopes = points[None, :] - freqs[:, None]
    widths = np.diff(points)
    down, up = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    return np.maximum(0.0, np.minimum(down, up))


@dataclass(frozen=True)
class LogMel:
    """Log-mel settings: rate (Hz), mel bands, window and hop (ms), DFT size (samples)."""

    sample_rate: int = 16000
    n_mels: int = 40
    win_ms: float = 25.0
    hop_ms: float = 10.0
    n_fft: int = 512

    @property
    def win_length(self) -> int:
        return int(round(self.sample_rate * self.win_ms / 1000))

    @property
    def hop_length(self) -> int:
        return int(round(self.sample_rate * self.hop_ms / 1000))

    def check(self) -> None:
        if not (self.sample_rate > 0 and self.n_mels > 0 and 0 < self.win_length <= self.n_fft
                and self.hop_length > 0):
            raise ArgumentError(f"log-mel settings {self}: need positive sizes and a window ({self.win_length} "
                                f"samples) no longer than --n-fft {self.n_fft}")

    def frames(self, samples: int) -> int:
        return 1 + samples // self.hop_length


def log_mel(samples: np.ndarray, settings: LogMel) -> np.ndarray:
    """float32 [n_mels, frames] log-mel features of mono samples at settings.sample_rate (module docstring)."""
    s = settings
    x = np.asarray(samples, dtype=np.float64)
    pad = s.n_fft // 2
    if len(x) <= pad:
        raise InputError(f"a clip of {len(x)} samples is too short for an n_fft of {s.n_fft}")
    x = np.pad(x, pad, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, s.n_fft)[::s.hop_length]
    window = np.zeros(s.n_fft)
    left = (s.n_fft - s.win_length) // 2
    n = np.arange(s.win_length)
    window[left:left + s.win_length] = 0.5 - 0.5 * np.cos(2 * np.pi * n / s.win_length)
    power = np.abs(np.fft.rfft(frames * window, axis=1)) ** 2
    mel = power @ mel_filter_bank(s.n_fft // 2 + 1, s.n_mels, s.sample_rate)
    return np.log(mel + LOG_OFFSET).T.astype(np.float32)


@dataclass
class AudioSource:
    """A folder of clips (`folder/<label>/*.wav`) and how to turn them into a model's input: the rate and
    length come from the model (its waveform input's length, or `features`' frames); `features` is None
    (waveform input) or LogMel settings. `skipped` lists (path, reason) of the files left out.
    `odtrain.data_loading.load_audio_folder` reads it into a Dataset."""

    folder: str
    features: LogMel | None = None
    sample_rate: int = 16000
    skip_unreadable: bool = False
    report: object = None  # called with one line when files were skipped
    skipped: list = field(default_factory=list)

    def length(self, spec) -> int:
        """Samples per clip: the waveform input's length, or what gives the feature input's frames."""
        dims = None if spec.shape is None else spec.shape[1:]
        if dims is None or not all(isinstance(d, int) for d in dims):
            raise InputError(f"input {spec.describe()} has no fixed size after the batch; clips can only be fitted "
                             "to a fixed length")
        if self.features is None:
            if int(np.prod(dims)) != max(dims):
                raise InputError(f"input {spec.describe()} is not a waveform [batch, samples]; for a features input "
                                 "give --audio-features log-mel")
            return int(max(dims))
        self.features.check()
        frames = int(np.prod(dims)) // self.features.n_mels
        if frames * self.features.n_mels != int(np.prod(dims)):
            raise InputError(f"input {spec.describe()} does not hold {self.features.n_mels} mel bands per frame; "
                             "give its --n-mels")
        return (frames - 1) * self.features.hop_length

    @property
    def rate(self) -> int:
        return self.features.sample_rate if self.features is not None else self.sample_rate

    def clip(self, path: str, length: int) -> np.ndarray:
        """One clip as the model's input: samples, or log-mel features; InputError naming the file."""
        rate = self.rate
        samples, clip_rate = read_audio(path)
        samples = resample(samples, clip_rate, rate)
        if len(samples) < MIN_FRACTION * length:
            raise InputError(f"audio file '{path}' is too short: {len(samples) / rate:.3f} s, under "
                             f"{MIN_FRACTION:.0%} of the model's {length / rate:.3f} s")
        samples = fit_length(samples, length)
        return samples if self.features is None else log_mel(samples, self.features)


def is_audio_folder(folder: str) -> bool:
    """Whether a class folder holds audio clips (the first file with a known extension decides)."""
    for name in sorted(os.listdir(folder)):
        directory = os.path.join(folder, name)
        if os.path.isdir(directory) and not name.startswith("."):
            for file in sorted(os.listdir(directory)):
                if file.lower().endswith(AUDIO_EXTENSIONS):
                    return True
    return False

