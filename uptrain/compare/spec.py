"""What a comparison is: the `uptrain compare` schema. Light to import (no torch), so that
building the command line costs nothing the other commands would pay for."""

from __future__ import annotations

from dataclasses import dataclass

from uptrain.budgets import UptrainingBudget
from uptrain.convert.spec import ConversionOptions, ConversionSpec, conversion_spec, seed_option, strategies
from uptrain.corpus import split_path
from uptrain.options import keys_of, option


@dataclass(kw_only=True)
class CompareSpec(UptrainingBudget):
    """Every (G, pooling) run of one comparison, trained alike; the budget keys are `uptrain
    train`'s, under the same rule."""

    model: str = option(help="the MHA (or GQA) checkpoint folder")
    num_kv_heads: list[int] = option(metavar="G", help="KV head counts to try")
    pooling: list[str] = option(["mean", "first", "random"], choices=strategies,
                                help="strategies to try (calibrated is calibrated on train_data)")
    train_data: str = option(str(split_path("train")), help="uptraining text (the default: the shipped corpus)")
    eval_data: str = option(str(split_path("validation")), help="evaluation text (the default: the shipped corpus)")
    output_dir: str = option(help="runs, results and plots go here")
    seq_len: int = option(256, help="tokens per packed block")
    batch_size: int = option(8, help="blocks per step")
    lr: float = option(1e-3, help="peak learning rate")
    warmup_steps: int = option(10, help="linear warmup steps")
    eval_every: int = option(10, help="evaluate (and checkpoint) every N steps")
    eval_blocks: int = option(64, help="eval blocks of seq_len tokens")
    seed: int = seed_option("seed of data order, initialisation and random pooling")
    report_to: list[str] = option(["wandb", "jsonl"], choices=("wandb", "jsonl", "none"),
                                  help="wandb, jsonl, none (several allowed)")
    overwrite: bool = option(False, help="delete an earlier compare in output_dir (or whatever else it holds) and "
                                         "start over")
    # Shared by every conversion; `pooling` above replaces its pooling.
    conversion: ConversionOptions = option(ConversionOptions, keys=("grouping", "calibration_tokens",
                                                                    "calibration_device", "calibration_dtype"),
                                           help="grouping and calibration of every conversion (calibration reads "
                                                "train_data)")

    def conversion_spec(self, num_kv_heads: int, pooling: str) -> ConversionSpec:
        """The conversion of one run (calibrated on the training data, as `uptrain train` does)."""
        shared = {k.name: getattr(self.conversion, k.name) for k in keys_of(ConversionOptions) if k.name != "pooling"}
        return conversion_spec(source=self.model, num_kv_heads=num_kv_heads, pooling=pooling, seed=self.seed,
                               calibration_data=self.train_data, calibration_seq_len=self.seq_len, **shared)

    def budget(self) -> dict:
        """The budget keys, as `TrainConfig` takes them."""
        return {k.name: getattr(self, k.name) for k in keys_of(UptrainingBudget)}
