"""Where the checkpoint path's tensors go: each planned tensor, computed by the conversion
(`Conversion.compute`: cast, pooled or merged) or copied byte for byte, streamed into bounded
safetensors shards, one tensor in memory at a time."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

from uptrain.checkpoint.reader import COPY_CHUNK_BYTES, SourceCheckpoint, tensor_bytes
from uptrain.checkpoint.writer import ShardedWriter
from uptrain.convert.conversion import Conversion
from uptrain.convert.layer_merge import LayerMerger

# Planned kinds pooled on a second thread, up to a layer's K and V ahead (see write_weights).
POOLED_KINDS = ("rows", "fused", "per_head")
COMPUTE_AHEAD = 2


def write_weights(
    conversion: Conversion,
    source: SourceCheckpoint,
    folder: Path,
    max_shard_bytes: int,
    progress: bool | None,
    merger: LayerMerger,
) -> None:
    """Every planned tensor, in plan order, into shards of at most `max_shard_bytes` in `folder`."""
    plan = conversion.plan
    metadata = {k: str(v) for k, v in source.metadata.items()}
    chunk = bytearray(COPY_CHUNK_BYTES)
    bar = tqdm(
        total=plan.total_bytes,
        unit="B",
        unit_scale=True,
        desc="convert",
        disable=None if progress is None else not progress,
    )
    # Pooled K/V tensors are computed, in plan order, on a second thread while this one copies
    # the tensors between them; at most COMPUTE_AHEAD results wait in memory. Casts and
    # whole-layer merges run here: computing them ahead would hold more than one tensor
    # (or layer) at a time.
    to_compute = iter([t for t in plan.tensors if t.kind in POOLED_KINDS])
    ahead: deque[Future] = deque()

    def compute_next() -> None:
        if (t := next(to_compute, None)) is not None:
            ahead.append(worker.submit(conversion.compute, t, source, merger))

    with bar, ThreadPoolExecutor(max_workers=1, thread_name_prefix="uptrain-pool") as worker:
        try:
            for _ in range(COMPUTE_AHEAD):
                compute_next()
            with ShardedWriter(folder, [t.out for t in plan.tensors], max_shard_bytes, metadata) as writer:
                for t in plan.tensors:
                    writer.begin(t.out.name)
                    if t.kind == "copy":
                        source.copy_raw(t.sources[0], writer.write, chunk)
                    elif t.kind in POOLED_KINDS:
                        tensor = ahead.popleft().result()
                        compute_next()
                        writer.write(tensor_bytes(tensor))
                    else:
                        writer.write(tensor_bytes(conversion.compute(t, source, merger)))
                    bar.update(t.out.nbytes)
        finally:
            for future in ahead:
                future.cancel()
