"""uptrain's FSDP path on 2 CPU processes, compared with the DDP run of the same config.

accelerate routes CPU runs to DDP even under an FSDP config; `UPTRAIN_FSDP_ON_CPU=1` turns that
into accelerate's FSDP2 path (torch's `fully_shard` over gloo), so the shipped
configs/accelerate/fsdp.yaml runs here with every FSDP-specific part of the loop: sharded
parameters and gradients, DTensor-aware clipping, the token-normalised loss reduced by
reduce-scatter, the sharded teacher, sharded save_state / load_state, and the full state dict
gathered for final/.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.train.train_helpers import CURVE, KILLER, curve, python_env, records

REPO = Path(__file__).resolve().parents[2]
FSDP_YAML = REPO / "configs" / "accelerate" / "fsdp.yaml"

# Runs a config with loop.setup wrapped: after the real setup, each process writes what it holds
# (is the teacher sharded, in bf16/fp32, in the optimizer?) to argv[2].rank{N}.json.
INSPECT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    import uptrain.train.loop as loop
    from uptrain.train.config import load_config

    real_setup = loop.setup

    def setup(config):
        run = real_setup(config)
        teacher = list(run.teacher.parameters())
        in_optimizer = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
        facts = {
            "distributed_type": str(run.accelerator.distributed_type),
            "model_sharded": all(isinstance(p, DTensor) for p in run.model.parameters()),
            "teacher_sharded": all(isinstance(p, DTensor) for p in teacher),
            "teacher_numel": sum(p.numel() for p in teacher),
            "teacher_local_numel": sum(p.to_local().numel() for p in teacher if isinstance(p, DTensor)),
            "teacher_dtypes": sorted({str(p.dtype) for p in teacher}),
            "teacher_in_optimizer": any(id(p) in in_optimizer for p in teacher),
            "teacher_trainable": any(p.requires_grad for p in teacher),
            "teacher_sharded_layers": sum(isinstance(m, FSDPModule) and type(m).__name__.endswith("DecoderLayer")
                                          for m in run.teacher.modules()),
        }
        Path(f"{sys.argv[2]}.rank{run.accelerator.process_index}.json").write_text(json.dumps(facts))
        return run

    loop.setup = setup
    loop.run_training(load_config(sys.argv[1], {}))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launch_args: list[str], args: list[str], home: Path, mixed_precision: str = "no",
           **env) -> subprocess.CompletedProcess:
    """`accelerate launch` on 2 CPU processes (DOMAIN.md §6) with extra launcher flags."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", *launch_args, "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", mixed_precision, "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), *args]
    full_env = {**python_env(), "ACCELERATE_USE_CPU": "1", "HOME": str(home), **env}
    return subprocess.run(cmd, env=full_env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)


def explain(proc: subprocess.CompletedProcess) -> str:
    """What the processes said, without torchrun's tracebacks and warnings around it."""
    keep = [line for line in (proc.stdout + proc.stderr).splitlines()
            if line.strip() and not line.startswith((" ", "W1", "E1", "[W", "Traceback", "torch.distributed"))]
    return "\n".join(keep)[-3000:]


def launch_fsdp(args: list[str], home: Path, mixed_precision: str = "no") -> subprocess.CompletedProcess:
    return launch(["--config_file", str(FSDP_YAML)], args, home, mixed_precision, UPTRAIN_FSDP_ON_CPU="1")


def launch_ddp(args: list[str], home: Path) -> subprocess.CompletedProcess:
    return launch(["--multi_gpu"], args, home)


@pytest.fixture(scope="module")
def fsdp_and_ddp(assets, tmp_path_factory):
    """The same distillation run (2 processes × 2 blocks × grad_accum 2, clipping active, a
    checkpoint at step 2) under FSDP2 and under DDP."""
    root = tmp_path_factory.mktemp("fsdp")
    (root / "home").mkdir()
    values = {"model": str(assets["gqa"]), "teacher": str(assets["mha"]), "distill_weight": 0.5,
              "train_data": str(assets["train"]), "eval_data": str(assets["eval"]), "seq_len": 32,
              "batch_size": 2, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 2, "max_steps": 4, "eval_every": 2,
              "save_every": 2, "keep_checkpoints": 1, "eval_blocks": 8, "max_grad_norm": 0.5,
              "report_to": ["jsonl"]}
    configs = {}
    for name in ("fsdp", "ddp"):
        configs[name] = root / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump({**values, "output_dir": str(root / name)}))
    script = root / "fsdp_facts.py"  # not inspect.py: that name shadows the standard library
    script.write_text(INSPECT)
    fsdp = launch_fsdp([str(script), str(configs["fsdp"]), str(root / "facts")], root / "home")
    ddp = launch_ddp(["-m", "uptrain", "train", "--config", str(configs["ddp"])], root / "home")
    return {"root": root, "values": values, "configs": configs, "fsdp": fsdp, "ddp": ddp}


@pytest.mark.slow  # two 2-process launches: ~40 s on 2 shared cores
def test_fsdp_matches_ddp(fsdp_and_ddp):
    fsdp, ddp, root = fsdp_and_ddp["fsdp"], fsdp_and_ddp["ddp"], fsdp_and_ddp["root"]
    assert fsdp.returncode == 0, explain(fsdp)
    assert ddp.returncode == 0, explain(ddp)
    assert fsdp.stdout.count("FSDP2 on CPU over gloo") == 1 and "FSDP2" not in ddp.stdout

    a, b = curve(root / "ddp"), curve(root / "fsdp")
    assert a.keys() == b.keys() == {0, 1, 2, 3, 4}
    for step in a:
        assert a[step].keys() == b[step].keys()
        for k in CURVE:
            if k in a[step]:
                # Same blocks, same token-normalised loss; the gradient norm is a sum of per-shard
                # sums under FSDP, which moves the clipping factor in the last bits.
                assert b[step][k] == pytest.approx(a[step][k], rel=1e-5, abs=1e-7), (step, k)
    losses = [r for r in records(root / "fsdp") if "train/ce_loss" in r]
    assert losses and all(r["train/distill_kl"] > 0 for r in losses)  # the teacher ran
    assert all(r["train/grad_norm"] > fsdp_and_ddp["values"]["max_grad_norm"] for r in losses)  # clipping ran

    # final/: a normal checkpoint gathered from the shards, equal to the DDP run's.
    ddp_final, fsdp_final = root / "ddp" / "final", root / "fsdp" / "final"
    assert sorted(p.name for p in fsdp_final.iterdir()) == sorted(p.name for p in ddp_final.iterdir())
    x, y = load_file(ddp_final / "model.safetensors"), load_file(fsdp_final / "model.safetensors")
    assert x.keys() == y.keys() and len(x) > 0
    for name in x:
        assert x[name].dtype == y[name].dtype and x[name].shape == y[name].shape, name
        torch.testing.assert_close(y[name], x[name], rtol=1e-5, atol=1e-6, msg=name)
    assert json.loads((fsdp_final / "config.json").read_text()) == json.loads((ddp_final / "config.json").read_text())


@pytest.mark.slow  # shares the launches above
def test_fsdp_run_holds_shards(fsdp_and_ddp):
    fsdp, root = fsdp_and_ddp["fsdp"], fsdp_and_ddp["root"]
    assert fsdp.returncode == 0, explain(fsdp)
    facts = [json.loads(Path(f"{root / 'facts'}.rank{rank}.json").read_text()) for rank in (0, 1)]
    for f in facts:
        assert f["distributed_type"] == "DistributedType.FSDP"
        assert f["model_sharded"] and f["teacher_sharded"]
        assert not f["teacher_in_optimizer"] and not f["teacher_trainable"]
        assert f["teacher_sharded_layers"] == 2  # one FSDP unit per decoder layer
        assert f["teacher_dtypes"] == ["torch.float32"]  # mixed_precision no; bf16 under bf16
    # Each process holds about half of the teacher; together exactly all of it.
    assert sum(f["teacher_local_numel"] for f in facts) == facts[0]["teacher_numel"]
    assert max(f["teacher_local_numel"] for f in facts) < 0.6 * facts[0]["teacher_numel"]

    # The checkpoint is sharded: torch.distributed.checkpoint folders with one file per process.
    [checkpoint] = list((root / "fsdp" / "checkpoints").iterdir())
    assert checkpoint.name == "step_00000002"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0",
                                                            "random_states_0.pkl", "random_states_1.pkl",
                                                            "trainer_state.json"]
    for folder in ("optimizer_0", "pytorch_model_fsdp_0"):
        assert sorted(p.name for p in (checkpoint / folder).iterdir()) == [".metadata", "__0_0.distcp",
                                                                          "__1_0.distcp"]


@pytest.mark.slow
def test_fsdp_killed_and_resumed_give_the_same_curve(fsdp_and_ddp, tmp_path):
    fsdp, root = fsdp_and_ddp["fsdp"], fsdp_and_ddp["root"]
    assert fsdp.returncode == 0, explain(fsdp)
    values = {**fsdp_and_ddp["values"], "output_dir": str(tmp_path / "killed")}
    path, script = tmp_path / "killed.yaml", tmp_path / "killer.py"
    path.write_text(yaml.safe_dump(values))
    script.write_text(KILLER)
    (tmp_path / "home").mkdir()
    killed = launch_fsdp([str(script), str(path), "3"], tmp_path / "home")
    assert killed.returncode != 0
    out = Path(values["output_dir"])
    assert max(r["step"] for r in records(out)) == 3 and (out / "checkpoints" / "step_00000002").is_dir()

    resumed = launch_fsdp(["-m", "uptrain", "train", "--config", str(path), "--resume"], tmp_path / "home")
    assert resumed.returncode == 0, explain(resumed)
    assert "resuming from" in resumed.stdout
    # Exactly: the sharded model, optimizer and RNG states come back bit for bit.
    assert curve(out) == curve(root / "fsdp")
    x, y = load_file(root / "fsdp" / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x) and x.keys() == y.keys()


@pytest.mark.slow
def test_fsdp_bf16_teacher_of_another_architecture(fsdp_and_ddp, assets, tmp_path):
    # fsdp.yaml's own mixed precision: the student keeps fp32 master shards, the teacher is
    # sharded in bf16 (bf16 autocast runs on CPUs too). The teacher is a Mistral, whose decoder
    # layers are not the student's LlamaDecoderLayer, with the same tokenizer.
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(assets["mha"])
    torch.manual_seed(1)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
                           eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    tokenizer.save_pretrained(tmp_path / "mistral")
    root = fsdp_and_ddp["root"]
    values = {**fsdp_and_ddp["values"], "teacher": str(tmp_path / "mistral"), "output_dir": str(tmp_path / "bf16")}
    path, script = tmp_path / "bf16.yaml", tmp_path / "fsdp_facts.py"
    path.write_text(yaml.safe_dump(values))
    script.write_text(INSPECT)
    (tmp_path / "home").mkdir()
    proc = launch_fsdp([str(script), str(path), str(tmp_path / "facts")], tmp_path / "home", mixed_precision="bf16")
    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"facts.rank{rank}.json").read_text())
        assert facts["teacher_sharded"] and facts["teacher_dtypes"] == ["torch.bfloat16"]
        assert not facts["teacher_in_optimizer"]
        assert facts["teacher_local_numel"] < 0.6 * facts["teacher_numel"]
        assert facts["teacher_sharded_layers"] == 2  # its own layer class, one unit each
    assert all(r["train/distill_kl"] > 0 for r in records(tmp_path / "bf16") if "train/distill_kl" in r)
    final = load_file(tmp_path / "bf16" / "final" / "model.safetensors")
    reference = load_file(root / "ddp" / "final" / "model.safetensors")
    assert final.keys() == reference.keys()
    assert all(final[k].dtype == reference[k].dtype for k in final)  # the source's dtype, not bf16
