"""Which heads share a KV head after conversion.

Groups are contiguous, as transformers' `repeat_kv` expands them: query head i reads KV head
i // (num_heads / G). Pooling strided groups (kv0, kv1, kv0, kv1, …) loads without error and
produces garbage, so this is the single place that decides membership.
"""

from __future__ import annotations

from uptrain import UptrainError


def check_num_kv_heads(num_heads: int, current_kv_heads: int, target: int, flag: str = "--num-kv-heads") -> None:
    """Refuse a G that the source cannot be pooled to, with a reason a user can act on (`flag`:
    what the user gave G by, as messages name it)."""
    if target < 1:
        raise UptrainError(f"{flag} must be at least 1, got {target}")
    if target > num_heads:
        raise UptrainError(f"{flag} {target} exceeds the model's {num_heads} attention heads")
    if num_heads % target:
        raise UptrainError(f"{flag} {target} does not divide the model's {num_heads} attention heads")
    if current_kv_heads % target:
        raise UptrainError(f"{flag} {target} does not divide the checkpoint's current {current_kv_heads} KV heads")


def kv_groups(current_kv_heads: int, target: int) -> list[list[int]]:
    """Source KV heads pooled into each target KV head: [[0..r-1], [r..2r-1], …]."""
    r = current_kv_heads // target
    return [list(range(j * r, (j + 1) * r)) for j in range(target)]


def query_to_kv(num_heads: int, num_kv_heads: int) -> list[int]:
    """The KV head each query head reads after conversion."""
    return [i // (num_heads // num_kv_heads) for i in range(num_heads)]
