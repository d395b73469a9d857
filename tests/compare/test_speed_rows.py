"""Speed beside quality in `uptrain compare`: measured columns on every row, one measurement per
G kept in speed-g{G}.json and reused on resume, the two speed plots, and the refusals."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from uptrain.cli import main
from uptrain.data.corpus import load_tokenizer, read_documents

HEADS, POSITIONS = 4, 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("speed_rows")
    tokenizer = load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_hidden_layers=2,
        max_position_embeddings=POSITIONS,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "mha")
    tokenizer.save_pretrained(root / "mha")
    docs = [d["text"][:3000] for _, d in zip(range(6), read_documents("validation"))]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:4]))
    (root / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[4:]))
    return root


def compare(root, out, *extra):
    return main(
        [
            "compare",
            "--model",
            str(root / "mha"),
            "--num-kv-heads",
            "2",
            "1",
            "--pooling",
            "mean",
            "first",
            "--train-data",
            str(root / "train.jsonl"),
            "--eval-data",
            str(root / "eval.jsonl"),
            "--output-dir",
            str(out),
            "--max-tokens",
            "128",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--eval-every",
            "1",
            "--eval-blocks",
            "4",
            "--warmup-steps",
            "1",
            "--report-to",
            "jsonl",
            "--speed-batch",
            "2",
            "--speed-repeats",
            "1",
            *extra,
        ]
    )


def read_rows(out: Path) -> list[dict]:
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


def test_every_row_carries_its_measured_speed_and_a_resume_reuses_it(setup, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare(setup, out) == 0
    rows = read_rows(out)
    assert [(r["num_kv_heads"], r["pooling"]) for r in rows] == [
        ("4", "mha"),
        ("2", "mean"),
        ("2", "first"),
        ("1", "mean"),
        ("1", "first"),
    ]
    for r in rows:
        assert float(r["time_per_sample_s"]) > 0 and float(r["decode_tokens_per_s"]) > 0, r
    # One measurement per G, shared by the rows at that G and kept in its own file.
    assert sorted(p.name for p in out.glob("speed-g*.json")) == ["speed-g1.json", "speed-g2.json", "speed-g4.json"]
    for g in ("2", "1"):
        same = {
            tuple(r[k] for k in ("time_per_sample_s", "decode_tokens_per_s", "kv_cache_bytes"))
            for r in rows
            if r["num_kv_heads"] == g
        }
        assert len(same) == 1, (g, same)
    stored = {g: json.loads((out / f"speed-g{g}.json").read_text()) for g in (4, 2, 1)}
    assert stored[2]["model"] == str(Path("converted") / "g2-mean") and stored[4]["model"] == str(setup / "mha")
    # The default fits the model's 64 positions: an eighth of them new, the rest prompt.
    assert (stored[1]["context"], stored[1]["new_tokens"], stored[1]["batch"]) == (56, 8, 2)
    # Measured from the cache tensors: h/G times less than MHA's, and the computed size of
    # batch × (prompt + new tokens − 1) positions.
    mha_bytes = int(rows[0]["kv_cache_bytes"])
    for r in rows:
        g = int(r["num_kv_heads"])
        assert int(r["kv_cache_bytes"]) * HEADS // g == mha_bytes, r
        assert int(r["kv_cache_bytes"]) == int(r["kv_cache_bytes_per_token"]) * 2 * (56 + 8 - 1), r
    text = (out / "results.md").read_text()
    assert "| time/sample s | decode tokens/s | KV cache MiB |" in text
    assert "Speed: greedy decoding of batch 2, 56-token prompt + 8 new tokens" in text and "measured on " in text
    for png in ("quality_vs_time_per_sample.png", "time_per_sample_vs_kv_heads.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png

    # A resumed compare (one run redone) reuses every stored measurement: no file is rewritten.
    written = {p.name: (p.stat().st_mtime_ns, p.read_text()) for p in out.glob("speed-g*.json")}
    (out / "runs" / "g1-first" / "result.json").unlink()
    capsys.readouterr()
    assert compare(setup, out) == 0
    printed = capsys.readouterr().out
    assert printed.count("measured earlier") == 3 and "speed: measuring" not in printed
    assert {p.name: (p.stat().st_mtime_ns, p.read_text()) for p in out.glob("speed-g*.json")} == written
    assert [r["time_per_sample_s"] for r in read_rows(out)] == [r["time_per_sample_s"] for r in rows]

    # A lost measurement is taken again for its G alone; another batch is a new measurement.
    (out / "speed-g1.json").unlink()
    capsys.readouterr()
    assert compare(setup, out) == 0
    assert "speed: measuring G = 1 (" in capsys.readouterr().out
    assert (out / "speed-g4.json").stat().st_mtime_ns == written["speed-g4.json"][0]
    assert compare(setup, out, "--speed-batch", "4") == 0
    assert "speed: measuring G = 4, 2, 1 (" in capsys.readouterr().out
    assert [int(r["kv_cache_bytes"]) for r in read_rows(out)] == [2 * int(r["kv_cache_bytes"]) for r in rows]

    # Speed off: empty columns, and no speed plot left from before.
    assert compare(setup, out, "--speed-repeats", "0") == 0
    assert all(r["time_per_sample_s"] == "" for r in read_rows(out))
    assert not (out / "quality_vs_time_per_sample.png").exists()
    assert "| — | — | — |" in (out / "results.md").read_text()


def test_speed_beyond_the_models_positions_is_refused_before_any_work(setup, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare(setup, out, "--speed-context", "60") == 2
    err = capsys.readouterr().err
    assert "--speed-context 60 + --speed-new-tokens 8 = 68 is beyond" in err and "64 positions" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()
    assert compare(setup, out, "--speed-device", "gpu") == 2
    assert "--device 'gpu': use cpu, cuda or cuda:N" in capsys.readouterr().err
    assert not out.exists()


def test_the_speed_plots_are_logged_to_wandb_with_the_table(tmp_path):
    from tests.train.test_tracking import leet
    from uptrain.compare.report import COLUMNS, write_report
    from uptrain.compare.spec import CompareSpec
    from uptrain.compare.study import RunResult

    def speed(g: int, seconds: float) -> dict:
        return {
            "time_per_sample_s": seconds,
            "decode_tokens_per_s": 8 / seconds,
            "kv_cache_bytes": 1024 * g,
            "spread": {"time_per_sample_s": {"min": seconds * 0.9, "max": seconds * 1.2}},
            "context": 448,
            "new_tokens": 64,
            "batch": 8,
            "device": "cpu",
            "dtype": "float32",
            "repeats": 2,
            "machine": "a CPU",
        }

    results = [
        RunResult("mha", 8, "mha", 4.0, 4.1, 200, 4096, [(0, 4.0), (200, 4.1)], speed(8, 3.0)),
        RunResult("g2-mean", 2, "mean", 5.0, 4.2, 200, 1024, [(0, 5.0), (200, 4.2)], speed(2, 1.5)),
        RunResult("g1-mean", 1, "mean", 5.5, 4.4, 200, 512, [(0, 5.5), (200, 4.4)], speed(1, 1.2)),
    ]
    spec = CompareSpec(
        model="m",
        num_kv_heads=[2, 1],
        pooling=["mean"],
        train_data="t",
        eval_data="e",
        output_dir=str(tmp_path / "study"),
        max_tokens=200,
        report_to=["wandb"],
    )
    Path(spec.output_dir).mkdir()
    files = write_report(results, spec.output_dir, spec)
    item = next(r["history"]["item"] for r in leet(files["wandb"]) if r["type"] == "history")
    for plot in ("quality_vs_time_per_sample", "time_per_sample_vs_kv_heads"):
        assert item[f"{plot}._type"] == "image-file", plot
    table = json.loads((files["wandb"] / "files" / item["results.path"]).read_text())
    assert table["columns"] == COLUMNS
    assert [row[-3:] for row in table["data"]] == [[3.0, 8 / 3.0, 8192], [1.5, 8 / 1.5, 2048], [1.2, 8 / 1.2, 1024]]


def test_the_demo_measures_speed_within_the_reference_models_positions(tmp_path):
    """The defaults are fitted to the reference model: its 512 positions, at batch 8."""
    from uptrain.compare.speed_rows import speed_setting
    from uptrain.demo import demo_spec

    assert speed_setting(demo_spec(tmp_path / "demo")) == {
        "context": 480,
        "new_tokens": 32,
        "batch": 8,
        "repeats": 2,
        "device": "cpu",
        "dtype": "float32",
    }
