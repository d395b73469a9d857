"""Every GQA attention uptrain ships dispatches through transformers' attention interface in its
own `forward`, as transformers' attentions do: engines that plug in their attention by that
interface find the call there (vLLM's transformers backend reads the `forward` source for an
assignment from `ALL_ATTENTION_FUNCTIONS` and exactly one call of it; tests/modeling/test_vllm.py
serves them). Checked here from the source, where vLLM is not installed."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
from torch import nn

import uptrain.modeling
from uptrain.modeling import attention as shared


def attention_classes() -> list[type]:
    """Every attention class of the GQA modeling files (and the encoder–decoders' shared one)."""
    modules = {inspect.getmodule(c) for classes in uptrain.modeling.CLASSES.values() for c in classes}
    found = [shared.EncoderDecoderAttention]
    for module in sorted(modules, key=lambda m: m.__name__):
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, nn.Module)
                and value.__name__.endswith("Attention")
                and value.__module__ == module.__name__
                and "forward" in vars(value)
            ):
                found.append(value)
    return found


def interface_calls(forward) -> tuple[set[str], int]:
    """The names `forward` assigns from ALL_ATTENTION_FUNCTIONS, and how many calls of them it makes."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            value = node.value.func if isinstance(node.value, ast.Call) else node.value
            if isinstance(value, (ast.Attribute, ast.Subscript)) and getattr(value.value, "id", None) == (
                "ALL_ATTENTION_FUNCTIONS"
            ):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    calls = sum(isinstance(n, ast.Call) and getattr(n.func, "id", None) in names for n in ast.walk(tree))
    return names, calls


def test_every_gqa_architecture_has_its_attention_checked():
    # One per decoder-only file and the T5 pair; the BART family shares EncoderDecoderAttention.
    names = {cls.__name__ for cls in attention_classes()}
    assert {"GPT2GQAAttention", "BloomGQAAttention", "T5GQAAttention", "EncoderDecoderAttention"} <= names
    assert len(names) >= 11, names


@pytest.mark.parametrize("cls", attention_classes(), ids=lambda c: c.__name__)
def test_the_attention_dispatches_through_the_interface_in_its_own_forward(cls):
    names, calls = interface_calls(cls.forward)
    assert names, f"{cls.__name__}.forward takes no function from ALL_ATTENTION_FUNCTIONS"
    assert calls == 1, f"{cls.__name__}.forward calls the attention interface {calls} times"
    # The scale is given as a number or an attribute of the module, which engines can read.
    source = textwrap.dedent(inspect.getsource(cls.forward))
    call = next(
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and getattr(n.func, "id", None) in names
    )
    scaling = [k.value for k in call.keywords if k.arg == "scaling"]
    assert len(scaling) == 1 and (
        isinstance(scaling[0], ast.Constant) or getattr(scaling[0].value, "id", None) == "self"
    ), ast.unparse(call)
