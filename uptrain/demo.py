"""`uptrain demo`: the paper's pooling study on a shipped reference model, in about ten minutes.

The reference model is a small MHA Llama that uptrain pretrained itself on the shipped corpus
for a recorded number of tokens, so α = 5% of its pretraining is exact. The demo converts it to
G = 2 and G = 1 (MQA) with mean, first and random pooling, uptrains each for α = 5%, and
trains the MHA model for the same budget as the reference. Beside quality it measures each G's
speed (time per sample, decode tokens/s, KV-cache bytes) at compare's speed defaults, which are
fitted to this model: its 512 positions at batch 8, where MHA's cache outweighs its weights; the
table says on what machine.

Uptraining learning rate 6e-4 (pretraining ended its cosine at 2e-4): one α = 5% run each of
G = 2 mean pooling at 3e-4 / 6e-4 / 1e-3 ended at eval loss 4.815 / 4.792 / 4.813, and the MHA
model trained alike at 4.652 / 4.690 / 4.744 (4.634 before): re-warming the rate costs the
already-converged MHA model a little and helps the converted ones recover.

`--reference t5` runs the same study in the paper's own setting: the shipped MHA T5 v1.1
(`uptrain/assets/reference_t5/`, pretrained by uptrain with span corruption for a recorded number of
tokens) converted in its decoder's self- and cross-attention, uptrained with span corruption
for α = 5%, timed by encoding a source once and decoding with both caches.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError
from uptrain.compare.spec import CompareSpec
from uptrain.data.corpus import split_path
from uptrain.options import Schema, option

REFERENCE = Path(__file__).parent / "assets" / "reference"
REFERENCE_T5 = Path(__file__).parent / "assets" / "reference_t5"
REFERENCES = {"llama": REFERENCE, "t5": REFERENCE_T5}
SCRIPTS = {"llama": "scripts/make_reference_model.py", "t5": "scripts/make_reference_t5.py"}


@dataclass(kw_only=True)
class DemoOptions(Schema):
    """`uptrain demo`."""

    reference: str = option(
        "llama",
        choices=tuple(REFERENCES),
        help="the shipped reference model: llama (decoder-only, 6.9M parameters) or t5 (the paper's "
        "encoder–decoder setting: a T5 v1.1 pretrained with span corruption)",
    )
    output_dir: str | None = option(
        None, help="runs, results and plots (default: demo-output, or demo-t5-output with --reference t5)"
    )
    overwrite: bool = option(False, help="discard an earlier demo in the output dir")


def demo_spec(output_dir: str | Path | None = None, reference: str = "llama") -> CompareSpec:
    """The demo's comparison on the `reference` model (llama or t5)."""
    if reference not in REFERENCES:
        raise UptrainError(f"--reference {reference!r}: choose {' or '.join(REFERENCES)}")
    folder = REFERENCES[reference]
    if not (folder / "model.safetensors").exists():
        raise UptrainError(f"the reference model is missing from {folder}; make it with `python {SCRIPTS[reference]}`")
    if reference == "t5":
        return t5_demo_spec(output_dir or "demo-t5-output")
    return _pooling_study(
        REFERENCE,
        output_dir or "demo-output",
        seq_len=256,
        batch_size=16,
        lr=6e-4,
        warmup_steps=4,
        eval_every=6,
    )


def t5_demo_spec(output_dir: str | Path) -> CompareSpec:
    """The study on the reference T5: G = 2 (4 query heads per KV head) and G = 1 (MQA) of its 8
    heads, in the decoder's self- and cross-attention
    (the paper's choice, conversion's default), uptrained with span corruption on blocks of the
    pretraining's shape (128 input tokens) for α = 5%."""
    return _pooling_study(
        REFERENCE_T5,
        output_dir,
        objective="span_corruption",
        seq_len=128,
        batch_size=8,
        lr=1e-3,
        warmup_steps=2,
        eval_every=5,
    )


def _pooling_study(model: Path, output_dir: str | Path, **training) -> CompareSpec:
    """The demo's study of `model`: G = 2 and G = 1 with mean, first and random pooling on the
    shipped corpus, each uptrained for α = 5% and evaluated on 64 blocks (`training`: the rest,
    fitted to the model)."""
    return CompareSpec(
        model=str(model),
        num_kv_heads=[2, 1],
        pooling=["mean", "first", "random"],
        train_data=str(split_path("train")),
        eval_data=str(split_path("validation")),
        output_dir=str(output_dir),
        uptrain_fraction=0.05,
        eval_blocks=64,
        **training,
    )


def prepare_output(output_dir: str | Path, overwrite: bool) -> None:
    """A finished or interrupted demo in `output_dir` is picked up; --overwrite starts afresh."""
    output_dir = Path(output_dir)
    if overwrite and output_dir.exists():
        shutil.rmtree(output_dir)
