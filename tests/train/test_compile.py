"""`compile` and `fused_adamw`: the same run, compiled or not, fused or not, up to float rounding;
the checkpoints and final/ keep the plain tensor names, so a resume may switch either way."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train.test_seq2seq import s2s  # noqa: F401, F811  (the encoder–decoder fixture)
from tests.train.train_helpers import records, reset_accelerate
from uptrain import UptrainError
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training
from uptrain.train.optimizer import fused_adamw

# Compiled kernels reorder float32 sums (fused reductions, recomputed softmax); over 4 AdamW steps
# at lr 3e-3 on a 2-layer model that stays far below 1e-4 of the loss. A change in what is
# computed (a lost scale, a skipped layer, dropout on) moves the loss by > 1e-2.
LOSS_RTOL = 1e-4
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(assets, tmp_path_factory) -> Path:
    """A Llama of hidden 32 × 2 layers (4 heads, 2 KV heads) with the corpus' tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(assets["gqa"])
    folder = tmp_path_factory.mktemp("tiny32")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def settings(base_config, tiny, out: Path, **changes) -> dict:
    return {
        **base_config,
        "model": str(tiny),
        "output_dir": str(out),
        "max_steps": 4,
        "eval_every": 1,  # five evaluations: each must reuse the compiled code
        "save_every": 2,
        "eval_blocks": 6,  # 4 + 2 rows: a last eval batch of another shape
        **changes,
    }


def losses(out: Path) -> tuple[list[float], list[float]]:
    recs = records(out)
    return [r["train/loss"] for r in recs if "train/loss" in r], [r["eval/loss"] for r in recs if "eval/loss" in r]


def final_tensors(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def assert_close_runs(run: Path, reference: Path) -> None:
    (train, evals), (ref_train, ref_evals) = losses(run), losses(reference)
    assert len(train) == len(ref_train) == 4 and len(evals) == len(ref_evals) == 5
    assert all(math.isfinite(x) for x in train + evals)
    torch.testing.assert_close(torch.tensor(train + evals), torch.tensor(ref_train + ref_evals), rtol=LOSS_RTOL, atol=0)
    ours, theirs = final_tensors(run), final_tensors(reference)
    assert sorted(ours) == sorted(theirs) and not any("_orig_mod" in k for k in ours)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=WEIGHT_ATOL, rtol=0, msg=name)


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def run_counting_graphs(config: TrainConfig) -> list[int]:
    """Run `config`; the number of graphs dynamo has compiled so far, after each step."""
    torch._dynamo.reset()
    seen = []
    run_training(config, on_step=lambda step, record: seen.append(compiled_graphs()))
    return seen


@pytest.fixture(scope="module")
def eager_run(base_config_module) -> Path:
    config = TrainConfig(**base_config_module["eager"])
    run_training(config)
    reset_accelerate()
    return Path(config.output_dir)


@pytest.fixture(scope="module")
def base_config_module(assets, tiny, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("compile-runs")
    base = {
        "train_data": str(assets["train"]),
        "eval_data": str(assets["eval"]),
        "seq_len": 32,
        "batch_size": 4,
        "grad_accum": 1,
        "lr": 3e-3,
        "warmup_steps": 2,
        "seed": 0,
        "report_to": ["jsonl"],
    }
    return {"root": root, "base": base, "eager": settings(base, tiny, root / "eager")}


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_compiled_run_matches_the_eager_one(base_config_module, tiny, eager_run, tmp_path, gradient_checkpointing):
    # aot_eager: dynamo's capture and AOTAutograd's forward/backward graphs, as inductor gets them,
    # without its C++ build (minutes on a shared CPU); the inductor run is the slow test below.
    out = tmp_path / "compiled"
    config = TrainConfig(
        **settings(
            base_config_module["base"],
            tiny,
            out,
            compile=True,
            compile_backend="aot_eager",
            gradient_checkpointing=gradient_checkpointing,
        )
    )
    graphs = run_counting_graphs(config)
    assert graphs[0] > 0  # it did compile
    # Steps 2–4 and their evaluations (and the odd-sized last eval batch) reuse what step 1 and the
    # evaluations at steps 0 and 1 compiled: training, evaluation, the other batch shape.
    assert graphs == [graphs[0]] * 4, graphs
    assert_close_runs(out, eager_run)
    # The checkpoints hold the plain names too.
    step = out / "checkpoints" / "step_00000002"
    eager_step = eager_run / "checkpoints" / "step_00000002"
    assert sorted(load_file(step / "model.safetensors")) == sorted(load_file(eager_step / "model.safetensors"))


@pytest.mark.parametrize("compile_on_resume", [False, True])
def test_resume_from_a_compiled_checkpoint(base_config_module, tiny, eager_run, tmp_path, compile_on_resume):
    out = tmp_path / "run"
    first = settings(base_config_module["base"], tiny, out, compile=True, compile_backend="aot_eager")
    torch._dynamo.reset()
    with pytest.raises(SystemExit):  # killed right after the checkpoint of step 2
        run_training(TrainConfig(**first), on_step=lambda step, record: step == 2 and sys.exit(0))
    reset_accelerate()
    assert not (out / "final").exists()
    run_training(TrainConfig(**{**first, "compile": compile_on_resume, "resume": True}))
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3, 4]
    assert_close_runs(out, eager_run)


def test_fused_adamw_matches_the_default(base_config_module, tiny, eager_run, tmp_path):
    # Fused AdamW on this CPU (auto picks it on CUDA only): the same update up to rounding, and a
    # resume may switch it off (its `step` state lives on the parameters' device, the loop's on the CPU).
    out = tmp_path / "fused"
    first = settings(base_config_module["base"], tiny, out, fused_adamw=True)
    with pytest.raises(SystemExit):
        run_training(TrainConfig(**first), on_step=lambda step, record: step == 2 and sys.exit(0))
    reset_accelerate()
    run_training(TrainConfig(**{**first, "fused_adamw": False, "resume": True}))
    assert_close_runs(out, eager_run)


def test_fused_adamw_auto_is_fused_on_cuda_only():
    assert fused_adamw("auto", torch.device("cuda", 0)) is True
    assert fused_adamw("auto", torch.device("cpu")) is None  # torch's default: CPU runs bit-identical to before
    assert fused_adamw(False, torch.device("cuda")) is False and fused_adamw(True, torch.device("cpu")) is True
    with pytest.raises(UptrainError, match="fused_adamw: true runs on CUDA and CPU, not on mps"):
        fused_adamw(True, torch.device("mps"))
    from uptrain.options import keys_of

    assert next(k.default for k in keys_of(TrainConfig) if k.name == "fused_adamw") == "auto"


def test_fused_adamw_values(base_config_module, tiny, tmp_path):
    from uptrain.train.config import validated_config

    values = settings(base_config_module["base"], tiny, tmp_path / "run")
    for given, meant in (("true", True), ("False", False), (True, True), ("auto", "auto")):
        assert validated_config({**values, "fused_adamw": given}).fused_adamw == meant
    with pytest.raises(UptrainError, match=r"^invalid config: `fused_adamw`: must be auto, true or false, not 'yes'$"):
        validated_config({**values, "fused_adamw": "yes"})


def test_an_unknown_backend_is_refused_before_anything_is_written(base_config_module, tiny, tmp_path):
    out = tmp_path / "run"
    config = TrainConfig(**settings(base_config_module["base"], tiny, out, compile=True, compile_backend="nope"))
    with pytest.raises(UptrainError, match="compile_backend 'nope' is not a torch.compile backend"):
        run_training(config)
    assert not out.exists() or not any(p.name != ".uptrain-lock" for p in out.iterdir())


@pytest.mark.slow  # inductor's C++ build: 35 s cold on a quiet core here, over 100 s under the shared load
def test_inductor_run_matches_the_eager_one(base_config_module, tiny, eager_run, tmp_path):
    # The default backend, as a GPU run would use it (here its C++ CPU kernels).
    out = tmp_path / "inductor"
    graphs = run_counting_graphs(TrainConfig(**settings(base_config_module["base"], tiny, out, compile=True)))
    assert graphs[0] > 0 and graphs == [graphs[0]] * 4, graphs
    assert_close_runs(out, eager_run)


@pytest.mark.slow  # two 2-process launches that each compile: ~1–2 min on 2 shared cores
@pytest.mark.parametrize("launcher", ["ddp", "fsdp"])
def test_compiled_run_under_ddp_and_fsdp2(base_config_module, tiny, eager_run, tmp_path, launcher):
    # 2 processes × batch 2: the eager run's global batch of 4 (the loop's curve does not depend on
    # the split); DDP wraps, or FSDP2 shards, the eager model, then its layers compile in place.
    import yaml

    from tests.train.test_fsdp import explain, launch_ddp, launch_fsdp

    out = tmp_path / launcher
    values = settings(base_config_module["base"], tiny, out, compile=True, compile_backend="aot_eager", batch_size=2)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(values))
    (tmp_path / "home").mkdir()
    launch = launch_fsdp if launcher == "fsdp" else launch_ddp
    proc = launch(["-m", "uptrain", "train", "--config", str(path)], tmp_path / "home")
    assert proc.returncode == 0, explain(proc)
    assert_close_runs(out, eager_run)


@pytest.mark.parametrize("kind", ["t5", "marian"])
def test_compiled_encoder_decoder_matches_the_eager_one(s2s, tmp_path, kind):  # noqa: F811
    # T5: encoder and decoder blocks of one class, block 0 with the relative position bias;
    # Marian: pairs padded to each batch's longest (shapes change from batch to batch).
    from tests.train.test_seq2seq import run_config

    runs = {}
    for name, extra in (("eager", {}), ("compiled", {"compile": True, "compile_backend": "aot_eager"})):
        config = TrainConfig(**run_config(s2s, kind, tmp_path / name, eval_every=2, **extra))
        torch._dynamo.reset()
        run_training(config)
        reset_accelerate()
        runs[name] = Path(config.output_dir)
    (train, evals), (ref_train, ref_evals) = losses(runs["compiled"]), losses(runs["eager"])
    assert len(train) == 4 and all(math.isfinite(x) for x in train + evals)
    torch.testing.assert_close(torch.tensor(train + evals), torch.tensor(ref_train + ref_evals), rtol=LOSS_RTOL, atol=0)
    ours, theirs = final_tensors(runs["compiled"]), final_tensors(runs["eager"])
    assert sorted(ours) == sorted(theirs)
