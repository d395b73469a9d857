"""How the weights move: the learning-rate schedule, AdamW's parameter groups, and which of
torch's AdamW implementations runs (`fused_adamw`)."""

from __future__ import annotations

import math

import torch

from uptrain import UptrainError
from uptrain.train.config import TrainConfig


def lr_at(config: TrainConfig, step: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (from 0): linear warmup, then cosine to min_lr_ratio·lr."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def adamw(config: TrainConfig, model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    """The run's AdamW over `model`'s trainable parameters, for the device they will train on."""
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        fused=fused_adamw(config.fused_adamw, device),
    )


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two groups: the matrices with `weight_decay`, the rest without."""
    # Decay matrices only: decaying norm scales and biases towards 0 fights what they encode.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def fused_adamw(setting: str | bool, device: torch.device) -> bool | None:
    """AdamW's `fused` argument for `fused_adamw` on `device`. None leaves torch's default: on CPU
    the single-tensor loop every earlier run used (so CPU results stay bit-identical), on CUDA
    foreach. The parameters are still on the CPU when the optimizer is built (accelerate's
    prepare moves them), so the choice is made from the device they will train on."""
    if setting == "auto":
        return True if device.type == "cuda" else None
    if setting and device.type not in ("cuda", "cpu"):
        raise UptrainError(f"fused_adamw: true runs on CUDA and CPU, not on {device.type}; use auto or false")
    return setting
