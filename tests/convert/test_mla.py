"""`uptrain convert --target mla`: a tiny Llama written as DeepSeek-V2 multi-head latent attention,
loaded by transformers' own `DeepseekV2ForCausalLM` (no uptrain modeling registered for it).

What is exact, and why only there: the layout has one rotary key for all heads, so a source's
keys survive whole only when the source has one KV head and every rotary column is kept (D = d);
the latent RMSNorm divides each token's latent by its rms, which the conversion makes the rms of
the input RMSNorm's output n — exactly 1 only when that norm's ε is negligible against the
residual's mean square (the source here has ε = 1e-12), and only at full rank (R = hidden), where
the latent is n rotated. Below full rank the written tensors are checked against the truncated
SVD of the stacked non-rotary keys and values, recomputed here from the source's weights.
`--mla-init calibrated` is exact below full rank where the attention inputs span the latent's rank
(a source built so), and the weight-space SVD there is not.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from uptrain import UptrainError
from uptrain.architecture import REGISTRY, source_model_type
from uptrain.cli import main
from uptrain.convert import convert_checkpoint
from uptrain.convert.mla import FAMILIES, FAMILY_REFUSALS, mla_geometry

HEADS, HEAD_DIM, HIDDEN = 4, 32, 128


def tiny_llama(folder, kv_heads: int, eps: float = 1e-12, tied: bool = False):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=HIDDEN,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        rms_norm_eps=eps,
        initializer_range=0.5,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # gains other than 1: the latent must absorb the input norm's gain
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return model


def test_one_kv_head_at_full_rank_with_every_rotary_column_is_the_source(tmp_path):
    source = tiny_llama(tmp_path / "src", kv_heads=1)
    out = convert_checkpoint(
        tmp_path / "src", tmp_path / "mla", target="mla", kv_rank=HIDDEN, rope_dims=HEAD_DIM, source_hash="none"
    )
    mla = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(mla).__name__ == "DeepseekV2ForCausalLM"
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = source(ids).logits, mla(ids).logits
        reference = source.double()(ids).logits.float()  # what float32 itself costs the source
    noise = (expected - reference).abs().max().item()
    assert (got - expected).abs().max().item() <= 20 * noise + 1e-4, "logits differ beyond float32 rounding"
    prompt = ids[:, :6]
    with torch.no_grad():
        assert torch.equal(
            source.float().generate(prompt, max_new_tokens=8, do_sample=False),
            mla.generate(prompt, max_new_tokens=8, do_sample=False),
        )


def logits_close(got: torch.Tensor, source, ids: torch.Tensor, **inputs) -> None:
    """`got` equals the source's logits up to 20× what float32 itself costs the source."""
    with torch.no_grad():
        expected = source.float()(ids, **inputs).logits
        reference = source.double()(ids, **inputs).logits.float()
    source.float()
    noise = (expected - reference).abs().max().item()
    assert (got - expected).abs().max().item() <= 20 * noise + 1e-4, "logits differ beyond float32 rounding"


@pytest.mark.parametrize(("rope", "stride"), [(8, 3), (16, 2)])
def test_a_stride_keeps_every_strided_frequency_rotary_and_turns_at_the_sources_frequencies(tmp_path, rope, stride):
    """`--rope-stride S`: the source's frequencies 0, S, 2S, … stay rotary, the layout's one base
    turning at exactly those (`rope_theta` θ^(S·D/d)). A one-KV-head source whose other frequencies
    are zero in its queries (so their rotation never counts) is then the conversion at full rank."""
    source = tiny_llama(tmp_path / "src", kv_heads=1)
    kept = [stride * j for j in range(rope // 2)]
    half = HEAD_DIM // 2
    with torch.no_grad():
        for layer in source.model.layers:
            rows = layer.self_attn.q_proj.weight.view(HEADS, HEAD_DIM, -1)
            for i in set(range(half)) - set(kept):
                rows[:, [i, i + half]] = 0
    source.save_pretrained(tmp_path / "src")
    options = dict(target="mla", kv_rank=HIDDEN, rope_dims=rope, rope_stride=stride, source_hash="none")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "mla", **options)
    mla = AutoModelForCausalLM.from_pretrained(out).eval()
    source_freq = source.model.rotary_emb.inv_freq
    torch.testing.assert_close(mla.model.rotary_emb.inv_freq, source_freq[kept], rtol=1e-6, atol=0)
    assert json.loads((out / "uptrain.json").read_text())["rotary_frequencies_kept"] == kept
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_close(mla(ids).logits, source, ids)
    too_far = half // (rope // 2 - 1) + 1  # the last kept frequency would be past the source's
    with pytest.raises(UptrainError, match="past its last"):
        convert_checkpoint(tmp_path / "src", tmp_path / "bad", **dict(options, rope_stride=too_far))
    assert not (tmp_path / "bad").exists()


def test_rotary_residual_keeps_what_the_shared_key_misses_unrotated(tmp_path):
    """`--rope-residual N`: per head, the part of its rotary key the shared key misses goes into the
    latent, unrotated, read by the head's own query (the softmax scale kept the source's by
    scaling the queries). Where no rotation turns anything (every position 0) four KV heads whose
    rotary keys no one key holds are then the source exactly at full rank with every frequency
    shared (D = d) and every residual kept; without the residual they are not. At real positions a
    one-KV-head source (nothing to miss) stays the source, D = d, with residual columns written."""
    source = tiny_llama(tmp_path / "src", kv_heads=4)
    options = dict(target="mla", kv_rank=HIDDEN, rope_dims=HEAD_DIM, source_hash="none")
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    still = torch.zeros_like(ids)
    kept = convert_checkpoint(tmp_path / "src", tmp_path / "kept", rope_residual=HEAD_DIM // 2, **options)
    dropped = convert_checkpoint(tmp_path / "src", tmp_path / "dropped", **options)
    config = json.loads((kept / "config.json").read_text())
    assert (config["qk_nope_head_dim"], config["qk_rope_head_dim"]) == (HEAD_DIM, HEAD_DIM)
    with torch.no_grad():
        logits_close(
            AutoModelForCausalLM.from_pretrained(kept)(ids, position_ids=still).logits, source, ids, position_ids=still
        )
        with pytest.raises(AssertionError, match="float32 rounding"):
            got = AutoModelForCausalLM.from_pretrained(dropped)(ids, position_ids=still).logits
            logits_close(got, source, ids, position_ids=still)
    one = tiny_llama(tmp_path / "one", kv_heads=1)
    out = convert_checkpoint(tmp_path / "one", tmp_path / "one-mla", rope_residual=3, **options)
    assert json.loads((out / "config.json").read_text())["qk_nope_head_dim"] == 6
    assert json.loads((out / "uptrain.json").read_text())["rotary_residual_frequencies"] == [13, 14, 15]
    assert "at frequencies [13, 14, 15] is kept in the latent, unrotated" in (out / "README.md").read_text()
    with torch.no_grad():
        logits_close(AutoModelForCausalLM.from_pretrained(out)(ids).logits, one, ids)


def llama_rope_rows(rope_dims: int) -> list[int]:
    """Llama rotates column i with i + d/2; DeepSeek-V2 rotates (2j, 2j + 1): the first D/2 pairs."""
    pairs = [(i, i + HEAD_DIM // 2) for i in range(rope_dims // 2)]
    return [row for pair in pairs for row in pair]


def test_lower_rank_is_the_truncated_svd_of_the_stacked_keys_and_values(tmp_path):
    rank, rope = 40, 16
    tiny_llama(tmp_path / "src", kv_heads=2)
    out = convert_checkpoint(
        tmp_path / "src", tmp_path / "mla", target="mla", kv_rank=rank, rope_dims=rope, rotary_key="mean"
    )
    written, source = load_file(out / "model.safetensors"), load_file(tmp_path / "src" / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"]) == (rank, rope, 16)
    assert config["rope_parameters"]["rope_theta"] == pytest.approx(10000.0 ** (rope / HEAD_DIM))
    rope_rows = llama_rope_rows(rope)
    nope_rows = [r for r in range(HEAD_DIM) if r not in rope_rows]
    for layer in range(2):
        p = f"model.layers.{layer}."
        q, k, v = (source[p + f"self_attn.{n}_proj.weight"].double() for n in "qkv")
        gain = source[p + "input_layernorm.weight"].double()
        heads_q, heads_k, heads_v = q.view(HEADS, HEAD_DIM, -1), k.view(2, HEAD_DIM, -1), v.view(2, HEAD_DIM, -1)
        # q_proj: each head's source rows, non-rotary then rotary (interleaved pairs), bit for bit
        expected_q = torch.cat([torch.cat([heads_q[h, nope_rows], heads_q[h, rope_rows]]) for h in range(HEADS)])
        assert torch.equal(written[p + "self_attn.q_proj.weight"], expected_q.float())
        kv_a = written[p + "self_attn.kv_a_proj_with_mqa.weight"].double()
        assert kv_a.shape == (rank + rope, HIDDEN)
        # the shared rotary key: the mean of the two KV heads' rotary rows
        torch.testing.assert_close(kv_a[rank:], (heads_k[0, rope_rows] + heads_k[1, rope_rows]) / 2)
        # the latent: the truncated SVD of [K_nope; V] per query head (its KV head's, heads 0,1 → 0),
        # taken from the normalised hidden state (the gain folded in)
        stacked = torch.cat([torch.cat([heads_k[h // 2, nope_rows], heads_v[h // 2]]) for h in range(HEADS)])
        u, s, vh = torch.linalg.svd(stacked * gain, full_matrices=False)
        truncated = u[:, :rank] @ torch.diag(s[:rank]) @ vh[:rank]
        kv_b = written[p + "self_attn.kv_b_proj.weight"].double()
        torch.testing.assert_close(kv_b @ (kv_a[:rank] * gain), truncated, atol=1e-5, rtol=1e-5)
        # the latent is an orthonormal projection of n: rms ≈ 1 wherever n lies in its span
        torch.testing.assert_close((kv_a[:rank] * gain) @ (kv_a[:rank] * gain).T, torch.eye(rank, dtype=torch.float64))
        assert torch.equal(written[p + "self_attn.kv_a_layernorm.weight"], torch.ones(rank))
        assert torch.equal(written[p + "self_attn.o_proj.weight"], source[p + "self_attn.o_proj.weight"])
    record = json.loads((out / "uptrain.json").read_text())
    assert record["target"] == "mla" and record["kv_elements_per_token_per_layer"] == {
        "mla": rank + rope,
        "source": 2 * 2 * HEAD_DIM,
        "mha": 2 * HEADS * HEAD_DIM,
    }


def complex_rows(rows: torch.Tensor, i: int, half: int) -> torch.Tensor:
    """A rotary pair's two rows (Llama's i and i + d/2, or DeepSeek-V2's 2i and 2i + 1 when half is
    given as 1 from 2i) as one complex row: the pair's rotation is a complex multiplication."""
    return torch.complex(rows[i], rows[i + half])


def test_principal_rotary_key_is_exact_when_each_frequencys_keys_are_multiples_of_one(tmp_path):
    """Every head's rotary key pair is a complex multiple (a turn and a scale) of head 0's, frequency
    by frequency: one shared key reproduces them all, the queries turned to match. With every
    rotary column kept and the rank full, the model is the source (the mean key is not)."""
    source = tiny_llama(tmp_path / "src", kv_heads=HEADS)
    half, generator = HEAD_DIM // 2, torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in source.model.layers:
            heads = layer.self_attn.k_proj.weight.view(HEADS, HEAD_DIM, -1)
            for h in range(1, HEADS):
                for i in range(half):
                    turn = torch.complex(*torch.randn(2, generator=generator))
                    pair = turn * complex_rows(heads[0], i, half)
                    heads[h, i], heads[h, i + half] = pair.real, pair.imag
    source.save_pretrained(tmp_path / "src")
    ids = torch.randint(0, 96, (2, 24), generator=generator)
    with torch.no_grad():
        expected = source(ids).logits
        noise = (expected - source.double()(ids).logits.float()).abs().max().item()
    errors = {}
    for key in ("principal", "mean"):
        out = convert_checkpoint(
            tmp_path / "src", tmp_path / key, target="mla", kv_rank=HIDDEN, rope_dims=HEAD_DIM, rotary_key=key
        )
        with torch.no_grad():
            errors[key] = (AutoModelForCausalLM.from_pretrained(out)(ids).logits - expected).abs().max().item()
    assert errors["principal"] <= 20 * noise + 1e-4 < errors["mean"], errors


def test_principal_rotary_key_is_the_best_rank_one_fit(tmp_path):
    """On a source whose heads' rotary keys are unrelated: each query head's rotary rows are its
    source rows turned and scaled (a complex multiple), and the shared key leaves exactly the
    Eckart–Young residual of the query-weighted heads' keys — all but the top singular value."""
    rank, rope, half = 40, 16, HEAD_DIM // 2
    tiny_llama(tmp_path / "src", kv_heads=2)
    out = convert_checkpoint(tmp_path / "src", tmp_path / "mla", target="mla", kv_rank=rank, rope_dims=rope)
    written, source = load_file(out / "model.safetensors"), load_file(tmp_path / "src" / "model.safetensors")
    for layer in range(2):
        p = f"model.layers.{layer}."
        gain = source[p + "input_layernorm.weight"].double()
        q_src = source[p + "self_attn.q_proj.weight"].double().view(HEADS, HEAD_DIM, -1)
        k_src = source[p + "self_attn.k_proj.weight"].double().view(2, HEAD_DIM, -1)
        q_out = written[p + "self_attn.q_proj.weight"].double().view(HEADS, HEAD_DIM, -1)[:, HEAD_DIM - rope :]
        k_out = written[p + "self_attn.kv_a_proj_with_mqa.weight"].double()[rank:]
        for i in range(rope // 2):
            shared = torch.complex(k_out[2 * i], k_out[2 * i + 1]) * gain  # the key, read from n = x / g
            residual, rows = 0.0, []
            for h in range(HEADS):
                alpha, query = complex_rows(q_src[h], i, half), torch.complex(q_out[h, 2 * i], q_out[h, 2 * i + 1])
                turn = (query * alpha.conj()).sum() / (alpha.abs() ** 2).sum()
                torch.testing.assert_close(query, turn * alpha)  # the source's query, turned and scaled
                weight = (alpha * gain).abs().pow(2).sum().sqrt()
                beta = complex_rows(k_src[h // 2], i, half) * gain
                rows.append(weight * beta)
                # the score map conj(q') k must approximate conj(α) β: here β ≈ conj(turn) · shared
                residual += ((weight * (beta - turn.conj() * shared)).abs() ** 2).sum().item()
            singular = torch.linalg.svdvals(torch.stack(rows))
            assert residual == pytest.approx((singular[1:] ** 2).sum().item(), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--target", "mla", "--kv-rank", "40", "-g", "2"], "not -g"),
        (["--target", "mla"], "needs one of --kv-rank R"),
        (["--target", "mla", "--kv-rank", "40", "--kv-budget", "0.25"], "needs one of --kv-rank R"),
        (["--target", "mla", "--kv-budget", "0.3"], "is 76.8, which must be a whole number above --rope-dims 16"),
        (["--target", "mla", "--kv-budget", "0.0625", "--rope-dims", "16"], "is 16, which must be a whole number"),
        (["--target", "mla", "--kv-rank", "40", "--pooling", "calibrated"], "not --pooling"),
        (["-g", "2", "--kv-rank", "40"], "give them with --target mla"),
        (["-g", "2", "--rotary-key", "mean"], "give them with --target mla"),
        (["-g", "2", "--mla-init", "calibrated"], "give them with --target mla"),
        (["--target", "mla", "--kv-rank", "40", "--mla-init", "calibrated"], "needs calibration data"),
        (["--target", "mla", "--kv-rank", "40", "--rotary-key", "calibrated"], "give it with --mla-init calibrated"),
        (["--target", "mla", "--kv-rank", "40", "--calibration-data", "text.txt"], "--mla-init svd reads no"),
        (
            ["--target", "mla", "--kv-rank", "40", "--mla-init", "calibrated", "--calibration-data", "missing.txt"],
            "missing.txt",
        ),
        (["--target", "mla", "--kv-rank", "0"], "kv_rank"),
        (
            ["--target", "mla", "--kv-budget", "1", "--rope-dims", "2"],
            "latent rank 254 (--kv-rank, or what --kv-budget",
        ),
        (["--target", "mla", "--kv-rank", f"{HIDDEN + 1}"], "give 1 to 128"),
        (["--target", "mla", "--kv-rank", "40", "--rope-dims", "7"], "even number from 2 to the head dimension 32"),
        (["--target", "mla", "--kv-rank", "40", "--rope-dims", "34"], "even number from 2 to the head dimension 32"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, flags, message):
    tiny_llama(tmp_path / "src", kv_heads=4)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), *flags]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(model_type="mistral"), "converts the Llama family"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "'linear'"),
    ],
)
def test_sources_the_layout_cannot_take_are_refused(tmp_path, capsys, config, message):
    tiny_llama(tmp_path / "src", kv_heads=4)
    path = tmp_path / "src" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--target", "mla", "--kv-rank", "40"]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_every_other_family_is_refused_with_what_the_layout_cannot_state():
    """Each family uptrain converts to GQA, but not to MLA, has its own reason (a family added to
    the registry without one fails here); converted `*_gqa` types read as their source's."""
    assert set(FAMILY_REFUSALS) == set(REGISTRY) - set(FAMILIES)
    for model_type in [*FAMILY_REFUSALS, "gpt2_gqa", "whisper_gqa", "not_a_model"]:
        with pytest.raises(UptrainError) as refused:
            mla_geometry({"model_type": model_type}, kv_rank=8, rope_dims=None)
        reason = FAMILY_REFUSALS.get(source_model_type(model_type), "an architecture uptrain does not know")
        assert f"{model_type!r} has {reason} (use --target gqa)" in str(refused.value)
        assert "\n" not in str(refused.value)


def test_a_zero_input_norm_gain_is_refused_before_anything_is_written(tmp_path):
    model = tiny_llama(tmp_path / "src", kv_heads=4)
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[3] = 0
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(UptrainError, match="layer 1's input_layernorm has a weight of 0"):
        convert_checkpoint(tmp_path / "src", tmp_path / "mla", target="mla", kv_rank=40)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_dtype_cast_card_and_record(tmp_path):
    tiny_llama(tmp_path / "src", kv_heads=4)
    out = convert_checkpoint(
        tmp_path / "src",
        tmp_path / "mla",
        target="mla",
        kv_rank=24,
        rope_dims=8,
        dtype="bfloat16",
        max_shard_size="100KB",
    )
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded, with its index
    model = AutoModelForCausalLM.from_pretrained(out)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    record = json.loads((out / "uptrain.json").read_text())
    assert (record["kv_lora_rank"], record["qk_rope_head_dim"], record["rotary_frequencies_kept"]) == (
        24,
        8,
        [0, 1, 2, 3],
    )
    card = (out / "README.md").read_text()
    assert "a latent of rank 24 and one rotary key of 8 columns" in card
    # Latent attention's own tags, not the GQA outputs'; and where vLLM takes it (24 + 8: nowhere).
    tags = yaml.safe_load(card.split("---\n")[1])["tags"]
    assert {"multi-head-latent-attention", "mla", "llama"} <= set(tags) and "gqa" not in tags, tags
    assert not {"grouped-query-attention"} & set(tags)
    assert "vLLM does not serve it" in card and "(this one has 32)" in card


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_sources_head_is_written_as_a_copy_of_its_embeddings(tmp_path, tied):
    """vLLM's DeepseekV2ForCausalLM never ties the head: a tied source's head is written (the
    embeddings, bit for bit), the config keeps the tie (transformers ties on load and trains one
    matrix); an untied source's head is its own, as the source wrote it."""
    tiny_llama(tmp_path / "src", kv_heads=4, tied=tied)
    source = load_file(tmp_path / "src" / "model.safetensors")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "mla", target="mla", kv_rank=24, rope_dims=8)
    written = load_file(out / "model.safetensors")
    head = source.get("lm_head.weight", source["model.embed_tokens.weight"])
    assert torch.equal(written["lm_head.weight"], head)
    assert ("lm_head.weight" in source) == (not tied)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] == tied
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_the_rotary_is_written_as_yarn_at_factor_one_the_plain_rotary_vllm_runs_right(tmp_path):
    """`rope_type: default` is mis-positioned by vLLM 0.32's CPU rotary kernel; YaRN at factor 1 is
    the same rotary in transformers: the frequencies of the default at θ' = θ^(D/d), attention
    factor 1, and no softmax-scale correction."""
    tiny_llama(tmp_path / "src", kv_heads=4)
    out = convert_checkpoint(tmp_path / "src", tmp_path / "mla", target="mla", kv_rank=24, rope_dims=8)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and "mscale_all_dim" not in config["rope_parameters"]
    model = AutoModelForCausalLM.from_pretrained(out)
    theta = 10000.0 ** (8 / HEAD_DIM)
    default = 1.0 / theta ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    rotary = model.model.rotary_emb
    torch.testing.assert_close(rotary.inv_freq, default, rtol=2**-23, atol=0)
    assert rotary.attention_scaling == 1.0
    assert model.model.layers[0].self_attn.scaling == HEAD_DIM**-0.5


def test_kv_budget_spends_the_sources_kv_elements_on_the_latent_and_the_rotary_key(tmp_path):
    tiny_llama(tmp_path / "src", kv_heads=2)  # 2 KV heads × 32: 128 K/V elements per token and layer
    out = convert_checkpoint(tmp_path / "src", tmp_path / "mla", target="mla", kv_budget=0.5, rope_dims=16)
    assert json.loads((out / "config.json").read_text())["kv_lora_rank"] == 64 - 16
    record = json.loads((out / "uptrain.json").read_text())
    assert record["kv_budget"] == 0.5 and record["kv_elements_per_token_per_layer"]["mla"] == 64


def test_inspect_shows_the_latents_bytes_per_token(tmp_path, capsys):
    tiny_llama(tmp_path / "src", kv_heads=4)
    out = convert_checkpoint(tmp_path / "src", tmp_path / "mla", target="mla", kv_rank=24, rope_dims=8)
    capsys.readouterr()
    assert main(["inspect", str(out), "--json", "--context", "10"]) == 0
    info = json.loads(capsys.readouterr().out)
    per_token = 2 * (24 + 8) * 4  # layers × (latent + shared rotary key) × float32
    assert (info["kv_cache_bytes_per_token"], info["kv_cache_bytes"]) == (per_token, per_token * 10)
    mha = 2 * 2 * HEADS * HEAD_DIM * 4  # layers × K and V × heads × head_dim × float32
    assert info["expanded"][0] == {
        "num_kv_heads": HEADS,
        "kv_cache_bytes_per_token": mha,
        "latent_share": per_token / mha,
    }
    assert [row["num_kv_heads"] for row in info["expanded"]] == [4, 2, 1]
    assert main(["inspect", str(out)]) == 0
    assert "a latent of rank 24 + one rotary key of 8 shared by all heads" in capsys.readouterr().out


def subspace_llama(folder, tokenizer, rank: int, kv_heads: int = 1, keys_alike_on_s: bool = False):
    """A tiny Llama whose residual stream lies in a `rank`-dimensional subspace S for every input:
    the embeddings, o_proj's and down_proj's outputs are projected onto S, so every attention input
    is diag(g) of a vector of S. `keys_alike_on_s`: per frequency, every KV head's complex key row
    is a complex multiple of head 0's plus a part that reads nothing of diag(g) S."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-12,
        initializer_range=0.5,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    basis, _ = torch.linalg.qr(torch.randn(HIDDEN, rank))
    onto = basis @ basis.T
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight @ onto)
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.self_attn.o_proj.weight.copy_(onto @ layer.self_attn.o_proj.weight)
            layer.mlp.down_proj.weight.copy_(onto @ layer.mlp.down_proj.weight)
            if keys_alike_on_s:
                gain, half = layer.input_layernorm.weight, HEAD_DIM // 2
                k = layer.self_attn.k_proj.weight.view(kv_heads, HEAD_DIM, HIDDEN)
                for i in range(half):
                    first = torch.complex(k[0, i], k[0, i + half])
                    for s in range(1, kv_heads):
                        unseen = torch.complex(*(torch.randn(2, HIDDEN) @ (torch.eye(HIDDEN) - onto) / gain))
                        row = torch.complex(*torch.randn(2)) * first + unseen
                        k[s, i], k[s, i + half] = row.real, row.imag
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def test_calibrated_latent_is_exact_when_the_attention_inputs_span_its_rank(tmp_path, tokenizer, calibration_text):
    """Hidden states in an R-dimensional subspace: the calibrated latent of rank R spans them, so
    B A x = W x and, its basis orthonormal in n = x / g, every token's latent has the norm of n
    (√hidden): the latent norm's measured weight √(hidden / R) undoes its division exactly and the
    model is the source (every rotary column kept, one KV head: the rotary key is exact too).
    The weight-space SVD at the same rank keeps the values' top singular directions, not S: far off."""
    rank = 24
    source = subspace_llama(tmp_path / "src", tokenizer, rank)
    mla = dict(target="mla", kv_rank=rank, rope_dims=HEAD_DIM, source_hash="none", progress=False)
    calibrated = convert_checkpoint(
        tmp_path / "src",
        tmp_path / "calibrated",
        mla_init="calibrated",
        calibration_data=str(calibration_text),
        calibration_tokens=1024,
        calibration_device="cpu",
        **mla,
    )
    svd = convert_checkpoint(tmp_path / "src", tmp_path / "svd", **mla)
    weights = load_file(calibrated / "model.safetensors")
    expected_weight = torch.full((rank,), (HIDDEN / rank) ** 0.5)
    assert torch.allclose(weights["model.layers.1.self_attn.kv_a_layernorm.weight"], expected_weight, rtol=1e-5)
    record = json.loads((calibrated / "uptrain.json").read_text())
    assert record["initialisation"] == "calibrated" and record["calibration"]["tokens"] == 1024
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = source(ids).logits
        noise = (expected - source.double()(ids).logits.float()).abs().max().item()
        got = AutoModelForCausalLM.from_pretrained(calibrated).eval()(ids).logits
        off = AutoModelForCausalLM.from_pretrained(svd).eval()(ids).logits
    assert (got - expected).abs().max().item() <= 20 * noise + 1e-4, "the calibrated latent is not the source"
    assert (off - expected).abs().max().item() > 1000 * (20 * noise + 1e-4)


def test_calibrated_rotary_key_is_exact_where_the_keys_are_multiples_of_one_on_the_data(
    tmp_path, tokenizer, calibration_text
):
    """Four KV heads whose rotary keys, frequency by frequency, are complex multiples of one on
    every attention input (they differ only where no input reaches): the calibrated rotary key,
    fitted under C, is exact (with the calibrated latent at the inputs' rank, the model is the
    source), the weight-space principal key, which sees the differences, is not."""
    rank = 24
    source = subspace_llama(tmp_path / "src", tokenizer, rank, kv_heads=HEADS, keys_alike_on_s=True)
    common = dict(target="mla", kv_rank=rank, rope_dims=HEAD_DIM, source_hash="none", progress=False)
    calibration = dict(calibration_data=str(calibration_text), calibration_tokens=1024, calibration_device="cpu")
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = source(ids).logits
        noise = (expected - source.double()(ids).logits.float()).abs().max().item()
    gaps = {}
    for key in ("calibrated", "principal"):
        out = convert_checkpoint(
            tmp_path / "src", tmp_path / key, rotary_key=key, mla_init="calibrated", **calibration, **common
        )
        with torch.no_grad():
            got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        gaps[key] = (got - expected).abs().max().item()
    assert gaps["calibrated"] <= 20 * noise + 1e-4, gaps
    assert gaps["principal"] > 100 * (20 * noise + 1e-4), gaps


def test_speed_measures_the_latent_and_the_rotary_key_in_the_cache(tmp_path, capsys):
    """transformers caches the normalised latent and the shared rotary key, not expanded K/V: the
    measured cache bytes are the latent's arithmetic, and so is the pre-run fit check's estimate."""
    from uptrain.speed import format_speed_table, measure_speed
    from uptrain.speed_checks import model_shape

    tiny_llama(tmp_path / "src", kv_heads=4)
    out = convert_checkpoint(tmp_path / "src", tmp_path / "mla", target="mla", kv_rank=24, rope_dims=8)
    per_layer = json.loads((out / "uptrain.json").read_text())["kv_elements_per_token_per_layer"]["mla"]
    assert per_layer == 24 + 8
    context, new_tokens, batch = 10, 3, 2
    (result,) = measure_speed([out], context=context, new_tokens=new_tokens, batch=batch, repeats=1)
    positions = context + new_tokens - 1  # the last token is never fed back
    assert result["kv_cache_bytes"] == 2 * per_layer * 4 * batch * positions  # layers × elements × float32
    assert result["num_kv_heads"] is None
    assert model_shape(out, "mla").cache_bytes(batch, context, new_tokens, "float32") == (
        2 * per_layer * 4 * batch * (context + new_tokens)
    )
    assert " MLA " in format_speed_table([result])
