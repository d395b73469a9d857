"""What a comparison is: the `uptrain compare` schema. Light to import (no torch), so that
building the command line costs nothing the other commands would pay for."""

from __future__ import annotations

from dataclasses import dataclass

from uptrain.budgets import UptrainingBudget
from uptrain.convert.spec import ConversionOptions, ConversionSpec, conversion_spec, seed_option, strategies
from uptrain.corpus import split_path
from uptrain.options import keys_of, option

SPEED = "speed (measured once per G after the runs, with `uptrain speed`'s method)"
# The reference model's 512 positions as a 480-token prompt + 32 new tokens, at batch 8: MHA's cache
# (50 MB) then outweighs the weights (28 MB), so decoding reads mostly cache, where fewer KV heads
# pay (docs/DOMAIN.md §2); 32 new tokens keep the measurement a small share of the demo's time
# (measured figures: the README's demo table and BENCHMARKS.md).
SPEED_CONTEXT, SPEED_NEW_TOKENS = 480, 32


@dataclass(kw_only=True)
class CompareSpec(UptrainingBudget):
    """Every (G, pooling) run of one comparison, trained alike; the budget keys are `uptrain
    train`'s, under the same rule."""

    model: str = option(help="the MHA (or GQA) checkpoint folder")
    num_kv_heads: list[int] = option(metavar="G", help="KV head counts to try")
    pooling: list[str] = option(
        ["mean", "first", "random"],
        choices=strategies,
        help="strategies to try (calibrated is calibrated on train_data)",
    )
    train_data: str = option(str(split_path("train")), help="uptraining text (the default: the shipped corpus)")
    eval_data: str = option(str(split_path("validation")), help="evaluation text (the default: the shipped corpus)")
    output_dir: str = option(help="runs, results and plots go here")
    seq_len: int = option(256, help="tokens per packed block")
    batch_size: int = option(8, help="blocks per step")
    lr: float = option(1e-3, help="peak learning rate")
    warmup_steps: int = option(10, help="linear warmup steps")
    eval_every: int = option(10, help="evaluate (and checkpoint) every N steps")
    eval_blocks: int = option(64, help="eval blocks of seq_len tokens")
    objective: str | None = option(None, help="what every run learns, as `uptrain train`'s (default: by the model)")
    seed: int = seed_option("seed of data order, initialisation and random pooling")
    report_to: list[str] = option(
        ["wandb", "jsonl"], choices=("wandb", "jsonl", "none"), help="wandb, jsonl, none (several allowed)"
    )
    speed_context: int | None = option(
        None,
        at_least=1,
        group=SPEED,
        metavar="N",
        help=f"prompt tokens of the speed measurement (default: {SPEED_CONTEXT}, or the model's positions less the "
        "new tokens where that is fewer): the cache, and so what fewer KV heads save, grows with it",
    )
    speed_new_tokens: int | None = option(
        None,
        at_least=2,
        group=SPEED,
        metavar="M",
        help=f"tokens generated greedily after the prompt, with the cache (default: {SPEED_NEW_TOKENS}, or an eighth "
        "of the model's positions where that is fewer); time per sample is the prompt's pass plus these",
    )
    speed_batch: int = option(
        8,
        at_least=1,
        group=SPEED,
        metavar="B",
        help="sequences decoded together: the cache grows with the batch, the weights read per step do not (at "
        "batch 8 and 512 positions the reference model's MHA cache is twice its weights)",
    )
    speed_repeats: int = option(
        2,
        at_least=0,
        group=SPEED,
        metavar="R",
        help="timed samples per checkpoint after one warm-up, reported as their median; each takes seconds for "
        "the reference model on 2 CPU cores; 0: no speed measurement, the columns stay empty",
    )
    speed_device: str = option(
        "cpu",
        group=SPEED,
        metavar="DEVICE",
        help="device of the speed measurement: cpu, cuda or cuda:N (float32 on CPU, bfloat16 on CUDA)",
    )
    overwrite: bool = option(
        False, help="delete an earlier compare in output_dir (or whatever else it holds) and start over"
    )
    # Shared by every conversion; `pooling` above replaces its pooling.
    conversion: ConversionOptions = option(
        ConversionOptions,
        keys=("grouping", "calibration_tokens", "calibration_device", "calibration_dtype"),
        help="grouping and calibration of every conversion (calibration reads train_data)",
    )

    def conversion_spec(self, num_kv_heads: int, pooling: str) -> ConversionSpec:
        """The conversion of one run (calibrated on the training data, as `uptrain train` does)."""
        shared = {k.name: getattr(self.conversion, k.name) for k in keys_of(ConversionOptions) if k.name != "pooling"}
        return conversion_spec(
            source=self.model,
            num_kv_heads=num_kv_heads,
            pooling=pooling,
            seed=self.seed,
            calibration_data=self.train_data,
            calibration_seq_len=self.seq_len,
            **shared,
        )

    def budget(self) -> dict:
        """The budget keys, as `TrainConfig` takes them."""
        return {k.name: getattr(self, k.name) for k in keys_of(UptrainingBudget)}
