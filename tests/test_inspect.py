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
