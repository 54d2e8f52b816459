"""The op table (minisched/ops/table.py) against the tree: every face of every op exists where it says."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from minisched.ops import checks, reference
from minisched.ops.table import OPS

ROOT = Path(__file__).resolve().parents[2]
BINDINGS = (ROOT / "csrc" / "torch_bindings.cpp").read_text()


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_face_exists(name):
    spec = OPS[name]
    assert re.search(rf'm\.def\(\s*"{name}\(', BINDINGS), f"{name}: no schema in csrc/torch_bindings.cpp"
    assert (ROOT / "csrc" / "cpu" / f"{spec.family}.cpp").is_file(), f"{name}: no csrc/cpu/{spec.family}.cpp"
    assert (ROOT / "csrc" / "cuda" / f"{spec.family}.cu").is_file() == spec.cuda, f"{name}: cuda={spec.cuda}"
    assert (ROOT / "tests" / "ops" / f"test_{spec.family}.py").is_file(), f"{name}: no tests/ops/test_{spec.family}.py"
    assert callable(getattr(reference, name)) and callable(getattr(checks, name))
    assert ("values" in inspect.signature(getattr(checks, name)).parameters) == spec.reads_indices
    triton_file = ROOT / "minisched" / "triton_kernels" / f"{spec.family}.py"
    assert triton_file.is_file() == spec.triton, f"{name}: triton={spec.triton}"
    if spec.triton:
        assert callable(getattr(importlib.import_module(f"minisched.triton_kernels.{spec.family}"), name))


def test_every_schema_is_in_the_table():
    schemas = set(re.findall(r'm\.def\(\s*"(\w+)\(', BINDINGS))
    assert schemas == set(OPS), (
        f"schemas without a table entry: {schemas - set(OPS)}; entries without a schema: {set(OPS) - schemas}"
    )
