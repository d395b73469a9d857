"""`uptrain compare` end to end on a tiny model: files, rows, finite metrics, resumability."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from uptrain.cli import main
from uptrain.data.corpus import load_tokenizer, read_documents


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    tokenizer = load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "mha")
    tokenizer.save_pretrained(root / "mha")
    (root / "mha" / "reference.json").write_text(json.dumps({"pretrain_tokens": 20480}))
    docs = [d["text"][:4000] for _, d in zip(range(8), read_documents("validation"))]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:6]))
    (root / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[6:]))
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
            "random",
            "--train-data",
            str(root / "train.jsonl"),
            "--eval-data",
            str(root / "eval.jsonl"),
            "--output-dir",
            str(out),
            "--uptrain-fraction",
            "0.05",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--eval-every",
            "2",
            "--eval-blocks",
            "8",
            "--warmup-steps",
            "1",
            "--report-to",
            "jsonl",
            *extra,
        ]
    )


def test_compare_writes_table_plots_and_resumes(setup, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare(setup, out) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["num_kv_heads"], r["pooling"]) for r in rows] == [
        ("4", "mha"),
        ("2", "mean"),
        ("2", "random"),
        ("1", "mean"),
        ("1", "random"),
    ]
    for r in rows:
        for key in (
            "eval_loss_before",
            "eval_loss_after",
            "perplexity_before",
            "perplexity_after",
            "gap_to_mha_before",
            "gap_to_mha_after",
        ):
            assert math.isfinite(float(r[key])), (r, key)
        # α = 0.05 of the card's 20,480 pretraining tokens = 1,024 = 8 steps of 4 × 32 tokens.
        assert int(r["uptrain_tokens"]) == 1024
        assert int(r["kv_cache_bytes_per_token"]) == 2 * 2 * int(r["num_kv_heads"]) * 16 * 4
    assert float(rows[0]["gap_to_mha_before"]) == 0.0
    assert float(rows[4]["eval_loss_before"]) > float(rows[0]["eval_loss_before"])  # random MQA starts worse
    assert "| 1 | random |" in (out / "results.md").read_text()
    for png in ("loss_vs_uptraining.png", "quality_vs_kv_heads.png", "strategies.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curve = json.loads((out / "runs" / "g2-mean" / "result.json").read_text())["curve"]
    assert [t for t, _ in curve] == [0, 256, 512, 768, 1024]
    # A compare run again picks up every finished run instead of redoing it.
    (out / "runs" / "g1-random" / "result.json").unlink()
    capsys.readouterr()
    assert compare(setup, out) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished earlier") == 4 and "[compare] g1-random: G = 1" in printed
    with open(out / "results.csv") as f:
        assert list(csv.DictReader(f)) == rows


def test_tokens_to_reach_and_gap_closed():
    from uptrain.compare.report import against_mean, tokens_to_reach
    from uptrain.compare.study import RunResult

    assert tokens_to_reach([(0, 5.0), (100, 4.0), (200, 3.0)], 3.5) == 150.0
    assert tokens_to_reach([(0, 3.0), (100, 2.0)], 3.5) == 0.0
    assert tokens_to_reach([(0, 5.0), (100, 4.0)], 3.5) is None
    mha = RunResult("mha", 8, "mha", 3.0, 2.9, 200, 64, [(0, 3.0), (200, 2.9)])
    mean = RunResult("g2-mean", 2, "mean", 5.0, 3.3, 200, 16, [(0, 5.0), (100, 3.6), (200, 3.3)])
    cal = RunResult("g2-calibrated", 2, "calibrated", 3.5, 3.1, 200, 16, [(0, 3.5), (100, 3.3), (200, 3.1)])
    [row] = against_mean([mha, mean, cal])
    assert row["gap_closed_before"] == 0.75  # (5.0 − 3.5) / (5.0 − 3.0)
    assert abs(row["gap_closed_after"] - 0.5) < 1e-12  # (3.3 − 3.1) / (3.3 − 2.9)
    assert row["tokens_to_mean_final"] == 100.0


def test_compare_checks_every_conversion_before_any_work(setup, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare(setup, out, "--pooling", "mean", "meen") == 2
    assert "unknown pooling 'meen'" in capsys.readouterr().err
    assert (
        main(
            [
                "compare",
                "--model",
                str(setup / "mha"),
                "--num-kv-heads",
                "2",
                "3",
                "--train-data",
                str(setup / "train.jsonl"),
                "--eval-data",
                str(setup / "eval.jsonl"),
                "--output-dir",
                str(out),
                "--max-tokens",
                "128",
                "--report-to",
                "jsonl",
            ]
        )
        == 2
    )
    assert "--num-kv-heads 3 does not divide" in capsys.readouterr().err
    assert not out.exists()


def test_compare_conversions_share_grouping_and_calibration(setup, tmp_path):
    from uptrain.cli import COMMANDS, build_parser

    argv = [
        "compare",
        "--model",
        str(setup / "mha"),
        "--num-kv-heads",
        "2",
        "--pooling",
        "first",
        "--train-data",
        str(setup / "train.jsonl"),
        "--eval-data",
        str(setup / "eval.jsonl"),
        "--output-dir",
        str(tmp_path),
        "--max-tokens",
        "128",
        "--seq-len",
        "32",
        "--grouping",
        "similarity",
        "--calibration-tokens",
        "64",
    ]
    spec = COMMANDS["compare"].options(build_parser("compare").parse_args(argv), "compare")
    conversion = spec.conversion_spec(2, "first")
    assert (conversion.pooling, conversion.grouping, conversion.num_kv_heads) == ("first", "similarity", 2)
    assert (conversion.calibration_data, conversion.calibration_tokens, conversion.calibration_seq_len) == (
        str(setup / "train.jsonl"),
        64,
        32,
    )
    assert json.loads(json.dumps(spec.to_dict()))["grouping"] == "similarity"  # flat, as train's and convert's


def small_spec(out, **changes):
    from uptrain.compare.spec import CompareSpec

    return CompareSpec(
        **{
            "model": "m",
            "num_kv_heads": [2],
            "pooling": ["mean"],
            "train_data": "t",
            "eval_data": "e",
            "output_dir": str(out),
            "max_tokens": 200,
            **changes,
        }
    )


def test_a_compare_record_is_compared_key_by_key():
    from uptrain.compare.study import _flat_record, resume_rule

    def changes(old, spec):
        return [str(c) for c in resume_rule().changes(_flat_record(old), spec.to_dict())]

    spec = small_spec("cmp")
    old = spec.to_dict()
    assert changes(old, spec) == []
    # A key the earlier uptrain did not have held its default; operational keys may change.
    del old["seed"], old["grouping"]
    assert changes({**old, "report_to": ["none"], "pooling": ["first"], "output_dir": "elsewhere"}, spec) == []
    old["calibration_tokens"] = 64
    assert changes({**old, "lr": 0.5}, spec) == ["calibration_tokens: 64 → 32768", "lr: 0.5 → 0.001"]
    # A record from before the conversion keys were flat: read flat.
    conversion = {k: old.pop(k) for k in ("attention", "calibration_tokens")}
    assert changes({**old, "conversion": {**conversion, "grouping": "similarity", "pooling": "mean"}}, spec) == [
        "grouping: 'similarity' → 'contiguous'",
        "calibration_tokens: 64 → 32768",
    ]


def test_a_compare_of_the_shipped_corpus_resumes_after_the_checkout_moved():
    """The default data are files of the package: recorded where the package was, they are the same
    files once it moved (a compare made before the move resumes); other paths still count as paths."""
    from uptrain.compare.study import resume_rule
    from uptrain.data.corpus import split_path

    spec = small_spec("cmp", train_data=str(split_path("train")), eval_data=str(split_path("validation")))
    moved = {**spec.to_dict()}
    for key, split in (("train_data", "train"), ("eval_data", "validation")):
        moved[key] = f"/elsewhere/checkout/uptrain/assets/corpus/{split}.jsonl.gz"
    assert resume_rule().changes(moved, spec.to_dict()) == []
    mine = {**moved, "train_data": "/elsewhere/mine/train.jsonl.gz"}
    assert [c.key for c in resume_rule().changes(mine, spec.to_dict())] == ["train_data"]


def test_compare_takes_train_s_operational_keys_but_the_global_batch():
    """Derived, not listed: whatever train lets a resumed run change (compile, fused AdamW, where
    calibration runs, …) a compare may change too, once it has the key; the batch it may not."""
    from uptrain.compare.study import OWN_OPERATIONAL_KEYS, operational_keys, resume_rule

    keys = ["lr", "seed", "batch_size", "grad_accum", "compile", "compile_backend", "fused_adamw", "log_every"]
    keys += ["calibration_device", "grouping", "speed_batch", "num_kv_heads"]
    assert operational_keys(keys) == {
        "compile",
        "compile_backend",
        "fused_adamw",
        "log_every",
        "calibration_device",
        "speed_batch",
        "num_kv_heads",
    }
    # The compare's own keys: at least the list it used to spell out by hand, and nothing that
    # decides what a run computes.
    operational = resume_rule().operational
    assert not operational & {"model", "train_data", "lr", "seed", "batch_size", "max_tokens", "grouping"}
    assert operational >= OWN_OPERATIONAL_KEYS | {
        "report_to",
        "eval_every",
        "calibration_device",
        "source_hash",
        "speed_context",
        "speed_new_tokens",
        "speed_batch",
        "speed_repeats",
        "speed_device",
    }


def test_the_wandb_group_is_recorded_once_and_an_earlier_compare_keeps_its_own(tmp_path):
    from uptrain.compare.study import _start, recorded_group

    first, second = tmp_path / "a" / "cmp", tmp_path / "b" / "cmp"
    for out in (first, second):
        out.mkdir(parents=True)
    groups = [_start(small_spec(out), out) for out in (first, second)]
    assert groups[0] != groups[1] and all(g.startswith("cmp-") for g in groups)
    assert [recorded_group(first), recorded_group(second)] == groups
    assert _start(small_spec(first), first) == groups[0]  # a resume keeps it
    # A compare recorded before groups were: its runs are in the folder's name's group, and stay there.
    record = json.loads((first / "compare.json").read_text())
    del record["wandb_group"]
    (first / "compare.json").write_text(json.dumps(record))
    assert _start(small_spec(first), first) == "cmp" == recorded_group(first)


def test_the_results_run_joins_the_recorded_group(tmp_path):
    from tests.train.test_tracking import leet
    from uptrain.compare.report import write_report
    from uptrain.compare.study import RunResult, _start

    out = tmp_path / "cmp"
    out.mkdir()
    spec = small_spec(out, report_to=["wandb"])
    group = _start(spec, out)
    results = [
        RunResult("mha", 8, "mha", 4.0, 4.1, 200, 4096, [(0, 4.0), (200, 4.1)]),
        RunResult("g2-mean", 2, "mean", 5.0, 4.2, 200, 1024, [(0, 5.0), (200, 4.2)]),
    ]
    run = next(r["run"] for r in leet(write_report(results, out, spec)["wandb"]) if r["type"] == "run")
    assert run["run_group"] == group and run["display_name"] == "cmp/results"


@pytest.mark.parametrize("checkout", ["this checkout", "a checkout elsewhere"])
def test_a_demo_folder_made_before_the_assets_moved_resumes(checkout, tmp_path):
    """Before commit 8b6848f the shipped corpus and reference models lay in uptrain/data/, and a
    demo (a compare of them) recorded those paths in compare.json and in each run's
    run_config.yaml: they name the same shipped assets, so resuming it is accepted, not refused as
    "settings changed"; another model in the old place's name is still another model."""
    from uptrain import UptrainError
    from uptrain.checkpoint.resumable import PACKAGE
    from uptrain.compare.study import hold_compare_dir, validate
    from uptrain.demo import demo_spec
    from uptrain.train.config import config_to_yaml
    from uptrain.train.rundir import inspect_run_dir

    package = str(PACKAGE) if checkout == "this checkout" else "/elsewhere/checkout/uptrain"

    def as_before(path: str) -> str:  # where the old code's REFERENCE and split_path named the assets
        return path.replace(f"{PACKAGE}/assets/", f"{package}/data/")

    root = tmp_path / "demo-output"
    spec = demo_spec(root)
    validate(spec)  # what a compare records: its settings once checked (the budget filled in)
    old = {key: as_before(spec.to_dict()[key]) for key in ("model", "train_data", "eval_data")}
    assert old["model"] == f"{package}/data/reference" and old["train_data"] == f"{package}/data/corpus/train.jsonl.gz"
    run = root / "runs" / "mha" / "train"
    run.mkdir(parents=True)
    (root / "compare.json").write_text(json.dumps({**spec.to_dict(), **old, "wandb_group": "demo-output-0a1b2c3d"}))
    trained = spec.train_config(spec.model, run, "mha", "demo-output-0a1b2c3d")
    (run / "run_config.yaml").write_text(config_to_yaml(trained.__class__(**{**trained.to_dict(), **old})))
    (run / "metrics.jsonl").write_text("")

    with hold_compare_dir(spec) as group:
        assert group == "demo-output-0a1b2c3d"  # the earlier compare's, kept
    assert inspect_run_dir(trained, trained.batch_size).fresh  # accepted: no checkpoint yet, nothing refused

    other = {**old, "model": f"{package}/data/reference_t5"}
    (root / "compare.json").write_text(json.dumps({**spec.to_dict(), **other, "wandb_group": "g"}))
    with pytest.raises(UptrainError, match=r"settings changed \(model: "):
        with hold_compare_dir(spec):
            pass
