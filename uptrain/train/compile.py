"""torch.compile for a run (`compile: true`): the backend checked before anything is written, the
model's repeated blocks compiled in place once accelerate has prepared it."""

from __future__ import annotations

import torch

from uptrain import UptrainError


def check_compile_backend(backend: str) -> None:
    """Refuse an unknown torch.compile backend before anything is written."""
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise UptrainError(
            f"compile_backend {backend!r} is not a torch.compile backend (e.g. "
            f"{', '.join(torch.compiler.list_backends())}, aot_eager, eager)"
        )


def compile_blocks(model: torch.nn.Module, backend: str) -> int:
    """torch.compile the repeated blocks of `model` in place (every member of a ModuleList whose
    members share one class: the decoder layers, T5's encoder and decoder blocks); a model without
    any is compiled whole, in place. Returns how many modules were compiled.

    Why so: in place (`Module.compile`), the module tree, and so every state-dict name, stays as
    it was (`torch.compile(model)` would wrap it and prefix `_orig_mod.`): accelerate's
    checkpoints and final/ hold the plain names whether or not the run compiled, and a resume may
    switch `compile` either way. Per block: one compiled layer's code serves every layer (compile
    time of one layer, not of N), and FSDP2's per-block hooks stay outside the compiled regions
    (accelerate's regional compilation does the same). After prepare, not through accelerate's
    dynamo plugin: DDP and FSDP wrap the eager model and the accelerator is built the same way
    with or without compile. Gradient checkpointing works wherever transformers puts it (around
    the block's call in 5.17, inside its forward later: dynamo traces non-reentrant checkpoints);
    evaluation (eval mode, no grad) compiles once more, then reuses that."""
    blocks = list(_repeated_blocks(model))
    for block in blocks or [model]:
        block.compile(backend=backend)
    return len(blocks) or 1


def _repeated_blocks(module: torch.nn.Module):
    if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
        yield from module  # the outermost repetition only: a block's own lists are compiled with it
        return
    for child in module.children():
        yield from _repeated_blocks(child)
