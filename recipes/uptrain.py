"""Recipe: uptrain a GQA checkpoint (converting it first with `source`), then report what came back.

    python recipes/uptrain.py --config configs/llama-68m_gqa4_cpu.yaml
    accelerate launch --config_file configs/accelerate/fsdp.yaml recipes/uptrain.py --config configs/llama2-7b_gqa8.yaml

Takes every `uptrain train` key as a flag. After training it prints the evaluation loss right
after conversion (α = 0) and after uptraining, and the KV cache saved per token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from uptrain import UptrainError
from uptrain.model_info import attention_geometry, read_config
from uptrain.train.config import TrainConfig, add_config_arguments, config_from_args


def setup(argv: list[str] | None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def train(config: TrainConfig) -> Path:
    from uptrain.train.loop import run_training

    return run_training(config)


def report(config: TrainConfig, final: Path) -> str:
    """α = 0 vs uptrained eval loss, and the KV-cache saving against the source checkpoint."""
    records = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/loss" in r]
    start, end = evals[0], evals[-1]
    ours = records[-1]
    lines = [
        f"eval loss: {start['eval/loss']:.4f} at α = 0 → {end['eval/loss']:.4f} after {end['step']} steps "
        f"({end.get('train/tokens_seen', 0):,} tokens; perplexity {start['eval/perplexity']:.4g} → "
        f"{end['eval/perplexity']:.4g})"
    ]
    origin = config.source or config.model
    if origin and Path(origin, "config.json").is_file():
        before = attention_geometry(read_config(origin))
        per_token = ours["model/kv_cache_bytes_per_token"]
        saved = before.kv_cache_bytes_per_token(1, before.num_kv_heads) / before.kv_cache_bytes_per_token(
            1, ours["model/num_kv_heads"]
        )
        lines.append(
            f"KV heads: {before.num_kv_heads} → {ours['model/num_kv_heads']} ({per_token:,} bytes per "
            f"token, {saved:.3g}× smaller than {origin})"
        )
    lines.append(f"uptrained model: {final}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        config = setup(argv)
        final = train(config)
    except UptrainError as err:
        print(f"uptrain recipe: error: {err}", file=sys.stderr)
        return 2
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(report(config, final))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
