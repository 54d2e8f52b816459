"""The op table (minisched/ops/table.py) against the tree: every face of every op exists where it says."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from minisched import ops
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
    triton_file = ROOT / "triton_kernels" / f"{spec.family}.py"
    assert triton_file.is_file() == spec.triton, f"{name}: triton={spec.triton}"


def test_the_triton_launchers_are_the_tables():
    """ops.triton_launchers() names, for every op with a Triton kernel, the launcher `name` of
    minisched.triton_kernels.<family> (triton_kernels/<family>.py), and nothing else."""
    pytest.importorskip("triton")
    launchers = ops.triton_launchers()
    assert set(launchers) == {name for name, spec in OPS.items() if spec.triton}
    for name, fn in launchers.items():
        assert (fn.__module__, fn.__name__) == (f"minisched.triton_kernels.{OPS[name].family}", name)
        assert inspect.getsourcefile(fn) == str(triton_file := ROOT / "triton_kernels" / f"{OPS[name].family}.py"), (
            f"{name}: imported from {inspect.getsourcefile(fn)}, not this tree's {triton_file}"
        )


@pytest.mark.skipif(not ops.native_available(), reason="the native extension is not built")
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_its_own_fake(name):
    """One fake per op in minisched.ops.fakes, with the schema's own argument list, in the module the
    TORCH_LIBRARY block names (m.set_python_module): torch checks the two agree when a fake runs."""
    from minisched.ops import fakes

    schema = getattr(torch.ops.minisched, name).default._schema
    fake = getattr(fakes, name)
    assert list(inspect.signature(fake).parameters) == [a.name for a in schema.arguments]
    assert torch._C._dispatch_pystub(schema.name, schema.overload_name) == ("minisched.ops.fakes", "")


def test_every_schema_is_in_the_table():
    schemas = set(re.findall(r'm\.def\(\s*"(\w+)\(', BINDINGS))
    assert schemas == set(OPS), (
        f"schemas without a table entry: {schemas - set(OPS)}; entries without a schema: {set(OPS) - schemas}"
    )
