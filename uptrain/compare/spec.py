"""What a comparison is: the `uptrain compare` schema. Light to import (no torch), so that
building the command line costs nothing the other commands would pay for.

A comparison embeds `uptrain train`'s own groups of keys (data, step, optimizer, budget,
execution, reporting, timeouts: bounds and checks included) and the conversion keys, flat as in
`uptrain train` and `uptrain convert`; a handful take a default of its own (`option_like`). Each
run's `TrainConfig` is built from those groups as they are (`CompareSpec.train_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from uptrain.budgets import UptrainingBudget
from uptrain.convert.kv_heads import allocation_cost_problem, cross_kv_weight_problem
from uptrain.convert.spec import (
    MERGE_DEFAULTS,
    Allocation,
    AllocationCost,
    ConversionOptions,
    ConversionSpec,
    MLAInit,
    RotaryKey,
    Target,
    kv_heads_option,
    merge_key_problems,
    seed_option,
)
from uptrain.data.corpus import split_path
from uptrain.evaluation.tasks import HARNESS_PREFIX, task_problem
from uptrain.options import InvalidOptions, names_of, option, option_like, validated_values
from uptrain.train.config import (
    Execution,
    Optimization,
    Reporting,
    StepShape,
    Timeouts,
    TrainConfig,
    TrainData,
    training_conversion,
)

SPEED = "speed (measured once per G after the runs, with `uptrain speed`'s method)"
# The reference model's 512 positions as a 480-token prompt + 32 new tokens, at batch 8: MHA's cache
# (50 MB) then outweighs the weights (28 MB), so decoding reads mostly cache, where fewer KV heads
# pay (docs/concepts/kv_cache.md); 32 new tokens keep the measurement a small share of the demo's time
# (measured figures: the README's demo table and BENCHMARKS.md).
SPEED_CONTEXT, SPEED_NEW_TOKENS = 480, 32
TASKS = "task metrics (each run's final/ scored with `uptrain evaluate` after the runs)"
# `uptrain train`'s groups that every run of a comparison takes as they are.
TRAINED_ALIKE = (TrainData, StepShape, Optimization, UptrainingBudget, Execution, Reporting, Timeouts)


def _speed_option(default, metavar: str, help: str, **bounds):
    """An option of the speed measurement, listed under SPEED in --help."""
    return option(default, group=SPEED, metavar=metavar, help=help, **bounds)


@dataclass(kw_only=True)
class CompareSpec(
    Timeouts, Reporting, Execution, UptrainingBudget, Optimization, StepShape, TrainData, ConversionOptions
):
    """Every (G, pooling) and (KV budget, allocation, pooling) run of one comparison, trained
    alike: `uptrain train`'s keys of `TRAINED_ALIKE` (the budget under the same rule) and the
    conversion keys, then the comparison's own."""

    model: str = option(help="the MHA (or GQA) checkpoint folder")
    num_kv_heads: list[int] = kv_heads_option(
        [], "KV head counts to try, every layer alike (and/or --kv-budget)", flags=("-g",)
    )
    # `uptrain convert`'s --kv-budget and --allocation, several of each: one run per (budget,
    # allocation, pooling), beside the runs per (G, pooling).
    kv_budget: list[float] = option_like(
        ConversionSpec,
        "kv_budget",
        [],
        help="KV budgets to try, each a fraction of the source's KV bytes per token (0.25 0.125), spent per "
        "layer as each --allocation says",
    )
    allocation: list[Allocation] = option_like(
        ConversionSpec,
        "allocation",
        ["uniform"],
        help="how each --kv-budget is spent: uniform (one G, which must give the budget exactly) and/or calibrated "
        "(each layer's KV heads chosen by --allocation-cost on the training data)",
    )
    allocation_cost: AllocationCost | None = option_like(ConversionSpec, "allocation_cost", None)
    cross_kv_weight: float | None = option_like(ConversionSpec, "cross_kv_weight", None)
    # `uptrain convert --target`, several: each --kv-budget is spent on GQA heads (the runs per
    # allocation and pooling) and/or on a latent (one run per --mla-init), at the same KV bytes.
    target: list[Target] = option_like(
        ConversionSpec,
        "target",
        ["gqa"],
        help="what each --kv-budget becomes: gqa (KV heads: one run per --allocation and --pooling) and/or mla "
        "(multi-head latent attention, Llama family: one run per --mla-init, its rank what the budget leaves after "
        "the rotary key); -g runs are GQA's",
    )
    mla_init: list[MLAInit] = option_like(
        ConversionSpec,
        "mla_init",
        ["svd", "calibrated"],
        help="--target mla: the latent initialisations to try, one run each: svd (weight space) and/or calibrated "
        "(calibrated on train_data, as calibrated pooling is)",
    )
    rope_dims: int | None = option_like(ConversionSpec, "rope_dims", None)
    rope_stride: int = option_like(ConversionSpec, "rope_stride", 1)
    rope_residual: int = option_like(ConversionSpec, "rope_residual", 0)
    rotary_key: RotaryKey = option_like(
        ConversionSpec,
        "rotary_key",
        "principal",
        help="--target mla: the one rotary key all heads share, as `uptrain convert --rotary-key`; calibrated "
        "applies to the --mla-init calibrated runs (the svd runs read no data: theirs is principal)",
    )
    # The conversion's `pooling`, several strategies: one run each.
    pooling: list[str] = option_like(
        ConversionOptions,
        "pooling",
        ["mean", "first", "random"],
        help="strategies to try (calibrated is calibrated on train_data)",
    )
    train_data: str | list[str] = option_like(
        TrainData, "train_data", str(split_path("train")), help="uptraining text (the default: the shipped corpus)"
    )
    eval_data: str | list[str] = option_like(
        TrainData, "eval_data", str(split_path("validation")), help="evaluation text (the default: the shipped corpus)"
    )
    seq_len: int = option_like(StepShape, "seq_len", 256)
    batch_size: int = option_like(StepShape, "batch_size", 8)
    lr: float = option_like(Optimization, "lr", 1e-3)
    warmup_steps: int = option_like(Optimization, "warmup_steps", 10)
    output_dir: str = option(help="runs, results and plots go here")
    eval_every: int = option_like(TrainConfig, "eval_every", 10, help="evaluate (and checkpoint) every N steps")
    seed: int = seed_option("seed of data order, initialisation and random pooling")
    speed_context: int | None = _speed_option(
        None,
        "N",
        f"prompt tokens of the speed measurement (default: {SPEED_CONTEXT}, or the model's positions less the "
        "new tokens where that is fewer): the cache, and so what fewer KV heads save, grows with it",
        at_least=1,
    )
    speed_new_tokens: int | None = _speed_option(
        None,
        "M",
        f"tokens generated greedily after the prompt, with the cache (default: {SPEED_NEW_TOKENS}, or an eighth "
        "of the model's positions where that is fewer); time per sample is the prompt's pass plus these",
        at_least=2,
    )
    speed_batch: int = _speed_option(
        8,
        "B",
        "sequences decoded together: the cache grows with the batch, the weights read per step do not (at "
        "batch 8 and 512 positions the reference model's MHA cache is twice its weights)",
        at_least=1,
    )
    speed_repeats: int = _speed_option(
        2,
        "R",
        "timed samples per checkpoint after one warm-up, reported as their median; each takes seconds for "
        "the reference model on 2 CPU cores; 0: no speed measurement, the columns stay empty",
        at_least=0,
    )
    speed_device: str = _speed_option(
        "cpu", "DEVICE", "device of the speed measurement: cpu, cuda or cuda:N (float32 on CPU, bfloat16 on CUDA)"
    )
    task: list[str] = option(
        [],
        group=TASKS,
        metavar="TASK",
        check=task_problem,
        help="tasks to score every run's uptrained checkpoint on, as `uptrain evaluate --task` does: asr, "
        "translation, summarization, qa, lm-eval:NAME (one table column each, the Table-1 view, a quality vs "
        "time per sample plot each); none by default",
    )
    task_data: list[str] = option(
        [],
        group=TASKS,
        metavar="FILE",
        help="local JSON-lines data of each --task, in their order (lm-eval tasks take none: their task names it)",
    )
    task_max_new_tokens: int | None = option(
        None, at_least=1, group=TASKS, metavar="N", help="most tokens generated per example (default: evaluate's)"
    )
    task_batch_size: int = option(8, at_least=1, group=TASKS, metavar="B", help="examples generated together")
    task_limit: int | None = option(None, at_least=1, group=TASKS, metavar="N", help="score the first N examples only")
    task_device: str = option(
        "cpu", group=TASKS, metavar="DEVICE", help="device of the task scoring: cpu, cuda or cuda:N"
    )
    overwrite: bool = option(
        False, help="delete an earlier compare in output_dir (or whatever else it holds) and start over"
    )

    def problems(self) -> list[str]:
        found = super().problems()
        if not self.num_kv_heads and not self.kv_budget:
            found.append("give the runs to compare: -g/--num-kv-heads G … and/or --kv-budget F …")
        if set(self.allocation) != {"uniform"} and not self.kv_budget:
            found.append(f"--allocation {' '.join(self.allocation)} spends a --kv-budget; give one (--kv-budget F …)")
        found += self._target_problems()
        if "gqa" in self.target:
            found += merge_key_problems(self, self.pooling)
        spent = "calibrated" if "calibrated" in self.allocation else "uniform"
        if (problem := allocation_cost_problem(spent, self.allocation_cost)) is not None:
            found.append(problem)
        if (problem := cross_kv_weight_problem(self.kv_budget or None, self.cross_kv_weight)) is not None:
            found.append(problem)
        for flag, values in (
            ("--kv-budget", self.kv_budget),
            ("--allocation", self.allocation),
            ("--target", self.target),
            ("--mla-init", self.mla_init),
        ):
            if len(set(values)) != len(values):
                found.append(f"{flag} {' '.join(map(str, values))} names a value twice (each is one run)")
        wanted = sum(not t.startswith(HARNESS_PREFIX) for t in self.task)
        if len(self.task_data) != wanted:
            found.append(
                f"`task_data`: give one file for each --task but lm-eval ones ({wanted}), in their order; "
                f"got {len(self.task_data)}"
            )
        return found

    def _target_problems(self) -> list[str]:
        """What --target refuses: MLA runs without a budget or beside -g (G counts KV heads, which a
        latent has none of), and each target's own keys without that target."""
        found = []
        if "mla" in self.target:
            if self.num_kv_heads:
                found.append(
                    "-g/--num-kv-heads counts GQA heads, which --target mla has none of: give the MLA runs' KV bytes "
                    "as --kv-budget F (G heads' bytes are F = G / the source's KV heads)"
                )
            elif not self.kv_budget:
                found.append("--target mla spends a --kv-budget: give one (--kv-budget F …)")
        else:
            latent = {
                "--mla-init": self.mla_init != ["svd", "calibrated"],
                "--rope-dims": self.rope_dims is not None,
                "--rope-stride": self.rope_stride != 1,
                "--rope-residual": self.rope_residual != 0,
                "--rotary-key": self.rotary_key != "principal",
            }
            if given := [flag for flag, set_ in latent.items() if set_]:
                found.append(f"{', '.join(given)} shape(s) the MLA runs: give them with --target mla")
        if "gqa" not in self.target and (set(self.allocation) != {"uniform"} or self.allocation_cost is not None):
            found.append("--allocation and --allocation-cost spend a budget on GQA heads: give them with --target gqa")
        merge = [key for key, default in MERGE_DEFAULTS.items() if getattr(self, key) != default]
        if "gqa" not in self.target and merge:
            flags = ", ".join(f"--{key.replace('_', '-')}" for key in merge)
            found.append(f"{flags} shape(s) the GQA runs' merge: give them with --target gqa")
        return found

    def conversion_spec(self, num_kv_heads: int, pooling: str) -> ConversionSpec:
        """The conversion of one run (calibrated on the training data, as `uptrain train` does)."""
        return training_conversion(self, source=self.model, num_kv_heads=num_kv_heads, pooling=pooling)

    def budget_conversion_spec(self, kv_budget: float, allocation: str, pooling: str) -> ConversionSpec:
        """The conversion of one budget run: `uptrain convert --kv-budget F --allocation A` (the
        compare's --allocation-cost for a calibrated allocation), calibrated on the training data."""
        cost = self.allocation_cost if allocation == "calibrated" else None
        return training_conversion(
            self,
            source=self.model,
            num_kv_heads=None,
            kv_budget=kv_budget,
            allocation=allocation,
            allocation_cost=cost,
            cross_kv_weight=self.cross_kv_weight,
            pooling=pooling,
        )

    def latent_conversion_spec(self, kv_budget: float, mla_init: str) -> ConversionSpec:
        """The conversion of one MLA run: `uptrain convert --target mla --kv-budget F --mla-init I`
        with the compare's --rope-dims, --rope-stride, --rope-residual and --rotary-key (principal for
        svd, which reads no data), the GQA route's keys at their defaults, calibrated (I = calibrated)
        on the training data."""
        rotary_key = "principal" if mla_init == "svd" and self.rotary_key == "calibrated" else self.rotary_key
        gqa_only = {"pooling": "mean", "grouping": "contiguous", "allocation": "uniform", "allocation_cost": None}
        latent = {"target": "mla", "mla_init": mla_init, "rope_dims": self.rope_dims, "rotary_key": rotary_key}
        latent |= {"rope_stride": self.rope_stride, "rope_residual": self.rope_residual}
        if mla_init != "calibrated":  # reads no calibration data
            latent["calibration_data"] = None
        return training_conversion(
            self, source=self.model, num_kv_heads=None, kv_budget=kv_budget, **gqa_only, **MERGE_DEFAULTS, **latent
        )

    def train_config(self, model: str | Path, output_dir: str | Path, run: str, group: str | None = None):
        """The `uptrain train` config (`TrainConfig`) of the run named `run`: the keys of
        `TRAINED_ALIKE` as they are, checkpoints where it evaluates, resumed when its folder
        exists. One UptrainError naming every bad key."""
        values = {name: getattr(self, name) for name in names_of(*TRAINED_ALIKE)}
        values.update(
            model=str(model),
            output_dir=str(output_dir),
            eval_every=self.eval_every,
            save_every=self.eval_every,
            seed=self.seed,
            run_name=f"{Path(self.output_dir).name}/{run}",
            wandb_group=group,
            resume=Path(output_dir).exists(),
        )
        try:
            return validated_values(TrainConfig, values, "compare")
        except InvalidOptions as err:  # compare's keys are options (flags), not a config file's
            raise InvalidOptions(err.problems) from None
