"""The Whisper study with the decoder's K/V projections at a multiple of the learning rate: does a
merged K/V need to move further than the weights conversion left alone? (An experiment for #31.)

    python scripts/whisper_kv_lr.py --kv-lr-scale 10 -- --model whisper-base --train-data … \
        --output-dir whisper-study-kv10 --kv-heads 4 --poolings calibrated --uptrain mha g4-calibrated

Everything after `--` is `scripts/whisper_study.py`'s command line. Every row's uptraining, the MHA
row's too (the rows stay trained alike), runs AdamW with the weights and biases of the decoder's
self- and cross-attention `k_proj` / `v_proj` at `--kv-lr-scale` × the schedule's learning rate,
every other weight as the study trains it. The study's compare does not record the scale, so an
output folder that already holds uptrained runs is refused: start from a copy of a study folder
without `compare/runs` (its α = 0 scores, conversions and calibration are reused as they are).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.train import optimizer as optimizer_module

# Whisper's decoder K/V projections, self- and cross-attention (transformers' and uptrain's names).
DECODER_KV = re.compile(r"(^|\.)decoder\.layers\.\d+\.(self_attn|encoder_attn)\.(k_proj|v_proj)\.")


def kv_scaled_adamw(scale: float):
    """`uptrain.train.optimizer.adamw` with the decoder's K/V split off its groups into groups of
    their own (the same settings) at `scale` × lr."""

    def adamw(config, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
        optimizer = optimizer_module.adamw(config, model, device)
        kv = {id(param) for name, param in model.named_parameters() if DECODER_KV.search(name)}
        if not kv:
            raise UptrainError("--kv-lr-scale: the model has no decoder.layers.N.{self_attn,encoder_attn}.{k,v}_proj")
        for group in list(optimizer.param_groups):  # before any step: no state to move
            scaled = [param for param in group["params"] if id(param) in kv]
            group["params"] = [param for param in group["params"] if id(param) not in kv]
            if scaled:
                settings = {key: value for key, value in group.items() if key != "params"}
                optimizer.add_param_group({**settings, "params": scaled, "lr_scale": scale})
        plain_step = optimizer.step

        # The loop sets every group's lr each step, and accelerate's prepare reloads the state dict
        # (new group dicts, "lr_scale" kept): the scale is applied inside the step only.
        def step(*args, **kwargs):
            scheduled = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] *= group.get("lr_scale", 1)
            try:
                return plain_step(*args, **kwargs)
            finally:
                for group, lr in zip(optimizer.param_groups, scheduled):
                    group["lr"] = lr

        optimizer.step = step
        return optimizer

    return adamw


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-lr-scale", type=float, required=True, help="the decoder K/V's multiple of the lr")
    parser.add_argument("study", nargs=argparse.REMAINDER, help="-- then whisper_study.py's arguments")
    args = parser.parse_args(argv)
    study_argv = args.study[1:] if args.study[:1] == ["--"] else args.study
    if not args.kv_lr_scale > 0:
        parser.error(f"--kv-lr-scale {args.kv_lr_scale}: give a positive multiple")
    import whisper_study  # beside this script: the first entry of sys.path when it runs

    output_dir = Path(whisper_study.parse_args(study_argv).output_dir)
    if (output_dir / "compare" / "runs").exists():
        raise UptrainError(
            f"{output_dir} holds uptrained runs, whose K/V learning rate this script cannot tell: "
            "give a copy without compare/runs"
        )
    import uptrain.train.setup

    uptrain.train.setup.adamw = kv_scaled_adamw(args.kv_lr_scale)
    whisper_study.main(study_argv)


if __name__ == "__main__":
    try:
        main()
    except UptrainError as err:
        sys.exit(f"error: {err}")
