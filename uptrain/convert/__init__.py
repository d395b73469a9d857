"""Streaming MHA → GQA conversion. Pure tensor plumbing: imports nothing from `uptrain.train`."""

from uptrain.convert.run import convert_checkpoint

__all__ = ["convert_checkpoint"]
