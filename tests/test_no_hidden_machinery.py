"""Shipped code has no hidden machinery (issue #16): no import hooks, no switch of its own in the
environment, and no write to another library's private state.

Read from the source with `ast`, so every module counts, imported or not, including code inside
functions. `self._x` / `cls._x` are an object's own business; anything else with a leading
underscore belongs to someone else.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "uptrain"
# Underscored names that are public API: transformers documents `config._attn_implementation`
# as how custom modeling code picks its attention; namedtuples' methods carry an underscore so
# they cannot clash with field names.
READABLE_PRIVATE = {"_attn_implementation", "_replace", "_asdict", "_fields", "_make"}
IMPORT_MACHINERY = {"meta_path", "path_hooks", "path_importer_cache"}
# Named exceptions, per file, each with its reason. The GQA modeling subclasses transformers'
# models, which check the attention backend against their own flags while they build (BLOOM's
# allows eager only); it builds them as eager and then sets the backend the user asked for on
# the config, the attribute and check transformers' own `PreTrainedModel.__init__` uses.
ALLOWED = {
    "modeling/attention.py": {"_attn_implementation_internal", "_check_and_adjust_attn_implementation"},
    # transformers 4.x's hooks for renaming state-dict keys, overridden by the GQA class (its
    # checkpoints keep `lm_head`, 4.x's NeoX calls it `embed_out`), delegating to its base class.
    "modeling/modeling_gpt_neox_gqa.py": {"_fix_state_dict_key_on_load", "_fix_state_dict_key_on_save"},
}


def owner(node: ast.Attribute) -> str | None:
    if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and node.value.func.id == "super":
        return "self"  # a subclass calling its base's hook (e.g. `super()._fix_state_dict_key_on_load`)
    return node.value.id if isinstance(node.value, ast.Name) else None


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def problems(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and private(target.attr) and owner(target) not in ("self", "cls"):
                    found.append(f"line {line}: writes another object's private `{target.attr}`")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and private(name.value):
                found.append(f"line {line}: {node.func.id} of the private `{name.value}`")
        elif isinstance(node, ast.Attribute):
            if private(node.attr) and owner(node) not in ("self", "cls") and node.attr not in READABLE_PRIVATE:
                found.append(f"line {line}: uses another object's private `{node.attr}`")
            if node.attr in IMPORT_MACHINERY and owner(node) == "sys":
                found.append(f"line {line}: changes the import machinery (sys.{node.attr})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("UPTRAIN_"):
            found.append(f"line {line}: an environment switch of uptrain's own ({node.value})")
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_hidden_machinery(path):
    allowed = ALLOWED.get(str(path.relative_to(PACKAGE)), set())
    found = problems(ast.parse(path.read_text(), str(path)))
    assert [p for p in found if not any(f"`{name}`" in p for name in allowed)] == []


def test_the_check_finds_what_it_names():
    planted = """
import sys, os
from accelerate.state import AcceleratorState
def switch():
    if os.environ.get("UPTRAIN_FSDP_ON_CPU"):
        AcceleratorState._shared_state["distributed_type"] = "FSDP"
        AcceleratorState()._mixed_precision = "no"
        setattr(AcceleratorState, "_reset", None)
    sys.meta_path.insert(0, object())
class Fine:
    def __init__(self):
        self._mine = 1
"""
    found = problems(ast.parse(planted))
    assert len([p for p in found if "UPTRAIN_FSDP_ON_CPU" in p]) == 1
    assert any("private `_mixed_precision`" in p for p in found)
    assert any("private `_shared_state`" in p for p in found)
    assert any("setattr" in p for p in found)
    assert any("sys.meta_path" in p for p in found)
    assert not any("_mine" in p for p in found)
