"""scripts/whisper_study.py --quick end to end: a tiny Whisper built from a config, espeak-ng clips,
real conversions and uptraining (compare's machinery, a distilled run, a run with the encoder
converted), real scoring — and numbers that agree with each other: WER and CER recomputed from the
predictions kept, KV bytes as G heads of the geometry hold them, mean's share of its own gap 0.

The study scores with jiwer (`uptrain[eval]`), which the main environment leaves out (it tests the
one-line message naming the extra): it runs in the metric libraries' cached environment
(tests/evaluation/test_metric_environment.py), which holds this checkout."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.evaluation.test_metric_environment import eval_python
from uptrain import UptrainError
from uptrain.model_info import layer_kv_heads

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "whisper_study.py"

JIWER = "import json, sys, jiwer; print(json.dumps([(jiwer.wer(*n), jiwer.cer(*n)) for n in json.loads(sys.argv[1])]))"


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng (Debian) makes the clips")
def test_whisper_study_quick(tmp_path):
    python = str(eval_python())
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    out = tmp_path / "study"
    argv = [
        python,
        str(SCRIPT),
        "--quick",
        "--poolings",
        "mean",
        "calibrated",
        "--weighted-rows",
        "--output-rows",
        "--trained-teacher-rows",
        "--kv-budgets",
        "0.25",
    ]
    argv += ["--output-dir", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["name"]: r for r in study["rows"]}
    scored = []  # (wer, cer, [references, predictions]) of every row and time, checked with jiwer below
    names = ["mha", "g2-mean", "g2-calibrated", "g2-calibrated-distill", "g2-calibrated-distill-trained"]
    names += ["g2-calibrated-attention", "g2-calibrated-output"]
    budgets = ["kv0.25-uniform", "kv0.25-calibrated"]
    assert list(rows) == [*names, "g2-calibrated-encoder", *budgets]
    # The tiny model: 2 decoder layers, 8 heads of 8 dims, float32; 3 s of audio = 150 frames.
    for name, row in rows.items():
        for when in ("start", "final"):
            s = row[when]
            own, cross = s["kv_cache_heads_per_layer"], s["cross_cache_heads_per_layer"]
            if name in budgets:  # each layer's heads as the converted config lists them
                config = json.loads((out / "extra" / "converted" / name / "config.json").read_text())
                assert tuple(own) == layer_kv_heads(config, "decoder_num_key_value_heads", 2, 8)
                assert tuple(cross) == layer_kv_heads(config, "cross_attention_num_key_value_heads", 2, 8)
                assert sum(own) + sum(cross) == (8 + 8 + 8 + 8) // 4  # 1/4 of the self + cross heads
            else:
                assert own == cross == [8 if name == "mha" else 2] * 2, (name, when)
            assert s["kv_self_bytes_per_token"] == 2 * sum(own) * 8 * 4, (name, when)
            assert s["kv_cross_bytes_per_frame"] == 2 * sum(cross) * 8 * 4
            assert s["kv_cross_bytes_per_clip"] == 150 * s["kv_cross_bytes_per_frame"]
            assert s["perplexity"] > 1 and s["time_per_sample_s"] > 0
            kept = out / "scores" / when / f"{name.partition('-distill')[0] if when == 'start' else name}.json"
            predictions = json.loads(kept.read_text())["predictions"]
            assert len(predictions) == 2
            norm = [[" ".join(p[k].lower().split()) for p in predictions] for k in ("reference", "prediction")]
            scored.append((s["wer"], s["cer"], norm))
        # Fig. 5: scored at step 0, at the checkpoint of step 2 and at the end (step 4).
        assert sorted(map(int, row["steps"])) == [0, 2, 4]
        assert row["training"]["clips"] == 8 and row["training"]["tokens_seen"] > 0
    recomputed = subprocess.run(
        [python, "-c", JIWER, json.dumps([norm for _, _, norm in scored])],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    for (wer, cer, _), (again_wer, again_cer) in zip(scored, json.loads(recomputed.stdout)):
        assert wer == pytest.approx(100 * again_wer) and cer == pytest.approx(100 * again_cer)
    assert rows["g2-mean"]["gap_closed"] == 0.0
    # A quarter of the bytes spent uniformly is G = 2 (the same merge, the same scores); the
    # calibrated allocation spends it unevenly, chosen by the merge's cost (what uptrain.json records).
    assert rows["kv0.25-uniform"]["start"]["kv_cache_heads_per_layer"] == [2, 2]
    same = ("wer", "cer", "perplexity")
    assert [rows["kv0.25-uniform"]["start"][k] for k in same] == [rows["g2-calibrated"]["start"][k] for k in same]
    record = json.loads((out / "extra" / "converted" / "kv0.25-calibrated" / "uptrain.json").read_text())
    assert (record["kv_budget"], record["allocation"], record["allocation_cost"]) == (0.25, "calibrated", "merge")
    chosen = rows["kv0.25-calibrated"]["start"]
    assert chosen["kv_cache_heads_per_layer"] + chosen["cross_cache_heads_per_layer"] != [2, 2, 2, 2]
    assert rows["g2-calibrated-distill"]["start"] == rows["g2-calibrated"]["start"]
    assert rows["g2-calibrated-distill-trained"]["start"] == rows["g2-calibrated"]["start"]
    # Distillation (from either teacher) and the encoder's conversion change what is trained: their
    # ends differ from calibrated's and from each other's.
    changed = ("g2-calibrated-distill", "g2-calibrated-distill-trained", "g2-calibrated-encoder")
    assert len({rows[n]["final"]["perplexity"] for n in ("g2-calibrated", *changed)}) == 4
    # The teachers: the MHA original, and the MHA row as uptrained here.
    teachers = {
        n: (out / "extra" / n / "train" / "run_config.yaml").read_text()
        for n in ("g2-calibrated-distill", "g2-calibrated-distill-trained")
    }
    assert f"teacher: {out / 'compare' / 'runs' / 'mha' / 'train' / 'final'}\n" in teachers[changed[1]]
    assert "compare/runs/mha" not in teachers[changed[0]] and "teacher: " in teachers[changed[0]]
    # The attention-weighted calibration is its own (the record says so) and merges otherwise.
    record = json.loads((out / "extra" / "converted" / "g2-calibrated-attention" / "uptrain.json").read_text())
    assert record["calibration"]["weighting"] == "attention"
    assert rows["g2-calibrated-attention"]["start"]["perplexity"] != rows["g2-calibrated"]["start"]["perplexity"]
    # So is the refit to the attention output (`--value-fit output`, convert's own), from compare's moments.
    record = json.loads((out / "extra" / "converted" / "g2-calibrated-output" / "uptrain.json").read_text())
    assert (record["calibration"]["value_fit"], record["calibration"]["value_fit_blend"]) == ("output", 0.1)
    assert rows["g2-calibrated-output"]["start"]["perplexity"] != rows["g2-calibrated"]["start"]["perplexity"]
    # Each uptrained row's WER over MHA's trained alike (same clips: the ratio of the two corpus WERs),
    # inside its paired-bootstrap interval; none for the MHA row itself.
    assert rows["mha"]["final_wer_vs_mha"] is None
    for name in names[1:]:
        ratio, mha_wer = rows[name]["final_wer_vs_mha"], rows["mha"]["final"]["wer"]
        if mha_wer > 0:
            assert ratio["ratio"] == pytest.approx(rows[name]["final"]["wer"] / mha_wer)
        assert ratio["low"] <= ratio["ratio"] <= ratio["high"]
    for name in ("results.md", "results.csv", "quality_vs_time.png", "wer_vs_steps.png"):
        assert (out / name).stat().st_size > 0
    # A rerun picks everything up: nothing converted, trained or scored again.
    again = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[whisper]" not in again.stderr and "uptraining" not in again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["rows"] == study["rows"]
    # --score-data rescores the finished study on other held-out pairs (here the training clips),
    # the uptraining loop's --eval-data unchanged: nothing converted or trained again.
    train_pairs = out / "quick-inputs" / "speech" / "train.jsonl"
    rescored = subprocess.run(
        [*argv, "--score-data", str(train_pairs)], capture_output=True, text=True, timeout=1800, env=env
    )
    assert rescored.returncode == 0, rescored.stderr[-3000:]
    assert "converting" not in rescored.stderr and "uptraining" not in rescored.stderr
    assert json.loads(rescored.stdout.strip().splitlines()[-1])["score_data"] == str(train_pairs)
    kept = json.loads((out / "scores" / "final" / "g2-calibrated.json").read_text())
    assert [p["reference"] for p in kept["predictions"]] == ["the cat sat", "my dog sat on a mat"]


def test_whisper_study_refuses_at_start_without_jiwer(tmp_path):
    """In the main environment (no `uptrain[eval]`): one line naming the extra, before anything is
    built, converted or written — not at the first score, minutes in."""
    out = tmp_path / "study"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output-dir", str(out)], capture_output=True, text=True, timeout=300
    )
    needs = "whisper_study.py's WER and CER (as uptrain evaluate --task asr) needs jiwer, which is not installed"
    assert proc.returncode != 0 and proc.stderr == f"error: {needs}: pip install 'uptrain[eval]'\n"
    assert proc.stdout == "" and not out.exists()


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng (Debian) makes the clips")
def test_whisper_study_budget_rows_weigh_cross_heads(tmp_path):
    """--cross-kv-weight R reaches the budget rows' conversion: at 1/4 of the tiny Whisper's decoder
    heads with a cross head weighing 50 self heads (150 frames / ~3 tokens), the calibrated
    allocation keeps more heads than a quarter of the count (cheap self heads, few cross ones),
    within the weighted budget, as the cache and uptrain.json hold them (α = 0 only)."""
    python = str(eval_python())
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    out = tmp_path / "study"
    argv = [python, str(SCRIPT), "--quick", "--output-dir", str(out), "--start-only", "--no-encoder-row"]
    argv += ["--poolings", "calibrated", "--kv-budgets", "0.25", "--allocations", "calibrated"]
    proc = subprocess.run([*argv, "--cross-kv-weight", "50"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}
    assert list(rows) == ["mha", "g2-calibrated", "g2-calibrated-distill", "kv0.25-calibrated-r50"]
    row = rows["kv0.25-calibrated-r50"]
    assert (row["budget"], row["allocation"], row["cross_kv_weight"]) == (0.25, "calibrated", 50)
    folder = out / "extra" / "converted" / "kv0.25-calibrated-r50"
    record = json.loads((folder / "uptrain.json").read_text())
    assert (record["kv_budget"], record["cross_kv_weight"]) == (0.25, 50)
    config = json.loads((folder / "config.json").read_text())
    own, cross = row["start"]["kv_cache_heads_per_layer"], row["start"]["cross_cache_heads_per_layer"]
    assert tuple(own) == layer_kv_heads(config, "decoder_num_key_value_heads", 2, 8)
    assert tuple(cross) == layer_kv_heads(config, "cross_attention_num_key_value_heads", 2, 8)
    assert sum(own) + 50 * sum(cross) <= (16 + 50 * 16) / 4  # the weighted budget (2 layers × 8 heads each)
    assert sum(own) + sum(cross) > (16 + 16) // 4  # counted as heads, more than a quarter: R weighed them
    assert row["start"]["kv_cross_bytes_per_clip"] == 150 * 2 * sum(cross) * 8 * 4
    assert ", cross head = 50 self" in (out / "results.md").read_text()


def test_whisper_study_refuses_a_cross_kv_weight_without_budget_rows(tmp_path):
    """R weighs the --kv-budgets rows' cross heads: without them, one line before anything is written."""
    out = tmp_path / "study"
    argv = [sys.executable, str(SCRIPT), "--quick", "--output-dir", str(out), "--cross-kv-weight", "37.5"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stdout == "" and not out.exists()
    assert proc.stderr == (
        "error: --cross-kv-weight 37.5 weighs the cross-attention heads of the --kv-budgets rows, and this study "
        "has none (add --kv-budgets F, or drop it)\n"
    )
    proc = subprocess.run([*argv[:-1], "0.001", "--kv-budgets", "0.25"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stderr.startswith("error: --cross-kv-weight 0.001 is below 0.01")
    assert proc.stderr.count("\n") == 1 and not out.exists()


def study_module():
    spec = importlib.util.spec_from_file_location("whisper_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_wer_ratio_is_the_corpus_ratio_inside_a_paired_bootstrap_interval():
    """Per clip (word errors, reference words): a row with exactly MHA's errors is 1 with no spread,
    one with twice them on every clip 2 with none (the clips are drawn alike for both); uneven
    errors give an interval around the corpus ratio that narrows as the clips grow in number."""
    wer_ratio = study_module().wer_ratio
    mha = [(e, 20) for e in (1, 3, 0, 2, 5, 1, 2, 4)]
    assert wer_ratio(mha, mha) == {"ratio": 1.0, "low": 1.0, "high": 1.0}
    assert wer_ratio([(2 * e, w) for e, w in mha], mha) == {"ratio": 2.0, "low": 2.0, "high": 2.0}
    row = [(e + (i % 2), w) for i, (e, w) in enumerate(mha)]  # 4 more errors than MHA's 18
    few = wer_ratio(row, mha)
    assert few["ratio"] == pytest.approx(22 / 18) and few["low"] < few["ratio"] < few["high"]
    many = wer_ratio(row * 25, mha * 25)
    assert many["ratio"] == pytest.approx(22 / 18)
    assert many["high"] - many["low"] < (few["high"] - few["low"]) / 3  # ~1/√25 as wide
    with pytest.raises(UptrainError, match="different clips"):
        wer_ratio(row[:-1] + [(1, 7)], mha)


def test_whisper_seeds_pools_each_row_over_the_folders(tmp_path):
    """scripts/whisper_seeds.py on two study folders' kept scores: the rows every folder uptrained,
    each folder's WER, and the errors summed over both over MHA's (a row only one folder has is
    left out; a folder without the MHA row is refused in one line)."""
    references = ["the cat sat on the mat", "a dog ran", "one two three four"]

    def kept(folder: Path, name: str, predictions: list[str]) -> None:
        pairs = [{"reference": r, "prediction": p} for r, p in zip(references, predictions)]
        (folder / "scores" / "final").mkdir(parents=True, exist_ok=True)
        (folder / "scores" / "final" / f"{name}.json").write_text(json.dumps({"predictions": pairs}))

    seeds = [tmp_path / "seed0", tmp_path / "seed1"]
    kept(seeds[0], "mha", ["the cat sat on a mat", "a dog ran", "one two three four"])  # 1 error of 13 words
    kept(seeds[1], "mha", ["The cat sat on the mat.", "a dog", "one two three four"])  # 1 (case, punctuation: 0)
    kept(seeds[0], "g4", ["the cat sat on a mat", "a dog ran far", "one too three four"])  # 3
    kept(seeds[1], "g4", ["the cat sat", "a dog ran", "one two three four"])  # 3
    kept(seeds[1], "g2", ["", "", ""])
    python, script = str(eval_python()), str(SCRIPT.parent / "whisper_seeds.py")
    proc = subprocess.run([python, script, *map(str, seeds)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}
    assert list(rows) == ["mha", "g4"]
    assert rows["mha"]["wer_per_seed"] == pytest.approx([100 / 13, 100 / 13]) and rows["mha"]["vs_mha"] is None
    assert rows["g4"]["wer_per_seed"] == pytest.approx([300 / 13, 300 / 13])
    ratio = rows["g4"]["vs_mha"]
    assert ratio["ratio"] == pytest.approx(6 / 2) and ratio["low"] <= 3 <= ratio["high"]
    assert "| g4 | 23.1 | 23.1 | 3.000 (" in proc.stdout
    lone = tmp_path / "lone"
    kept(lone, "g4", references)
    proc = subprocess.run([python, script, str(seeds[0]), str(lone)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"error: no uptrained MHA row in {lone}: run the study's mha row there first\n"


def test_kv_lr_scale_moves_the_decoders_k_and_v_that_many_times_further(tmp_path, monkeypatch):
    """scripts/whisper_kv_lr.py's optimizer on a tiny real Whisper: with every gradient 1, AdamW's
    first step moves each weight by its group's lr, so the decoder's self- and cross-attention
    k_proj/v_proj move `scale` × as far as the rest (the encoder's K/V not), also after the state
    dict is reloaded as accelerate's prepare does; the loop's scheduled lr stays in the groups. A
    study folder that already holds uptrained runs is refused."""
    from types import SimpleNamespace

    from transformers import WhisperConfig, WhisperForConditionalGeneration

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("whisper_kv_lr", SCRIPT.parent / "whisper_kv_lr.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    config = WhisperConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_mel_bins=8,
        max_source_positions=8, max_target_positions=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config)
    settings = SimpleNamespace(
        lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-12, fused_adamw="auto"
    )
    optimizer = script.kv_scaled_adamw(10.0)(settings, model, torch.device("cpu"))
    for reload in (False, True):
        if reload:
            optimizer.load_state_dict(optimizer.state_dict())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3  # as the loop sets it
        optimizer.step()
        assert all(group["lr"] == 1e-3 for group in optimizer.param_groups)
        kv = 0
        for name, p in model.named_parameters():
            moved = (before[name] - p.detach()).abs().max().item()
            if not p.requires_grad:  # Whisper's sinusoidal encoder positions are frozen
                assert moved == 0, name
                continue
            attention = ".self_attn." in name or ".encoder_attn." in name
            is_kv = ".decoder.layers." in name and attention and ("k_proj" in name or "v_proj" in name)
            kv += is_kv
            assert moved == pytest.approx(1e-2 if is_kv else 1e-3, rel=1e-3), name
        assert kv == 2 * 2 * 3  # 2 layers × self and cross × k weight, v weight, v bias

    folder = tmp_path / "study"
    (folder / "compare" / "runs").mkdir(parents=True)
    with pytest.raises(UptrainError, match="holds uptrained runs"):
        study = ["--model", "m", "--train-data", "t.jsonl", "--eval-data", "e.jsonl", "--output-dir", str(folder)]
        script.main(["--kv-lr-scale", "10", "--", *study])
