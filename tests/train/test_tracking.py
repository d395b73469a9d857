"""wandb: the run config says what was trained, tokens seen is every curve's x-axis, compare
logs its table and plots, and WANDB_MODE=online without a key stops before anything is written.
Real offline wandb runs, read back with `wandb leet inspect`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.train.train_helpers import python_env, wandb_records
from uptrain.convert import convert_checkpoint
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training


def leet(run_dir: Path) -> list[dict]:
    cmd = [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run_dir)]
    return [
        json.loads(line) for line in subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
    ]


def test_run_config_records_the_conversion_done_and_tokens_are_the_x_axis(base_config, assets, tmp_path):
    # `first` pooling: not TrainConfig's default (mean), so the logged value can only come from the model.
    model = convert_checkpoint(assets["mha"], tmp_path / "first", 2, pooling="first", progress=False)
    config = TrainConfig(
        **{
            **base_config,
            "model": str(model),
            "report_to": ["wandb", "jsonl"],
            "max_steps": 2,
            "save_every": 10,
            "grad_accum": 2,
        }
    )
    run_training(config)
    history, summary = wandb_records(config.output_dir)
    logged = summary["config"]
    assert logged["pooling"] == "first" and logged["grouping"] == "contiguous" and logged["num_kv_heads"] == 2
    assert logged["conversion"]["source"] == assets["mha"].name  # the portable name uptrain.json records
    assert logged["conversion"]["base_model"] is None  # a local folder: no Hub id known
    assert logged["conversion"]["source_num_key_value_heads"] == 8
    assert logged["num_processes"] == 1 and logged["global_batch"] == 8 and logged["tokens_per_step"] == 256
    assert logged["uptrain_version"] and logged["model_path"] == str(model)

    run_dir = next((Path(config.output_dir) / "wandb").glob("offline-run-*"))
    metrics = [r["metric"] for r in leet(run_dir) if r["type"] == "metric"]
    assert {"name": "train/tokens_seen", "options": {"defined": True}} in metrics
    assert any(m.get("glob_name") == "*" and m.get("step_metric") == "train/tokens_seen" for m in metrics)
    assert all("train/tokens_seen" in h["item"] for h in history)


def test_a_model_uptrain_did_not_convert_logs_no_pooling(base_config, assets):
    config = TrainConfig(
        **{**base_config, "model": str(assets["mha"]), "report_to": ["wandb"], "max_steps": 1, "save_every": 10}
    )
    run_training(config)
    logged = wandb_records(config.output_dir)[1]["config"]
    assert logged["pooling"] is None and logged["conversion"] is None and logged["num_kv_heads"] == 8


def test_online_without_a_key_stops_in_one_line_before_writing(base_config, tmp_path):
    values = {**base_config, "report_to": ["wandb", "jsonl"], "max_steps": 1, "save_every": 10}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    env = {k: v for k, v in python_env().items() if k not in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")}
    env.update({"WANDB_MODE": "online", "NETRC": str(tmp_path / "no-netrc")})
    cli = [str(Path(sys.executable).parent / "uptrain"), "train", "--config", str(path)]
    refused = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "WANDB_MODE=online" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not Path(values["output_dir"]).exists()
    # Nothing left behind that makes the next run refuse.
    env["WANDB_MODE"] = "offline"
    again = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]


def test_compare_logs_its_table_and_plots(tmp_path):
    from uptrain.compare.report import COLUMNS, write_report
    from uptrain.compare.study import CompareSpec, RunResult

    curve = [(0, 5.0), (100, 4.5), (200, 4.2)]
    results = [
        RunResult("mha", 8, "mha", 4.0, 4.1, 200, 4096, [(0, 4.0), (200, 4.1)]),
        RunResult("g2-mean", 2, "mean", 5.0, 4.2, 200, 1024, curve),
        RunResult("g2-calibrated", 2, "calibrated", 4.4, 4.15, 200, 1024, [(0, 4.4), (200, 4.15)]),
    ]
    spec = CompareSpec(
        model="m",
        num_kv_heads=[2],
        pooling=["mean", "calibrated"],
        train_data="t",
        eval_data="e",
        output_dir=str(tmp_path / "study"),
        max_tokens=200,
    )
    Path(spec.output_dir).mkdir()
    files = write_report(results, spec.output_dir, spec)
    run_dir = files["wandb"]
    assert run_dir.parent == Path(spec.output_dir).absolute() / "wandb"
    recs = leet(run_dir)
    run = next(r["run"] for r in recs if r["type"] == "run")
    assert run["run_group"] == "study" and run["display_name"] == "study/results" and run["job_type"] == "compare"
    item = next(r["history"]["item"] for r in recs if r["type"] == "history")
    assert item["results._type"] == "table-file" and item["results.nrows"] == 3
    assert item["results.ncols"] == len(COLUMNS) and item["against_mean._type"] == "table-file"
    for plot in ("loss_vs_uptraining", "quality_vs_kv_heads", "strategies"):
        assert item[f"{plot}._type"] == "image-file", plot
    table = json.loads((run_dir / "files" / item["results.path"]).read_text())
    assert table["columns"] == COLUMNS
    assert [row[:2] for row in table["data"]] == [[8, "mha"], [2, "mean"], [2, "calibrated"]]

    # Without wandb in report_to: files only.
    spec.report_to = ["jsonl"]
    assert "wandb" not in write_report(results, tmp_path, spec)


# The fields a TrainConfig needs besides model and data.
RUN = dict(seq_len=16, batch_size=2, lr=1e-3, max_steps=1)


def test_run_config_of_an_encoder_decoder_logs_each_attentions_conversion(tmp_path):
    """run_config of a t5_gqa model whose cross-attention alone was pooled: the attentions chosen
    and each one's heads and groups, read from its uptrain.json."""
    from transformers import T5Config, T5ForConditionalGeneration

    from uptrain.train.tracking import ATTENTION_FIELDS, CONVERSION_FIELDS, run_config

    shape = dict(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=4)
    T5ForConditionalGeneration(T5Config(**shape, decoder_start_token_id=0, pad_token_id=0)).save_pretrained(
        tmp_path / "t5"
    )
    model = convert_checkpoint(tmp_path / "t5", tmp_path / "gqa", 2, attention="cross", progress=False)
    config = TrainConfig(model=str(model), train_data="t", eval_data="e", output_dir=str(tmp_path / "run"), **RUN)
    conversion = run_config(config, model, 4, 1, 8)["conversion"]
    assert list(conversion) == [*CONVERSION_FIELDS, "attention", "attentions"]
    assert conversion["model_type"] == "t5" and conversion["attention"] == ["cross"]
    assert list(conversion["attentions"]) == ["encoder", "decoder-self", "cross"]
    assert all(list(a) == list(ATTENTION_FIELDS) for a in conversion["attentions"].values())
    cross, decoder = conversion["attentions"]["cross"], conversion["attentions"]["decoder-self"]
    assert (cross["source_num_key_value_heads"], cross["num_key_value_heads"], cross["kv_groups"]) == (
        4,
        2,
        [[0, 1], [2, 3]],
    )
    assert decoder["num_key_value_heads"] == 4 and conversion["num_key_value_heads"] == 4  # not pooled
    assert cross["num_layers"] == 1 and conversion["attentions"]["encoder"]["num_layers"] == 2


def test_run_config_of_a_decoder_only_model_logs_the_same_fields_as_before(assets, tmp_path):
    from uptrain.train.tracking import CONVERSION_FIELDS, run_config

    config = TrainConfig(
        model=str(assets["gqa"]), train_data="t", eval_data="e", output_dir=str(tmp_path / "run"), **RUN
    )
    conversion = run_config(config, assets["gqa"], 2, 1, 8)["conversion"]
    assert list(conversion) == list(CONVERSION_FIELDS)
    assert "attention" not in CONVERSION_FIELDS and conversion["num_key_value_heads"] == 2


def test_run_config_logs_each_layers_kv_heads_where_they_differ(tmp_path):
    """A model converted with per-layer KV heads (or for a --kv-budget) logs them beside the fields
    every conversion logs, so runs can be told apart by them."""
    from tests.modeling.classic_models import build as build_classic
    from uptrain.train.tracking import CONVERSION_FIELDS, run_config

    build_classic("gpt2").save_pretrained(tmp_path / "src")
    model = convert_checkpoint(tmp_path / "src", tmp_path / "gqa", kv_heads_per_layer="4,1", progress=False)
    config = TrainConfig(model=str(model), train_data="t", eval_data="e", output_dir=str(tmp_path / "run"), **RUN)
    conversion = run_config(config, model, 4, 1, 8)["conversion"]
    assert list(conversion) == [*CONVERSION_FIELDS, "num_key_value_heads_per_layer"]
    assert conversion["num_key_value_heads_per_layer"] == [4, 1] and conversion["num_key_value_heads"] == 4
    budget = convert_checkpoint(tmp_path / "src", tmp_path / "budget", kv_budget=0.25, progress=False)
    conversion = run_config(config, budget, 2, 1, 8)["conversion"]
    assert (conversion["kv_budget"], conversion["allocation"], conversion["num_key_value_heads"]) == (
        0.25,
        "uniform",
        2,
    )
