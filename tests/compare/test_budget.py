"""`uptrain compare --kv-budget … --allocation uniform calibrated`: rows at equal KV bytes, end to end on
a tiny model whose layers differ (layer 0 loses nothing merged, layer 1 does), with its refusals and
its resume."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from uptrain.cli import main
from uptrain.data.corpus import load_tokenizer, read_documents

# 6 heads in 2 layers: a third of the KV cache is 4 heads, G = 2 in both layers (uniform) or 1 + 3 (a
# calibrated allocation); with powers of two, 2 layers at equal bytes would leave only uniform.
HEADS, HEAD_DIM, BUDGET = 6, 8, "0.333333"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    tokenizer = load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=96,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_hidden_layers=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # layer 0's K and V heads all alike: merged to one head it loses nothing
        for proj in (model.model.layers[0].self_attn.k_proj, model.model.layers[0].self_attn.v_proj):
            proj.weight.copy_(proj.weight[:HEAD_DIM].repeat(HEADS, 1))
    model.save_pretrained(root / "mha")
    tokenizer.save_pretrained(root / "mha")
    (root / "mha" / "reference.json").write_text(json.dumps({"pretrain_tokens": 10240}))
    docs = [d["text"][:4000] for _, d in zip(range(8), read_documents("validation"))]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:6]))
    (root / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[6:]))
    return root


def compare(root, out, *runs):
    argv = ["compare", "--model", str(root / "mha"), *runs, "--pooling", "mean"]
    argv += ["--train-data", str(root / "train.jsonl"), "--eval-data", str(root / "eval.jsonl")]
    argv += ["--output-dir", str(out), "--uptrain-fraction", "0.05", "--seq-len", "32", "--batch-size", "4"]
    argv += ["--eval-every", "2", "--eval-blocks", "4", "--warmup-steps", "1", "--report-to", "jsonl"]
    return main([*argv, "--calibration-tokens", "512", "--speed-repeats", "1"])


def rows_of(out) -> list[dict]:
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


# The merge's own loss (closed form, from the moments): on an untrained model the model's loss barely
# moves whatever a layer keeps, so the measured (`loss`) cost is noise there; the merge's is exact
# (layer 0's is 0 at every G) and falls as a layer keeps more heads.
RUNS = ("-g", "2", "--kv-budget", BUDGET, "--allocation", "uniform", "calibrated", "--allocation-cost", "merge")


def test_budget_rows_at_equal_kv_bytes_resume_and_report(setup, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare(setup, out, *RUNS) == 0
    rows = rows_of(out)
    by_name = {r["pooling"] if r["kv_budget"] == "" else f"{r['allocation']}": r for r in rows}
    assert [(r["num_kv_heads"], r["kv_budget"], r["allocation"], r["pooling"]) for r in rows] == [
        ("6", "", "", "mha"),
        ("2", "", "", "mean"),
        ("2", BUDGET, "uniform", "mean"),
        ("3", BUDGET, "calibrated", "mean"),  # the config's scalar: the largest layer's
    ]
    uniform, calibrated = by_name["uniform"], by_name["calibrated"]
    # Layer 0 merged to one head loses nothing, so the budget goes to layer 1: heads differ from uniform's.
    assert (uniform["kv_heads_per_layer"], calibrated["kv_heads_per_layer"]) == ("2,2", "1,3")
    # Equal budget, equal KV bytes: per token (2 × Σ heads × head_dim × 4 bytes, from each checkpoint)
    # and measured in the speed run's cache (batch × (prompt + new tokens − 1) positions: the last
    # token generated is never fed back).
    assert uniform["kv_cache_bytes_per_token"] == calibrated["kv_cache_bytes_per_token"] == str(2 * 4 * HEAD_DIM * 4)
    assert uniform["kv_cache_bytes"] == calibrated["kv_cache_bytes"]
    speed = json.loads((out / "speed-heads-1-3.json").read_text())
    assert int(calibrated["kv_cache_bytes"]) == 2 * 4 * HEAD_DIM * 4 * speed["batch"] * (
        speed["context"] + speed["new_tokens"] - 1
    )
    # The uniform budget row is the -g 2 row's conversion: said so, and trained again to the same curve.
    assert uniform["same_heads_as"] == "g2-mean" and calibrated["same_heads_as"] == ""
    assert uniform["eval_loss_after"] == rows[1]["eval_loss_after"]
    recorded = json.loads((out / "converted" / f"b{BUDGET}-calibrated-mean" / "uptrain.json").read_text())
    assert recorded["allocation_cost"] == "merge" and recorded["num_key_value_heads_per_layer"] == [1, 3]
    markdown = (out / "results.md").read_text()
    assert f"| mixed | {BUDGET} | calibrated | 1,3 | mean |" in markdown
    assert f"| 2 | {BUDGET} | uniform (= g2-mean) | 2,2 | mean |" in markdown
    assert "Calibrated against uniform allocation" in markdown
    assert (out / "quality_vs_kv_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A compare killed mid-way: after the calibrated run's conversion, before its training (its run
    # folder gone), and after the uniform run's training, before its row was written. The rerun
    # converts nothing again and finishes both, to the same rows.
    converted = out / "converted" / f"b{BUDGET}-calibrated-mean" / "uptrain.json"
    written = converted.stat().st_mtime_ns
    import shutil

    shutil.rmtree(out / "runs" / f"b{BUDGET}-calibrated-mean")
    (out / "runs" / f"b{BUDGET}-uniform-mean" / "result.json").unlink()
    capsys.readouterr()
    assert compare(setup, out, *RUNS) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished earlier") == 2  # mha, g2-mean
    assert f"[compare] b{BUDGET}-calibrated-mean: KV budget {float(BUDGET):g}, calibrated allocation" in printed
    assert converted.stat().st_mtime_ns == written
    assert rows_of(out) == rows


def test_a_budget_compare_refuses_in_one_line_before_any_run(setup, tmp_path, capsys):
    out = tmp_path / "cmp"
    for runs, message in (
        (("--kv-budget", "0.3"), "--kv-budget 0.3 with --allocation uniform: no single G gives that fraction"),
        ((), "give the runs to compare: -g/--num-kv-heads G … and/or --kv-budget F …"),
        (("-g", "2", "--allocation", "calibrated"), "--allocation calibrated spends a --kv-budget"),
        (("--kv-budget", "0.5", "--allocation-cost", "merge"), "--allocation-cost merge is the cost"),
        (("-g", "2", "--cross-kv-weight", "4"), "--cross-kv-weight 4 weighs cross-attention heads in a --kv-budget"),
        (("--kv-budget", "0.5", "--cross-kv-weight", "4"), "weighs cross-attention KV heads in the budget; the model"),
        (("--kv-budget", "0.5", "0.5"), "--kv-budget 0.5 0.5 names a value twice"),
        (("--kv-budget", "0.1", "--allocation", "calibrated"), "--kv-budget 0.1 is below what any allocation"),
        # A calibrated merge's keys with no calibrated run to apply them to (the helper pools by mean).
        (("-g", "2", "--value-fit", "output"), "--value-fit output refits the values of a calibrated merge, and "),
        (("-g", "2", "--calibration-weighting", "attention"), "--pooling mean solves none"),
    ):
        assert compare(setup, out, *runs) == 2, runs
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not out.exists()


def test_a_compare_made_before_budgets_resumes_and_may_add_them():
    """A compare.json and result.json written before --kv-budget existed: read as -g runs, and a
    rerun may add budget runs (they only add runs) but not change what chose a calibrated one."""
    from tests.compare.test_study import small_spec
    from uptrain.compare.study import RunResult, resume_rule

    old = small_spec("cmp").to_dict()
    for key in ("kv_budget", "allocation", "allocation_cost", "cross_kv_weight"):
        del old[key]
    assert resume_rule().changes(old, small_spec("cmp").to_dict()) == []
    now = small_spec("cmp", kv_budget=[0.25], allocation=["uniform", "calibrated"])
    assert resume_rule().changes(old, now.to_dict()) == []
    costed = small_spec("cmp", kv_budget=[0.25], allocation=["calibrated"], allocation_cost="merge")
    assert [c.key for c in resume_rule().changes(old, costed.to_dict())] == ["allocation_cost"]
    weighed = small_spec("cmp", kv_budget=[0.25], allocation=["calibrated"], cross_kv_weight=4.0)
    assert [c.key for c in resume_rule().changes(old, weighed.to_dict())] == ["cross_kv_weight"]
    row = RunResult(**{"name": "g2-mean", "num_kv_heads": 2, "pooling": "mean", "eval_loss_before": 5.0,
                       "eval_loss_after": 4.0, "uptrain_tokens": 8, "kv_cache_bytes_per_token": 64,
                       "curve": [[0, 5.0], [8, 4.0]]})  # fmt: skip
    assert (row.kv_budget, row.allocation, row.kv_heads_per_layer) == (None, None, None)
