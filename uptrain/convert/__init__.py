"""Streaming MHA → GQA conversion. Pure tensor plumbing: imports nothing from `uptrain.train`.

The public API (`convert_checkpoint`, `convert_model`, `prepare`, `calibrate`, `execute`) is
imported on first use, so that reading the conversion schema (`uptrain.convert.spec`) does not
import torch.
"""

__all__ = ["convert_checkpoint", "convert_model", "prepare", "calibrate", "execute", "conversion_spec"]


def __getattr__(name: str):
    if name == "convert_model":
        from uptrain.convert.in_memory import convert_model

        return convert_model
    if name in __all__:
        from uptrain.convert import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'uptrain.convert' has no attribute {name!r}")
