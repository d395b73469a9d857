"""Calibration statistics for the `calibrated` merge: each layer's attention-input second moment.

The source model reads calibration text through the same datasets pipeline as training
(tokenize, join documents with EOS, pack into blocks; the first blocks in file order, so the
result is deterministic). Forward hooks fold every token's attention input x, augmented with a
constant 1 so that biases are merged too, into C = E[x xᵀ] — statistics, never activations:
memory is layers × (hidden + 1)² float64 values whatever the number of tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.convert.layouts import layout_for
from uptrain.convert.source import resolve_source
from uptrain.model_info import read_config


def calibration_device(device: str = "auto", dtype: str = "float32") -> tuple[torch.device, torch.dtype]:
    """Where and in what dtype calibration runs the source model; refuses what this machine lacks."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UptrainError(f"--calibration-device {device}: no CUDA GPU is available")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise UptrainError(f"--calibration-device {device}: this machine has {torch.cuda.device_count()} GPU(s)")
    torch_dtype = getattr(torch, dtype)
    return torch.device(device), torch_dtype


def load_calibration_tokenizer(model_dir: Path):
    """The source's tokenizer, which must have an EOS token to join documents with."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:
        raise UptrainError(f"calibration needs the source's tokenizer: {model_dir}: {type(err).__name__}") from None
    if tokenizer.eos_token_id is None:
        raise UptrainError(f"the tokenizer in {model_dir} has no EOS token to join documents with")
    return tokenizer


def collect_attention_moments(src: str | Path, data: str | list[str], num_tokens: int = 32768, seq_len: int = 256,
                              batch_size: int = 4, text_field: str = "text", sample_by: str = "paragraph",
                              device: str = "auto", dtype: str = "float32",
                              progress: bool | None = None) -> tuple[dict[int, torch.Tensor], dict]:
    """Return ({layer: C of shape [(hidden + 1), (hidden + 1)]}, a description for provenance)."""
    from transformers import AutoModelForCausalLM

    from uptrain.textdata import load_blocks

    model_dir = resolve_source(src).folder
    config = read_config(model_dir)
    layout = layout_for(config.get("model_type"))
    seq_len = min(seq_len, config.get("max_position_embeddings") or seq_len)
    tokenizer = load_calibration_tokenizer(model_dir)
    blocks, source = load_blocks(data, "calibration_data", tokenizer, seq_len, text_field=text_field, split="train",
                                 dataset_config=None, sample_by=sample_by, streaming=False, workers=None)
    wanted = math.ceil(num_tokens / seq_len)
    if len(blocks) == 0:
        raise UptrainError(f"calibration data {source.label} holds fewer than {seq_len} tokens")
    count = min(wanted, len(blocks))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hidden = config["hidden_size"]
    moments = {i: torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64) for i in range(config["num_hidden_layers"])}

    def hook_for(layer: int):
        def hook(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            x = x.reshape(-1, x.shape[-1]).to(torch.float64)
            x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
            moments[layer].addmm_(x.mT, x)
        return hook

    handles = [model.get_submodule(layout.attn_prefix.format(layer=i)).register_forward_pre_hook(
        hook_for(i), with_kwargs=True) for i in moments]
    try:
        with torch.no_grad():
            for start in range(0, count, batch_size):
                model(blocks.take(list(range(start, min(start + batch_size, count)))), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    tokens = count * seq_len
    info = {"data": source.label, "tokens": tokens, "seq_len": seq_len, "blocks": count}
    return {i: m / tokens for i, m in moments.items()}, info
