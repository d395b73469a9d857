"""The calibrated merge and similarity grouping, tested where exactness is possible."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.convert.tiny_models import COMMON, EXTRA, logits
from uptrain import UptrainError
from uptrain.cli import main
from uptrain.convert import convert_checkpoint
from uptrain.convert.calibration import collect_attention_moments
from uptrain.convert.pipeline import Calibration
from uptrain.convert.spec import CalibrationSettings

# Layouts the whole-layer merge supports (no q/k norms): phi and stablelm without their optional
# qk_layernorm (support follows the checkpoint's tensors, not its model_type).
CALIBRATED = ["gemma", "granite", "llama", "mistral", "olmo", "phi", "qwen2", "stablelm", "starcoder2"]
WITHOUT_QK_NORMS = {"phi": dict(qk_layernorm=False), "stablelm": dict(qk_layernorm=False)}


def build(model_type: str, tokenizer, num_kv_heads: int = 8, seed: int = 0, **overrides):
    extra = {**EXTRA[model_type], **WITHOUT_QK_NORMS.get(model_type, {}), **overrides}
    common = dict(
        COMMON,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = AutoConfig.for_model(model_type, num_key_value_heads=num_kv_heads, **{**common, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "proj" in name and "self_attn" in name:
                p.mul_(8)  # sharper attention patterns make pooling errors visible in the logits
    return model


def save(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def calibrated(src, out, g, text, **kwargs):
    moments, info = collect_attention_moments(
        src, str(text), CalibrationSettings(calibration_tokens=2048, calibration_seq_len=64)
    )
    return convert_checkpoint(
        src, out, g, pooling="calibrated", calibration=Calibration(moments, info), progress=False, **kwargs
    )


def load(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("model_type", CALIBRATED)
def test_calibrated_at_g_equals_h_reproduces_logits(model_type, tokenizer, calibration_text, tmp_path):
    model = build(model_type, tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    out = calibrated(src, tmp_path / "out", 8, calibration_text)
    torch.testing.assert_close(logits(load(out)), logits(model), rtol=1e-4, atol=1e-4)


def relate_heads_exactly(model, groups: int, rotary_dim: int) -> None:
    """Within each group, make keys differ by per-pair complex scales and values by d×d maps:
    the relations a RoPE-safe merge can absorb exactly, and mean pooling cannot."""
    cfg = model.config
    h, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    r, half = h // groups, rotary_dim // 2
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            # Biases ride along as an extra input column, so they obey the same relation.
            k = _with_bias(attn.k_proj).view(h, d, -1)
            v = _with_bias(attn.v_proj).view(h, d, -1)
            for s in range(h):
                base = (s // r) * r
                if s == base:
                    continue
                scale = torch.complex(torch.randn(half, generator=generator), torch.randn(half, generator=generator))
                pair = torch.complex(k[base, :half], k[base, half:rotary_dim]) * scale[:, None]
                k[s, :half], k[s, half:rotary_dim] = pair.real, pair.imag
                k[s, rotary_dim:] = k[base, rotary_dim:] * torch.randn(d - rotary_dim, 1, generator=generator)
                v[s] = (torch.eye(d) + 0.5 * torch.randn(d, d, generator=generator)) @ v[base]
            _split_bias(attn.k_proj, k.view(h * d, -1))
            _split_bias(attn.v_proj, v.view(h * d, -1))


def _with_bias(proj) -> torch.Tensor:
    bias = proj.bias if proj.bias is not None else torch.zeros(proj.weight.shape[0])
    return torch.cat([proj.weight, bias[:, None]], dim=1).clone()


def _split_bias(proj, augmented: torch.Tensor) -> None:
    proj.weight.copy_(augmented[:, :-1])
    if proj.bias is not None:
        proj.bias.copy_(augmented[:, -1])


@pytest.mark.parametrize("model_type,rotary_dim", [("llama", 8), ("phi", 4)])
def test_exactly_related_heads_merge_exactly_and_mean_does_not(
    model_type, rotary_dim, tokenizer, calibration_text, tmp_path
):
    model = build(model_type, tokenizer)
    relate_heads_exactly(model, 2, rotary_dim)
    src = save(model, tokenizer, tmp_path / "src")
    reference = logits(model)
    merged = logits(load(calibrated(src, tmp_path / "calibrated", 2, calibration_text)))
    mean = logits(load(convert_checkpoint(src, tmp_path / "mean", 2, progress=False)))
    torch.testing.assert_close(merged, reference, rtol=1e-4, atol=1e-4)
    assert (mean - reference).abs().max() > 100 * (merged - reference).abs().max()
    assert (mean - reference).abs().max() > 1e-2


def test_calibrated_beats_mean_on_a_generic_model(tokenizer, calibration_text, tmp_path):
    """No exact relation here: the merge only has to do better than averaging on the same text."""
    model = build("llama", tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    reference = logits(model)
    merged = logits(load(calibrated(src, tmp_path / "calibrated", 2, calibration_text)))
    mean = logits(load(convert_checkpoint(src, tmp_path / "mean", 2, progress=False)))
    assert (merged - reference).pow(2).mean() < (mean - reference).pow(2).mean()


def permute_heads(model, order: list[int]):
    """An exact renumbering of an MHA model's heads (the same function, other head order)."""
    d = model.config.hidden_size // model.config.num_attention_heads
    rows = torch.tensor([s * d + i for s in order for i in range(d)])
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.weight.copy_(proj.weight[rows])
                if proj.bias is not None:
                    proj.bias.copy_(proj.bias[rows])
            attn.o_proj.weight.copy_(attn.o_proj.weight[:, rows])
    return model


@pytest.mark.parametrize("pooling", ["mean", "calibrated"])
def test_similarity_grouping_is_permutation_invariant(pooling, tokenizer, calibration_text, tmp_path):
    model = build("qwen2", tokenizer)  # biases: they must move with their heads
    src = save(model, tokenizer, tmp_path / "src")
    permuted = permute_heads(build("qwen2", tokenizer), [5, 2, 7, 0, 3, 6, 1, 4])
    torch.testing.assert_close(logits(permuted), logits(model), rtol=1e-5, atol=1e-5)
    psrc = save(permuted, tokenizer, tmp_path / "psrc")
    results = []
    for folder in (src, psrc):
        moments, info = collect_attention_moments(
            folder, str(calibration_text), CalibrationSettings(calibration_tokens=2048, calibration_seq_len=64)
        )
        out = convert_checkpoint(
            folder,
            tmp_path / f"{folder.name}-out",
            2,
            pooling=pooling,
            grouping="similarity",
            calibration=Calibration(moments) if pooling == "calibrated" else None,
            progress=False,
        )
        results.append(logits(load(out)))
        provenance = json.loads((out / "uptrain.json").read_text())
        assert provenance["grouping"] == "similarity" and len(provenance["kv_head_order"]) == 2
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-4)
    # Contiguous grouping of the permuted model groups other heads: the invariance is not free.
    contiguous = [logits(load(convert_checkpoint(f, tmp_path / f"{f.name}-c", 2, progress=False))) for f in (src, psrc)]
    assert not torch.allclose(contiguous[0], contiguous[1], atol=1e-4)


def test_similarity_at_g_equals_h_is_identity(tokenizer, tmp_path):
    model = build("llama", tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", 8, grouping="similarity", progress=False)
    assert torch.equal(logits(load(out)), logits(model))


def test_cli_calibrated_and_refusals(tokenizer, calibration_text, tmp_path, capsys):
    src = save(build("llama", tokenizer), tokenizer, tmp_path / "src")
    assert (
        main(
            [
                "convert",
                str(src),
                str(tmp_path / "out"),
                "-g",
                "2",
                "--pooling",
                "calibrated",
                "--calibration-data",
                str(calibration_text),
                "--calibration-tokens",
                "512",
            ]
        )
        == 0
    )
    provenance = json.loads((tmp_path / "out" / "uptrain.json").read_text())
    assert provenance["pooling"] == "calibrated" and provenance["calibration"]["tokens"] >= 512
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "x"), "-g", "2", "--pooling", "calibrated"]) == 2
    assert "needs calibration data" in capsys.readouterr().err
    qwen3 = build("qwen3", tokenizer)
    qsrc = save(qwen3, tokenizer, tmp_path / "qwen3")
    with pytest.raises(UptrainError, match="k_norm"):
        convert_checkpoint(qsrc, tmp_path / "y", 2, pooling="calibrated", calibration=Calibration({}), progress=False)
    assert not (tmp_path / "y").exists()


# Issue #10 §3: decide support from what the checkpoint holds and how the model computes.


def test_stablelm_without_qk_layernorm_is_a_plain_layout(tokenizer, calibration_text, tmp_path):
    """No per-head norms in the checkpoint: calibrated and similarity work (G = h is exact)."""
    model = build("stablelm", tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    assert not any("layernorm.norms" in name for name in model.state_dict())
    similarity = convert_checkpoint(src, tmp_path / "similarity", 8, grouping="similarity", progress=False)
    assert torch.equal(logits(load(similarity)), logits(model))
    merged = calibrated(src, tmp_path / "calibrated", 8, calibration_text)
    torch.testing.assert_close(logits(load(merged)), logits(model), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "options",
    [dict(pooling="calibrated", calibration=Calibration({})), dict(grouping="similarity")],
    ids=["calibrated", "similarity"],
)
def test_stablelm_with_qk_layernorm_is_refused_in_one_line(options, tokenizer, tmp_path):
    src = save(build("stablelm", tokenizer, qk_layernorm=True), tokenizer, tmp_path / "src")
    with pytest.raises(UptrainError, match=r"k_layernorm\.norms\.0\.weight .*per-head") as err:
        convert_checkpoint(src, tmp_path / "out", 2, progress=False, **options)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


CLIP_QKV = 0.5  # small enough that the tiny model's q, k and v are clamped (checked below)


def olmo_with_clip_qkv(tokenizer):
    model = build("olmo", tokenizer, clip_qkv=CLIP_QKV)
    unclipped = build("olmo", tokenizer)
    assert not torch.allclose(logits(model), logits(unclipped), atol=1e-3)  # the clamp acts
    return model


def tie_kv_heads(model, pairs: list[tuple[int, int]]) -> None:
    """Give head t the K and V of head s for each (s, t): non-contiguous duplicate heads."""
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                for s, t in pairs:
                    proj.weight[t * d : (t + 1) * d] = proj.weight[s * d : (s + 1) * d]


def test_similarity_grouping_commutes_with_clip_qkv(tokenizer, tmp_path):
    """Renumbering whole heads commutes with OLMo's element-wise clamp: G = h is exact, and so is
    grouping duplicate heads that sit apart — which contiguous grouping cannot do."""
    model = olmo_with_clip_qkv(tokenizer)
    tie_kv_heads(model, [(0, 5), (1, 3), (2, 7), (4, 6)])
    src = save(model, tokenizer, tmp_path / "src")
    reference = logits(model)
    same = convert_checkpoint(src, tmp_path / "g8", 8, grouping="similarity", progress=False)
    assert json.loads((same / "config.json").read_text())["clip_qkv"] == CLIP_QKV
    assert torch.equal(logits(load(same)), reference)
    grouped = convert_checkpoint(src, tmp_path / "g4", 4, grouping="similarity", progress=False)
    assert json.loads((grouped / "uptrain.json").read_text())["kv_head_order"]["0"] == [0, 5, 1, 3, 2, 7, 4, 6]
    torch.testing.assert_close(logits(load(grouped)), reference, rtol=1e-5, atol=1e-5)
    contiguous = convert_checkpoint(src, tmp_path / "c4", 4, progress=False)
    assert (logits(load(contiguous)) - reference).abs().max() > 1e-2


def test_calibrated_refuses_clip_qkv_in_one_line(tokenizer, calibration_text, tmp_path, capsys):
    src = save(olmo_with_clip_qkv(tokenizer), tokenizer, tmp_path / "src")
    capsys.readouterr()
    assert (
        main(
            [
                "convert",
                str(src),
                str(tmp_path / "out"),
                "-g",
                "8",
                "--pooling",
                "calibrated",
                "--calibration-data",
                str(calibration_text),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "clip_qkv" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
