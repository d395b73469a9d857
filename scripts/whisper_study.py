"""The paper's Table 1 on a real pretrained model: Whisper converted, uptrained and scored on speech.

    python scripts/whisper_study.py --model whisper-base --train-data speech/train.jsonl \\
        --eval-data speech/test.jsonl --output-dir whisper-study            # every row, α = 0 and uptrained
    python scripts/whisper_study.py ... --start-only                        # α = 0 only (conversion + scoring)
    python scripts/whisper_study.py ... --uptrain mha g4-calibrated g4-mean # uptrain these rows, in this order
    python scripts/whisper_study.py --quick --output-dir /tmp/q             # a tiny Whisper, espeak clips (the test's)

Rows: the MHA model (G = h = 8 for Whisper base) and, for each G of --kv-heads, the decoder's self-
and cross-attention (the paper's setting, `--attention decoder-self,cross`) converted with mean,
first, random and calibrated pooling, calibrated + distillation (the calibrated conversion uptrained
with distillation from the MHA original, train's `teacher`; with --trained-teacher-rows also from the
MHA row as uptrained here, g{G}-calibrated-distill-trained), and one row with the encoder's
self-attention converted too (calibrated, at the first G); with --weighted-rows, per G, calibrated with
`--calibration-weighting attention` (g{G}-calibrated-attention); with --output-rows, per G, calibrated
with `--value-fit output` (g{G}-calibrated-output: the values refit to each head's attention output
under the merged keys, from a second calibration pass); with --kv-budgets F, calibrated pooling at
`--kv-budget F` of the decoder's self + cross KV bytes, spent uniformly and by the calibrated
allocation (`--allocation-cost merge`, the cost encoder–decoders have), each layer's heads read
from the cache; with --cross-kv-weight R a cross-attention head weighs R self heads in those budgets
(convert's flag: R = the source frames cached per target token, 1,500 / ~40 for Whisper's clips).
Conversions, calibration (on the training pairs, with the `--language` prompt) and uptraining are
`uptrain compare`'s own
(`run_compare`: every run the same clips, order, seed and schedule; the MHA model trained alike as
the reference row); distilled and encoder rows take the `TrainConfig` the compare gives its runs.

Every row is scored at α = 0 (the model it starts from) and after uptraining, on the first
--eval-clips held-out speech pairs (--score-data, by default --eval-data), with one pass of the encoder per clip:
- WER and CER (jiwer, as `uptrain evaluate --task asr` computes them) of greedy transcription with
  the KV cache (`generate` with the prompt `--language` forces), on text lower-cased with
  punctuation removed on both sides;
- perplexity of the true transcript under Whisper's prompt: teacher-forced, over the transcript's
  tokens and <|endoftext|> (the prompt's tokens are given, not scored);
- KV-cache bytes, read from the cache `generate` fills: per target token (decoder self-attention)
  and per audio frame (cross-attention, 1500 frames per 30 s clip);
- time per sample in transformers (the encoder's pass plus greedy decoding, batch --batch-eval,
  float32 on the CPU), and in vLLM (`uptrain speed --engine vllm`) where vLLM is installed, else
  "not measured".
The encoder's output is computed once per distinct encoder: rows that keep the source's encoder
(every decoder-only conversion at α = 0) reuse the MHA model's, whose measured time stands for theirs.

Each uptrained row's final WER is also given over the MHA row's trained alike, with the 95 %
interval of a paired bootstrap over the held-out clips (`wer_ratio`): how well the clips resolve a
relative gap (one training seed: --seed reruns the study with another clip order).

Whisper's pretraining budget is not public, so α is stated as what uptraining saw: --steps ×
--batch-size clips (and the target tokens the training loop counted). Fig. 5's view, WER against
uptraining steps, scores each uptrained row's checkpoints (one every --eval-every steps, all kept).

Outputs in --output-dir: results.md (the table), results.csv, results.json, quality_vs_time.png
(Fig. 3: WER against time per sample) and wer_vs_steps.png (Fig. 5); the JSON is also printed as
one line. Resumable: every score is kept with its setting (scores/), every run by compare's resume;
a rerun with more rows or --uptrain names adds them.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import importlib.util
import io
import json
import math
import re
import sys
import time
from pathlib import Path

from uptrain import UptrainError
from uptrain.checkpoint.atomic import atomic_directory, atomic_file, write_file
from uptrain.convert.kv_heads import cross_kv_weight_problem
from uptrain.data.speech import speak, write_pcm_wav

POOLINGS = ("mean", "first", "random", "calibrated")
ALLOCATIONS = ("uniform", "calibrated")
DECODER = "decoder-self,cross"
WITH_ENCODER = "encoder,decoder-self,cross"
# --quick: a tiny Whisper built from a config, espeak clips of the words it knows, 4 steps.
QUICK_WORDS = "the cat sat on a mat with my dog"
QUICK_SENTENCES = ["the cat sat", "my dog sat on a mat", "a cat with my dog", "the dog sat on the cat"]
QUICK_EVAL = ["the cat sat on my dog", "a dog with the mat"]
SAMPLING_RATE = 16000


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the table: where its model starts, how it is uptrained."""

    name: str
    num_kv_heads: int | None  # None: the MHA model, or a budget row's per-layer heads
    pooling: str
    distillation: bool = False
    teacher: str = "original"  # a distilled row's teacher: the MHA original, or the MHA row "trained" alike
    attention: str = DECODER
    weighting: str = "uniform"  # the calibrated merge's `calibration_weighting`
    value_fit: str = "inputs"  # the calibrated merge's `value_fit` (output: refit to the attention output)
    budget: float | None = None  # `--kv-budget`: a share of the converted attentions' KV bytes
    allocation: str = "uniform"  # how the budget is spent (`--allocation`)
    cross_kv_weight: float | None = None  # `--cross-kv-weight R` of a budget row (None: a cross head weighs 1)

    @property
    def mha(self) -> bool:
        return self.num_kv_heads is None and self.budget is None

    @property
    def compare_start(self) -> bool:
        """Starts from a conversion `run_compare` makes (its G and pooling, nothing else)."""
        plain = self.budget is None and self.weighting == "uniform" and self.value_fit == "inputs"
        return plain and self.attention == DECODER

    @property
    def in_compare(self) -> bool:
        """Made and trained by `run_compare` (the others take its TrainConfig by hand)."""
        return self.compare_start and not self.distillation


def budget_rows(budgets: list[float], allocations: list[str], cross_kv_weight: float | None = None) -> list[Row]:
    """Per budget F and allocation: calibrated pooling at `--kv-budget F --allocation A` (the
    calibrated allocation by the merge's cost, the one encoder–decoders have), a cross-attention
    head weighing `cross_kv_weight` self heads when given — named for it (kv0.25-calibrated-r37.9),
    so that a folder's rows of another weight are converted, trained and scored apart."""
    weight = "" if cross_kv_weight is None else f"-r{cross_kv_weight:g}"
    return [
        Row(f"kv{f:g}-{a}{weight}", None, "calibrated", budget=f, allocation=a, cross_kv_weight=cross_kv_weight)
        for f in budgets
        for a in allocations
    ]


def rows_of(
    kv_heads: list[int],
    poolings: list[str],
    encoder_row: bool,
    weighted: bool = False,
    budgets: list[float] = (),
    allocations: list[str] = ALLOCATIONS,
    cross_kv_weight: float | None = None,
    output: bool = False,
    trained_teacher: bool = False,
) -> list[Row]:
    rows = [Row("mha", None, "mha")]
    for g in kv_heads:
        rows += [Row(f"g{g}-{p}", g, p) for p in poolings]
        if "calibrated" in poolings:
            rows.append(Row(f"g{g}-calibrated-distill", g, "calibrated", distillation=True))
            if trained_teacher:
                name = f"g{g}-calibrated-distill-trained"
                rows.append(Row(name, g, "calibrated", distillation=True, teacher="trained"))
        if weighted:
            rows.append(Row(f"g{g}-calibrated-attention", g, "calibrated", weighting="attention"))
        if output:
            rows.append(Row(f"g{g}-calibrated-output", g, "calibrated", value_fit="output"))
    if encoder_row and kv_heads:
        rows.append(Row(f"g{kv_heads[0]}-calibrated-encoder", kv_heads[0], "calibrated", attention=WITH_ENCODER))
    return rows + budget_rows(budgets, allocations, cross_kv_weight)


def study_rows(args: argparse.Namespace) -> list[Row]:
    return rows_of(
        args.kv_heads,
        args.poolings,
        not args.no_encoder_row,
        args.weighted_rows,
        args.kv_budgets,
        args.allocations,
        args.cross_kv_weight,
        args.output_rows,
        args.trained_teacher_rows,
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", help="the Whisper checkpoint folder (or Hub id, e.g. openai/whisper-base)")
    parser.add_argument("--train-data", help="speech pairs (jsonl audio/text) for calibration and uptraining")
    parser.add_argument("--eval-data", help="held-out speech pairs (jsonl audio/text), never trained on")
    parser.add_argument(
        "--score-data",
        help="held-out pairs the rows are scored on (default: --eval-data, which the uptraining loop also reads\n"
        "for its own few-clip evaluation): rescore a finished study on a larger held-out set",
    )
    parser.add_argument(
        "--output-dir", default="whisper-study", help="runs, scores and results (default: whisper-study)"
    )
    parser.add_argument("--language", default="en", help="the audio's language, Whisper's prompt (default en)")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=None, metavar="G", help="G values (default 4 2 1)")
    parser.add_argument("--poolings", nargs="+", default=list(POOLINGS), choices=POOLINGS, help="pooling strategies")
    parser.add_argument("--no-encoder-row", action="store_true", help="leave out the row that converts the encoder")
    parser.add_argument(
        "--weighted-rows",
        action="store_true",
        help="also, per G, calibrated with --calibration-weighting attention (errors weighed where attention goes)",
    )
    parser.add_argument(
        "--output-rows",
        action="store_true",
        help="also, per G, calibrated with --value-fit output (the values refit to each head's attention output\n"
        "under the merged keys, a second calibration pass; λ = convert's --value-fit-blend default)",
    )
    parser.add_argument(
        "--trained-teacher-rows",
        action="store_true",
        help="also, per G, calibrated + distillation from the MHA row as uptrained here (its final model, on\n"
        "the same clips) instead of the MHA original (g{G}-calibrated-distill-trained; trains the MHA row first)",
    )
    parser.add_argument(
        "--kv-budgets",
        type=float,
        nargs="+",
        default=[],
        metavar="F",
        help="also, per F, calibrated pooling at --kv-budget F of the decoder's self + cross KV bytes",
    )
    parser.add_argument(
        "--allocations",
        nargs="+",
        default=list(ALLOCATIONS),
        choices=ALLOCATIONS,
        help="how each --kv-budgets row spends its budget (default: both; calibrated: the merge's cost)",
    )
    parser.add_argument(
        "--cross-kv-weight",
        type=float,
        default=None,
        metavar="R",
        help="in the --kv-budgets rows, a cross-attention KV head weighs R self-attention heads (convert's\n"
        "--cross-kv-weight: R = 1,500 frames / the target tokens a transcript's cache holds; default 1)",
    )
    parser.add_argument("--steps", type=int, default=None, help="uptraining steps (default 20; --quick 4)")
    parser.add_argument("--batch-size", type=int, default=2, help="clips per uptraining step (default 2)")
    parser.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (default 5e-5)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="warm-up steps (default 2)")
    parser.add_argument(
        "--seed", type=int, default=0, help="the compare's seed: the uptraining's clip order (default 0)"
    )
    parser.add_argument("--eval-every", type=int, default=None, help="checkpoint (Fig. 5) every K steps (default 5)")
    parser.add_argument("--eval-clips", type=int, default=40, help="held-out clips scored per model (default 40)")
    parser.add_argument("--batch-eval", type=int, default=8, help="clips transcribed together (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens per transcript (default 128)")
    parser.add_argument("--calibration-clips", type=int, default=64, help="training clips calibration reads")
    parser.add_argument("--start-only", action="store_true", help="α = 0 only: convert and score, train nothing")
    parser.add_argument(
        "--uptrain",
        nargs="+",
        default=None,
        metavar="ROW",
        help="uptrain only these rows, in this order (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny Whisper and four espeak clips (the test's)")
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or ([2] if args.quick else [4, 2, 1])
    args.steps = args.steps or (4 if args.quick else 20)
    args.eval_every = args.eval_every or (2 if args.quick else 5)
    if args.quick:
        args.eval_clips, args.batch_eval, args.max_new_tokens = min(args.eval_clips, 2), 2, 8
        args.calibration_clips = min(args.calibration_clips, 4)
    elif not (args.model and args.train_data and args.eval_data):
        parser.error("--model, --train-data and --eval-data are required (or --quick)")
    if min(args.steps, args.eval_every, args.eval_clips, args.batch_size, args.calibration_clips) < 1:
        parser.error("--steps, --eval-every, --eval-clips, --batch-size and --calibration-clips must be at least 1")
    # One line, before anything is built (main's `error:`): R weighs the budget rows' cross heads only.
    if args.cross_kv_weight is not None and not args.kv_budgets:
        raise UptrainError(
            f"--cross-kv-weight {args.cross_kv_weight:g} weighs the cross-attention heads of the --kv-budgets "
            "rows, and this study has none (add --kv-budgets F, or drop it)"
        )
    if problem := cross_kv_weight_problem(args.kv_budgets[0] if args.kv_budgets else None, args.cross_kv_weight):
        raise UptrainError(problem)
    names = [r.name for r in study_rows(args)]
    if args.uptrain and (unknown := [n for n in args.uptrain if n not in names]):
        parser.error(f"--uptrain {' '.join(unknown)}: not a row of this study ({', '.join(names)})")
    return args


# --- --quick: a tiny Whisper and espeak clips -----------------------------------------------------


def speech_pairs(texts: list[str], folder: Path, name: str) -> Path:
    """Speech pairs `folder`/NAME.jsonl of `texts`, each spoken into audio/NAME-I.wav."""
    (folder / "audio").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, text in enumerate(texts):
        wav = folder / "audio" / f"{name}-{i}.wav"
        if not wav.exists():  # whole or not at all: a rerun reuses what a killed one left
            with atomic_file(wav) as tmp:
                write_pcm_wav(tmp, speak(text))
        lines.append(json.dumps({"audio": f"audio/{wav.name}", "text": text}) + "\n")
    write_file(folder / f"{name}.jsonl", "".join(lines))
    return folder / f"{name}.jsonl"


def tiny_whisper(folder: Path) -> Path:
    """A 2-layer Whisper (d_model 64, 8 heads of 8) from a config, with a word-level tokenizer
    holding Whisper's special tokens, a 2 s feature extractor and a multilingual generation config
    as the Hub's checkpoints have it (language and task ids, <|notimestamps|>)."""
    if (folder / "generation_config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(folder, overwrite=True) as tmp:  # a killed build is not taken for a built one
        _write_tiny_whisper(tmp)
    return folder


def _write_tiny_whisper(folder: Path) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.trainers import WordLevelTrainer

    specials = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|translate|>", "<|transcribe|>"]
    specials.append("<|notimestamps|>")
    tok = Tokenizer(WordLevel(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = Whitespace()
    tok.train_from_iterator([QUICK_WORDS], WordLevelTrainer(special_tokens=specials))
    eot = "<|endoftext|>"
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=eot, pad_token=eot, eos_token=eot, bos_token=eot
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    torch.manual_seed(0)
    geometry = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=8, decoder_attention_heads=8)
    geometry.update(encoder_ffn_dim=128, decoder_ffn_dim=128, d_model=64, dropout=0.0, attention_dropout=0.0)
    config = tf.WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=16,
        max_source_positions=150,  # 3 s of frames
        max_target_positions=64,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=ids[eot],
        eos_token_id=ids[eot],
        pad_token_id=ids[eot],
        suppress_tokens=None,
        begin_suppress_tokens=None,
        **geometry,
    )
    tf.WhisperForConditionalGeneration(config).save_pretrained(folder)
    tf.WhisperFeatureExtractor(feature_size=16, sampling_rate=SAMPLING_RATE, chunk_length=3).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    path = folder / "generation_config.json"
    gen = json.loads(path.read_text())
    gen.update(
        no_timestamps_token_id=ids["<|notimestamps|>"],
        is_multilingual=True,
        lang_to_id={"<|en|>": ids["<|en|>"], "<|fr|>": ids["<|fr|>"]},
        task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        forced_decoder_ids=[[1, None], [2, ids["<|transcribe|>"]]],
        _from_model_config=False,
    )
    write_file(path, json.dumps(gen, indent=2) + "\n")


def quick_inputs(args: argparse.Namespace) -> None:
    """--quick: the tiny Whisper and the espeak clips, made in --output-dir/quick-inputs (kept)."""
    root = Path(args.output_dir).absolute() / "quick-inputs"
    args.model = str(tiny_whisper(root / "model"))
    args.train_data = str(speech_pairs(QUICK_SENTENCES, root / "speech", "train"))
    args.eval_data = str(speech_pairs(QUICK_EVAL, root / "speech", "test"))


# --- the comparison: conversions and uptraining on compare's machinery ---------------------------


def study_spec(args: argparse.Namespace, kv_heads: list[int], poolings: list[str]):
    """The `uptrain compare` of this study (`CompareSpec`): the decoder's self- and cross-attention,
    speech pairs with the --language prompt, --steps × --batch-size clips, a checkpoint every
    --eval-every steps (all kept, for Fig. 5), no speed measurement of its own."""
    from uptrain.compare.spec import CompareSpec
    from uptrain.model_info import read_config
    from uptrain.options import validated

    seq_len = min(256, read_config(args.model).get("max_target_positions", 448))  # target tokens
    return validated(
        CompareSpec,
        "compare",
        model=args.model,
        num_kv_heads=kv_heads,
        pooling=poolings,
        attention=DECODER,
        train_data=args.train_data,
        eval_data=args.eval_data,
        objective="speech_pairs",
        language=args.language,
        speech_task="transcribe",
        seq_len=seq_len,  # a 30 s clip's transcript is about 100 tokens
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        max_steps=args.steps,
        eval_every=args.eval_every,
        eval_blocks=min(args.eval_clips, 8),  # the loop's own evaluation: a few clips (the study scores its own)
        calibration_tokens=args.calibration_clips * seq_len,  # calibration reads ⌈tokens / seq_len⌉ clips
        calibration_device="cpu",
        report_to=["jsonl"],
        speed_repeats=0,
        source_hash="none",
        output_dir=str(Path(args.output_dir).absolute() / "compare"),
    )


def start_folder(row: Row, spec, root: Path) -> Path:
    if row.mha:
        return Path(spec.model)
    if not row.compare_start:
        return root / "extra" / "converted" / row.name
    return Path(spec.output_dir) / "converted" / f"g{row.num_kv_heads}-{row.pooling}"


def start_name(row: Row) -> str:
    """The name a row's α = 0 score is kept under: a distilled row starts where calibrated does."""
    return row.name.partition("-distill")[0]


def train_folder(row: Row, spec, root: Path) -> Path:
    if row.in_compare:
        return Path(spec.output_dir) / "runs" / row.name / "train"
    return root / "extra" / row.name / "train"


def convert_starts(rows: list[Row], spec, root: Path, log) -> None:
    """Each row's start, converted where it is not yet (compare's calibration, shared by all)."""
    from uptrain.compare.study import hold_compare_dir, shared_calibration
    from uptrain.convert.pipeline import execute, prepare, settle_allocation

    with hold_compare_dir(spec):
        for row in rows:
            out = start_folder(row, spec, root)
            if row.mha or out.exists():
                continue
            log(f"[whisper] converting {row.name}")
            conversion = row_conversion(row, spec)
            out.parent.mkdir(parents=True, exist_ok=True)
            began = time.perf_counter()
            with prepare(conversion, out) as prepared:
                calibration = None
                if prepared.needs_calibration:
                    # One calibration per weighting, shared by its conversions (compare's, for uniform).
                    place = Path(spec.output_dir) if row.weighting == "uniform" else root / "extra" / row.weighting
                    place.mkdir(parents=True, exist_ok=True)
                    calibration = shared_calibration(prepared, place, log)
                if prepared.conversion.pending_budget is not None:  # the budget's heads, from the moments
                    settle_allocation(prepared, calibration)
                execute(prepared, out, calibration=calibration, progress=False)
            log(f"[whisper] {row.name}: converted in {time.perf_counter() - began:.0f} s")


def row_conversion(row: Row, spec):
    """The `ConversionSpec` of a row's start: compare's (its budget conversion for a budget row, at
    the row's --cross-kv-weight: the allocation cost is compare's default, `merge` for
    encoder–decoders, the only one they have), with the row's attention and weighting."""
    if row.budget is not None:
        conversion = spec.budget_conversion_spec(row.budget, row.allocation, row.pooling)
        # The row's weight on its conversion alone: the study's compare (no --kv-budget) has none to weigh.
        conversion = dataclasses.replace(conversion, cross_kv_weight=row.cross_kv_weight)
    else:
        conversion = spec.conversion_spec(row.num_kv_heads, row.pooling)
    return dataclasses.replace(
        conversion, attention=row.attention, calibration_weighting=row.weighting, value_fit=row.value_fit
    )


def uptrain_row(row: Row, args: argparse.Namespace, root: Path, log) -> None:
    """Uptrain `row` with the `TrainConfig` the compare gives its runs (the distilled row: + the
    teacher), every checkpoint kept for Fig. 5; compare rows in the compare's own folders, where
    `run_compare` then picks each up (with the MHA reference) and records its result."""
    from uptrain.compare.study import RESULT, hold_compare_dir, run_compare
    from uptrain.train.loop import run_training

    spec = study_spec(args, args.kv_heads, args.poolings)
    folder = train_folder(row, spec, root)
    if not (folder / "final" / "config.json").is_file():
        teacher = teacher_folder(row, args, root, log) if row.distillation else None  # before the hold: it may train
        with hold_compare_dir(spec):
            name = "mha" if row.mha else row.name
            config = spec.train_config(start_folder(row, spec, root), folder, name)
            config = dataclasses.replace(config, keep_checkpoints=spec.max_steps // spec.eval_every + 1)
            if row.distillation:
                config = dataclasses.replace(config, teacher=str(teacher))
            log(f"[whisper] {row.name}: uptraining" + (" with distillation" if row.distillation else ""))
            run_training(config)
    if row.in_compare and not row.mha:
        run_compare(study_spec(args, [row.num_kv_heads], [row.pooling]), log)
    elif not row.in_compare:
        write_file(folder.parent / RESULT, json.dumps({"name": row.name}) + "\n")


def teacher_folder(row: Row, args: argparse.Namespace, root: Path, log) -> Path:
    """A distilled row's teacher: the MHA original, or the MHA row's uptrained model (trained first
    where it is not yet: the same clips, order, seed and schedule as every row)."""
    spec = study_spec(args, args.kv_heads, args.poolings)
    if row.teacher == "original":
        return Path(spec.model)
    mha = Row("mha", None, "mha")
    uptrain_row(mha, args, root, log)
    return train_folder(mha, spec, root) / "final"


def training_record(row: Row, spec, root: Path) -> dict | None:
    """What a finished run saw (clips, target tokens, steps) and its wall time; None before."""
    from uptrain.train.metrics import read_metrics

    folder = train_folder(row, spec, root)
    if not (folder / "final" / "config.json").is_file():
        return None
    records = read_metrics(folder / "metrics.jsonl")
    steps = [r for r in records if "train/tokens_seen" in r]
    last = steps[-1]
    return {
        "steps": last.get("train/step", spec.max_steps),
        "clips": spec.max_steps * spec.batch_size,
        "tokens_seen": last["train/tokens_seen"],
        "curve": [[r["train/tokens_seen"], r["eval/loss"]] for r in records if "eval/loss" in r],
    }


# --- scoring: WER, CER, perplexity, KV bytes, time per sample ------------------------------------


_PUNCTUATION = re.compile(r"[^\w\s']|_")


def normalise(text: str) -> str:
    """Lower case, punctuation removed, single spaces: what WER and CER compare."""
    return " ".join(_PUNCTUATION.sub(" ", text.lower()).split())


class Scorer:
    """Scores models on the held-out clips, one encoder pass per clip per distinct encoder."""

    def __init__(self, args: argparse.Namespace, log):
        from uptrain import loading
        from uptrain.architecture import find_architecture
        from uptrain.data.pairs import load_pairs
        from uptrain.model_info import read_config
        from uptrain.objectives import OBJECTIVES
        from uptrain.objectives.prompts import PromptKeys, target_framing

        self.args, self.log = args, log
        config = read_config(args.model)
        self.tokenizer = loading.load_tokenizer(args.model, "model")
        objective = OBJECTIVES["speech_pairs"]
        keys = PromptKeys(language=args.language, speech_task="transcribe")
        arch = find_architecture(config.get("model_type"))
        self.framing = target_framing(arch, objective, keys, self.tokenizer, args.model, config)
        target_len = len(self.framing.label_prefix) + 1 + args.max_new_tokens
        examples = load_pairs(
            args.score_data, "score_data", objective, self.tokenizer, args.model, config, 256, target_len, self.framing
        )
        self.count = min(args.eval_clips, len(examples))
        self.examples = examples
        self.references = [r["text"] for _, r in examples.records[: self.count]]
        self.encoded: dict[str, tuple[list, float]] = {}  # encoder fingerprint → (outputs per batch, seconds)
        self.setting = {
            "eval_data": str(Path(args.score_data).absolute()),
            "clips": self.count,
            "batch": args.batch_eval,
            "max_new_tokens": args.max_new_tokens,
            "language": args.language,
        }

    def batches(self) -> list[list[int]]:
        size = self.args.batch_eval
        return [list(range(s, min(s + size, self.count))) for s in range(0, self.count, size)]

    def _encoder(self, model) -> tuple[list, float]:
        """The encoder's outputs on every batch, and the seconds they took (computed once per encoder)."""
        import torch

        digest = hashlib.sha256()
        for name, p in model.get_encoder().state_dict().items():
            digest.update(name.encode() + p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        key = digest.hexdigest()
        if key not in self.encoded:
            outputs, seconds = [], 0.0
            with torch.inference_mode():
                for indices in self.batches():
                    features = self.examples.take(indices)["input_features"].to(model.dtype)
                    began = time.perf_counter()
                    outputs.append(model.get_encoder()(features))
                    seconds += time.perf_counter() - began
            self.encoded = {key: (outputs, seconds)}  # one encoder kept: rows come in order of their encoders
        return self.encoded[key]

    def score(self, model) -> dict:
        """WER, CER, perplexity, KV bytes and time per sample of a loaded model."""
        import torch
        from transformers import GenerationConfig, GenerationMixin

        from uptrain.evaluation.scores import word_error_rates

        # Greedy decoding with the KV cache from the prompt `generate(language=…, task=…)` forces,
        # with the checkpoint's suppressed tokens, by transformers' generic generate: Whisper's own
        # runs its long-form loop, which slices the batch when a clip ends early and, given the
        # encoder's outputs, can return fewer sequences than clips.
        own = model.generation_config
        settings = GenerationConfig(
            do_sample=False,
            num_beams=1,
            use_cache=True,
            max_new_tokens=self.args.max_new_tokens,
            eos_token_id=own.eos_token_id,
            pad_token_id=own.pad_token_id if own.pad_token_id is not None else own.eos_token_id,
            suppress_tokens=own.suppress_tokens,
            begin_suppress_tokens=own.begin_suppress_tokens,
        )
        start = [model.config.decoder_start_token_id, *self.framing.label_prefix]
        prompt = len(self.framing.label_prefix)
        encoded, encoder_seconds = self._encoder(model)
        predictions, nll, scored, decode_seconds, kv = [], 0.0, 0, 0.0, None
        with torch.inference_mode():
            for indices, outputs in zip(self.batches(), encoded):
                labels = self.examples.take(indices)["labels"]
                logits = model(encoder_outputs=outputs, labels=labels).logits
                target = labels[:, prompt:]  # the transcript and <|endoftext|>, after the given prompt
                losses = torch.nn.functional.cross_entropy(
                    logits[:, prompt:].flatten(0, 1).float(), target.flatten(), ignore_index=-100, reduction="sum"
                )
                nll, scored = nll + float(losses), scored + int((target != -100).sum())
                began = time.perf_counter()
                generated = GenerationMixin.generate(
                    model,
                    encoder_outputs=outputs,
                    decoder_input_ids=torch.tensor([start] * len(indices)),
                    generation_config=settings,
                    return_dict_in_generate=True,
                )
                decode_seconds += time.perf_counter() - began
                texts = self.tokenizer.batch_decode(generated.sequences[:, len(start) :], skip_special_tokens=True)
                predictions += [t.strip() for t in texts]
                if kv is None:
                    kv = cache_bytes(generated.past_key_values, len(indices), generated.sequences.shape[1])
        rates = word_error_rates([normalise(p) for p in predictions], [normalise(r) for r in self.references])
        return {
            **rates,
            "perplexity": math.exp(nll / scored),
            "transcript_tokens": scored,
            **kv,
            "time_per_sample_s": (encoder_seconds + decode_seconds) / self.count,
            "encoder_s_per_sample": encoder_seconds / self.count,
            "predictions": [{"reference": r, "prediction": p} for r, p in zip(self.references, predictions)],
        }

    def stored_or_scored(self, path: Path, load, folder: Path | None = None) -> dict:
        """The score kept at `path` when made with this setting, else `load()`'s model scored now
        (and the checkpoint `folder`, when given, timed in vLLM)."""
        try:
            stored = json.loads(path.read_text())
            if stored.get("setting") == self.setting:
                return stored
        except (OSError, ValueError, AttributeError):
            pass
        began = time.perf_counter()
        model = load()
        result = {**self.score(model), "setting": self.setting, "wall_s": None}
        result["wall_s"] = round(time.perf_counter() - began, 1)
        del model
        if folder is not None:
            result.update(vllm_time(folder, self.args, self.log))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps(result, indent=1) + "\n")
        self.log(f"[whisper] {path.parent.name}/{path.stem}: WER {result['wer']:.1f}, ppl {result['perplexity']:.4g}")
        return result


def cache_bytes(cache, batch: int, target_len: int) -> dict:
    """KV-cache bytes per decoder token (self-attention) and per audio frame (cross-attention), as
    the cache `generate` filled holds them (the last token's K/V is never written: target_len − 1)."""

    def size(part) -> tuple[int, int]:
        layers = part.layers
        total = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        return total, layers[0].keys.shape[-2]

    own, own_positions = size(cache.self_attention_cache)
    cross, frames = size(cache.cross_attention_cache)
    return {
        "kv_self_bytes_per_token": own // (batch * own_positions),
        "kv_cross_bytes_per_frame": cross // (batch * frames),
        "kv_cross_bytes_per_clip": cross // batch,
        "kv_cache_heads": cache.self_attention_cache.layers[0].keys.shape[1],
        "cross_cache_heads": cache.cross_attention_cache.layers[0].keys.shape[1],
        "kv_cache_heads_per_layer": [layer.keys.shape[1] for layer in cache.self_attention_cache.layers],
        "cross_cache_heads_per_layer": [layer.keys.shape[1] for layer in cache.cross_attention_cache.layers],
    }


def load_folder(folder: Path):
    from uptrain.speed import load_model

    return lambda: load_model(folder, "float32", "cpu")


def load_checkpoint(start: Path, checkpoint: Path):
    """The start model with a training checkpoint's weights (accelerate's model.safetensors)."""

    def load():
        from safetensors.torch import load_file

        model = load_folder(start)()
        missing, unexpected = model.load_state_dict(load_file(checkpoint / "model.safetensors"), strict=False)
        tied = {"proj_out.weight"}
        if unexpected or set(missing) - tied:
            raise SystemExit(f"error: {checkpoint} does not hold {start}'s weights ({(missing + unexpected)[:3]})")
        model.tie_weights()
        return model.eval()

    return load


def vllm_time(folder: Path, args, log) -> dict:
    """Time per sample in vLLM (`uptrain speed --engine vllm`, batch --batch-eval, --max-new-tokens
    decoded), or why it was not measured."""
    if importlib.util.find_spec("vllm") is None:
        return {"vllm_time_per_sample_s": None, "vllm": "not measured: vLLM is not installed"}
    from uptrain import UptrainError
    from uptrain.speed_vllm import measure_vllm_speed

    try:
        result = measure_vllm_speed([folder], new_tokens=args.max_new_tokens, batch=args.batch_eval, repeats=2)[0]
    except UptrainError as err:
        log(f"[whisper] vLLM: {err}")
        return {"vllm_time_per_sample_s": None, "vllm": f"not measured: {err}"}
    return {"vllm_time_per_sample_s": result["time_per_sample_s"], "vllm": "measured"}


# --- the study -----------------------------------------------------------------------------------


def study(args: argparse.Namespace, log) -> dict:
    root = Path(args.output_dir).absolute()
    if args.quick:
        quick_inputs(args)
    args.score_data = args.score_data or args.eval_data  # known here for --quick too
    rows = study_rows(args)
    spec = study_spec(args, args.kv_heads, args.poolings)
    began = time.perf_counter()
    convert_starts(rows, spec, root, log)
    scorer = Scorer(args, log)
    # Rows that keep the source's encoder first, so that its outputs are computed once.
    for row in sorted(rows, key=lambda r: r.attention != DECODER):
        if row.distillation:
            continue  # its start is the calibrated row's
        start = start_folder(row, spec, root)
        scorer.stored_or_scored(root / "scores" / "start" / f"{start_name(row)}.json", load_folder(start), start)
    wall = {"start_s": round(time.perf_counter() - began, 1)}
    if not args.start_only:
        order = [r for name in (args.uptrain or [r.name for r in rows]) for r in rows if r.name == name]
        for row in order:
            t = time.perf_counter()
            uptrain_row(row, args, root, log)
            score_uptrained(row, spec, root, scorer)
            wall[row.name] = round(time.perf_counter() - t, 1)
            report(collect(rows, spec, root, args), root)  # partial results survive a kill
    result = collect(rows, spec, root, args)
    result["wall_s"] = wall
    report(result, root)
    return result


def score_uptrained(row: Row, spec, root: Path, scorer: Scorer) -> None:
    """The uptrained model and each kept checkpoint (Fig. 5)."""
    from uptrain.train.checkpoint import list_checkpoints

    folder = train_folder(row, spec, root)
    start = start_folder(row, spec, root)
    for step, checkpoint in list_checkpoints(folder):
        if step < spec.max_steps:
            scorer.stored_or_scored(
                root / "scores" / "steps" / row.name / f"{step}.json", load_checkpoint(start, checkpoint)
            )
    final = folder / "final"
    scorer.stored_or_scored(root / "scores" / "final" / f"{row.name}.json", load_folder(final), final)


def collect(rows: list[Row], spec, root: Path, args) -> dict:
    """Every score measured so far, per row."""
    out = []
    for row in rows:
        entry = {"name": row.name, **dataclasses.asdict(row)}
        entry["start"] = _summary(root / "scores" / "start" / f"{start_name(row)}.json")
        entry["final"] = _summary(root / "scores" / "final" / f"{row.name}.json")
        steps = root / "scores" / "steps" / row.name
        entry["steps"] = {int(p.stem): _summary(p) for p in steps.glob("*.json")} if steps.is_dir() else {}
        entry["training"] = training_record(row, spec, root)
        if entry["final"] is not None:
            entry["steps"][spec.max_steps] = entry["final"]
        if entry["start"] is not None:
            entry["steps"][0] = entry["start"]
        entry["steps"] = dict(sorted(entry["steps"].items()))
        out.append(entry)
    _gaps(out)
    _wer_ratios(rows, root, out)
    return {
        "model": args.model,
        "eval_data": args.eval_data,
        "score_data": args.score_data,
        "train_data": args.train_data,
        "language": args.language,
        "budget": {"steps": spec.max_steps, "batch_size": spec.batch_size, "clips": spec.max_steps * spec.batch_size},
        "settings": {k: getattr(spec, k) for k in ("lr", "warmup_steps", "eval_every", "seed", "calibration_tokens")},
        "rows": out,
    }


def _stored(path: Path) -> dict | None:
    """A kept score, or None before it is scored."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) else None


def _summary(path: Path) -> dict | None:
    stored = _stored(path)
    return None if stored is None else {k: v for k, v in stored.items() if k not in ("predictions", "setting")}


def clip_errors(path: Path, setting: dict | None = None) -> list[tuple[int, int]] | None:
    """Per held-out clip of a kept score: its word errors (substitutions, deletions, insertions)
    and its reference's words, on the normalised text WER compares; None before it is scored (or
    when it was scored with another `setting` than the one given)."""
    kept = _stored(path)
    if kept is None or (setting is not None and kept.get("setting") != setting):
        return None
    return _clip_errors(kept)


def _clip_errors(kept: dict) -> list[tuple[int, int]] | None:
    import jiwer

    if "predictions" not in kept:
        return None
    counts = []
    for p in kept["predictions"]:
        m = jiwer.process_words(normalise(p["reference"]), normalise(p["prediction"]))
        counts.append((m.substitutions + m.deletions + m.insertions, m.substitutions + m.deletions + m.hits))
    return counts


def wer_ratio(row: list[tuple[int, int]], mha: list[tuple[int, int]], resamples: int = 2000) -> dict:
    """A row's corpus WER over MHA's on the same clips, and its 95 % interval by a paired bootstrap
    over the clips (each resample draws clips, the same ones for both models): how far the held-out
    set's few clips resolve a relative gap (training seeds are not resampled)."""
    import numpy as np

    errors, words = np.array(row, dtype=float).T
    base, base_words = np.array(mha, dtype=float).T
    if not np.array_equal(words, base_words):
        raise UptrainError("the row and the MHA row were scored on different clips")
    draws = np.random.default_rng(0).integers(0, len(errors), size=(resamples, len(errors)))
    ratios = errors[draws].sum(1) / np.maximum(base[draws].sum(1), 1)
    low, high = np.quantile(ratios, [0.025, 0.975])
    return {"ratio": float(errors.sum() / base.sum()), "low": float(low), "high": float(high)}


def _wer_ratios(rows: list[Row], root: Path, out: list[dict]) -> None:
    """Each uptrained row's final WER relative to the MHA row trained alike (`wer_ratio`), where
    both were scored alike (a study being rescored with --score-data has rows of both settings)."""
    final = root / "scores" / "final"
    kept = _stored(final / "mha.json")
    mha = None if kept is None else _clip_errors(kept)
    setting = None if kept is None else kept.get("setting")
    for row, entry in zip(rows, out):
        own = None if row.mha or mha is None else clip_errors(final / f"{row.name}.json", setting)
        entry["final_wer_vs_mha"] = None if own is None else wer_ratio(own, mha)


def _gaps(rows: list[dict]) -> None:
    """Per converted row at α = 0: the share of mean's log-perplexity gap to MHA it closes."""
    mha = next((r["start"] for r in rows if r["num_kv_heads"] is None and r["budget"] is None), None)
    means = {r["num_kv_heads"]: r["start"] for r in rows if r["pooling"] == "mean" and r["start"]}
    for r in rows:
        mean = means.get(r["num_kv_heads"])
        if mha and mean and r["start"] and r["num_kv_heads"] is not None:
            gap = math.log(mean["perplexity"]) - math.log(mha["perplexity"])
            closed = (math.log(mean["perplexity"]) - math.log(r["start"]["perplexity"])) / gap if gap > 0 else None
            r["gap_closed"] = closed
        else:
            r["gap_closed"] = None


# --- outputs -------------------------------------------------------------------------------------

COLUMNS = (
    "row",
    "G",
    "pooling",
    "KV self B/token",
    "KV cross B/clip",
    "WER α=0",
    "CER α=0",
    "ppl α=0",
    "gap closed α=0",
    "WER end",
    "WER end / MHA's (95 % CI)",
    "CER end",
    "ppl end",
    "s/sample (transformers)",
    "s/sample (vLLM)",
)


def table_rows(result: dict) -> list[list[str]]:
    def num(s, key, fmt):
        return format(s[key], fmt) if s and s.get(key) is not None else "—"

    lines = []
    for r in result["rows"]:
        s, f = r["start"], r["final"]
        timing = f or s
        vllm = (timing or {}).get("vllm_time_per_sample_s")
        lines.append(
            [
                r["name"],
                _heads_column(r),
                r["pooling"]
                + (f", {r['allocation']} allocation" if r["budget"] is not None else "")
                + (f", cross head = {r['cross_kv_weight']:g} self" if r.get("cross_kv_weight") is not None else "")
                + (" + distillation" if r["distillation"] else "")
                + (" from the MHA row uptrained" if r["distillation"] and r.get("teacher") == "trained" else "")
                + (" (+ encoder)" if r["attention"] != DECODER else "")
                + (", attention-weighted" if r["weighting"] != "uniform" else "")
                + (", values fit to the attention output" if r.get("value_fit", "inputs") != "inputs" else ""),
                num(s, "kv_self_bytes_per_token", ","),
                num(s, "kv_cross_bytes_per_clip", ","),
                num(s, "wer", ".1f"),
                num(s, "cer", ".1f"),
                num(s, "perplexity", ".4g"),
                "—" if r["gap_closed"] is None else f"{100 * r['gap_closed']:.0f} %",
                num(f, "wer", ".1f"),
                _ratio_column(r["final_wer_vs_mha"]),
                num(f, "cer", ".1f"),
                num(f, "perplexity", ".4g"),
                num(timing, "time_per_sample_s", ".3f"),
                f"{vllm:.3f}" if vllm is not None else "not measured",
            ]
        )
    return lines


def _ratio_column(ratio: dict | None) -> str:
    if ratio is None:
        return "—"
    return f"{ratio['ratio']:.2f} ({ratio['low']:.2f}–{ratio['high']:.2f})"


def _heads_column(r: dict) -> str:
    """G, or a budget row's budget and each layer's heads (decoder self / cross) as its cache holds them."""
    if r["budget"] is None:
        return "h (MHA)" if r["num_kv_heads"] is None else str(r["num_kv_heads"])
    s = r["start"] or {}
    lists = [s.get(k) for k in ("kv_cache_heads_per_layer", "cross_cache_heads_per_layer")]
    heads = " / ".join(",".join(map(str, x)) for x in lists) if all(lists) else "?"
    return f"budget {r['budget']:g}: {heads}"


def report(result: dict, root: Path) -> None:
    """results.md, results.csv, results.json and the two plots (what is measured so far)."""
    rows = table_rows(result)
    budget = result["budget"]
    md = [
        f"Whisper study: {result['model']}, held-out {result['score_data']}; uptraining budget "
        f"{budget['steps']} steps × {budget['batch_size']} clips = {budget['clips']} clips; — : not measured yet",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    write_file(root / "results.md", "\n".join(md) + "\n")
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(COLUMNS)
    writer.writerows(rows)
    write_file(root / "results.csv", text.getvalue())
    write_file(root / "results.json", json.dumps(result, indent=1) + "\n")
    plot(result, root)


def plot(result: dict, root: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result["rows"]:
        for when, marker in (("start", "o"), ("final", "s")):
            s = r[when]
            if s and s.get("time_per_sample_s"):
                ax.scatter(s["time_per_sample_s"], min(s["wer"], 200), marker=marker)
                ax.annotate(
                    f"{r['name']} {'α=0' if when == 'start' else 'end'}",
                    (s["time_per_sample_s"], min(s["wer"], 200)),
                    fontsize=6,
                )
    ax.set(
        xlabel="time per sample (s, transformers, CPU)",
        ylabel="WER (%) held-out, capped at 200",
        title="quality vs time (Fig. 3)",
    )
    fig.tight_layout()
    fig.savefig(root / "quality_vs_time.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result["rows"]:
        points = [(step, s["wer"]) for step, s in r["steps"].items() if s]
        if len(points) > 1:
            steps, wers = zip(*points)
            ax.plot(steps, [min(w, 200) for w in wers], marker=".", label=r["name"])
    ax.set(
        xlabel=f"uptraining steps ({result['budget']['batch_size']} clips each)",
        ylabel="WER (%), capped at 200",
        title="WER during uptraining (Fig. 5)",
    )
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "wer_vs_steps.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    from uptrain.evaluation.scores import require
    from uptrain.evaluation.tasks import TASKS

    # Every row is scored with jiwer: refuse now, not after minutes of calibration and conversion.
    asr = TASKS["asr"]
    require(asr.module, asr.package, "whisper_study.py's WER and CER (as uptrain evaluate --task asr)")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    from transformers.utils import logging

    logging.set_verbosity_error()  # generate's per-batch notes about max_length would bury the log
    result = study(args, log)
    print((Path(args.output_dir) / "results.md").read_text())
    print(json.dumps(result))


if __name__ == "__main__":
    try:
        main()
    except UptrainError as err:
        sys.exit(f"error: {err}")
