"""The calibrated merge on encoder–decoders: every attention (encoder, decoder self-, cross-)
merged with per-head key maps folded into the queries (no rotary embedding; T5's relative bias
stays with the query heads) and value maps into the output projection, each calibrated from its
own input: cross-attention's keys and values from the encoder's output, its queries from the
decoder's states."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

import uptrain.modeling  # noqa: F401  registers t5_gqa, bart_gqa, …
from tests.convert.test_encoder_decoder import MODELS, TOKENS, WHISPER_GEOMETRY
from uptrain.architecture import architecture
from uptrain.cli import main
from uptrain.convert import convert_checkpoint
from uptrain.convert.calibration_seq2seq import seq2seq_moments
from uptrain.convert.pipeline import Calibration

ALL = "encoder,decoder-self,cross"
# K and V weights and biases of every attention, as transformers names them (T5: q/k/v/o; BART family: *_proj).
KV = re.compile(r"\.(SelfAttention|EncDecAttention|self_attn|encoder_attn)\.(k|v|k_proj|v_proj)\.(weight|bias)$")


# T5 scores are not divided by √d: its weights need less to give peaked attention.
SHARPEN = {"t5": 2, "umt5": 2, "whisper": 6, "bart": 6, "mbart": 6, "marian": 6, "m2m_100": 6, "pegasus": 6}


def build(name: str, seed: int = 0):
    model_class, config = MODELS[name]
    torch.manual_seed(seed)
    model = model_class(config()).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                p.add_(torch.randn_like(p) * 0.1)
            if re.search(r"\.(q|k|v|o|q_proj|k_proj|v_proj|out_proj)\.weight$", param_name):
                p.mul_(SHARPEN[name])  # sharper attention patterns make pooling errors visible in the logits
    return model


def relate_heads_exactly(model, groups: int) -> None:
    """In every attention, K head s = A_s · (its group's first K head) and V head s = B_s · (its
    first V head), weights and biases alike, with random invertible d×d maps."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            match = KV.search(name)
            if match is None:
                continue
            heads_count = p.shape[0] // head_dim(model, name)
            heads = p.data.view(heads_count, head_dim(model, name), *p.shape[1:])
            r = heads_count // groups
            module = name[: match.start(3)]
            for s in range(heads_count):
                base = (s // r) * r
                if s != base:
                    seed = sum(map(ord, module)) * 100 + s  # the same map for a module's weight and bias
                    d = heads.shape[1]
                    m = torch.eye(d) + 0.5 * torch.randn(d, d, generator=torch.Generator().manual_seed(seed))
                    heads[s] = torch.einsum("ij,j...->i...", m, heads[base])


def head_dim(model, name: str) -> int:
    cfg = model.config
    if cfg.model_type in ("t5", "mt5", "umt5"):
        return cfg.d_kv
    heads = cfg.encoder_attention_heads if ".encoder." in name else cfg.decoder_attention_heads
    return cfg.d_model // heads


def inputs(name: str, seed: int = 1, batch: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    decoder = torch.randint(3, TOKENS["vocab_size"], (batch, 7), generator=generator)
    if name == "whisper":
        frames = 2 * WHISPER_GEOMETRY["max_source_positions"]
        features = torch.randn(batch, WHISPER_GEOMETRY["num_mel_bins"], frames, generator=generator)
        return {"input_features": features, "decoder_input_ids": decoder}
    encoder = torch.randint(3, TOKENS["vocab_size"], (batch, 9), generator=generator)
    return {"input_ids": encoder, "decoder_input_ids": decoder}


def calibration_batches(name: str) -> list[dict[str, torch.Tensor]]:
    """What the objective's examples give the model: encoder inputs, and targets (-100: padding)."""
    batches = []
    for seed in range(4):
        batch = inputs(name, seed=10 + seed, batch=4)
        labels = batch.pop("decoder_input_ids")
        labels[:, -2:] = -100
        batches.append({**batch, "labels": labels})
    return batches


def logits(model, name: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(name)).logits


def load(folder, name: str):
    auto = getattr(transformers, architecture(MODELS[name][1]().model_type).auto_class)
    return auto.from_pretrained(folder).eval()


def calibrated(model, name: str, src, out, g: int):
    moments = seq2seq_moments(model, architecture(model.config.model_type), calibration_batches(name), progress=False)
    return convert_checkpoint(
        src, out, g, pooling="calibrated", attention=ALL, calibration=Calibration(moments), progress=False
    )


CASES = ["t5", "umt5", "bart", "mbart", "marian", "whisper", "m2m_100", "pegasus"]


@pytest.mark.parametrize("name", CASES)
def test_exactly_related_heads_merge_exactly_and_mean_does_not(name, tmp_path):
    model = build(name)
    relate_heads_exactly(model, 2)
    model.save_pretrained(tmp_path / "src")
    reference = logits(model, name)
    merged = logits(load(calibrated(model, name, tmp_path / "src", tmp_path / "calibrated", 2), name), name)
    mean = convert_checkpoint(tmp_path / "src", tmp_path / "mean", 2, attention=ALL, progress=False)
    mean = logits(load(mean, name), name)
    torch.testing.assert_close(merged, reference, rtol=1e-4, atol=1e-4)
    assert (mean - reference).abs().max() > 100 * (merged - reference).abs().max()
    assert (mean - reference).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["t5", "umt5"])
def test_calibrated_at_g_equals_h_reproduces_logits(name, tmp_path):
    model = build(name)
    model.save_pretrained(tmp_path / "src")
    out = calibrated(model, name, tmp_path / "src", tmp_path / "out", 8)  # every attention's heads
    torch.testing.assert_close(logits(load(out, name), name), logits(model, name), rtol=1e-4, atol=1e-4)


def test_cross_attention_moments_are_the_encoder_output_and_the_decoder_states():
    """Cross-attention's keys and values read the encoder's output, its queries the decoder's
    states: each has its own moment, padding left out."""
    model = build("bart")
    batch = calibration_batches("bart")[0]
    moments = seq2seq_moments(model, architecture("bart"), [batch], progress=False)
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    encoded = out.encoder_last_hidden_state.reshape(-1, 32).double()
    encoded = torch.cat([encoded, torch.ones(len(encoded), 1, dtype=encoded.dtype)], 1)
    torch.testing.assert_close(moments["cross.keys_values"], encoded.mT @ encoded / len(encoded))
    assert set(moments) == {
        "cross.keys_values",
        *(f"{a}.{i}" for a in ("encoder", "decoder-self", "cross") for i in range(2)),
    }
    assert not torch.allclose(moments["cross.0"], moments["cross.keys_values"])


def test_provenance_names_the_calibration(tmp_path):
    model = build("t5")
    model.save_pretrained(tmp_path / "src")
    out = calibrated(model, "t5", tmp_path / "src", tmp_path / "out", 2)
    record = json.loads((out / "uptrain.json").read_text())
    assert record["pooling"] == "calibrated"


def test_card_says_what_the_merge_rewrote_and_it_did(tmp_path):
    """The card of a calibrated encoder–decoder names q and o as rewritten, and they are; the
    tensors it calls unchanged are."""
    from safetensors.torch import load_file

    model = build("bart")
    model.save_pretrained(tmp_path / "src")
    out = calibrated(model, "bart", tmp_path / "src", tmp_path / "out", 2)
    card = (out / "README.md").read_text()
    assert "`calibrated` merge" in card and "own inputs" in card and "per-head d×d map folded" in card
    assert "`q_proj` and the K and V projections (weights and biases) and the `out_proj` weights" in card
    assert "`q_proj`, `out_proj` and every other tensor are copied unchanged" not in card
    before, after = load_file(tmp_path / "src" / "model.safetensors"), load_file(out / "model.safetensors")
    for name, tensor in before.items():
        attention = ".self_attn." in name or ".encoder_attn." in name
        rewritten = attention and (
            any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj")) or ".out_proj.weight" in name
        )
        assert rewritten != torch.equal(tensor, after[name]), name


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_in_memory_merge_equals_the_checkpoint(name, tmp_path):
    """`convert_model` merges each attention from its own moments exactly as the checkpoint path."""
    from safetensors.torch import load_file

    from uptrain.convert import convert_model

    model = build(name)
    model.save_pretrained(tmp_path / "src")
    moments = seq2seq_moments(model, architecture(model.config.model_type), calibration_batches(name), progress=False)
    calibration = Calibration(moments)
    out = convert_checkpoint(
        tmp_path / "src",
        tmp_path / "out",
        2,
        pooling="calibrated",
        attention=ALL,
        calibration=calibration,
        progress=False,
    )
    in_memory = convert_model(model, 2, pooling="calibrated", attention=ALL, calibration=calibration).state_dict()
    for tensor_name, tensor in load_file(out / "model.safetensors").items():
        assert torch.equal(in_memory[tensor_name], tensor), tensor_name


def test_pairs_families_calibrate_on_their_pairs(tokenizer, tmp_path, capsys):
    """Marian (objective `pairs`): calibrated from jsonl source/target pairs, the targets the
    decoder's inputs; a file that is not such pairs is refused in one line, nothing written."""
    from tests.convert.test_encoder_decoder import BART_GEOMETRY

    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    geometry = {**BART_GEOMETRY, **ids, "vocab_size": len(tokenizer), "decoder_start_token_id": tokenizer.pad_token_id}
    src = tmp_path / "src"
    transformers.MarianMTModel(transformers.MarianConfig(**geometry)).save_pretrained(src)
    tokenizer.save_pretrained(src)
    pairs = tmp_path / "pairs.jsonl"
    lines = [{"source": f"the cat sat on mat number {i}", "target": f"le chat numéro {i}"} for i in range(12)]
    pairs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["convert", str(src), str(tmp_path / "out"), "-g", "2", "--pooling", "calibrated"]
    assert main([*argv, "--calibration-data", str(pairs)]) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "out" / "uptrain.json").read_text())
    assert record["calibration"]["objective"] == "pairs" and record["calibration"]["examples"] == 12
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no pairs here"}) + "\n")
    capsys.readouterr()
    assert main([*argv[:2], str(tmp_path / "out2"), *argv[3:], "--calibration-data", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 1: no `target` field" in err, err
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize(
    "name, weighting", [("bart", "uniform"), ("mbart", "uniform"), ("bart", "attention")], ids=["bart", "mbart", "w"]
)
def test_infilling_families_calibrate_on_infilled_text(name, weighting, tokenizer, calibration_text, tmp_path, capsys):
    """BART and mBART (objective `text_infilling`): calibrated from text blocks with spans masked,
    the whole block the decoder's input; the card says which moments the merge was solved from."""
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    from tests.convert.test_encoder_decoder import BART_GEOMETRY

    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=0)
    geometry = {**BART_GEOMETRY, **ids, "vocab_size": len(tokenizer), "decoder_start_token_id": tokenizer.eos_token_id}
    model_class, config = MODELS[name]
    src = tmp_path / "src"
    model_class(type(config())(**{**geometry, "max_position_embeddings": 256})).save_pretrained(src)
    tokenizer.save_pretrained(src)
    argv = ["convert", str(src), str(tmp_path / "out"), "-g", "2", "--pooling", "calibrated"]
    argv += ["--calibration-data", str(calibration_text), "--calibration-tokens", "512"]
    assert main([*argv, "--calibration-weighting", weighting]) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "out" / "uptrain.json").read_text())
    assert record["calibration"]["objective"] == "text_infilling" and record["calibration"]["tokens"] > 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert ("solved from attention-weighted moments" in card) == (weighting == "attention")


def weighted_moments(model, name: str) -> dict[str, torch.Tensor]:
    """`calibration_weighting: attention`'s moments of `model` (eager: the probabilities returned)."""
    model.set_attn_implementation("eager")
    arch = architecture(model.config.model_type)
    return seq2seq_moments(model, arch, calibration_batches(name), progress=False, weighting="attention")


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_attention_weighted_calibration_keeps_exactly_related_heads_exact(name, tmp_path):
    """Weighing errors where attention goes changes what is minimised, not what is exact: heads
    related exactly still merge exactly (decoder self + cross, the moments the weighting changes)."""
    model = build(name)
    relate_heads_exactly(model, 2)
    model.save_pretrained(tmp_path / "src")
    reference = logits(model, name)
    moments = weighted_moments(model, name)
    assert {"decoder-self.0.pooled", "cross.1.received"} <= set(moments)
    out = convert_checkpoint(
        tmp_path / "src", tmp_path / "out", 2, pooling="calibrated", calibration=Calibration(moments), progress=False
    )
    torch.testing.assert_close(logits(load(out, name), name), reference, rtol=1e-4, atol=1e-4)


def test_attention_weighted_moments_are_what_the_attention_reads():
    """Whisper's cross-attention, layer 1, by hand from transformers' own attention probabilities:
    `pooled` is the moment of every head's attention-pooled encoder output (per kept query),
    `received` the encoder output's moment with each frame weighted by the attention it receives;
    and the merge takes them (keys by `received`, values by `pooled`)."""
    from uptrain.convert.calibrated import CrossMoments
    from uptrain.convert.calibration_seq2seq import site_moments

    model = build("whisper")
    moments = weighted_moments(model, "whisper")
    pooled, received = 0, 0
    rows, weight = 0, 0.0
    with torch.no_grad():
        for batch in calibration_batches("whisper"):
            out = model(**batch, output_attentions=True)
            x = out.encoder_last_hidden_state.double()
            x = torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], -1)  # [b, s, D+1]
            keep = batch["labels"] != -100
            p = out.cross_attentions[1].double()  # [b, h, t, s]
            for b in range(len(x)):
                y = p[b][:, keep[b]] @ x[b]  # [h, kept, D+1]
                y = y.reshape(-1, y.shape[-1])
                pooled, rows = pooled + y.mT @ y, rows + len(y)
                w = p[b][:, keep[b]].sum((0, 1))
                received, weight = received + (x[b] * w[:, None]).mT @ x[b], weight + float(w.sum())
    torch.testing.assert_close(moments["cross.1.pooled"], pooled / rows)
    torch.testing.assert_close(moments["cross.1.received"], received / weight)
    layer = site_moments(moments, "cross")[1]
    assert isinstance(layer, CrossMoments)
    assert layer.keys_values is moments["cross.1.received"] and layer.values is moments["cross.1.pooled"]
    assert layer.queries is moments["cross.1"]


def test_attention_weighting_is_refused_where_nothing_is_calibrated(tmp_path, capsys):
    build("bart").save_pretrained(tmp_path / "src")
    argv = ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "-g", "2", "--pooling", "mean"]
    capsys.readouterr()
    assert main([*argv, "--calibration-weighting", "attention"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--pooling mean solves none" in err, err
    assert not (tmp_path / "out").exists()


def decoder_only_source(folder: Path) -> tuple[Path, Path]:
    """A one-layer Llama in `folder`/llama and a line of calibration text beside it: the decoder-only
    model that encoder–decoder-only calibration options are refused for."""
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
        )
    )
    llama.save_pretrained(folder / "llama")
    text = folder / "text.txt"
    text.write_text("some words\n")
    return folder / "llama", text


def test_attention_weighting_is_refused_for_decoder_only_models(tmp_path, capsys):
    src, text = decoder_only_source(tmp_path)
    argv = ["convert", str(src), str(tmp_path / "out"), "-g", "2", "--pooling", "calibrated"]
    capsys.readouterr()
    assert main([*argv, "--calibration-data", str(text), "--calibration-weighting", "attention"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "applies to encoder–decoders' calibration" in err, err
    assert not (tmp_path / "out").exists()
