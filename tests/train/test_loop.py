"""End-to-end uptraining runs on a tiny Llama, in this process (fast) or through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.train.train_helpers import KILLER, METRICS, curve, python_env, records, wandb_records
from uptrain import UptrainError
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training
from uptrain.train.optimizer import lr_at


def test_uptrain_a_converted_checkpoint(base_config, capsys):
    config = TrainConfig(
        **{**base_config, "report_to": ["wandb", "jsonl"], "peak_flops": 1e12, "save_every": 1, "keep_checkpoints": 2}
    )
    final = run_training(config)
    captured = capsys.readouterr()
    out = captured.out
    for line in (
        "tokens per step  128 = seq_len 32 × batch_size 4 × grad_accum 1 × processes 1",
        "steps            6",
        "tokens           768",
        "processes        1 (cpu",
    ):
        assert line in out
    assert "estimated remaining:" in out

    recs = records(config.output_dir)
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4, 5, 6]
    seen = {k for r in recs for k in r}
    assert set(METRICS) <= seen
    assert [r["step"] for r in recs if "eval/loss" in r] == [0, 3, 6]
    assert recs[0]["model/num_kv_heads"] == 2
    assert recs[0]["model/kv_cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 4  # K,V × layers × kv heads × d × fp32
    assert recs[-1]["eval/loss"] < recs[0]["eval/loss"] - 0.3  # quality comes back (from random weights here)
    assert recs[-1]["train/tokens_seen"] == 768
    assert [r["train/lr"] for r in recs[1:]] == [lr_at(config, s, 6) for s in range(6)]

    history, summary = wandb_records(config.output_dir)
    assert [h["step"]["num"] for h in history] == [0, 1, 2, 3, 4, 5, 6]
    logged = {k for h in history for k in h["item"]}
    assert set(METRICS) <= logged
    eval_at_end = next(h["item"] for h in history if h["step"]["num"] == 6)["eval/loss"]
    assert eval_at_end == pytest.approx(recs[-1]["eval/loss"], rel=1e-12)
    assert summary["state"] == "finished" and summary["config"]["seq_len"] == 32
    assert all(k in summary["summary"] for k in METRICS)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.num_key_value_heads == 2
    assert (final / "tokenizer.json").is_file()
    # The saved weights are the trained ones: they give the logged final eval loss.
    uptraining = json.loads((final / "uptrain.json").read_text())["uptraining"]
    assert uptraining["eval_after"]["eval/loss"] == recs[-1]["eval/loss"]
    # Saved after steps 1…5 (the last step goes to final/), the last two kept.
    assert sorted(p.name for p in (Path(config.output_dir) / "checkpoints").iterdir()) == [
        "step_00000004",
        "step_00000005",
    ]


def test_mfu_is_absent_on_cpu_without_peak_flops(base_config):
    config = TrainConfig(**{**base_config, "max_steps": 2, "save_every": 10, "keep_checkpoints": 1})
    run_training(config)
    assert not any("perf/mfu" in r for r in records(config.output_dir))


def test_grad_accum_matches_a_bigger_batch(base_config, tmp_path):
    big = TrainConfig(**{**base_config, "max_steps": 3, "save_every": 10})
    small = TrainConfig(
        **{
            **base_config,
            "max_steps": 3,
            "save_every": 10,
            "batch_size": 1,
            "grad_accum": 4,
            "output_dir": str(tmp_path / "accum"),
        }
    )
    run_training(big)
    run_training(small)
    a, b = curve(big.output_dir), curve(small.output_dir)
    assert a.keys() == b.keys()
    for step in a:
        for k in a[step]:
            assert b[step][k] == pytest.approx(a[step][k], rel=1e-5, abs=1e-6), (step, k)


def test_resume_after_kill_gives_the_same_curve(base_config, tmp_path):
    values = {**base_config, "max_steps": 8, "save_every": 3, "eval_every": 4}
    baseline = TrainConfig(**values)
    run_training(baseline)

    values["output_dir"] = str(tmp_path / "killed")
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(values))
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(path), "5"], env=python_env(), capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert max(r["step"] for r in records(values["output_dir"])) == 5  # logged past its last checkpoint (3)
    # As if it had also died while writing the next checkpoint: the half-written folder must be ignored.
    partial = Path(values["output_dir"]) / "checkpoints" / ".step_00000006.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")

    resumed = subprocess.run(
        [str(Path(sys.executable).parent / "uptrain"), "train", "--config", str(path), "--resume"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and "step_00000003" in resumed.stdout
    # Exactly equal: same blocks, same schedule, optimizer state and weights restored bit for bit,
    # and the same kernels on the same CPU.
    assert curve(values["output_dir"]) == curve(baseline.output_dir)
    assert [r["step"] for r in records(values["output_dir"])] == list(range(9))
    assert sorted(p.name for p in (Path(values["output_dir"]) / "checkpoints").iterdir()) == [
        "step_00000003",
        "step_00000006",
    ]
    a = load_file(Path(baseline.output_dir) / "final" / "model.safetensors")
    b = load_file(Path(values["output_dir"]) / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    again = subprocess.run(
        [str(Path(sys.executable).parent / "uptrain"), "train", "--config", str(path), "--resume"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_distillation_from_the_mha_teacher(base_config, assets):
    config = TrainConfig(
        **{
            **base_config,
            "teacher": str(assets["mha"]),
            "distill_weight": 0.25,
            "distill_temperature": 2.0,
            "max_steps": 2,
            "save_every": 10,
        }
    )
    run_training(config)
    step1 = records(config.output_dir)[1]
    assert step1["train/distill_kl"] > 0
    assert step1["train/loss"] == pytest.approx(0.75 * step1["train/ce_loss"] + 0.25 * step1["train/distill_kl"])


def test_distilling_from_itself_starts_at_zero_kl(base_config, assets):
    config = TrainConfig(
        **{**base_config, "teacher": str(assets["gqa"]), "distill_weight": 0.5, "max_steps": 1, "save_every": 10}
    )
    run_training(config)
    assert records(config.output_dir)[1]["train/distill_kl"] == pytest.approx(0.0, abs=1e-5)


def test_convert_on_the_fly(base_config, assets):
    values = {**base_config, "source": str(assets["mha"]), "num_kv_heads": 2, "max_steps": 1, "save_every": 10}
    del values["model"]
    config = TrainConfig(**values)
    final = run_training(config)
    converted = Path(config.output_dir) / "converted"
    assert json.loads((converted / "config.json").read_text())["num_key_value_heads"] == 2
    a, b = load_file(converted / "model.safetensors"), load_file(assets["gqa"] / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)  # the same code as `uptrain convert`
    assert json.loads((final / "config.json").read_text())["num_key_value_heads"] == 2


def test_convert_on_the_fly_again_under_overwrite(base_config, assets):
    # --overwrite empties the folder, converted/ included: the conversion runs again rather than
    # trusting the converted/ it is about to delete.
    values = {**base_config, "source": str(assets["mha"]), "num_kv_heads": 2, "max_steps": 1, "save_every": 10}
    del values["model"]
    run_training(TrainConfig(**values))
    run_training(TrainConfig(**{**values, "overwrite": True, "num_kv_heads": 4}))
    converted = Path(values["output_dir"]) / "converted"
    assert json.loads((converted / "config.json").read_text())["num_key_value_heads"] == 4
    assert [r["step"] for r in records(values["output_dir"])] == [0, 1]


def test_convert_on_the_fly_calibrated_on_train_data(base_config, assets):
    values = {
        **base_config,
        "source": str(assets["mha"]),
        "num_kv_heads": 2,
        "pooling": "calibrated",
        "grouping": "similarity",
        "calibration_tokens": 256,
        "max_steps": 1,
        "save_every": 10,
    }
    del values["model"]
    config = TrainConfig(**values)
    run_training(config)
    provenance = json.loads((Path(config.output_dir) / "converted" / "uptrain.json").read_text())
    assert provenance["pooling"] == "calibrated" and provenance["grouping"] == "similarity"
    assert provenance["calibration"]["tokens"] >= 256
    assert records(config.output_dir)[0]["model/num_kv_heads"] == 2


def test_similarity_grouping_on_the_fly_is_calibrated_like_convert(base_config, assets, tmp_path):
    """`grouping: similarity` with mean pooling groups heads on the training data, as
    `uptrain convert --grouping similarity --calibration-data` does."""
    from uptrain.convert import convert_checkpoint
    from uptrain.convert.calibration import collect_attention_moments
    from uptrain.convert.pipeline import Calibration
    from uptrain.convert.spec import CalibrationSettings

    values = {
        **base_config,
        "source": str(assets["mha"]),
        "num_kv_heads": 2,
        "grouping": "similarity",
        "calibration_tokens": 256,
        "max_steps": 1,
        "save_every": 10,
    }
    del values["model"]
    config = TrainConfig(**values)
    run_training(config)
    converted = Path(config.output_dir) / "converted"
    provenance = json.loads((converted / "uptrain.json").read_text())
    assert provenance["pooling"] == "mean" and provenance["calibration"]["tokens"] >= 256
    calibration, info = collect_attention_moments(
        str(assets["mha"]),
        config.train_data,
        CalibrationSettings(calibration_tokens=256, calibration_seq_len=config.seq_len),
    )
    by_hand = convert_checkpoint(
        assets["mha"],
        tmp_path / "by-hand",
        2,
        grouping="similarity",
        calibration=Calibration(calibration, info),
        progress=False,
    )
    assert json.loads((by_hand / "uptrain.json").read_text())["kv_head_order"] == provenance["kv_head_order"]
    a, b = load_file(converted / "model.safetensors"), load_file(by_hand / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Bad input: one clear error, nothing written over.


def refuses(config: dict, message: str) -> None:
    with pytest.raises(UptrainError, match=message) as err:
        run_training(TrainConfig(**config))
    assert "\n" not in str(err.value)


def test_refuses_seq_len_beyond_positions(base_config):
    refuses({**base_config, "seq_len": 129}, "seq_len 129 is beyond the model's 128 positions")


def test_refuses_empty_and_short_data(base_config, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("The cat sees a dog.\n" * 20)
    refuses({**base_config, "train_data": str(tmp_path / "empty.txt")}, "`train_data`: .*empty.txt is empty")
    refuses(
        {**base_config, "train_data": str(tmp_path / "short.txt")},
        r"gives 3 blocks of 32 tokens; one optimizer step needs 4",
    )
    refuses(  # streamed: the head of the stream counted, the same refusal
        {**base_config, "train_data": str(tmp_path / "short.txt"), "streaming": True},
        r"gives 3 blocks of 32 tokens; one optimizer step needs 4: give more text",
    )
    (tmp_path / "blank.txt").write_text("\n\n\n")
    refuses(
        {**base_config, "train_data": str(tmp_path / "blank.txt")}, "`train_data`: .*blank.txt holds only whitespace"
    )
    refuses({**base_config, "eval_data": str(tmp_path / "empty.txt")}, "`eval_data`: .*empty.txt is empty")
    refuses({**base_config, "eval_data": str(tmp_path / "blank.txt")}, "`eval_data`: .*blank.txt holds only whitespace")
    (tmp_path / "tiny.txt").write_text("The cat.\n")
    refuses({**base_config, "eval_data": str(tmp_path / "tiny.txt")}, "eval_data .* gives no block")


def test_refuses_teacher_with_another_tokenizer(base_config, assets):
    refuses({**base_config, "teacher": str(assets["other"])}, "teacher .* uses another tokenizer")


def test_refuses_output_dir_of_another_run(base_config, tmp_path):
    out = Path(base_config["output_dir"])
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refuses(base_config, "already holds files of something else; pass --resume .* or --overwrite")
    refuses({**base_config, "resume": True}, "not an uptrain run")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]

    first = {**base_config, "output_dir": str(tmp_path / "first"), "max_steps": 1}
    run_training(TrainConfig(**first))
    refuses(first, "already holds another uptrain run")
    changed = r"cannot resume the run in .*first: its settings changed \(lr: 0.003 → 1.0\); rerun with the earlier"
    refuses({**first, "resume": True, "lr": 1.0}, changed)
    run_training(TrainConfig(**{**first, "overwrite": True, "max_steps": 2}))
    assert [r["step"] for r in records(first["output_dir"])] == [0, 1, 2]


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(base_config):
    # An absurd learning rate: the first update sends the weights to ~1e30, the next forward overflows.
    config = {**base_config, "lr": 1e30, "warmup_steps": 0, "save_every": 1, "keep_checkpoints": 3}
    refuses(config, r"non-finite loss at step 2 .*last good checkpoint: .*checkpoints/step_00000001 \(step 1\)")
    out = Path(config["output_dir"])
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000001"]
    assert not (out / "final").exists()
    assert [r["step"] for r in records(out)] == [0, 1, 2]


def test_resume_accepts_a_run_started_before_a_key_existed(base_config, tmp_path):
    # A run started by an older uptrain has no entry for keys added since; they held their defaults.
    config = {**base_config, "output_dir": str(tmp_path / "old"), "max_steps": 2, "save_every": 1}
    marker = Path(config["output_dir"]) / "run_config.yaml"
    with pytest.raises(SystemExit):
        run_training(TrainConfig(**config), on_step=lambda step, record: step == 1 and sys.exit(0))
    saved = yaml.safe_load(marker.read_text())
    del saved["grouping"], saved["calibration_tokens"]
    marker.write_text(yaml.safe_dump(saved))
    run_training(TrainConfig(**{**config, "resume": True}))
    assert [r["step"] for r in records(config["output_dir"])] == [0, 1, 2]
    saved["lr"] = 1.0  # a real change is still refused
    marker.write_text(yaml.safe_dump(saved))
    refuses({**config, "resume": True}, r"its settings changed \(lr: 1.0 → 0.003\)")


def test_uptrain_fraction_alone_takes_a_known_family_budget(base_config, assets, tmp_path):
    import shutil

    # A Llama-2-7B-named folder (model_type llama): α × 2T tokens. 1e-12 × 2e12 = 2 tokens → one step.
    named = tmp_path / "Llama-2-7b-toy"
    shutil.copytree(assets["gqa"], named)
    values = {**base_config, "model": str(named), "uptrain_fraction": 1e-12}
    del values["max_steps"]
    run_training(TrainConfig(**values))
    recorded = yaml.safe_load((Path(values["output_dir"]) / "run_config.yaml").read_text())
    assert recorded["pretrain_tokens"] == 2e12
    assert [r["step"] for r in records(Path(values["output_dir"]))][-1] == 1
    # An unknown family needs pretrain_tokens, and nothing is written before that is said.
    unknown = {**values, "model": str(assets["gqa"]), "output_dir": str(tmp_path / "unknown")}
    refuses(unknown, "`uptrain_fraction` needs `pretrain_tokens`: .* is not recognised")
    assert not (tmp_path / "unknown").exists()
