"""`document_mask`: a packed block gives each of its documents the logits (and so the per-token
losses) of that document run alone, on transformers' own models and uptrain's GQA modeling, with
eager and SDPA attention; and `uptrain train` trains with it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import uptrain.modeling  # noqa: F401  registers gpt2_gqa, …
from tests.convert.tiny_models import build_model
from tests.modeling.classic_models import build
from uptrain import UptrainError
from uptrain.convert import convert_checkpoint
from uptrain.data.document_mask import DocumentPacking, check_document_mask, document_positions

EOS = 2  # the tiny models' eos_token_id
TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # float32 noise on logits of ~1; a document leaking in moves them by 1e-2


def packed_blocks() -> torch.Tensor:
    """Two rows of 40 tokens, documents ending with EOS: lengths 7, 1 (EOS alone), 12, 20 (cut);
    and 15, 25 (the first continuing a document of an earlier block, with no EOS at the end)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 128, (2, 40), generator=g)
    for row, ends in ((0, (6, 7, 19)), (1, (14,))):
        rows[row, list(ends)] = EOS
    return rows


def documents(row: torch.Tensor, eos: int = EOS) -> list[tuple[int, int]]:
    ends = [i + 1 for i, t in enumerate(row.tolist()) if t == eos]
    bounds = [0, *[e for e in ends if e < len(row)], len(row)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def token_losses(logits: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), blocks[:, 1:].flatten(), reduction="none")


def logits_alone(model, blocks: torch.Tensor, eos: int = EOS) -> torch.Tensor:
    """Each document of each block run by itself, its logits put back at its place in the block."""
    out = None
    with torch.no_grad():
        for r, row in enumerate(blocks):
            for start, end in documents(row, eos):
                logits = model(input_ids=row[None, start:end], use_cache=False).logits[0]
                out = logits.new_zeros(*blocks.shape, logits.shape[-1]) if out is None else out
                out[r, start:end] = logits
    return out


def test_positions_restart_after_each_eos():
    blocks = packed_blocks()
    positions = document_positions(blocks, EOS)
    assert positions[0].tolist() == [*range(7), 0, *range(12), *range(20)]
    assert positions[1].tolist() == [*range(15), *range(25)]


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """`gqa_model(model_type)`: a tiny source model converted to uptrain's *_gqa modeling, G = 2."""

    def get(model_type: str):
        root = tmp_path_factory.mktemp(model_type)
        build(model_type, init_std=0.5).save_pretrained(root / "src")
        return AutoModelForCausalLM.from_pretrained(convert_checkpoint(root / "src", root / "out", 2, progress=False))

    return get


def model_for(kind: str, gqa_model, implementation: str):
    model = build_model(kind, num_kv_heads=2) if kind in ("llama", "qwen2", "mistral") else gqa_model(kind)
    model.set_attn_implementation(implementation)
    return model.eval()


# Flex attention: the batch as one row and positions only (no mask), the layout flash attention
# gets too; compiled by inductor on CPU, minutes the first time, hence slow.
FLEX = pytest.param("flex_attention", marks=pytest.mark.slow)


@pytest.mark.parametrize("implementation", ["eager", "sdpa", FLEX])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt_neox", "gpt2", "gptj", "opt", "gpt_neo", "mpt"])
def test_a_packed_block_gives_each_document_its_own_losses(kind, implementation, gqa_model):
    if kind == "opt" and implementation == "flex_attention":
        pytest.skip("refused: test_opt_with_flash_or_flex_attention_is_refused")
    if kind == "mpt" and implementation == "flex_attention":
        pytest.skip("mpt_gqa has no flex attention (ALiBi): tests/modeling/test_backends.py")
    model = model_for(kind, gqa_model, implementation)
    blocks = packed_blocks()
    packing = DocumentPacking.for_model(model, EOS)
    # torch 2.13's CPU flex template fails to compile GPT-Neo's window bias with a packed block
    # mask: its flex attention runs uncompiled (flex attention's own unfused arithmetic).
    uncompiled = kind == "gpt_neo" and implementation == "flex_attention"
    with torch.no_grad(), torch.compiler.set_stance("force_eager") if uncompiled else contextlib.nullcontext():
        packed = model(**packing.inputs(blocks), use_cache=False).logits.view(*blocks.shape, -1)
        plain = model(input_ids=blocks, use_cache=False).logits
        alone = logits_alone(model, blocks)
    torch.testing.assert_close(packed, alone, **TOLERANCE)
    # Per-token losses of every target, the token after each EOS included (predicted from its document).
    losses = [token_losses(x, blocks) for x in (packed, alone)]
    torch.testing.assert_close(losses[0], losses[1], **TOLERANCE)
    # The check can fail: without the mask, later documents see earlier ones.
    assert not torch.allclose(plain[0, 7:], alone[0, 7:], **TOLERANCE)


def test_flash_layout_is_one_row_of_documents():
    """Flash and flex attention get no mask: the rows end to end, positions restarting in each."""
    blocks = packed_blocks()
    inputs = DocumentPacking(EOS, "flash_attention_2", torch.bfloat16).inputs(blocks)
    assert set(inputs) == {"input_ids", "position_ids"}
    assert torch.equal(inputs["input_ids"], blocks.reshape(1, -1))
    assert torch.equal(inputs["position_ids"][0, 40:], document_positions(blocks, EOS)[1])


def test_models_the_mask_cannot_express_are_refused():
    with pytest.raises(UptrainError, match="ALiBi"):
        check_document_mask({"model_type": "bloom_gqa"}, 64, "m")
    with pytest.raises(UptrainError, match="m is Falcon, whose ALiBi"):
        check_document_mask({"model_type": "falcon_gqa", "alibi": True}, 64, "m")
    check_document_mask({"model_type": "falcon_gqa", "alibi": False}, 64, "m")  # rotary
    with pytest.raises(UptrainError, match="sliding window of 16 tokens, shorter than seq_len 64"):
        check_document_mask({"model_type": "mistral", "sliding_window": 16}, 64, "m")
    check_document_mask({"model_type": "mistral", "sliding_window": 4096}, 64, "m")
    check_document_mask({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False}, 64, "m")


def test_training_with_the_document_mask_scores_each_document_alone(assets, base_config):
    """The run's eval loss at step 0 is the mean loss of its eval blocks' documents run one by one."""
    from tests.train.train_helpers import records
    from uptrain.data.text import load_blocks
    from uptrain.train.config import TrainConfig
    from uptrain.train.loop import run_training

    config = TrainConfig(**{**base_config, "document_mask": True, "max_steps": 2, "eval_every": 2})
    run_training(config)
    recs = records(config.output_dir)
    model = AutoModelForCausalLM.from_pretrained(assets["gqa"]).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets["gqa"])
    eval_blocks, _ = load_blocks(str(assets["eval"]), "eval_data", tokenizer, 32, "text", "train", None,
                                 "paragraph", streaming=False, workers=None)  # fmt: skip
    blocks = eval_blocks.take(list(range(min(8, len(eval_blocks)))))
    alone = token_losses(logits_alone(model, blocks, tokenizer.eos_token_id), blocks).mean().item()
    with torch.no_grad():
        plain = token_losses(model(input_ids=blocks).logits, blocks).mean().item()
    assert recs[0]["eval/loss"] == pytest.approx(alone, rel=1e-5)
    assert abs(plain - alone) > 1e-3  # the check can fail: packing without the mask scores otherwise
    assert all(r["train/loss"] > 0 for r in recs[1:])


def test_training_refuses_a_model_the_mask_cannot_express(assets, base_config, tmp_path):
    from transformers import AutoTokenizer

    from uptrain.train.config import TrainConfig
    from uptrain.train.loop import run_training

    mistral = build_model("mistral", num_kv_heads=2)
    mistral.config.sliding_window = 16
    mistral.save_pretrained(tmp_path / "mistral")
    AutoTokenizer.from_pretrained(assets["gqa"]).save_pretrained(tmp_path / "mistral")
    config = TrainConfig(**{**base_config, "model": str(tmp_path / "mistral"), "document_mask": True})
    with pytest.raises(UptrainError, match="sliding window of 16 tokens, shorter than seq_len 32") as err:
        run_training(config)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
def test_opt_with_flash_or_flex_attention_is_refused(implementation, gqa_model):
    """OPT's forward builds its mask without positions: those backends would see one document."""
    model = model_for("opt", gqa_model, "sdpa")
    model.config._attn_implementation = implementation
    with pytest.raises(UptrainError, match=f"OPT builds its attention mask without position ids, so {implementation}"):
        DocumentPacking.for_model(model, EOS)


def test_gpt_neo_with_flash_attention_is_refused(gqa_model):
    """GPT-Neo's layers give attention no positions, from which flash attention finds documents."""
    model = model_for("gpt_neo", gqa_model, "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UptrainError, match="GPT-Neo's layers do not pass position ids to attention, so flash"):
        DocumentPacking.for_model(model, EOS)
    model.config._attn_implementation = "flex_attention"
    assert DocumentPacking.for_model(model, EOS).attn_implementation == "flex_attention"
