"""`uptrain demo`: build a small MHA Llama checkpoint, convert it to every G, check each loads.

The weights are random, so the logit differences below say how far pooling moves an
untrained model, not what quality a trained one keeps; the quality study needs a trained
MHA model and uptraining (`uptrain compare`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from uptrain.convert import convert_checkpoint
from uptrain.convert.synthetic import write_synthetic_llama
from uptrain.inspect_checkpoint import human_bytes
from uptrain.model_info import attention_geometry, read_config


def run_demo(output_dir: str | Path, overwrite: bool = False) -> list[dict]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one loading bar per checkpoint buries the table
    output_dir = Path(output_dir)
    if output_dir.exists():
        if not overwrite:
            from uptrain import UptrainError

            raise UptrainError(f"{output_dir} already exists; pass --overwrite to replace it")
        shutil.rmtree(output_dir)
    source = write_synthetic_llama(output_dir / "mha", hidden=256, heads=8, layers=4, intermediate=512,
                                   vocab=1024, dtype=torch.float32, max_shard_bytes=4_000_000)
    geometry = attention_geometry(read_config(source))
    ids = torch.randint(3, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(source).eval()(ids).logits
    rows = []
    for g in reversed(geometry.valid_num_kv_heads()):
        out = convert_checkpoint(source, output_dir / f"gqa-{g}", g, progress=False)
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            result = model(ids, use_cache=True)
        rows.append({
            "num_kv_heads": g,
            "cached_heads": result.cache.layers[0].keys.shape[1],
            "kv_cache_bytes_per_token": geometry.kv_cache_bytes_per_token(4, g),
            "max_logit_change": (result.logits - reference).abs().max().item(),
            "path": str(out),
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'G':>3} {'cached heads':>12} {'KV bytes/token':>15} {'max |Δ logit|':>14}  checkpoint"]
    for r in rows:
        lines.append(f"{r['num_kv_heads']:>3} {r['cached_heads']:>12} {human_bytes(r['kv_cache_bytes_per_token']):>15} "
                     f"{r['max_logit_change']:>14.4f}  {r['path']}")
    return "\n".join(lines)
