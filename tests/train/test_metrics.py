"""FLOPs, MFU, the learning-rate schedule, checkpoint bookkeeping and wandb's offline fallback."""

from __future__ import annotations

import math
import os

import pytest
import torch

from uptrain.train import metrics as M
from uptrain.train.checkpoint import STATE_FILE, latest_checkpoint, list_checkpoints
from uptrain.train.config import TrainConfig
from uptrain.train.loop import lr_at
from uptrain.train.tracking import ensure_wandb_never_prompts


def test_flops_and_mfu_by_hand():
    # Causal: 6·N + 6·L·(heads·head_dim)·T with N = 1e6, L = 2, width 64, T = 32, i.e. half of
    # PaLM's full-attention 12·L·H·Q·T = 49152.
    assert M.train_flops_per_token(10**6, 2, 64, 32) == 6e6 + 24576
    assert M.forward_flops_per_token(10**6, 2, 64, 32) == pytest.approx((6e6 + 24576) / 3)
    # 1000 tokens/s × 1e9 FLOPs each = 1e12 FLOP/s on 2 devices of 1e12 peak: 50%.
    assert M.mfu(1000, 1e9, 1e12, 2) == 0.5
    assert M.default_peak_flops(torch.device("cpu")) is None


def test_attention_flops_count_the_causal_mask():
    # By hand from the mask: forward, each query head spends 2·Q FLOPs per key on its scores and
    # 2·Q on the values; under a causal mask position i sees i + 1 keys; backward costs twice the
    # forward. Per token that is 3·4·H·Q·(T + 1)/2 per layer: the formula's T/2 within 1/T.
    layers, heads, head_dim, seq_len = 3, 4, 16, 64
    keys_seen = int(torch.ones(seq_len, seq_len).tril().sum())  # T(T + 1)/2 = 2080
    by_hand = 3 * layers * 4 * heads * head_dim * keys_seen / seq_len
    attention = M.train_flops_per_token(0, layers, heads * head_dim, seq_len)
    assert attention == pytest.approx(by_hand, rel=1 / seq_len)
    assert attention == pytest.approx(12 * layers * heads * head_dim * seq_len / 2)  # PaLM's term, halved
    # The bench shape (~1B Llama, hidden 2048 × 22 layers, MLP 5632, vocab 32000, seq 2048): the
    # full attention term would read MFU about 8% high.
    hidden, n_layers, mlp, vocab = 2048, 22, 5632, 32000
    params = n_layers * (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * mlp) + hidden * vocab
    full = 6 * params + 12 * n_layers * hidden * 2048
    assert 1.07 < full / M.train_flops_per_token(params, n_layers, hidden, 2048) < 1.09


def test_non_embedding_params_counts_a_tied_head_once(assets):
    from transformers import LlamaConfig, LlamaForCausalLM

    untied = LlamaForCausalLM.from_pretrained(assets["gqa"])
    total = sum(p.numel() for p in untied.parameters())
    assert M.non_embedding_params(untied) == total - untied.get_input_embeddings().weight.numel()
    tied = LlamaForCausalLM(LlamaConfig(**{**untied.config.to_dict(), "tie_word_embeddings": True}))
    assert M.non_embedding_params(tied) == sum(p.numel() for p in tied.parameters())


def test_lr_warms_up_then_decays_to_min_ratio():
    config = TrainConfig(
        model="m",
        train_data="t",
        eval_data="e",
        output_dir="o",
        seq_len=8,
        batch_size=1,
        lr=1.0,
        warmup_steps=4,
        max_steps=104,
        min_lr_ratio=0.1,
    )
    assert [lr_at(config, s, 104) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(config, 4, 104) == 1.0
    assert lr_at(config, 54, 104) == pytest.approx(0.55)  # half way down the cosine
    assert lr_at(config, 103, 104) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.99)))
    assert all(lr_at(config, s, 104) >= lr_at(config, s + 1, 104) for s in range(4, 103))


def test_only_complete_checkpoints_count(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in [
        ("step_00000002", True),
        ("step_00000010", True),
        ("step_00000012", False),
        (".step_00000014.tmp", True),
    ]:
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / STATE_FILE).write_text("{}")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 10]
    assert latest_checkpoint(tmp_path)[0] == 10


def test_wandb_goes_offline_without_credentials(tmp_path, monkeypatch):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    note = ensure_wandb_never_prompts()
    assert os.environ["WANDB_MODE"] == "offline" and "offline" in note

    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert ensure_wandb_never_prompts() is None and "WANDB_MODE" not in os.environ
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert ensure_wandb_never_prompts() is None and os.environ["WANDB_MODE"] == "disabled"
