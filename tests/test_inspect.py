from __future__ import annotations

import json

from tests.convert.tiny_models import build_model, save
from uptrain.cli import main


def run_json(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["inspect", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_mha(capsys, tmp_path):
    model = build_model("llama")
    src = save(model, tmp_path / "src")
    info = run_json(capsys, src, "--context", 100, "--batch", 3)
    assert (info["num_layers"], info["num_attention_heads"], info["num_key_value_heads"], info["head_dim"]) == (
        2,
        8,
        8,
        8,
    )
    assert info["parameters"] == model.num_parameters()
    assert info["dtype"] == "float32"
    assert info["kv_cache_bytes_per_token"] == 2 * 2 * 8 * 8 * 4
    assert info["kv_cache_bytes"] == 2 * 2 * 8 * 8 * 4 * 100 * 3
    by_g = {o["num_kv_heads"]: o for o in info["options"]}
    assert sorted(by_g) == [1, 2, 4, 8]
    assert by_g[2]["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 4 and by_g[2]["saving"] == 0.75
    assert by_g[8]["tensor_parallel_degrees"] == [2, 4, 8] and by_g[1]["tensor_parallel_degrees"] == []


def test_inspect_gqa_dtype_and_text(capsys, tmp_path):
    src = save(build_model("gemma", num_kv_heads=4), tmp_path / "src")  # head_dim 16 from the config
    info = run_json(capsys, src, "--dtype", "bfloat16", "--context", 10)
    assert info["head_dim"] == 16 and info["num_key_value_heads"] == 4
    assert [o["num_kv_heads"] for o in info["options"]] == [1, 2, 4]
    assert info["kv_cache_bytes_per_token"] == 2 * 2 * 4 * 16 * 2
    assert main(["inspect", str(src)]) == 0
    text = capsys.readouterr().out
    assert "gemma" in text and "4 KV, head_dim 16" in text


def test_inspect_bad_input(capsys, tmp_path):
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == f"uptrain inspect: error: {tmp_path / 'missing'} does not exist"


def test_inspect_t5_reports_self_and_cross_caches(capsys, tmp_path):
    """T5: head_dim is d_kv (not d_model / heads); per G, the decoder self-attention's cache per
    generated token and the cross-attention's per source token, both at G heads."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=32, d_kv=6, d_ff=40, num_layers=2, num_decoder_layers=3, num_heads=8)
    model = T5ForConditionalGeneration(config)
    src = save(model, tmp_path / "src")
    info = run_json(capsys, src, "--context", 100, "--batch", 3)
    assert info["encoder_decoder"] and info["convertible"] and info["source_unit"] == "source token"
    assert info["attentions"] == {
        "encoder": {"num_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 6},
        "decoder-self": {"num_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 6},
        "cross": {"num_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 6},
    }
    assert info["parameters"] == model.num_parameters()  # tied embeddings saved once
    per_token = 2 * 3 * 8 * 6 * 4  # K and V × decoder layers × heads × d_kv × fp32
    assert info["kv_cache_bytes_per_token"] == per_token
    assert info["cross_kv_cache_bytes_per_source_token"] == per_token  # as many cross layers and heads
    assert info["kv_cache_bytes"] == (per_token * 100 + per_token * 100) * 3  # source as long as the context
    by_g = {o["num_kv_heads"]: o for o in info["options"]}
    assert sorted(by_g) == [1, 2, 4, 8]
    assert by_g[2]["kv_cache_bytes_per_token"] == 2 * 3 * 2 * 6 * 4 and by_g[2]["saving"] == 0.75
    assert by_g[2]["cross_kv_cache_bytes_per_source_token"] == 2 * 3 * 2 * 6 * 4
    assert main(["inspect", str(src)]) == 0
    text = capsys.readouterr().out
    assert "t5 (encoder–decoder)" in text and "decoder-self  3 layers, 8 query, 8 KV, head_dim 6" in text
    assert "per source token" in text


def tiny_whisper():
    """A Whisper of 8 decoder heads (4 in the encoder), 1500 audio frames, 16 decoder positions."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(
        WhisperConfig(
            vocab_size=64,
            d_model=32,
            encoder_layers=1,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=8,
            encoder_ffn_dim=40,
            decoder_ffn_dim=40,
            max_source_positions=1500,
            max_target_positions=16,
            num_mel_bins=8,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=3,
            suppress_tokens=[],
            begin_suppress_tokens=[],
        )
    )


def test_inspect_whisper_caches_every_audio_frame(capsys, tmp_path):
    """Whisper's cross-attention caches the encoder's max_source_positions frames (1500 in every
    released model) whatever the context; a converted checkpoint reports its own KV heads."""
    src = save(tiny_whisper(), tmp_path / "src")
    info = run_json(capsys, src, "--context", 10)
    assert info["source_unit"] == "audio frame" and info["source_positions"] == 1500
    assert info["attentions"]["encoder"] == {
        "num_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
    }
    per_token = 2 * 2 * 8 * 4 * 4  # K and V × decoder layers × heads × (32 / 8) × fp32
    assert info["kv_cache_bytes"] == per_token * 10 + per_token * 1500
    assert main(["convert", str(src), str(tmp_path / "g2"), "-g", "2", "--attention", "cross"]) == 0
    capsys.readouterr()
    info = run_json(capsys, tmp_path / "g2", "--context", 10)
    assert info["model_type"] == "whisper_gqa"
    assert info["attentions"]["cross"]["num_key_value_heads"] == 2
    assert info["num_key_value_heads"] == info["attentions"]["decoder-self"]["num_key_value_heads"] == 8
    assert info["cross_kv_cache_bytes_per_source_token"] == per_token // 4
    # -g pools both decoder attentions: G must divide the 8 self-attention and the 2 cross KV heads.
    assert [o["num_kv_heads"] for o in info["options"]] == [1, 2]
    assert info["options"][1]["kv_cache_bytes_per_token"] == per_token // 4


def test_inspect_clamps_an_encoder_decoders_context_to_its_decoder(capsys, tmp_path):
    """Whisper's decoder takes at most max_target_positions (448 in the released models; 16
    here): the default context is clamped there and says so; a larger --context is refused in one
    line. T5 (relative positions) has no such limit."""
    from transformers import T5Config, T5ForConditionalGeneration

    src = save(tiny_whisper(), tmp_path / "whisper")
    info = run_json(capsys, src)
    assert info["context"] == 16 and info["decoder_positions"] == 16 and info["context_clamped"]
    per_token = 2 * 2 * 8 * 4 * 4  # K and V × decoder layers × heads × head_dim × fp32
    assert info["kv_cache_bytes"] == per_token * 16 + per_token * 1500
    assert main(["inspect", str(src)]) == 0
    assert "for 16 tokens (the decoder's positions: it generates no more) from 1500 audio frames" in (
        capsys.readouterr().out
    )
    info = run_json(capsys, src, "--context", 16)
    assert info["context"] == 16 and not info["context_clamped"]
    assert main(["inspect", str(src), "--context", "17"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "--context 17 is beyond the decoder's 16 positions (max_target_positions of "
        f"{src}): it generates at most 16 tokens; give --context 16 or less"
    )
    assert len(err.splitlines()) == 1
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=40, num_layers=1, num_heads=4))
    info = run_json(capsys, save(t5, tmp_path / "t5"))
    assert info["context"] == 4096 and info["decoder_positions"] is None and not info["context_clamped"]


def interleave_kv_heads(model, groups: int) -> None:
    """Every layer's K/V heads s and s + groups made identical: similarity grouping renumbers the
    heads into the groups {j, j + groups, …}, not the contiguous ones."""
    import torch

    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                heads = p.data.view(p.shape[0] // d, d, *p.shape[1:])
                for s in range(groups, heads.shape[0]):
                    heads[s] = heads[s % groups]


def test_inspect_shows_the_head_orders_of_similarity_grouping(capsys, tmp_path):
    """A converted checkpoint shows its groups; under similarity grouping each layer's order of
    the source KV heads (uptrain.json's `kv_head_order`), in --json and in the text."""
    model = build_model("llama")
    interleave_kv_heads(model, 2)
    src = save(model, tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "sim"), "-g", "2", "--grouping", "similarity"]) == 0
    assert main(["convert", str(src), str(tmp_path / "contiguous"), "-g", "2"]) == 0
    record = json.loads((tmp_path / "sim" / "uptrain.json").read_text())
    info = run_json(capsys, tmp_path / "sim")
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    assert info["conversion"] == {
        "pooling": "mean",
        "grouping": "similarity",
        "source_num_key_value_heads": 8,
        "kv_groups": record["kv_groups"],
        "kv_head_order": record["kv_head_order"],
    }
    assert info["conversion"]["kv_head_order"] == {"0": order, "1": order}
    assert main(["inspect", str(tmp_path / "sim")]) == 0
    text = capsys.readouterr().out
    assert "grouping      similarity (mean pooling) of 8 source KV heads" in text
    assert "  layer 0: [0 2 4 6] [1 3 5 7]\n  layer 1: [0 2 4 6] [1 3 5 7]\n" in text
    contiguous = run_json(capsys, tmp_path / "contiguous")["conversion"]
    assert contiguous["grouping"] == "contiguous" and "kv_head_order" not in contiguous
    assert main(["inspect", str(tmp_path / "contiguous")]) == 0
    assert "  every layer: [0 1 2 3] [4 5 6 7]\n" in capsys.readouterr().out
    assert run_json(capsys, src)["conversion"] is None  # not converted by uptrain


def test_inspect_shows_each_attentions_head_orders_of_an_encoder_decoder(capsys, tmp_path):
    """An encoder–decoder's similarity grouping renumbers each attention per layer:
    `attentions.<site>.kv_head_order` of uptrain.json, shown per attention."""
    from tests.convert.test_calibrated_encoder_decoder import build
    from tests.convert.test_similarity_encoder_decoder import expected_order, interleave_identical_heads

    model = build("bart")
    interleave_identical_heads(model, 2)
    src = save(model, tmp_path / "src")
    argv = ["convert", str(src), str(tmp_path / "sim"), "-g", "2", "--grouping", "similarity"]
    assert main([*argv, "--attention", "encoder,decoder-self,cross"]) == 0
    record = json.loads((tmp_path / "sim" / "uptrain.json").read_text())
    conversion = run_json(capsys, tmp_path / "sim")["conversion"]
    assert conversion["grouping"] == "similarity" and conversion["kv_head_order"] == record["kv_head_order"]
    assert set(conversion["attentions"]) == {"encoder", "decoder-self", "cross"}
    for site, attention in conversion["attentions"].items():
        heads = record["attentions"][site]["source_num_key_value_heads"]
        assert attention == {k: record["attentions"][site][k] for k in ("kv_groups", "kv_head_order")}
        assert set(map(tuple, attention["kv_head_order"].values())) == {tuple(expected_order(heads, 2))}
    assert main(["inspect", str(tmp_path / "sim")]) == 0
    text = capsys.readouterr().out
    for site in ("encoder", "decoder-self", "cross"):
        groups = record["attentions"][site]["kv_groups"]["0"]
        assert f"  {site} layer 0: " + " ".join("[" + " ".join(map(str, g)) + "]" for g in groups) in text


def test_inspect_refuses_a_damaged_head_order_in_one_line(capsys, tmp_path):
    src = save(build_model("llama"), tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "sim"), "-g", "2", "--grouping", "similarity"]) == 0
    path = tmp_path / "sim" / "uptrain.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "kv_head_order": {"0": "3 1 0 2"}}))
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "sim")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"uptrain inspect: error: {path}: `kv_head_order` is not a mapping of layers to head orders; "
        "it is not a record uptrain wrote"
    )


def test_inspect_shows_each_layers_kv_heads_and_sums_their_cache(capsys, tmp_path):
    """A conversion with per-layer KV heads: each layer's shown, the cache summed layer by layer
    (not layers × the largest), each layer's groups; the G rows: one G for every layer instead."""
    from tests.modeling.classic_models import build as build_classic

    build_classic("gpt2").save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--kv-heads-per-layer", "4,1"]) == 0
    info = run_json(capsys, tmp_path / "out", "--context", 10)
    assert (info["num_key_value_heads"], info["num_key_value_heads_per_layer"]) == (4, [4, 1])
    assert info["kv_cache_bytes_per_token"] == 2 * (4 + 1) * 8 * 4
    assert [o["num_kv_heads"] for o in info["options"]] == [1]  # the one G dividing 4 and 1
    assert info["conversion"]["kv_groups"] == {"0": [[0, 1], [2, 3], [4, 5], [6, 7]], "1": [list(range(8))]}
    assert main(["inspect", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "8 query, 4, 1 KV (layer by layer), head_dim 8" in text and "KV cache      320 B per token" in text
    assert "layer 0: [0 1] [2 3] [4 5] [6 7]" in text and "layer 1: [0 1 2 3 4 5 6 7]" in text


def test_inspect_sums_an_encoder_decoders_per_layer_caches(capsys, tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=32, d_kv=6, d_ff=40, num_layers=2, num_decoder_layers=3, num_heads=8)
    save(T5ForConditionalGeneration(config), tmp_path / "src")
    flags = ["--kv-heads-per-layer", "8,2,4/1,2,2"]
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), *flags]) == 0
    info = run_json(capsys, tmp_path / "out", "--context", 10)
    assert info["kv_cache_bytes_per_token"] == 2 * (8 + 2 + 4) * 6 * 4
    assert info["cross_kv_cache_bytes_per_source_token"] == 2 * (1 + 2 + 2) * 6 * 4
    assert info["attentions"]["cross"]["num_key_value_heads_per_layer"] == [1, 2, 2]
    assert "num_key_value_heads_per_layer" not in info["attentions"]["encoder"]
    assert [o["num_kv_heads"] for o in info["options"]] == [1]


def test_inspect_names_the_budget_that_chose_the_kv_heads(capsys, tmp_path):
    """A conversion by `--kv-budget` shows the budget and its allocation (text and --json); one by
    -g shows none, and a damaged budget in uptrain.json is one line."""
    src = save(build_model("llama"), tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "budget"), "--kv-budget", "0.5"]) == 0
    assert main(["convert", str(src), str(tmp_path / "g"), "-g", "2"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "budget")]) == 0
    assert "budget        0.5 of the source's KV bytes (uniform allocation)" in capsys.readouterr().out
    conversion = run_json(capsys, tmp_path / "budget")["conversion"]
    assert (conversion["kv_budget"], conversion["allocation"], conversion["allocation_costs"]) == (
        0.5,
        "uniform",
        False,
    )
    assert main(["inspect", str(tmp_path / "g")]) == 0
    assert "budget        " not in capsys.readouterr().out
    record = tmp_path / "budget" / "uptrain.json"
    record.write_text(record.read_text().replace('"kv_budget": 0.5', '"kv_budget": 7'))
    assert main(["inspect", str(tmp_path / "budget")]) == 2
    err = capsys.readouterr().err.strip()
    assert "`kv_budget` is 7, not a fraction in (0, 1]" in err and "\n" not in err
