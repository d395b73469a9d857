"""`uptrain compare --target gqa mla --kv-budget …`: MLA runs beside the GQA runs at equal KV bytes, end to
end on test_budget's tiny Llama, with their resume and their refusals."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.compare.test_budget import rows_of, setup  # noqa: F401  (the fixture: its tiny Llama)
from uptrain.cli import main

# A third of the 6 heads × 2 × 8 = 96 K/V elements per token and layer: GQA's 2 KV heads (32), or a
# latent of rank 28 beside the default rotary key of 4 columns (half the head's frequencies: 8 / 2).
BUDGET, RANK, ROPE = "0.333333", 28, 4
PER_TOKEN = 2 * 32 * 4  # 2 layers × 32 elements × 4 bytes (float32)


def compare(root, out, *runs, pooling=("calibrated",)):
    argv = ["compare", "--model", str(root / "mha"), *runs, "--pooling", *pooling]
    argv += ["--train-data", str(root / "train.jsonl"), "--eval-data", str(root / "eval.jsonl")]
    argv += ["--output-dir", str(out), "--uptrain-fraction", "0.05", "--seq-len", "32", "--batch-size", "4"]
    argv += ["--eval-every", "2", "--eval-blocks", "4", "--warmup-steps", "1", "--report-to", "jsonl"]
    return main([*argv, "--calibration-tokens", "512", "--speed-repeats", "1"])


RUNS = ("--kv-budget", BUDGET, "--target", "gqa", "mla", "--rotary-key", "calibrated")


def test_mla_rows_at_the_gqa_rows_kv_bytes_resume_and_report(setup, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "cmp"
    assert compare(setup, out, *RUNS) == 0
    rows = rows_of(out)
    assert [
        (r["target"], r["num_kv_heads"], r["allocation"], r["pooling"], r["kv_rank"], r["rope_dims"]) for r in rows
    ] == [
        ("", "6", "", "mha", "", ""),
        ("gqa", "2", "uniform", "calibrated", "", ""),
        ("mla", "", "", "svd", str(RANK), str(ROPE)),
        ("mla", "", "", "calibrated", str(RANK), str(ROPE)),
    ]
    gqa, svd, calibrated = rows[1:]
    # The svd run reads no data, so its rotary key is the weight-space one; the calibrated run's is fitted.
    assert (svd["rotary_key"], calibrated["rotary_key"]) == ("principal", "calibrated")
    # Equal budget, equal KV bytes: per token from each converted checkpoint (GQA: 2 heads × K and V × 8;
    # MLA: R + D, every layer), and measured in the speed run's cache (batch × (prompt + new tokens − 1)).
    assert gqa["kv_cache_bytes_per_token"] == svd["kv_cache_bytes_per_token"] == str(PER_TOKEN)
    assert calibrated["kv_cache_bytes_per_token"] == str(PER_TOKEN)
    speed = json.loads((out / f"speed-mla-r{RANK}-d{ROPE}.json").read_text())
    assert speed["num_kv_heads"] is None  # measured as a latent, not as K/V heads
    assert speed["kv_cache_bytes"] == PER_TOKEN * speed["batch"] * (speed["context"] + speed["new_tokens"] - 1)
    assert (
        svd["kv_cache_bytes"] == calibrated["kv_cache_bytes"] == gqa["kv_cache_bytes"] == str(speed["kv_cache_bytes"])
    )
    recorded = json.loads((out / "converted" / f"b{BUDGET}-mla-calibrated" / "uptrain.json").read_text())
    assert (recorded["target"], recorded["initialisation"], recorded["kv_lora_rank"]) == ("mla", "calibrated", RANK)
    assert recorded["calibration"]["tokens"] == 512  # calibrated on the training data, as the GQA rows are
    markdown = (out / "results.md").read_text()
    assert f"| MLA | {BUDGET} | — | R = {RANK} + D = {ROPE} (calibrated key) | calibrated |" in markdown
    assert "MLA against GQA (uniform allocation, calibrated pooling)" in markdown
    # Each MLA row against the GQA row of uniform allocation and calibrated pooling: the share of its gap closed.
    mha = rows[0]
    for mla in (svd, calibrated):
        shares = [
            (float(gqa[k]) - float(mla[k])) / (float(gqa[k]) - float(mha[k]))
            for k in ("eval_loss_before", "eval_loss_after")
        ]
        cells = f"| {BUDGET} | {mla['pooling']} | R = {RANK} + D = {ROPE} | 2,2 | {shares[0]:.1%} | {shares[1]:.1%} |"
        assert cells in markdown, cells

    # Killed after the calibrated MLA run's conversion, before its training, and after the svd run's
    # training, before its row: the rerun converts nothing again and finishes both, to the same rows.
    converted = out / "converted" / f"b{BUDGET}-mla-calibrated" / "uptrain.json"
    written = converted.stat().st_mtime_ns
    shutil.rmtree(out / "runs" / f"b{BUDGET}-mla-calibrated")
    (out / "runs" / f"b{BUDGET}-mla-svd" / "result.json").unlink()
    capsys.readouterr()
    assert compare(setup, out, *RUNS) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished earlier") == 2  # mha, the GQA run
    assert f"[compare] b{BUDGET}-mla-calibrated: KV budget {float(BUDGET):g}, MLA, calibrated init" in printed
    assert converted.stat().st_mtime_ns == written
    assert rows_of(out) == rows


@pytest.fixture(scope="module")
def gpt2(setup):  # noqa: F811
    from transformers import GPT2Config, GPT2LMHeadModel

    from uptrain.data.corpus import load_tokenizer

    tokenizer = load_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(setup / "gpt2")
    tokenizer.save_pretrained(setup / "gpt2")
    return setup / "gpt2"


def test_an_mla_compare_refuses_in_one_line_before_any_run(setup, gpt2, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "cmp"
    mla = ("--target", "mla")
    for runs, message in (
        ((*mla, "-g", "2", "--kv-budget", BUDGET), "-g/--num-kv-heads counts GQA heads, which --target mla has none"),
        (mla, "--target mla spends a --kv-budget: give one"),
        (("--kv-budget", BUDGET, "--rope-dims", "2"), "--rope-dims shape(s) the MLA runs: give them with --target mla"),
        (("--kv-budget", BUDGET, "--rope-residual", "1"), "--rope-residual shape(s) the MLA runs: give them with"),
        ((*mla, "--kv-budget", BUDGET, "--allocation", "calibrated"), "--allocation and --allocation-cost spend"),
        ((*mla, "mla", "--kv-budget", BUDGET), "--target mla mla names a value twice"),
        ((*mla, "--kv-budget", "0.03"), "which must be a whole number above --rope-dims 4"),
        ((*mla, "--kv-budget", BUDGET, "--rope-dims", "3"), "--rope-dims 3: give an even number"),
        # A calibrated merge's keys with no GQA run to merge (they were refused at the MLA run's conversion).
        ((*mla, "--kv-budget", BUDGET, "--value-fit", "output"), "--value-fit shape(s) the GQA runs' merge: give"),
        ((*mla, "--kv-budget", BUDGET, "--calibration-weighting", "attention"), "--calibration-weighting shape(s)"),
    ):
        assert compare(setup, out, *runs) == 2, runs
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not out.exists()
    # Another family than Llama's: refused as `uptrain convert --target mla` refuses it, before any run.
    argv = ["compare", "--model", str(gpt2), *mla, "--kv-budget", "0.5", "--max-tokens", "64", "--output-dir", str(out)]
    assert main([*argv, "--train-data", str(setup / "train.jsonl"), "--eval-data", str(setup / "eval.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--target mla converts the Llama family" in err and "'gpt2' has learned absolute positions" in err, err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_a_compare_made_before_mla_runs_resumes_and_may_add_them():
    """A compare.json written before --target: read as GQA runs; a rerun may add MLA runs (they only
    add runs) but not change the latent they would be made with once there."""
    from tests.compare.test_study import small_spec
    from uptrain.compare.study import resume_rule

    old = small_spec("cmp", num_kv_heads=[], kv_budget=[0.25]).to_dict()
    for key in ("target", "mla_init", "rope_dims", "rope_stride", "rope_residual", "rotary_key"):
        del old[key]
    assert resume_rule().changes(old, small_spec("cmp", num_kv_heads=[], kv_budget=[0.25]).to_dict()) == []
    now = small_spec("cmp", num_kv_heads=[], kv_budget=[0.25], target=["gqa", "mla"], mla_init=["calibrated"])
    assert resume_rule().changes(old, now.to_dict()) == []
    turned = small_spec("cmp", num_kv_heads=[], kv_budget=[0.25], target=["gqa", "mla"], rotary_key="calibrated")
    assert [c.key for c in resume_rule().changes(old, turned.to_dict())] == ["rotary_key"]
    kept = small_spec("cmp", num_kv_heads=[], kv_budget=[0.25], target=["mla"], rope_dims=8, rope_residual=2)
    assert [c.key for c in resume_rule().changes(old, kept.to_dict())] == ["rope_dims", "rope_residual"]
    for init in ("svd", "calibrated"):  # every MLA run converts with the compare's rotary part
        spec = kept.latent_conversion_spec(0.25, init)
        assert (spec.rope_dims, spec.rope_stride, spec.rope_residual) == (8, 1, 2)


def test_mla_rows_labels_say_a_rope_stride_and_residual(setup, tmp_path):  # noqa: F811
    """--rope-stride and --rope-residual, read from the converted checkpoint, in every label of an MLA
    row (its result.json fields and results.csv columns, its results.md row and MLA-against-GQA row,
    the plot's annotation) where they are not the defaults: two compares that differ in them do not
    report alike. At the defaults the labels are as they were."""
    from uptrain.compare.report import latent_text, write_report
    from uptrain.compare.study import PlannedRun, RunResult, latent_fields
    from uptrain.convert import convert_checkpoint

    budget = float(BUDGET)
    made = convert_checkpoint(
        setup / "mha", tmp_path / "mla", target="mla", kv_budget=budget, rope_stride=2, rope_residual=1
    )
    fields = latent_fields(PlannedRun("b-mla-svd", "svd", kv_budget=budget, latent=True), made, ("decoder-self",), 4)
    assert (fields["kv_rank"], fields["rope_dims"], fields["rope_stride"], fields["rope_residual"]) == (
        RANK,
        ROPE,
        2,
        1,
    )

    def row(name, pooling, loss, **fields):
        return RunResult(
            name,
            fields.pop("num_kv_heads", None),
            pooling,
            loss,
            loss - 1,
            64,
            PER_TOKEN,
            [(0, loss), (64, loss - 1)],
            **fields,
        )

    del fields["num_kv_heads"], fields["kv_cache_bytes_per_token"]
    gqa = {"num_kv_heads": 2, "kv_budget": budget, "allocation": "uniform", "kv_heads_per_layer": "2,2"}
    results = [
        row("mha", "mha", 4.0, num_kv_heads=6),
        row("b-uniform-calibrated", "calibrated", 6.0, **gqa),
        row("b-mla-svd", "svd", 5.0, **fields),
    ]
    (tmp_path / "report").mkdir()
    write_report(results, tmp_path / "report")
    mla = rows_of(tmp_path / "report")[2]
    assert (mla["target"], mla["rope_stride"], mla["rope_residual"]) == ("mla", "2", "1")
    markdown = (tmp_path / "report" / "results.md").read_text()
    shown = f"R = {RANK} + D = {ROPE} (principal key, rope stride 2, rope residual 1)"
    assert f"| MLA | {BUDGET} | — | {shown} | svd |" in markdown
    assert (
        f"| {BUDGET} | svd | R = {RANK} + D = {ROPE} (rope stride 2, rope residual 1) | 2,2 | 50.0% | 50.0% |"
        in markdown
    )
    # The plot's annotation; at the defaults (and in rows written before the options: None) no brackets.
    assert latent_text(fields) == f"R = {RANK} + D = {ROPE} (rope stride 2, rope residual 1)"
    assert latent_text({**fields, "rope_residual": 0}) == f"R = {RANK} + D = {ROPE} (rope stride 2)"
    for default in ({"rope_stride": 1, "rope_residual": 0}, {"rope_stride": None, "rope_residual": None}):
        assert latent_text({**fields, **default}) == f"R = {RANK} + D = {ROPE}"
