"""Encoder–decoders (T5, T5 v1.1 / Flan gated-GELU, mT5, UMT5, BART, mBART, Marian, Whisper,
M2M100, Pegasus): conversion of tiny real checkpoints built with transformers' own classes and
saved with save_pretrained.

What the converter must do is checked here against an independent computation written from
transformers' tensor names (not from uptrain's layout tables): each chosen attention's K/V rows
mean-pooled per contiguous group, every other tensor byte for byte, config.json and uptrain.json.
Loading the result needs uptrain's T5/BART/Whisper GQA modeling, tested beside that modeling.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    M2M100Config,
    M2M100ForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    MBartConfig,
    MBartForConditionalGeneration,
    MT5Config,
    MT5ForConditionalGeneration,
    PegasusConfig,
    PegasusForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    UMT5Config,
    UMT5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from tests.convert.tiny_models import build_model, save
from uptrain.cli import main
from uptrain.convert import convert_checkpoint
from uptrain.convert.in_memory import converted_tensors
from uptrain.convert.spec import ConversionOptions
from uptrain.options import validated

TOKENS = dict(vocab_size=96, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
# T5: 8 heads of d_kv 6 on d_model 32 (8 × 6 ≠ 32: d_kv is independent of d_model / heads);
# 2 encoder blocks, 3 decoder blocks.
T5_GEOMETRY = dict(d_model=32, d_kv=6, d_ff=40, num_layers=2, num_decoder_layers=3, num_heads=8, **TOKENS)
# BART family: 4 encoder heads and 8 decoder heads on d_model 32 (head_dim 8 and 4).
BART_GEOMETRY = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=8,
    encoder_ffn_dim=40,
    decoder_ffn_dim=40,
    max_position_embeddings=32,
    bos_token_id=2,
    **TOKENS,
)
WHISPER_GEOMETRY = {
    **BART_GEOMETRY,
    "max_source_positions": 16,
    "max_target_positions": 16,
    "num_mel_bins": 8,
    "suppress_tokens": [],
    "begin_suppress_tokens": [],
}
WHISPER_GEOMETRY.pop("max_position_embeddings")

MODELS = {
    "t5": (T5ForConditionalGeneration, lambda: T5Config(**T5_GEOMETRY)),
    # T5 v1.1 / Flan-T5: gated-GELU feed-forward, untied head; the same attention tensors.
    "t5-gated": (
        T5ForConditionalGeneration,
        lambda: T5Config(**T5_GEOMETRY, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    ),
    "mt5": (MT5ForConditionalGeneration, lambda: MT5Config(**T5_GEOMETRY)),
    # UMT5: T5's tensor names, a relative_attention_bias in every self-attention layer.
    "umt5": (UMT5ForConditionalGeneration, lambda: UMT5Config(**T5_GEOMETRY, tie_word_embeddings=False)),
    "bart": (BartForConditionalGeneration, lambda: BartConfig(**BART_GEOMETRY)),
    "mbart": (MBartForConditionalGeneration, lambda: MBartConfig(**BART_GEOMETRY)),
    "marian": (MarianMTModel, lambda: MarianConfig(**BART_GEOMETRY)),
    "whisper": (WhisperForConditionalGeneration, lambda: WhisperConfig(**WHISPER_GEOMETRY)),
    "m2m_100": (M2M100ForConditionalGeneration, lambda: M2M100Config(**BART_GEOMETRY)),
    "pegasus": (PegasusForConditionalGeneration, lambda: PegasusConfig(**BART_GEOMETRY)),
}
T5_LIKE = ("t5", "t5-gated", "mt5", "umt5")
GQA_TYPE = {"t5": "t5_gqa", "t5-gated": "t5_gqa", "mt5": "t5_gqa", "umt5": "umt5_gqa"} | {
    name: f"{name}_gqa" for name in ("bart", "mbart", "marian", "whisper", "m2m_100", "pegasus")
}
HEAD_CLASS = {
    "t5_gqa": ("T5GQAForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    "umt5_gqa": ("UMT5GQAForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    "bart_gqa": ("BartGQAForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    "mbart_gqa": ("MBartGQAForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    "marian_gqa": ("MarianGQAMTModel", "AutoModelForSeq2SeqLM"),
    "whisper_gqa": ("WhisperGQAForConditionalGeneration", "AutoModelForSpeechSeq2Seq"),
    "m2m_100_gqa": ("M2M100GQAForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    "pegasus_gqa": ("PegasusGQAForConditionalGeneration", "AutoModelForSeq2SeqLM"),
}

# Where each attention's K and V live, written from transformers' module names.
T5_KV = {
    "encoder": r"encoder\.block\.\d+\.layer\.0\.SelfAttention\.[kv]\.weight",
    "decoder-self": r"decoder\.block\.\d+\.layer\.0\.SelfAttention\.[kv]\.weight",
    "cross": r"decoder\.block\.\d+\.layer\.1\.EncDecAttention\.[kv]\.weight",
}
BART_KV = {
    "encoder": r"model\.encoder\.layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)",
    "decoder-self": r"model\.decoder\.layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)",
    "cross": r"model\.decoder\.layers\.\d+\.encoder_attn\.[kv]_proj\.(weight|bias)",
}


def kv_patterns(name: str) -> dict[str, str]:
    return T5_KV if name in T5_LIKE else BART_KV


def heads_and_dim(name: str, attention: str) -> tuple[int, int]:
    """Query heads and head_dim of one attention of the test geometries."""
    if name in T5_LIKE:
        return 8, 6
    return (4, 8) if attention == "encoder" else (8, 4)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One saved checkpoint per architecture, built once; biases (T5's position biases too) and
    norms randomised so that pooling them is tested (fresh ones are zeros and ones)."""
    built = {}

    def get(name: str):
        if name not in built:
            model_class, config = MODELS[name]
            torch.manual_seed(0)
            model = model_class(config()).eval()
            with torch.no_grad():
                for param_name, p in model.named_parameters():
                    if param_name.endswith("bias") or "norm" in param_name or "relative_attention" in param_name:
                        p.add_(torch.randn_like(p) * 0.1)
            folder = tmp_path_factory.mktemp(name) / "src"
            model.save_pretrained(folder)
            built[name] = (model, folder)
        return built[name]

    return get


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def expected_mean(t: torch.Tensor, heads: int, head_dim: int, g: int) -> torch.Tensor:
    """Group j of G averages KV heads j·h/G … (j+1)·h/G − 1 (rows of head k: k·d … (k+1)·d − 1)."""
    per_head = t.float().reshape(heads, head_dim, *t.shape[1:])
    groups = [per_head[j * heads // g : (j + 1) * heads // g].sum(0) / (heads // g) for j in range(g)]
    return torch.cat(groups).to(t.dtype)


def attention_of(name: str, tensor_name: str) -> str | None:
    for attention, pattern in kv_patterns(name).items():
        if re.fullmatch(pattern, tensor_name):
            return attention
    return None


def convert(src: Path, out: Path, g: int, *extra) -> None:
    assert main(["convert", str(src), str(out), "-g", str(g), "--source-hash", "none", *extra]) == 0


def check_pooled(name: str, src: Path, out: Path, g: int, chosen: set[str]) -> None:
    """Chosen attentions' K/V are the group means; everything else is byte for byte the source's."""
    before, after = tensors(src), tensors(out)
    assert sorted(before) == sorted(after)
    pooled = set()
    for tensor_name, t in before.items():
        attention = attention_of(name, tensor_name)
        if attention in chosen:
            heads, d = heads_and_dim(name, attention)
            assert after[tensor_name].shape == (g * d, *t.shape[1:]), tensor_name
            torch.testing.assert_close(after[tensor_name], expected_mean(t, heads, d, g), rtol=0, atol=1e-6)
            pooled.add(attention)
        else:
            assert after[tensor_name].dtype == t.dtype and torch.equal(after[tensor_name], t), tensor_name
    assert pooled == chosen  # every chosen attention was found and pooled


def check_config(name: str, src: Path, out: Path, kv: dict[str, int]) -> dict:
    source, config = (json.loads((f / "config.json").read_text()) for f in (src, out))
    gqa = GQA_TYPE[name]
    head, auto = HEAD_CLASS[gqa]
    assert config["model_type"] == gqa and config["architectures"] == [head]
    assert config["auto_map"][auto] == f"modeling_{gqa}.{head}"
    assert config["auto_map"]["AutoConfig"].startswith(f"modeling_{gqa}.")
    assert config["encoder_num_key_value_heads"] == kv["encoder"]
    assert config["decoder_num_key_value_heads"] == kv["decoder-self"]
    assert config["cross_attention_num_key_value_heads"] == kv["cross"]
    assert config["num_key_value_heads"] == kv["decoder-self"]
    # mT5 never rescales its decoder output; the T5 classes t5_gqa builds on must be told so.
    assert config.get("scale_decoder_outputs") is (
        False if source["model_type"] == "mt5" else source.get("scale_decoder_outputs")
    )
    changed = {
        "scale_decoder_outputs",
        "model_type",
        "architectures",
        "auto_map",
        "num_key_value_heads",
        "encoder_num_key_value_heads",
        "decoder_num_key_value_heads",
        "cross_attention_num_key_value_heads",
    }
    assert {k: v for k, v in config.items() if k not in changed} == {
        k: v for k, v in source.items() if k not in changed
    }
    return config


@pytest.mark.parametrize("name", list(MODELS))
def test_default_pools_the_decoder_attentions(name, sources, tmp_path):
    """`-g 2` pools the decoder's self- and cross-attention (the paper's choice); the encoder,
    T5's relative_attention_bias and every other tensor stay byte for byte."""
    model, src = sources(name)
    out = tmp_path / "out"
    convert(src, out, 2)
    check_pooled(name, src, out, 2, {"decoder-self", "cross"})
    encoder_heads = heads_and_dim(name, "encoder")[0]
    check_config(name, src, out, {"encoder": encoder_heads, "decoder-self": 2, "cross": 2})
    record = json.loads((out / "uptrain.json").read_text())
    assert record["attention"] == ["decoder-self", "cross"]
    assert record["model_type"] == model.config.model_type
    assert (record["num_attention_heads"], record["source_num_key_value_heads"], record["num_key_value_heads"]) == (
        8,
        8,
        2,
    )
    attentions = record["attentions"]
    assert attentions["cross"]["kv_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert attentions["cross"]["query_to_kv"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert attentions["encoder"]["num_key_value_heads"] == encoder_heads
    assert attentions["encoder"]["kv_groups"] == [[i] for i in range(encoder_heads)]
    card = (out / "README.md").read_text()
    assert "decoder self-attention" in card and "cross-attention: " not in card
    assert "encoder self-attention: unchanged" in card
    tasks = {
        "whisper": "automatic-speech-recognition",
        "marian": "translation",
        "m2m_100": "translation",
        "pegasus": "summarization",
    }
    task = tasks.get(name, "text2text-generation")
    assert f"pipeline_tag: {task}\n" in card
    modeling = f"modeling_{GQA_TYPE[name]}.py"
    assert (out / modeling).is_file()


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_g_equals_h_keeps_every_bit(name, sources, tmp_path):
    _, src = sources(name)
    out = tmp_path / "out"
    convert(src, out, 8, "--attention", "decoder-self,cross")
    before, after = tensors(src), tensors(out)
    assert all(torch.equal(after[n], t) and after[n].dtype == t.dtype for n, t in before.items())
    assert json.loads((out / "config.json").read_text())["decoder_num_key_value_heads"] == 8


@pytest.mark.parametrize(
    "name,attention,g,chosen",
    [
        ("t5", "encoder", 4, {"encoder"}),
        ("t5", "cross,encoder,decoder-self", 1, {"encoder", "decoder-self", "cross"}),
        ("mt5", "decoder-self", 2, {"decoder-self"}),
        ("umt5", "encoder,decoder-self", 4, {"encoder", "decoder-self"}),
        ("bart", "encoder,cross", 2, {"encoder", "cross"}),
        ("whisper", "encoder", 1, {"encoder"}),
    ],
)
def test_attention_choice(name, attention, g, chosen, sources, tmp_path):
    """`--attention` pools exactly the attentions it names, each to G; the others keep their heads."""
    _, src = sources(name)
    out = tmp_path / "out"
    convert(src, out, g, "--attention", attention)
    check_pooled(name, src, out, g, chosen)
    kv = {a: g if a in chosen else heads_and_dim(name, a)[0] for a in ("encoder", "decoder-self", "cross")}
    check_config(name, src, out, kv)
    record = json.loads((out / "uptrain.json").read_text())
    assert record["attention"] == [a for a in ("encoder", "decoder-self", "cross") if a in chosen]
    assert {a: v["num_key_value_heads"] for a, v in record["attentions"].items()} == kv


def test_converted_checkpoint_converts_again(sources, capsys, tmp_path):
    """A t5_gqa checkpoint (same layout, fewer heads) pools further; mean of equal-sized
    group means is the mean of the whole group."""
    _, src = sources("t5")
    convert(src, tmp_path / "g4", 4)
    convert(tmp_path / "g4", tmp_path / "g1", 1)
    convert(src, tmp_path / "direct", 1)
    again, direct = tensors(tmp_path / "g1"), tensors(tmp_path / "direct")
    for n, t in direct.items():
        torch.testing.assert_close(again[n], t, rtol=0, atol=1e-6)
    config = json.loads((tmp_path / "g1" / "config.json").read_text())
    assert config["model_type"] == "t5_gqa" and config["decoder_num_key_value_heads"] == 1
    assert config["encoder_num_key_value_heads"] == 8
    record = json.loads((tmp_path / "g1" / "uptrain.json").read_text())
    assert record["model_type"] == "t5_gqa" and record["attentions"]["cross"]["source_num_key_value_heads"] == 4
    # G must divide the current 4 KV heads of each chosen attention.
    expected = "does not divide the checkpoint's current 4 KV heads of its decoder self-attention"
    fails(capsys, [tmp_path / "g4", "-g", 8], expected, tmp_path / "bad")


def test_in_memory_equals_the_converted_checkpoint(sources, tmp_path):
    """`convert_model`'s tensors (before they become a model) equal `convert_checkpoint`'s."""
    model, src = sources("bart")
    out = convert_checkpoint(src, tmp_path / "out", 2, attention="encoder,decoder-self", source_hash="none")
    state, plan = converted_tensors(model, 2, validated(ConversionOptions, attention="encoder,decoder-self"))
    assert plan.attention == ("encoder", "decoder-self")
    assert plan.config_kv_heads == {"encoder": 2, "decoder-self": 2, "cross": 8}
    written = tensors(out)
    for n, t in written.items():
        assert torch.equal(state[n], t), n


def fails(capsys, argv, expected: str, out: Path) -> str:
    capsys.readouterr()
    code = main(["convert", *map(str, argv[:1]), str(out), *map(str, argv[1:])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("uptrain convert: error: ") and expected in err, err
    assert not out.exists()
    return err


@pytest.mark.parametrize(
    "name,argv,expected",
    [
        ("t5", ["-g", 3], "does not divide the model's 8 attention heads of its decoder self-attention"),
        ("t5", ["-g", 16], "exceeds the model's 8 attention heads of its decoder self-attention"),
        ("bart", ["-g", 8, "--attention", "encoder"], "exceeds the model's 4 attention heads of its encoder"),
        ("bart", ["-g", 3, "--attention", "cross"], "does not divide the model's 8 attention heads of its cross"),
        ("t5", ["-g", 2, "--attention", "decoder"], "unknown attention 'decoder'"),
        ("t5", ["-g", 2, "--attention", ""], "unknown attention ''"),
        ("t5", ["-g", 2, "--attention", "cross,cross"], "names an attention twice"),
        ("t5", ["-g", 2, "--grouping", "similarity"], "cannot renumber the heads of T5's decoder self-attention"),
    ],
)
def test_refusals(name, argv, expected, sources, capsys, tmp_path):
    _, src = sources(name)
    fails(capsys, [src, *argv], expected, tmp_path / "out")


@pytest.mark.parametrize(
    "name,alias,key",
    [("bart", "num_attention_heads", "encoder_attention_heads"), ("t5", "num_attention_heads", "num_heads")],
)
def test_a_config_whose_head_counts_conflict_is_refused(name, alias, key, sources, capsys, tmp_path):
    """config.json with transformers' standard name beside the family's own key, disagreeing
    (BART's num_attention_heads is its encoder_attention_heads, T5's its num_heads): uptrain read
    one, transformers loaded the other, and the conversion did not load (issue #34)."""
    import shutil

    _, src = sources(name)
    conflicting = tmp_path / "src"
    shutil.copytree(src, conflicting)
    config = json.loads((conflicting / "config.json").read_text())
    config[alias] = 2  # the sources have 4 (BART's encoder) and 8 (T5) heads
    (conflicting / "config.json").write_text(json.dumps(config))
    fails(capsys, [conflicting, "-g", 2], f"sets {alias}: 2 and {key}: {config[key]}", tmp_path / "out")
    config[alias] = config[key]  # agreeing, both are fine
    (conflicting / "config.json").write_text(json.dumps(config))
    assert main(["convert", str(conflicting), str(tmp_path / "out"), "-g", "2"]) == 0, capsys.readouterr().err


def test_calibrated_from_the_command_line(capsys, tmp_path):
    """The shipped reference T5 calibrated on text through its objective (span corruption), every
    attention moment from its own input: G KV heads in the decoder's self- and cross-attention."""
    from uptrain.demo import REFERENCE_T5

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 200}) + "\n")
    out = tmp_path / "out"
    argv = ["convert", str(REFERENCE_T5), str(out), "-g", "2", "--pooling", "calibrated"]
    assert main([*argv, "--calibration-data", str(text), "--calibration-tokens", "512"]) == 0, capsys.readouterr().err
    record = json.loads((out / "uptrain.json").read_text())
    assert record["pooling"] == "calibrated" and record["calibration"]["objective"] == "span_corruption"
    config = json.loads((out / "config.json").read_text())
    assert config["decoder_num_key_value_heads"] == config["cross_attention_num_key_value_heads"] == 2


@pytest.mark.parametrize("attention", ["encoder", "cross", "encoder,decoder-self"])
def test_decoder_only_takes_only_its_self_attention(attention, capsys, tmp_path):
    src = save(build_model("llama"), tmp_path / "src")
    fails(
        capsys,
        [src, "-g", 2, "--attention", attention],
        f"--attention {attention}: llama is decoder-only, its one attention is decoder-self",
        tmp_path / "out",
    )
    # The default (the decoder's attentions) and decoder-self alone mean its one attention.
    for i, given in enumerate(([], ["--attention", "decoder-self"])):
        convert(src, tmp_path / f"ok{i}", 2, *given)
        assert "attention" not in json.loads((tmp_path / f"ok{i}" / "uptrain.json").read_text())


def test_random_pooling_draws_with_t5s_init_std(sources, tmp_path):
    """T5 initialises K and V with std initializer_factor × d_model^-½ (not initializer_range)."""
    _, src = sources("t5")
    out = tmp_path / "out"
    convert(src, out, 1, "--pooling", "random", "--attention", "encoder,decoder-self,cross")
    after = tensors(out)
    k = torch.cat([t.flatten() for n, t in after.items() if attention_of("t5", n)])
    assert abs(k.std().item() - 32**-0.5) < 0.1 * 32**-0.5


def test_config_keys_match_the_modeling():
    """The converter writes the KV-head keys the GQA configs read (`uptrain.modeling.attention`,
    carried beside converted checkpoints, keeps its own copy of the table)."""
    from uptrain.architecture import STACK_KV_HEADS as WRITTEN
    from uptrain.modeling.attention import STACK_KV_HEADS as READ

    assert WRITTEN == READ


def test_a_bad_t5_config_is_one_line(sources, capsys, tmp_path):
    _, built = sources("t5")
    for key, value, expected in (
        ("d_kv", None, "config (t5) has no d_kv"),
        ("num_heads", "8", "config (t5): num_heads is '8'; it must be a whole number"),
        ("initializer_factor", "x", "initializer_factor is 'x'; it must be a finite number"),
    ):
        src = tmp_path / key
        src.mkdir()
        for f in built.iterdir():
            (src / f.name).write_bytes(f.read_bytes())
        config = json.loads((src / "config.json").read_text())
        config[key] = value
        (src / "config.json").write_text(json.dumps(config))
        fails(capsys, [src, "-g", 2, "--pooling", "random"], expected, tmp_path / f"out-{key}")
