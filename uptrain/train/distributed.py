"""Launch checks and FSDP plumbing: what `accelerate launch` was asked for against what it started.

accelerate falls back silently when it cannot do what its config says: an FSDP or DeepSpeed config
on a machine without GPUs becomes N independent single-process runs (or, with
`ACCELERATE_USE_CPU=1`, DDP). `make_accelerator` turns each such mismatch into one line before
anything is written. `place_teacher` shards the distillation teacher under FSDP2 instead of
copying it whole to every GPU. `MainProcessWait` lets the other processes wait for the main
process's conversion longer than the collectives' timeout. `leave_together` ends a finished run
on every process without a gloo worker thread still holding Python tensors at interpreter exit.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from uptrain import UptrainError, exception_line

_TRUE = ("1", "true", "yes")


@dataclass(frozen=True)
class Launch:
    """What the launcher asked for (environment) and what accelerate set up (its state)."""

    launched: int  # processes the launcher started: WORLD_SIZE (torchrun, accelerate launch), else 1
    joined: int  # processes in the run accelerate set up (accelerator.num_processes)
    asked: str | None  # the sharding engine the accelerate config asks for: "FSDP", "DEEPSPEED" or None
    got: str  # accelerate's distributed type: "NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED", …
    device: str  # "cpu", "cuda", …
    gpus: int  # GPUs visible to this process
    gpus_in_use: int | None = None  # distinct GPUs the run's processes landed on (None off GPUs)


def _flag(name: str, env) -> bool:
    return env.get(name, "").strip().lower() in _TRUE


def asked_engine(env=os.environ) -> str | None:
    """The sharding engine `accelerate launch --config_file …` asked for, read from the variables it sets."""
    if _flag("ACCELERATE_USE_FSDP", env):
        return "FSDP"
    if _flag("ACCELERATE_USE_DEEPSPEED", env):
        return "DEEPSPEED"
    return None


def launch_problem(launch: Launch) -> str | None:
    """Why this launch cannot do what it says, in one line, or None when it can."""
    if launch.launched != launch.joined:
        why = (
            "this machine has no GPU, and without one accelerate starts each process on its own; for CPU "
            "processes launch with ACCELERATE_USE_CPU=1 and --multi_gpu --num_processes N"
            if launch.gpus == 0
            else f"accelerate set up {launch.got} with {launch.joined} process(es)"
        )
        return (
            f"the launcher started {launch.launched} processes but they did not join one run (each would train "
            f"alone and race on output_dir): {why}"
        )
    if launch.asked is not None and launch.got != launch.asked:
        name = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed"}[launch.asked]
        why = (
            "accelerate runs it on GPUs only and this machine has none"
            if launch.gpus == 0
            else f"it fell back on this machine's {launch.gpus} GPU(s)"
        )
        return (
            f"the accelerate config asks for {name}, but accelerate set up {launch.got} with {launch.joined} "
            f"process(es) on {launch.device} ({why}); use a launch config without {name} "
            f"(e.g. configs/accelerate/multi_gpu.yaml) or run on GPUs"
        )
    if launch.gpus_in_use is not None and launch.gpus_in_use < launch.joined:
        return (
            f"the run's {launch.joined} processes landed on {launch.gpus_in_use} GPU(s) ({launch.gpus} visible "
            f"here): each process needs a GPU of its own; pass --num_processes {launch.gpus_in_use}"
        )
    return None


def _gpus_in_use(accelerator) -> int | None:
    """How many distinct GPUs the processes of the run use (None off GPUs).

    Compared by (host, GPU UUID) across all processes, because some schedulers show each process
    only its own GPU (CUDA_VISIBLE_DEVICES per rank), so counting visible GPUs would mislead."""
    if accelerator.device.type != "cuda":
        return None
    if accelerator.num_processes == 1:
        return 1
    import socket

    props = torch.cuda.get_device_properties(accelerator.device)
    mine = (socket.gethostname(), str(getattr(props, "uuid", accelerator.device.index)))
    everyone = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(everyone, mine)
    return len(set(everyone))


def make_accelerator(collective_timeout_s: float | None = None, **kwargs):
    """`Accelerator(**kwargs)`, refused with one line when the launch cannot do what it says.

    `collective_timeout_s`: how long any collective of the run may wait before the run fails
    (set when the process group is created; None: torch's default, 10 minutes under NCCL, 30 under
    gloo). Builds nothing on disk: call it before the first write to output_dir."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if collective_timeout_s is not None:
        # backend None: accelerate picks it for the device, as without the handler. (accelerate
        # passes on only values that differ from its defaults: exactly 600 s is torch's default.)
        timeout = timedelta(seconds=collective_timeout_s)
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend=None, timeout=timeout)]
    accelerator = Accelerator(**kwargs)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    launch = Launch(
        launched=int(os.environ.get("WORLD_SIZE", "1")),
        joined=accelerator.num_processes,
        asked=asked_engine(),
        got=str(accelerator.distributed_type).rsplit(".", 1)[-1].upper(),
        device=accelerator.device.type,
        gpus=gpus,
    )
    if launch.launched == launch.joined:  # a collective needs every process in the run
        launch = dataclasses.replace(launch, gpus_in_use=_gpus_in_use(accelerator))
    if problem := launch_problem(launch):
        raise UptrainError(problem)
    return accelerator


class MainProcessWait:
    """A barrier at which the other processes wait for a long step of the main process (the
    conversion of `source`: calibration, merges and writing take from seconds to hours) with a
    timeout of its own, `timeout_s`.

    The run's collectives keep theirs (NCCL: 10 minutes by default), so a hung process is still
    caught within minutes during training; raising the process group's timeout for the sake of
    this one wait would let every later hang go unnoticed for as long. The wait runs on a
    dedicated gloo group: a CPU barrier, which under NCCL keeps the idle GPUs free of a pending
    collective (and of NCCL's watchdog). Build it on every process before the main process starts
    the step: creating a group is itself a collective, with the run's timeout.
    """

    def __init__(self, accelerator, timeout_s: float, what: str = "the main process"):
        self.accelerator, self.timeout_s, self.what = accelerator, timeout_s, what
        self.group = None
        if accelerator.num_processes > 1:
            self.group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def wait(self) -> None:
        """Every process, once the main process has finished the step."""
        if self.group is None:
            return
        try:
            torch.distributed.barrier(group=self.group)
        except RuntimeError as err:  # gloo's timeout, or the connection of a process that died
            if self.accelerator.is_main_process:
                raise UptrainError(f"the other processes stopped waiting for {self.what}: {err}") from None
            raise UptrainError(
                f"waited {self.timeout_s:g} s for {self.what} (conversion_timeout_s) and gave up, or it failed: "
                f"see its own error; raise conversion_timeout_s if it was still running "
                f"({exception_line(err)[:160]})"
            ) from None
        finally:
            torch.distributed.destroy_process_group(self.group)
            self.group = None


# The last barrier of a finished gloo run, held by the main thread until the interpreter clears
# this module (see `leave_together`); at most one, the latest run's.
_last_barrier: list = []


def leave_together(accelerator) -> None:
    """End a finished run on every process: finish the trackers, meet at a last barrier, then
    destroy the process group. Call it only once every process has finished (a failed process
    must not wait for the others: use `accelerator.end_training()` there).

    Why a barrier whose work is kept: a gloo worker thread drops its reference to a collective
    after the caller's `wait()` has returned, and when that is the last reference it frees the
    collective's tensors, which takes the GIL (they have Python objects). A worker that asks for
    the GIL once the interpreter is finalizing is ended by Python (`pthread_exit`) inside that C++
    destructor: std::terminate, "terminate called without an active exception", SIGABRT, after a
    run that had finished (a process with little left to do after the run's last barrier; about
    1 launch in 20 of tests/train/test_fsdp.py, the backtrace in the commit message). A gloo
    barrier keeps (weak) references to every collective still queued, running or not yet released
    by its worker when it is issued, so those are freed when the barrier is; the main thread keeps
    this one until the interpreter clears this module, so the reference its worker drops right
    after it completes is not the last (no GIL needed), and it and the collectives it holds are
    freed on the main thread. Under NCCL the run ends as accelerate ends it.
    """
    for tracker in accelerator.trackers:
        tracker.finish()
    if accelerator.num_processes > 1 and torch.distributed.get_backend() == "gloo":
        barrier = torch.distributed.barrier(async_op=True)
        barrier.wait()
        _last_barrier[:] = [barrier]  # a previous run's is freed here, on the main thread
    accelerator.state.destroy_process_group()


def teacher_dtype(accelerator) -> torch.dtype:
    """The dtype the frozen teacher is held in: the autocast dtype, as it computes in it anyway."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)


def place_teacher(accelerator, teacher: torch.nn.Module) -> torch.nn.Module:
    """Put the frozen teacher where the student runs, in `teacher_dtype`, outside the optimizer.

    Under FSDP2 it is sharded like the student (one unit per decoder layer), so each GPU holds
    1/N of it plus the layers being gathered; with `cpu_ram_efficient_loading` only rank 0 holds
    real weights before this call and they are broadcast into the shards."""
    teacher = teacher.requires_grad_(False).eval().to(dtype=teacher_dtype(accelerator))
    if not getattr(accelerator, "is_fsdp2", False):
        return teacher.to(accelerator.device)
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = accelerator.state.fsdp_plugin
    student_layers = plugin.transformer_cls_names_to_wrap
    # The wrap policy names the student's decoder layer classes; a teacher of another
    # architecture has its own (accelerate would refuse it for lacking the student's).
    plugin.transformer_cls_names_to_wrap = list(getattr(teacher, "_no_split_modules", None) or []) or student_layers
    try:
        # accelerate's own FSDP2 preparation, as for the student; frozen parameters are not upcast
        # to fp32 (it upcasts trainable ones only), and the teacher is in no optimizer and not in
        # accelerator._models, so save_state neither saves nor restores it.
        return fsdp2_prepare_model(accelerator, teacher)
    finally:
        plugin.transformer_cls_names_to_wrap = student_layers
