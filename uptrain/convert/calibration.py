"""Calibration statistics for the `calibrated` merge: each layer's attention-input second moment.

The source model reads calibration text through the same datasets pipeline as training
(tokenize, join documents with EOS, pack into blocks; the first blocks in file order, so the
result is deterministic). Every token's attention input x, augmented with a constant 1 so that
biases are merged too, is folded into C = E[x xᵀ] — statistics, never activations.

The model runs one decoder layer at a time, so memory is the calibration hidden states
(tokens × hidden) + one layer's weights + one moment — or, before the first layer, the
embedding — whatever the number of layers:
- the transformers model is built on the meta device (no weights), so its own code computes
  what precedes the first layer — embedding, Gemma's embedding scale, Granite's multiplier,
  rotary tables, causal masks — once per batch, with only the non-layer weights loaded;
- each decoder layer's weights are then read from the safetensors shards by the converter's
  reader, every batch's hidden states pass through it, its attention input is folded into its
  moment, and the layer goes back to the meta device before the next one is read;
- each finished moment (float64) goes, while still on the calibration device, to `per_layer`
  (the conversion solves that layer's merge with it at once and drops it, see
  `pipeline.calibrate`); without `per_layer` every moment is kept, spilled to a temporary file
  that `moments[layer]` reads back (`uptrain compare` reuses them across conversions).
Running transformers' own layer modules (rather than re-implementing each architecture's
block) keeps every architecture's quirks — partial rotary, parallel residuals, biases, q/k
norms — exactly as in the model users load, and gives the same moments as running the whole
model (tests/convert/test_calibration_layerwise.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF, architecture
from uptrain.checkpoint.reader import SourceCheckpoint, tensor_bytes
from uptrain.checkpoint.source import resolve_source
from uptrain.convert.calibrated import augmented_inputs
from uptrain.convert.spec import DEFAULT_CALIBRATION, CalibrationSettings
from uptrain.data.blocks import Blocks
from uptrain.data.text import TextStream, head_blocks, load_blocks
from uptrain.loading import load_model, load_tokenizer
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
    return load_tokenizer(model_dir, "calibration's source")


def fold_attention_input(moment: torch.Tensor, x: torch.Tensor) -> None:
    """Add Σ x̃ x̃ᵀ over the tokens of `x` ([..., hidden]) to `moment`, x̃ = [x, 1], in float64."""
    x = augmented_inputs(x.reshape(-1, x.shape[-1]))
    moment.addmm_(x.mT, x)


def attention_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states an attention module was called with (positional or keyword)."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


class SpilledMoments(Mapping):
    """{layer: C} spilled to one anonymous temporary file in TMPDIR; reading a layer loads only
    that layer.

    The file never has a name (O_TMPFILE on Linux; elsewhere created and unlinked at once), so the
    kernel frees its space when the process ends, however it ends: SIGTERM and kill -9 leave
    nothing behind (a named spill of a 7B model's moments is 4.3 GB).
    """

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="uptrain-moments-")
        self._where: dict[int, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        self._end = 0

    def add(self, layer: int, moment: torch.Tensor) -> None:
        moment = moment.detach().to("cpu").contiguous()
        data, offset = tensor_bytes(moment), self._end
        while data:  # pwrite may write less than asked (at most ~2 GiB per call on Linux)
            written = os.pwrite(self._file.fileno(), data, offset)
            data, offset = data[written:], offset + written
        self._where[layer] = (self._end, moment.dtype, tuple(moment.shape))
        self._end = offset

    def __getitem__(self, layer: int) -> torch.Tensor:
        start, dtype, shape = self._where[layer]
        out = torch.empty(shape, dtype=dtype)
        view = tensor_bytes(out)  # the buffer of `out` itself: reading into it fills the tensor
        while view:
            n = os.preadv(self._file.fileno(), [view], start)
            if n == 0:
                raise RuntimeError(f"the spilled moments of layer {layer} are truncated")
            view, start = view[n:], start + n
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def release_freed_memory() -> None:
    """Hand memory freed inside glibc's heap back to the OS (malloc_trim), once per layer.

    glibc serves buffers below its (self-raising) mmap threshold from the heap, and freed heap
    memory below a live buffer stays resident: without this, part of each freed layer stays
    behind and the peak grows with the number of layers (BENCHMARKS.md, calibration). A one-off
    trim changes no allocator setting, so a training process that calibrates first is left as
    it was.
    """
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    if sys.platform.startswith("linux") and libc_name:
        try:
            ctypes.CDLL(libc_name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


class _LayerInputsRecorded(Exception):
    """Raised by the last decoder layer's stand-in: nothing after the layers needs to run."""


def _materialise(
    module: torch.nn.Module, prefix: str, checkpoint: SourceCheckpoint, device: torch.device, dtype: torch.dtype
) -> None:
    """Give a meta-device module its weights from the checkpoint (floating point ones cast to `dtype`)."""
    state = {}
    for name, meta in module.state_dict().items():
        key = prefix + name
        if key not in checkpoint.tensors:
            raise UptrainError(f"calibration: {key} is missing from {checkpoint.folder}")
        tensor = checkpoint.read_tensor(key)
        if tuple(tensor.shape) != tuple(meta.shape):
            raise UptrainError(
                f"calibration: {key} has shape {tuple(tensor.shape)}, the config implies {tuple(meta.shape)}"
            )
        state[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    module.load_state_dict(state, assign=True)
    module.to(device)  # buffers that are not in the state dict (rotary inv_freq)
    del state
    release_freed_memory()  # the stored-dtype copies read before each cast


def _empty_model(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The source's transformers model with every parameter on the meta device (buffers are real)."""
    import uptrain.modeling  # noqa: F401  registers gpt2_gqa, …: every model uptrain writes loads here

    return load_model(model_dir, "calibration's source", dtype=dtype, weights=False).eval()


def _record_layer_inputs(
    base: torch.nn.Module, layers: torch.nn.ModuleList, ids: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
    """Run the model's own code up to the first layer; return the first layer's hidden states
    and the other arguments each layer is called with (masks may differ per layer type)."""
    calls: list[tuple[tuple, dict]] = []
    first: list[torch.Tensor] = []

    def stand_in(hidden_states, *args, **kwargs):
        if not calls:
            first.append(hidden_states)
        calls.append((args, kwargs))
        if len(calls) == len(layers):
            raise _LayerInputsRecorded
        return hidden_states

    for layer in layers:
        layer.forward = stand_in  # an instance attribute shadows the class's forward
    try:
        base(input_ids=ids, use_cache=False)
    except _LayerInputsRecorded:
        pass
    finally:
        for layer in layers:
            del layer.forward
    if len(calls) != len(layers):
        raise UptrainError(f"calibration: the model called {len(calls)} of its {len(layers)} decoder layers")
    return first[0], calls


def _first_blocks(data: Blocks | TextStream, wanted: int) -> torch.Tensor:
    """The first `wanted` blocks in data order, [count, seq_len]: of a local dataset tokenized
    up front, or the head of a streamed one (a Hub dataset is never read in full)."""
    blocks = head_blocks(data, wanted)
    count = min(wanted, len(blocks))
    return blocks.take(list(range(count))) if count else torch.empty(0, dtype=torch.long)


def _layer_inputs(base, base_path: str, layers, all_ids: torch.Tensor, batch_size: int, reading: tuple):
    """What enters the decoder layers for every batch of `all_ids` (`_record_layer_inputs`): the
    modules outside the layers (the embedding, …) are read from the checkpoint, run, then freed
    before the first layer is read. `reading`: (checkpoint, its root prefix, device, dtype)."""
    checkpoint, root, run_device, run_dtype = reading
    outside = [(name, child) for name, child in base.named_children() if child is not layers]
    for name, child in outside:
        _materialise(child, f"{base_path}.{name}.".removeprefix(root), checkpoint, run_device, run_dtype)
    hidden, calls = [], []
    with torch.no_grad():
        for start in range(0, len(all_ids), batch_size):
            h, c = _record_layer_inputs(base, layers, all_ids[start : start + batch_size].to(run_device))
            hidden.append(h)
            calls.append(c)
    for _, child in outside:
        child.to("meta")  # the embedding is no longer needed: free it before the layers
    release_freed_memory()
    return hidden, calls


def collect_attention_moments(
    src: str | Path,
    data: str | list[str],
    settings: CalibrationSettings = DEFAULT_CALIBRATION,
    *,
    batch_size: int = 4,
    progress: bool | None = None,
    per_layer: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[Mapping[int, torch.Tensor], dict]:
    """Return ({layer: C of shape [(hidden + 1), (hidden + 1)], float64}, a description for provenance).

    The forward pass runs as `settings` say (dtype, device), one decoder layer at a time, over
    `batch_size` blocks at once; moments are accumulated in float64 and read back from disk on
    access. With `per_layer`, each moment is instead handed to `per_layer(layer, C)` as soon as
    it is complete (C on the calibration device) and not kept: the mapping returned is empty.
    `progress`: None shows a bar on terminals, False never, True always.
    """

    model_dir = resolve_source(src).folder
    config = read_config(model_dir)
    # A decoder-only model's one attention (encoder–decoders: calibration_seq2seq.py).
    arch = architecture(config.get("model_type"))
    layout = arch.site(DECODER_SELF).layout
    # The block length is calibration's own choice: at most the model's positions.
    positions = arch.target_positions(config, f"calibration's source {model_dir}")
    seq_len = min(settings.calibration_seq_len, positions or settings.calibration_seq_len)
    settings = replace(settings, calibration_seq_len=seq_len)
    run_device, run_dtype = calibration_device(settings.calibration_device, settings.calibration_dtype)
    tokenizer = load_calibration_tokenizer(model_dir)
    all_ids, source = first_calibration_blocks(tokenizer, data, settings, seq_len)
    count = len(all_ids)
    tokens = count * seq_len
    # "model.layers.{layer}.self_attn" → layers at "model.layers", their parent "model", the
    # attention module "self_attn" of each (GPT-Neo's "attn.attention": nested).
    layers_path, attn_name = layout.attn_prefix.split(".{layer}.")
    layer_template = layers_path + ".{layer}"
    base_path = layers_path.rsplit(".", 1)[0]
    # Weights only (weights_only=True for pickles); whether a pickle source may be converted
    # at all is decided by the conversion's own checks (pipeline.prepare, --allow-pickle).
    checkpoint = SourceCheckpoint(model_dir, allow_pickle=True)
    # A checkpoint saved from the base model lacks the task model's leading module name
    # (GPT-2's "h.0.attn" for "transformer.h.0.attn"): read its tensors under its own names.
    stored = layout.attn_prefix_in(checkpoint.tensors)
    checkpoint_root = layout.attn_prefix[: len(layout.attn_prefix) - len(stored)]
    moments = SpilledMoments() if per_layer is None else {}
    try:
        model = _empty_model(model_dir, run_dtype)
        base, layers = model.get_submodule(base_path), model.get_submodule(layers_path)
        reading = (checkpoint, checkpoint_root, run_device, run_dtype)
        hidden, calls = _layer_inputs(base, base_path, layers, all_ids, batch_size, reading)
        bar = tqdm(
            total=len(layers), desc="calibrate", unit="layer", disable=None if progress is None else not progress
        )
        with bar, torch.no_grad():
            for i, layer in enumerate(layers):
                _materialise(
                    layer,
                    f"{layer_template.format(layer=i)}.".removeprefix(checkpoint_root),
                    checkpoint,
                    run_device,
                    run_dtype,
                )
                moment = _layer_moment(layer, attn_name, hidden, [c[i] for c in calls], run_device)
                layer.to("meta")  # frees this layer's weights before the next layer is read
                if per_layer is None:
                    moments.add(i, moment / tokens)
                else:
                    per_layer(i, moment / tokens)
                del moment
                release_freed_memory()
                bar.update(1)
    finally:
        checkpoint.close()
    dtype = settings.calibration_dtype
    info = {"data": source.label, "tokens": tokens, "seq_len": seq_len, "blocks": count, "dtype": dtype}
    return moments, info


def first_calibration_blocks(tokenizer, data, settings: CalibrationSettings, block_length: int):
    """The first `settings.wanted_blocks` blocks of `block_length` tokens of `data`, tokenized as
    training tokenizes it (documents joined with EOS, packed), and the data's description;
    refuses data too short for one."""
    blocks, source = load_blocks(
        data,
        "calibration_data",
        tokenizer,
        block_length,
        text_field=settings.text_field,
        split=settings.calibration_split,
        dataset_config=settings.calibration_dataset_config,
        sample_by=settings.sample_by,
        streaming=None,
        workers=None,
    )
    rows = _first_blocks(blocks, settings.wanted_blocks)
    if len(rows) == 0:
        raise UptrainError(f"calibration data {source.label} holds fewer than {settings.calibration_seq_len} tokens")
    return rows, source


def _layer_moment(layer: torch.nn.Module, attn_name: str, hidden: list, calls: list, device) -> torch.Tensor:
    """The sum over the calibration blocks of the outer products of `layer`'s attention input
    (with a constant 1 appended), in float64 on `device`. Each block's hidden states become the
    layer's output, in place, ready for the next layer; `calls` holds each block's other
    arguments to the layer."""
    width = hidden[0].shape[-1] + 1
    moment = torch.zeros(width, width, dtype=torch.float64, device=device)
    hook = layer.get_submodule(attn_name).register_forward_pre_hook(
        lambda module, args, kwargs: fold_attention_input(moment, attention_input(args, kwargs)),
        with_kwargs=True,
    )
    try:
        for b, (args, kwargs) in enumerate(calls):
            out = layer(hidden[b], *args, **kwargs)
            # In place: the hidden states, allocated once before any layer, stay below the
            # layers' short-lived buffers in the heap, which can then be returned.
            hidden[b].copy_(out[0] if isinstance(out, tuple) else out)
    finally:
        hook.remove()
    return moment
