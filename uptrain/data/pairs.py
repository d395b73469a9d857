"""Aligned examples for the `pairs` and `speech_pairs` objectives, read from JSON-lines files.

`pairs`: one object per line with a `source` and a `target` text (translation, summarisation).
`speech_pairs`: an `audio` (a PCM .wav file, relative to the jsonl file's folder, or an array of
samples at the feature extractor's rate) and its `text`; the checkpoint's feature extractor turns
audio into the encoder's input features.

Every example is read and checked when the data is loaded, before the run writes anything: a
missing field, an empty target, audio that does not decode or has another sampling rate is one
UptrainError naming the file and line. Sources are cut at `seq_len` tokens, targets at
`target_len`; a batch is padded to its longest example (labels with -100, which the loss skips).
Targets start with the family's prompt (`uptrain.objectives.prompts`: Whisper's language and task
tokens, mBART's and NLLB's language codes).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from uptrain import UptrainError, exception_line
from uptrain.architecture import find_architecture
from uptrain.data.blocks import check_indices
from uptrain.data.text import resolve_data
from uptrain.objectives import IGNORE_INDEX, Objective
from uptrain.objectives.prompts import TargetFraming, framed_target_ids
from uptrain.strict_json import parse_json

OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
PCM_TYPES = {1: np.uint8, 2: np.int16, 4: np.int32}  # sample width in bytes → numpy type


@dataclass(frozen=True)
class Where:
    """An example's place, for messages."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file} line {self.line}"


def _records(spec, key: str, objective: Objective) -> list[tuple[Where, dict]]:
    """Every JSON object of the jsonl files of `spec`, with its place."""
    source = resolve_data(spec, key)
    if source.builder != "json":
        what = "a Hub dataset" if not source.is_local else f"{source.builder} files"
        fields = " and ".join(f"`{f}`" for f in objective.fields)
        raise UptrainError(
            f"`{key}` ({source.label}) is {what}; objective {objective.name} reads .jsonl files with {fields} per line"
        )
    out = []
    for file in source.files:
        opener = OPENERS.get(Path(file).suffix, open)
        try:
            with opener(file, "rb") as f:
                lines = f.read().splitlines()
        except (OSError, EOFError, lzma.LZMAError) as err:
            raise UptrainError(f"`{key}`: cannot read {file}: {err}") from None
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            where = Where(file, number)
            record = parse_json(raw, f"`{key}` {where}")
            if not isinstance(record, dict):
                raise UptrainError(f"`{key}` {where}: a line must be a JSON object, not {type(record).__name__}")
            out.append((where, record))
    return out


def _field(record: dict, name: str, where: Where, key: str):
    if name not in record:
        raise UptrainError(f"`{key}` {where}: no `{name}` field (it has {', '.join(map(repr, record)) or 'none'})")
    return record[name]


def _text(record: dict, name: str, where: Where, key: str) -> str:
    value = _field(record, name, where, key)
    if not isinstance(value, str):
        raise UptrainError(f"`{key}` {where}: `{name}` is {type(value).__name__}, not text")
    if not value.strip():
        raise UptrainError(f"`{key}` {where}: `{name}` is empty")
    return value


def read_wav(path: Path, sampling_rate: int, what: str) -> np.ndarray:
    """The samples of a PCM .wav file as float32 in [-1, 1], channels averaged. Refuses, in one
    line, a file that does not decode, one recorded at another rate than `sampling_rate`, and one
    whose data ends inside a frame: every writer writes whole frames, so such a file was cut
    short while it was written or copied, and its clip may not be the one its text describes."""
    samples, rate = read_wav_at_its_rate(path, what)
    if rate != sampling_rate:
        raise UptrainError(
            f"{what}: {path} is sampled at {rate} Hz and the feature extractor reads {sampling_rate} Hz; resample it"
        )
    return samples


def read_wav_at_its_rate(path: Path, what: str) -> tuple[np.ndarray, int]:
    """`read_wav` for a file of any rate (espeak-ng's 22,050 Hz, before resampling): its samples and rate."""
    if path.suffix.lower() != ".wav":
        raise UptrainError(f"{what}: {path} is not a .wav file; convert it to 16-bit PCM wav (e.g. with ffmpeg)")
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except Exception as err:  # the stdlib's parser of a damaged header raises many types
        # (wave.Error, EOFError, RuntimeError from a chunk seek past its end, ...): one line says it.
        reason = str(err) if isinstance(err, (OSError, EOFError, wave.Error)) else exception_line(err)
        raise UptrainError(f"{what}: cannot decode {path} as PCM wav: {reason}") from None
    if width not in PCM_TYPES:
        raise UptrainError(f"{what}: {path} has {8 * width}-bit samples; use 8-, 16- or 32-bit PCM")
    if len(frames) % (channels * width):
        raise UptrainError(
            f"{what}: {path} ends inside a frame ({len(frames)} bytes of samples, {channels} channel(s) of "
            f"{width} bytes each): it was cut short; export it again"
        )
    samples = np.frombuffer(frames, dtype=PCM_TYPES[width]).astype(np.float32)
    if width == 1:
        samples = (samples - 128.0) / 128.0  # 8-bit wav is unsigned
    else:
        samples /= float(2 ** (8 * width - 1))
    samples = samples.reshape(-1, channels).mean(axis=1)
    if samples.size == 0:
        raise UptrainError(f"{what}: {path} holds no samples")
    return samples, rate


def _samples(value, where: Where, key: str) -> np.ndarray:
    """An `audio` value given as an array of samples."""
    if not value or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        raise UptrainError(f"`{key}` {where}: `audio` must be a wav path or a non-empty array of numbers")
    samples = np.asarray(value, dtype=np.float32)
    if not np.isfinite(samples).all():
        raise UptrainError(f"`{key}` {where}: `audio` holds a non-finite sample")
    return samples


class PairExamples:
    """Tokenized examples, batched on demand (`blocks.Blocks`: `take` gives a dict of padded
    tensors). Audio is decoded when loaded, to check it, and again for each batch it is in, so that
    only a batch's audio is held in memory. `records`: each example's place and JSON object, for
    readers of its text (evaluation's references)."""

    def __init__(
        self,
        sources: list,
        targets: list[list[int]],
        pad_id: int | None,
        feature_extractor=None,
        seconds: list[float] | None = None,
        records=None,
    ):
        self.sources, self.targets = sources, targets
        self.pad_id, self.feature_extractor = pad_id, feature_extractor
        self.seconds = seconds  # each clip's length in seconds (speech), for the plan
        self.records: list[tuple[Where, dict]] = records or []

    def __len__(self) -> int:
        return len(self.targets)

    def _audio(self, source) -> np.ndarray:
        if isinstance(source, np.ndarray):
            return source
        path, what = source
        return read_wav(path, self.feature_extractor.sampling_rate, what)

    def take(self, indices: list[int]) -> dict[str, torch.Tensor]:
        check_indices(indices, len(self))
        targets = [self.targets[i] for i in indices]
        width = max(map(len, targets))
        labels = torch.tensor([t + [IGNORE_INDEX] * (width - len(t)) for t in targets])
        if self.feature_extractor is not None:
            audio = [self._audio(self.sources[i]) for i in indices]
            fe = self.feature_extractor
            features = fe(audio, sampling_rate=fe.sampling_rate, return_tensors="pt")["input_features"]
            return {"input_features": features, "labels": labels}
        sources = [self.sources[i] for i in indices]
        width = max(map(len, sources))
        input_ids = torch.tensor([s + [self.pad_id] * (width - len(s)) for s in sources])
        attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sources])
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# Characters per token a long text's first prefix allows for: English runs about 4 to a token,
# so the first prefix is usually enough; a text of longer tokens takes a doubling or more.
PREFIX_CHARS_PER_TOKEN = 8


def cut_tokenized(encode: Callable[[list[str]], list[list[int]]], texts: list[str], max_tokens: int) -> list[list[int]]:
    """`encode(texts)` (a tokenizer call that truncates at about `max_tokens`), without tokenizing
    more of a long text than its first tokens need: a fast tokenizer tokenizes a text whole before
    it truncates (8 GB and over a minute for one 50 MB source). A text longer than twice
    PREFIX_CHARS_PER_TOKEN × `max_tokens` characters is tokenized from a prefix instead, doubled
    until the prefix gives all `max_tokens` ids and the prefix twice as long the same ones, or
    until the whole text is reached. A cut changes the tokens of the word it splits, which then
    lies past the ids kept: they are the whole text's (a single word longer than the prefix whose
    first tokens depend on its far end is the one case this cannot see)."""
    start = PREFIX_CHARS_PER_TOKEN * max_tokens + 64  # a few characters more for special tokens
    out = encode([t[: 2 * start] for t in texts])  # short texts (almost all): one call, whole
    for i, text in enumerate(texts):
        if len(text) > 2 * start:
            out[i] = _settled_prefix_ids(encode, text, start, max_tokens)
    return out


def _settled_prefix_ids(encode, text: str, chars: int, max_tokens: int) -> list[int]:
    while 2 * chars < len(text):
        cut, twice = encode([text[:chars], text[: 2 * chars]])
        # Settled: the prefix fills every place (a longer one cannot add a token), and doubling
        # it changes none (the cut fell past the tokens kept, not inside the last of them).
        if len(cut) >= max_tokens and cut == twice:
            return cut
        chars *= 2
    return encode([text])[0]  # no shorter prefix settled: the whole text


def _target_ids(tokenizer, texts: list[str], target_len: int, decoder_start: int | None) -> list[list[int]]:
    """Label ids as the tokenizer makes targets (`text_target`: Marian has a target vocabulary; mBART
    and NLLB write their language codes), cut at `target_len` before the tokenizer's closing special
    tokens (EOS; mBART's EOS and language code), which stay; a tokenizer that closes with none gets
    EOS. A leading decoder start token is dropped: the model puts it in front of the labels itself."""
    eos = tokenizer.eos_token_id
    closing_ids = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}  # an unknown word is text
    out = []
    encode = lambda part: tokenizer(text_target=part, truncation=True, max_length=target_len + 1)["input_ids"]  # noqa: E731
    for ids in cut_tokenized(encode, texts, target_len + 1):
        if ids and decoder_start is not None and ids[0] == decoder_start:
            ids = ids[1:]
        body = len(ids)
        while body and ids[body - 1] in closing_ids:
            body -= 1
        closing = ids[body:] or [eos]
        out.append(ids[:body][: target_len - len(closing)] + closing)
    return out


def load_pairs(
    spec,
    key: str,
    objective: Objective,
    tokenizer,
    model_path: str,
    model_config: dict,
    seq_len: int,
    target_len: int,
    framing: TargetFraming | None = None,
) -> PairExamples:
    """The examples of one data key for `objective` (one that reads examples), every one checked
    (see the module's docstring); `framing`: the family's prompt (`uptrain.objectives.prompts`)."""
    records = _records(spec, key, objective)
    if not records:
        raise UptrainError(f"`{key}` holds no examples")
    arch = find_architecture(model_config.get("model_type"))
    positions = arch.target_positions(model_config, model_path) if arch is not None else None
    if positions is not None and target_len > positions:
        raise UptrainError(
            f"target_len {target_len} is beyond the decoder's {positions} positions ({model_path}); set `target_len`"
        )
    source_name, target_name = objective.fields
    targets = [_text(r, target_name, where, key) for where, r in records]
    if framing is not None and framing.label_prefix is not None:
        label_ids = framed_target_ids(tokenizer, targets, target_len, framing)
    else:
        label_ids = _target_ids(tokenizer, targets, target_len, model_config.get("decoder_start_token_id"))
    if objective.encoder_reads == "text":
        # Sources are padded with the tokenizer's padding token, which the objective's special
        # tokens require (`special_tokens_for` refused a tokenizer without one).
        prefix = framing.source_prefix if framing is not None else ""
        texts = [prefix + _text(r, source_name, where, key) for where, r in records]
        sources = cut_tokenized(
            lambda part: tokenizer(part, truncation=True, max_length=seq_len)["input_ids"], texts, seq_len
        )
        return PairExamples(sources, label_ids, tokenizer.pad_token_id, records=records)
    feature_extractor = _load_feature_extractor(model_path)
    sources, seconds = [], []
    for where, r in records:
        value = _field(r, source_name, where, key)
        if isinstance(value, str):
            path = Path(value) if Path(value).is_absolute() else Path(where.file).parent / value
            what = f"`{key}` {where}"
            # Decoded now: refused before anything is written.
            samples = read_wav(path, feature_extractor.sampling_rate, what)
            sources.append((path, what))
        elif isinstance(value, list):
            samples = _samples(value, where, key)
            sources.append(samples)
        else:
            raise UptrainError(f"`{key}` {where}: `audio` must be a wav path or an array of samples")
        seconds.append(samples.size / feature_extractor.sampling_rate)
    return PairExamples(sources, label_ids, None, feature_extractor, seconds=seconds, records=records)


def _load_feature_extractor(model_path: str):
    from transformers import AutoFeatureExtractor

    try:
        # Never the folder's own code, nor a prompt asking for it (`uptrain.loading`).
        extractor = AutoFeatureExtractor.from_pretrained(model_path, trust_remote_code=False)
    except Exception as err:
        raise UptrainError(
            "objective speech_pairs needs the feature extractor of "
            f"{model_path} (preprocessor_config.json): {exception_line(err)}"
        ) from None
    if not getattr(extractor, "sampling_rate", None):
        raise UptrainError(f"the feature extractor of {model_path} names no sampling_rate")
    return extractor
