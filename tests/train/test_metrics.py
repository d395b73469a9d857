"""FLOPs, MFU, the learning-rate schedule, checkpoint bookkeeping and wandb's offline fallback."""

from __future__ import annotations

import math
import os

import pytest
import torch

from uptrain import UptrainError
from uptrain.train import metrics as M
from uptrain.train.checkpoint import STATE_FILE, latest_checkpoint, list_checkpoints
from uptrain.train.config import TrainConfig
from uptrain.train.optimizer import lr_at
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


# A tiny T5 whose attention width (heads × d_kv = 32) is not d_model (16), and whose stacks differ
# in depth, so that a formula mixing them up cannot pass.
T5_SHAPE = dict(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=4)
T5_IDS = dict(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def t5_by_hand(gated: bool, self_kv: int = 4, cross_kv: int = 4) -> dict[str, int]:
    """The non-embedding parameters of T5_SHAPE's stacks, counted from the architecture: q and o
    are d × (h·d_kv), k and v d × (kv·d_kv), a ReLU FFN has wi and wo (gated: wi_0, wi_1, wo),
    one RMSNorm weight of d per sublayer and per stack; the output projection V × d."""
    d, w, f, v, d_kv = 16, 32, 32, 64, 8
    ffn = (3 if gated else 2) * d * f
    encoder = 2 * (4 * d * w + ffn + 2 * d) + d
    self_attn = 2 * d * w + 2 * d * self_kv * d_kv
    cross_q_o = 2 * d * w
    decoder = 1 * (self_attn + cross_q_o + ffn + 3 * d) + d + v * d
    return {"encoder": encoder, "decoder": decoder, "cross_kv": 1 * 2 * d * cross_kv * d_kv}


def t5_checkpoint(folder, gated: bool = False):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    extra = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False) if gated else {}
    T5ForConditionalGeneration(T5Config(**T5_SHAPE, **T5_IDS, **extra)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "gated, attention, self_kv, cross_kv",
    [(False, None, 4, 4), (True, None, 4, 4), (False, "decoder-self,cross", 2, 2), (False, "cross", 4, 2)],
)
def test_encoder_decoder_flops_by_hand_on_a_tiny_t5(gated, attention, self_kv, cross_kv, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    import uptrain.modeling  # noqa: F401  registers t5_gqa with the Auto classes
    from uptrain.convert import convert_checkpoint
    from uptrain.model_info import read_config

    folder = t5_checkpoint(tmp_path / "t5", gated)
    if attention is not None:
        folder = convert_checkpoint(folder, tmp_path / "gqa", 2, attention=attention, progress=False)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder)
    cost = M.encoder_decoder_cost(model, read_config(folder))
    hand = t5_by_hand(gated, self_kv, cross_kv)
    assert (cost.encoder_params, cost.decoder_params, cost.cross_kv_params) == (
        hand["encoder"],
        hand["decoder"],
        hand["cross_kv"],
    )
    # Nothing else is left out but the lookups: the shared embedding (counted once, as the output
    # projection, tied or not) and each stack's relative-attention bias (32 buckets × 4 heads).
    total = sum(p.numel() for p in model.parameters())
    untied_input = 0 if model.lm_head.weight is model.shared.weight else 64 * 16
    assert sum(hand.values()) + untied_input + 2 * 32 * 4 == total
    assert (cost.encoder_layers, cost.decoder_layers) == (2, 1)
    assert cost.encoder_width == cost.decoder_width == cost.cross_width == 32

    s, t, w = 10, 6, 32
    encoder = s * (6 * (hand["encoder"] + hand["cross_kv"]) + 12 * 2 * w * s)  # bidirectional: all S keys
    decoder = t * (6 * hand["decoder"] + 6 * 1 * w * t + 12 * 1 * w * s)  # causal self (T/2 keys) + cross (S keys)
    assert cost.train_flops(s, t) == encoder + decoder
    assert cost.forward_flops(s, t) == pytest.approx((encoder + decoder) / 3)


def test_encoder_decoder_attention_terms_count_the_masks():
    """Only the attention terms (no parameters), against the masks themselves: per example,
    forward, 4·W FLOPs per (query, key) pair a mask lets through; training is 3× that."""
    cost = M.EncoderDecoderCost(
        0, 0, 0, encoder_layers=2, encoder_width=32, decoder_layers=3, decoder_width=16, cross_width=8
    )
    s, t = 64, 48
    pairs = {
        "encoder": int(torch.ones(s, s).sum()),  # bidirectional
        "decoder-self": int(torch.ones(t, t).tril().sum()),  # causal
        "cross": int(torch.ones(t, s).sum()),  # every decoder position reads every encoder position
    }
    by_hand = 3 * 4 * (2 * 32 * pairs["encoder"] + 3 * 16 * pairs["decoder-self"] + 3 * 8 * pairs["cross"])
    # Equal but for the causal mask's diagonal (T(T+1)/2 pairs, the formula's T²/2).
    assert cost.train_flops(s, t) == pytest.approx(by_hand, rel=1 / t)
    assert cost.train_flops(s, t) == by_hand - 3 * 4 * 3 * 16 * t / 2


def test_kv_cache_metrics_of_an_encoder_decoder_count_self_and_cross_caches(tmp_path):
    from uptrain.convert import convert_checkpoint
    from uptrain.model_info import read_config

    folder = t5_checkpoint(tmp_path / "t5")
    gqa = convert_checkpoint(folder, tmp_path / "gqa", 2, attention="cross", progress=False)
    # 2 (K and V) × 1 decoder layer × KV heads × d_kv 8 × 2 bytes (bf16).
    assert M.kv_cache_metrics(read_config(folder), 2) == {
        "model/kv_cache_bytes_per_token": 2 * 1 * 4 * 8 * 2,
        "model/cross_kv_cache_bytes_per_source_token": 2 * 1 * 4 * 8 * 2,
    }
    assert M.kv_cache_metrics(read_config(gqa), 2) == {
        "model/kv_cache_bytes_per_token": 2 * 1 * 4 * 8 * 2,  # the self-attention was not pooled
        "model/cross_kv_cache_bytes_per_source_token": 2 * 1 * 2 * 8 * 2,
    }


def test_decoder_only_kv_cache_metrics_are_unchanged(assets):
    from uptrain.architecture import config_geometry
    from uptrain.model_info import read_config

    config = read_config(assets["gqa"])  # Llama, 2 layers, 2 KV heads, head_dim 8
    assert M.kv_cache_metrics(config, 4) == {"model/kv_cache_bytes_per_token": 2 * 2 * 2 * 8 * 4}
    assert M.kv_cache_metrics(config, 4)["model/kv_cache_bytes_per_token"] == config_geometry(
        config
    ).kv_cache_bytes_per_token(4)


def test_encoder_decoder_cost_refuses_a_decoder_only_config(assets):
    from transformers import AutoModelForCausalLM

    from uptrain.model_info import read_config

    with pytest.raises(UptrainError, match="not an encoder–decoder"):
        M.encoder_decoder_cost(AutoModelForCausalLM.from_pretrained(assets["gqa"]), read_config(assets["gqa"]))


def test_encoder_decoder_forward_flops_match_torchs_flop_counter(tmp_path):
    """torch's own count of a tiny T5's forward matmuls (eager attention, which computes every
    (query, key) pair, the masked ones too): the formula's forward, less the RMSNorm weights that
    N counts but that multiply nothing, plus the causal half of the decoder self-attention that
    causal kernels skip and eager attention computes."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(**T5_SHAPE, **T5_IDS, attn_implementation="eager")
    model = T5ForConditionalGeneration(config).eval()
    cost = M.encoder_decoder_cost(model, {**config.to_dict(), "model_type": "t5"})
    s, t, d, w = 10, 6, 16, 32
    g = torch.Generator().manual_seed(0)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(
            input_ids=torch.randint(2, 64, (1, s), generator=g),
            decoder_input_ids=torch.randint(2, 64, (1, t), generator=g),
        )
    norms = s * (2 * 2 * d + d) + t * (3 * 1 * d + d)  # 2 per encoder layer + final; 3 per decoder layer + final
    causal_half = 2 * 1 * w * t * t  # 4·W·T² forward over the full T × T, half of it under the mask
    assert counter.get_total_flops() == cost.forward_flops(s, t) - 2 * norms + causal_half


@pytest.mark.parametrize("model_type", ["bart", "marian", "whisper"])
def test_encoder_decoder_cost_finds_each_familys_stacks_and_cross_kv(model_type):
    """BART's family names its stacks `model.encoder.` / `model.decoder.` and its cross-attention
    `encoder_attn` with biased k_proj/v_proj (Whisper: k_proj unbiased); its position embeddings
    are lookups, left out like the token embeddings."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    shape = dict(
        d_model=16,
        encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        vocab_size=64,
        max_position_embeddings=32,
    )
    if model_type == "whisper":
        shape.update(max_source_positions=8, max_target_positions=32, num_mel_bins=8)
        del shape["max_position_embeddings"]
    config = AutoConfig.for_model(model_type, **shape, decoder_start_token_id=1, pad_token_id=0)
    auto = AutoModelForSpeechSeq2Seq if model_type == "whisper" else AutoModelForSeq2SeqLM
    torch.manual_seed(0)
    model = auto.from_config(config)
    cost = M.encoder_decoder_cost(model, config.to_dict())
    d = 16
    k_bias = 0 if model_type == "whisper" else d
    assert cost.cross_kv_params == 1 * (d * d + k_bias + d * d + d)  # one decoder layer's cross k_proj, v_proj
    assert (cost.encoder_layers, cost.decoder_layers, cost.encoder_width, cost.cross_width) == (2, 1, 16, 16)
    lookups = {
        id(p): p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding)
        for p in m.parameters()
        if p is not model.get_output_embeddings().weight
    }
    total = sum(p.numel() for p in model.parameters())
    assert cost.encoder_params + cost.decoder_params + cost.cross_kv_params + sum(lookups.values()) == total
    encoder = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("model.encoder.") and id(p) not in lookups
    )
    assert cost.encoder_params == encoder > 0


def test_kv_cache_metrics_sum_each_layers_kv_heads(tmp_path):
    """A conversion with per-layer KV heads logs the cache its layers hold, summed layer by layer."""
    from tests.modeling.classic_models import build as build_classic
    from uptrain.convert import convert_checkpoint
    from uptrain.model_info import read_config

    build_classic("gpt2").save_pretrained(tmp_path / "src")
    gqa = convert_checkpoint(tmp_path / "src", tmp_path / "gqa", kv_heads_per_layer="4,1", progress=False)
    # 2 (K and V) × (4 + 1) KV heads × head_dim 8 × 2 bytes, not 2 layers × the largest 4.
    assert M.kv_cache_metrics(read_config(gqa), 2) == {"model/kv_cache_bytes_per_token": 2 * (4 + 1) * 8 * 2}
