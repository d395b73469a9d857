"""Test-only launcher: run a script (or `-m module`) with accelerate's FSDP2 path on CPU processes.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 \\
        --mixed_precision no --dynamo_backend no tests/train/fsdp_on_cpu.py -m uptrain train --config FILE.yaml

accelerate routes CPU runs to DDP even under an FSDP config, and has no public switch against
it, though torch's `fully_shard` trains on CPU processes over gloo. So that CI can run
accelerate's own FSDP2 code paths (preparation, DTensor-aware clipping, sharded save_state /
load_state, the gathered state dict) without GPUs, this launcher wraps `Accelerator.__init__`:
once accelerate has set up gloo, it makes the run FSDP2 with the plugin the launcher's FSDP_*
variables describe. That writes accelerate 1.x private state, which is why it lives here, in
the test processes, and not in `uptrain/`: a shipped run on CPUs under an FSDP config is refused.
"""

from __future__ import annotations

import os
import runpy
import sys


def _fail(message: str):
    raise SystemExit(f"fsdp_on_cpu.py: {message}")


def make_accelerate_take_fsdp2_on_cpu() -> None:
    """Every `Accelerator` built in this process after this call runs FSDP2 over gloo."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    real_init = Accelerator.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if self.distributed_type != DistributedType.MULTI_CPU:
            _fail(
                f"accelerate set up {self.distributed_type}; this launcher turns MULTI_CPU (ACCELERATE_USE_CPU=1, "
                "several processes) into FSDP2"
            )
        plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables accelerate launch set
        if plugin.fsdp_version != 2:
            _fail("needs fsdp_version 2 in the accelerate config (FSDP1 needs GPUs)")
        if self.mixed_precision != "no":
            plugin.set_mixed_precision(self.mixed_precision)
        self.state.fsdp_plugin = plugin
        # accelerate keeps the type twice and refreshes AcceleratorState's copy from PartialState's
        # whenever an AcceleratorState is built; on GPUs it sets both the same way.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.state.distributed_type = DistributedType.FSDP
        self.print("FSDP2 on CPU over gloo (tests/train/fsdp_on_cpu.py): a test of the sharded code paths")

    Accelerator.__init__ = init


def main(argv: list[str]) -> None:
    """Run `argv` as `python` would: `-m module args…` or `script.py args…`."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").strip().lower() not in ("1", "true", "yes"):
        _fail("launch with an FSDP accelerate config (--config_file configs/accelerate/fsdp.yaml)")
    make_accelerate_take_fsdp2_on_cpu()
    if argv[:1] == ["-m"] and len(argv) > 1:
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()  # as `python -m` puts it, instead of this file's folder
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    else:
        _fail("give a script or -m module to run")


if __name__ == "__main__":
    main(sys.argv[1:])
