"""uptrain's FSDP path on 2 CPU processes, compared with the DDP run of the same config.

accelerate routes CPU runs to DDP even under an FSDP config; the test-only launcher
`fsdp_on_cpu.py` beside this file turns that into accelerate's FSDP2 path (torch's `fully_shard`
over gloo), so the shipped configs/accelerate/fsdp.yaml runs here with every FSDP-specific part
of the loop: sharded parameters and gradients, DTensor-aware clipping, the token-normalised loss
reduced by reduce-scatter, the sharded teacher, sharded save_state / load_state, and the full
state dict gathered for final/. The tests check each of those where it shows (the parameters
each process holds, the files each process wrote), not that the launcher did what it does.
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
FSDP_ON_CPU = Path(__file__).with_name("fsdp_on_cpu.py")
SHARD_FILES = {"__0_0.distcp", "__1_0.distcp"}  # torch.distributed.checkpoint: one file per process

# Runs a config with loop.setup wrapped: after the real setup, each process writes what it holds
# (how much of each parameter, in which dtype, trainable or not) to argv[2].rank{N}.json.
INSPECT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    import uptrain.train.loop as loop
    from uptrain.train.config import load_config

    real_setup = loop.setup

    def held(params):
        dtensors = [p for p in params if isinstance(p, DTensor)]
        return {"count": len(params), "not_dtensor": len(params) - len(dtensors),
                "numel": sum(p.numel() for p in params),  # a DTensor's numel is the whole parameter's
                "local_numel": sum(p.to_local().numel() for p in dtensors),
                "mesh_sizes": sorted({p.device_mesh.size() for p in dtensors}),
                "placements": sorted({str(p.placements) for p in dtensors})}

    def setup(config):
        run = real_setup(config)
        teacher = list(run.teacher.parameters())
        in_optimizer = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
        facts = {
            "model": held(list(run.model.parameters())),
            "teacher": held(teacher),
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


def launch(
    launch_args: list[str], args: list[str], home: Path, mixed_precision: str = "no", **env
) -> subprocess.CompletedProcess:
    """`accelerate launch` on 2 CPU processes (as docs/commands/train.md shows) with extra launcher flags."""
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        *launch_args,
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        mixed_precision,
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        *args,
    ]
    full_env = {**python_env(), "ACCELERATE_USE_CPU": "1", "HOME": str(home), **env}
    return subprocess.run(cmd, env=full_env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)


def explain(proc: subprocess.CompletedProcess) -> str:
    """What the processes said, without torchrun's tracebacks and warnings around it."""
    keep = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if line.strip() and not line.startswith((" ", "W1", "E1", "[W", "Traceback", "torch.distributed"))
    ]
    return "\n".join(keep)[-3000:]


def launch_fsdp(args: list[str], home: Path, mixed_precision: str = "no") -> subprocess.CompletedProcess:
    """configs/accelerate/fsdp.yaml on 2 CPU processes, through the test-only FSDP2-on-CPU launcher."""
    return launch(["--config_file", str(FSDP_YAML)], [str(FSDP_ON_CPU), *args], home, mixed_precision)


def launch_ddp(args: list[str], home: Path) -> subprocess.CompletedProcess:
    return launch(["--multi_gpu"], args, home)


def read_facts(prefix: Path) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{rank}.json").read_text()) for rank in (0, 1)]


def assert_sharded_over_two(facts: list[dict], part: str) -> None:
    """Every parameter of `part` (model, teacher) is a DTensor split along its first dimension over a
    mesh of both processes, and each process holds about half of it: together exactly all of it."""
    held = [f[part] for f in facts]
    for h in held:
        assert h["count"] > 0 and h["not_dtensor"] == 0, (part, h)
        assert h["mesh_sizes"] == [2] and h["placements"] == ["(Shard(dim=0),)"], (part, h)
    total = held[0]["numel"]
    assert sum(h["local_numel"] for h in held) == total, (part, held)
    assert max(h["local_numel"] for h in held) < 0.6 * total, (part, held)


def chunk_files(checkpoint_folder: Path) -> dict[str, list[str]]:
    """For each tensor of a torch.distributed.checkpoint folder, the files its chunks are in, read from
    its .metadata (one entry per chunk each process wrote)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint_folder)).read_metadata()
    files: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(index.fqn, []).append(info.relative_path)
    return {fqn: sorted(paths) for fqn, paths in files.items()}


@pytest.fixture(scope="module")
def fsdp_and_ddp(assets, tmp_path_factory):
    """The same distillation run (2 processes × 2 blocks × grad_accum 2, clipping active, a
    checkpoint at step 2) under FSDP2 and under DDP."""
    root = tmp_path_factory.mktemp("fsdp")
    (root / "home").mkdir()
    values = {
        "model": str(assets["gqa"]),
        "teacher": str(assets["mha"]),
        "distill_weight": 0.5,
        "train_data": str(assets["train"]),
        "eval_data": str(assets["eval"]),
        "seq_len": 32,
        "batch_size": 2,
        "grad_accum": 2,
        "lr": 3e-3,
        "warmup_steps": 2,
        "max_steps": 4,
        "eval_every": 2,
        "save_every": 2,
        "keep_checkpoints": 1,
        "eval_blocks": 8,
        "max_grad_norm": 0.5,
        "report_to": ["jsonl"],
    }
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
    assert_sharded_over_two(read_facts(root / "facts"), "model")  # the curve compared is a sharded run's

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
    assert [r["step"] for r in losses] == [1, 2, 3, 4]  # every step
    assert min(r["train/distill_kl"] for r in losses) > 0  # the teacher ran
    assert min(r["train/grad_norm"] for r in losses) > fsdp_and_ddp["values"]["max_grad_norm"]  # clipping ran

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
    facts = read_facts(root / "facts")
    assert_sharded_over_two(facts, "model")
    assert_sharded_over_two(facts, "teacher")
    for f in facts:
        assert not f["teacher_in_optimizer"] and not f["teacher_trainable"]
        assert f["teacher_sharded_layers"] == 2  # one FSDP unit per decoder layer
        assert f["teacher_dtypes"] == ["torch.float32"]  # mixed_precision no; bf16 under bf16

    # The checkpoint is sharded: torch.distributed.checkpoint folders with one file per process.
    [checkpoint] = list((root / "fsdp" / "checkpoints").iterdir())
    assert checkpoint.name == "step_00000002"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "optimizer_0",
        "pytorch_model_fsdp_0",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "trainer_state.json",
    ]
    for folder in ("optimizer_0", "pytorch_model_fsdp_0"):
        assert sorted(p.name for p in (checkpoint / folder).iterdir()) == [".metadata", *sorted(SHARD_FILES)]
    # Each process wrote its own half of every weight and of its AdamW moments (only the step
    # counters, scalars, are whole in one file).
    weights = chunk_files(checkpoint / "pytorch_model_fsdp_0")
    moments = {
        k: v for k, v in chunk_files(checkpoint / "optimizer_0").items() if k.endswith(("exp_avg", "exp_avg_sq"))
    }
    assert len(weights) == facts[0]["model"]["count"] and len(moments) == 2 * len(weights)
    assert {k: v for k, v in {**weights, **moments}.items() if v != sorted(SHARD_FILES)} == {}


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
    assert x.keys() == y.keys() and len(x) > 0
    assert [k for k in x if not torch.equal(x[k], y[k])] == []


@pytest.mark.slow
def test_fsdp_bf16_teacher_of_another_architecture(fsdp_and_ddp, assets, tmp_path):
    # fsdp.yaml's own mixed precision: the student keeps fp32 master shards, the teacher is
    # sharded in bf16 (bf16 autocast runs on CPUs too). The teacher is a Mistral, whose decoder
    # layers are not the student's LlamaDecoderLayer, with the same tokenizer.
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(assets["mha"])
    torch.manual_seed(1)
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
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
    facts = read_facts(tmp_path / "facts")
    assert_sharded_over_two(facts, "teacher")
    for f in facts:
        assert f["teacher_dtypes"] == ["torch.bfloat16"]
        assert not f["teacher_in_optimizer"]
        assert f["teacher_sharded_layers"] == 2  # its own layer class, one unit each
    kl = [r["train/distill_kl"] for r in records(tmp_path / "bf16") if "train/distill_kl" in r]
    assert len(kl) == values["max_steps"] and min(kl) > 0  # the teacher ran at every step
    final = load_file(tmp_path / "bf16" / "final" / "model.safetensors")
    reference = load_file(root / "ddp" / "final" / "model.safetensors")
    assert final.keys() == reference.keys() and len(final) > 0
    assert {k: final[k].dtype for k in final} == {k: reference[k].dtype for k in final}  # the source's, not bf16
