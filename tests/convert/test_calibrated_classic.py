"""The calibrated merge and similarity grouping on the architectures uptrain brings its own GQA
modeling for: fused Q|K|V (GPT-2's Conv1D, NeoX/BLOOM/Falcon per head, MPT blocks), no rotary
embedding (any per-head key map folds into the queries), partial rotary (NeoX rotate_half, GPT-J
adjacent pairs) and ALiBi. Exactness where it is possible, as for Llama in test_calibrated.py."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import uptrain.modeling  # noqa: F401  registers gpt2_gqa, …: `load` uses plain AutoModelForCausalLM
from tests.convert.test_calibrated import calibrated, load, save
from tests.modeling.classic_models import CONFIGS, HEAD_DIM, HEADS, HIDDEN, SHARED, token_ids
from uptrain import UptrainError
from uptrain.architecture import architecture
from uptrain.convert import convert_checkpoint
from uptrain.convert.pipeline import Calibration

# (case, model_type, settings, rotary pairs written test-side from each model's own code: the
# dims each rotary pair (real, imaginary) takes; the other dims pass through).
HALF_4 = [(0, 2), (1, 3)]  # rotate_half on the first 4 of 8 dims
CASES = {
    "gpt2": ("gpt2", {}, []),
    "opt": ("opt", {}, []),
    "bloom": ("bloom", {}, []),
    "gpt_neo": ("gpt_neo", {}, []),
    "mpt": ("mpt", {}, []),
    "falcon-alibi": ("falcon", {}, []),
    "falcon-rotary": ("falcon", dict(alibi=False), [(i, i + HEAD_DIM // 2) for i in range(HEAD_DIM // 2)]),
    "gpt_neox": ("gpt_neox", {}, HALF_4),  # rotary_pct 0.5
    "gptj": ("gptj", {}, [(0, 1), (2, 3)]),  # rotary_dim 4, rotate_every_two
}


def build(case: str, tokenizer, seed: int = 0):
    model_type, settings, _ = CASES[case]
    shared = dict(
        SHARED,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = AutoConfig.for_model(model_type, **{**CONFIGS[model_type], **shared, **settings})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if kv_views(name, p) is not None or re.search(r"(q_proj|c_attn|query_key_value|Wqkv)\.weight$", name):
                p.mul_(8)  # sharper attention patterns make pooling errors visible in the logits
    return model


def kv_views(name: str, p: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """Views `[heads, head_dim, *rest]` of the K and V heads a parameter holds (None: none),
    from transformers' own layout of each architecture."""
    data = p.data
    if name.endswith("attn.c_attn.weight"):  # GPT-2 Conv1D [in, Q | K | V]
        w = data.view(HIDDEN, 3, HEADS, HEAD_DIM)
        return w[:, 1].permute(1, 2, 0), w[:, 2].permute(1, 2, 0)
    if name.endswith("attn.c_attn.bias"):
        b = data.view(3, HEADS, HEAD_DIM)
        return b[1], b[2]
    if name.endswith("attn.Wqkv.weight"):  # MPT rows [Q | K | V]
        rows = data.view(3, HEADS, HEAD_DIM, HIDDEN)
        return rows[1], rows[2]
    if "query_key_value" in name:  # NeoX / BLOOM / Falcon rows [h, 3, d]
        rows = data.view(HEADS, 3, HEAD_DIM, *p.shape[1:])
        return rows[:, 1], rows[:, 2]
    if re.search(r"\.k_proj\.(weight|bias)$", name):
        return data.view(HEADS, HEAD_DIM, *p.shape[1:]), None
    if re.search(r"\.v_proj\.(weight|bias)$", name):
        return None, data.view(HEADS, HEAD_DIM, *p.shape[1:])
    return None


def key_map(pairs: list[tuple[int, int]], generator: torch.Generator) -> torch.Tensor:
    """A random invertible d×d map that commutes with the rotary embedding: a complex scale on
    each rotary pair, any map on the dims no rotation touches."""
    m = torch.zeros(HEAD_DIM, HEAD_DIM)
    for re_, im in pairs:
        a, b = torch.randn(2, generator=generator)
        m[re_, re_], m[re_, im], m[im, re_], m[im, im] = a, -b, b, a
    rest = [i for i in range(HEAD_DIM) if i not in {d for pair in pairs for d in pair}]
    if rest:
        index = torch.tensor(rest)
        m[index[:, None], index] = torch.eye(len(rest)) + 0.5 * torch.randn(len(rest), len(rest), generator=generator)
    return m


def relate_heads_exactly(model, case: str, groups: int) -> None:
    """Within each contiguous group, K head s = A_s · (the group's first K head) and V head
    s = B_s · (its first V head), weights and biases alike: A_s maps the merge can fold into the
    queries, B_s into o_proj; mean pooling can absorb neither."""
    pairs, r = CASES[case][2], HEADS // groups
    with torch.no_grad():
        for name, p in model.named_parameters():
            views = kv_views(name, p)
            if views is None:
                continue
            layer = int(re.search(r"\.(\d+)\.", name).group(1))
            for part, heads in enumerate(views):
                if heads is None:
                    continue
                for s in range(HEADS):
                    base = (s // r) * r
                    if s == base:
                        continue
                    generator = torch.Generator().manual_seed(100 * layer + 10 * s + part)
                    if part == 0:
                        m = key_map(pairs, generator)
                    else:
                        m = torch.eye(HEAD_DIM) + 0.5 * torch.randn(HEAD_DIM, HEAD_DIM, generator=generator)
                    heads[s] = torch.einsum("ij,j...->i...", m, heads[base])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(token_ids()).logits


@pytest.mark.parametrize("case", CASES)
def test_calibrated_at_g_equals_h_reproduces_logits(case, tokenizer, calibration_text, tmp_path):
    model = build(case, tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    out = calibrated(src, tmp_path / "out", HEADS, calibration_text)
    torch.testing.assert_close(logits(load(out)), logits(model), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_exactly_related_heads_merge_exactly_and_mean_does_not(case, tokenizer, calibration_text, tmp_path):
    model = build(case, tokenizer)
    relate_heads_exactly(model, case, 2)
    src = save(model, tokenizer, tmp_path / "src")
    reference = logits(model)
    merged = logits(load(calibrated(src, tmp_path / "calibrated", 2, calibration_text)))
    mean = logits(load(convert_checkpoint(src, tmp_path / "mean", 2, progress=False)))
    torch.testing.assert_close(merged, reference, rtol=1e-4, atol=1e-4)
    assert (mean - reference).abs().max() > 100 * (merged - reference).abs().max()
    assert (mean - reference).abs().max() > 1e-2


def state(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("case", CASES)
def test_similarity_at_g_equals_h_is_identity(case, tokenizer, tmp_path):
    """Whole layers read from and written back to each layout (fused, Conv1D) keep every bit."""
    src = save(build(case, tokenizer), tokenizer, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", HEADS, grouping="similarity", progress=False)
    record = architecture(CASES[case][0])
    before, after = {record.output_name(k): v for k, v in state(src).items()}, state(out)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(after[name], before[name]), name


def test_calibrated_refuses_mpt_clip_qkv_in_one_line(tokenizer, tmp_path):
    """MPT's clamp sits in attn_config: the architecture says where, and the merge refuses it."""
    model_type = "mpt"
    config = AutoConfig.for_model(model_type, **CONFIGS[model_type], **SHARED, attn_config=dict(clip_qkv=0.5))
    src = save(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / "src")
    with pytest.raises(UptrainError, match=r"attn_config\.clip_qkv \(0\.5\)") as err:
        convert_checkpoint(src, tmp_path / "out", 2, pooling="calibrated", calibration=Calibration({}), progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


# Each architecture's attention modules, written from transformers' module names.
ATTENTION_MODULES = {
    "gpt2": r"transformer\.h\.(\d+)\.attn",
    "opt": r"model\.decoder\.layers\.(\d+)\.self_attn",
    "bloom": r"transformer\.h\.(\d+)\.self_attention",
    "gpt_neo": r"transformer\.h\.(\d+)\.attn\.attention",  # nested one level deeper than the others
    "mpt": r"transformer\.blocks\.(\d+)\.attn",
    "falcon": r"transformer\.h\.(\d+)\.self_attention",
    "gpt_neox": r"gpt_neox\.layers\.(\d+)\.attention",
    "gptj": r"transformer\.h\.(\d+)\.attn",
}


@pytest.mark.parametrize("case", ["gpt2", "bloom", "gpt_neo", "mpt", "falcon-rotary", "gpt_neox"])
def test_layerwise_moments_equal_the_whole_model(case, tokenizer, calibration_text, tmp_path):
    """Calibration layer by layer (each layer's weights read from the shards, in turn) gives the
    moments of the whole model's forward pass with hooks on its attention modules."""
    from tests.convert.test_calibration_layerwise import NUM_TOKENS, SEQ_LEN, on_cpu
    from uptrain.convert.calibration import (
        attention_input,
        collect_attention_moments,
        fold_attention_input,
        load_calibration_tokenizer,
    )
    from uptrain.data.text import load_blocks

    model = build(case, tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    moments, _ = collect_attention_moments(src, str(calibration_text), on_cpu(NUM_TOKENS), progress=False)
    blocks, _ = load_blocks(
        str(calibration_text),
        "calibration_data",
        load_calibration_tokenizer(src),
        SEQ_LEN,
        text_field="text",
        split="train",
        dataset_config=None,
        sample_by="paragraph",
        streaming=False,
        workers=None,
    )
    count = NUM_TOKENS // SEQ_LEN
    reference = {i: torch.zeros(HIDDEN + 1, HIDDEN + 1, dtype=torch.float64) for i in range(2)}
    pattern = re.compile(ATTENTION_MODULES[CASES[case][0]])
    for name, module in model.named_modules():
        match = pattern.fullmatch(name)
        if match:
            layer = int(match.group(1))
            module.register_forward_pre_hook(
                lambda m, args, kwargs, i=layer: fold_attention_input(reference[i], attention_input(args, kwargs)),
                with_kwargs=True,
            )
    with torch.no_grad():
        for start in range(0, count, 4):
            model(blocks.take(list(range(start, min(start + 4, count)))), use_cache=False)
    assert sorted(moments) == [0, 1]
    for layer in reference:
        torch.testing.assert_close(moments[layer], reference[layer] / (count * SEQ_LEN), rtol=1e-10, atol=1e-10)


def test_a_base_model_checkpoint_calibrates_and_merges_as_the_task_model(tokenizer, calibration_text, tmp_path):
    """GPT-2 saved from its base model (`h.0.attn…`, as the Hub's gpt2 is): calibration reads its
    tensors under their own names, and the merge writes them there, equal to the task model's."""
    model = build("gpt2", tokenizer)
    full = save(model, tokenizer, tmp_path / "full")
    base = save(model.transformer, tokenizer, tmp_path / "base")
    assert "h.0.attn.c_attn.weight" in state(base)
    merged = [state(calibrated(src, tmp_path / f"{src.name}-out", 2, calibration_text)) for src in (full, base)]
    for name, tensor in merged[1].items():
        torch.testing.assert_close(merged[0][f"transformer.{name}"], tensor, rtol=0, atol=0)


def test_the_card_names_what_the_merge_rewrote_and_it_did(tokenizer, calibration_text, tmp_path):
    """OPT (no rotary, biases everywhere): q, k and v with their biases and the out_proj weights are
    rewritten, out_proj's bias and every other tensor kept; the key maps are full d×d maps."""
    model = build("opt", tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    out = calibrated(src, tmp_path / "out", 2, calibration_text)
    card = (out / "README.md").read_text()
    assert "a per-head d×d map folded into that head's `q_proj` rows" in card and "RoPE frequency" not in card
    assert "`q_proj`, `k_proj` and `v_proj` (weights and biases) and the `out_proj` weights" in card
    before, after = state(src), state(out)
    for name, tensor in before.items():
        projection = ".self_attn." in name and not name.endswith("out_proj.bias")
        assert projection != torch.equal(tensor, after[name]), name
