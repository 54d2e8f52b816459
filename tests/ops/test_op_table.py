"""The op table (minisched/ops/table.py) against the tree: every face of every op exists where it says, takes
the schema's argument list, and every op the extension registers has an entry, sample inputs and a fake."""

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
needs_native = pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))


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


def _parameters(fn) -> list[str]:
    """fn's positional parameters (checks' keyword-only `values` switch is not the op's)."""
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.KEYWORD_ONLY]


@needs_native
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_face_takes_the_schemas_arguments(name):
    """The schema's argument list is the op's one signature: its checks (and so its fake), its reference and
    its Triton launcher take it as it is, names and order (call_op passes the same tuple to each)."""
    schema = [a.name for a in getattr(torch.ops.minisched, name).default._schema.arguments]
    assert _parameters(getattr(checks, name)) == schema, f"checks.{name}"
    assert _parameters(OPS[name].input_checks(values=False)) == schema, f"{name}'s fake"
    assert _parameters(getattr(reference, name)) == schema, f"reference.{name}"
    if OPS[name].triton:
        pytest.importorskip("triton")
        assert _parameters(ops.triton_launchers()[name]) == schema, f"triton_kernels.{OPS[name].family}.{name}"


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


def test_every_schema_is_in_the_table():
    schemas = set(re.findall(r'm\.def\(\s*"(\w+)\(', BINDINGS))
    assert schemas == set(OPS), (
        f"schemas without a table entry: {schemas - set(OPS)}; entries without a schema: {set(OPS) - schemas}"
    )


@needs_native
def test_every_registered_op_has_an_entry_samples_and_a_fake():
    """What the built extension registers in the torch.ops.minisched namespace, not only what the schema
    file says: each op has a table entry, a sample builder that gives argument lists, and a fake registered
    from the module the TORCH_LIBRARY block names (m.set_python_module; torch checks the two agree)."""
    registered = {
        n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("minisched::")
    }
    assert registered == set(OPS), (
        f"ops without a table entry: {registered - set(OPS)}; entries the extension lacks: {set(OPS) - registered}"
    )
    gen = torch.Generator().manual_seed(0)
    for name in sorted(registered):
        assert OPS[name].samples(torch.device("cpu"), OPS[name].dtypes[0], gen), f"{name}: no sample inputs"
        schema = getattr(torch.ops.minisched, name).default._schema
        fake = torch._library.simple_registry.singleton.find(f"minisched::{name}").fake_impl.kernel
        assert fake is not None, f"{name}: no fake registered"
        assert fake.source.startswith(str(ROOT / "minisched" / "ops" / "fakes.py")), f"{name}: fake from {fake.source}"
        assert torch._C._dispatch_pystub(schema.name, schema.overload_name) == ("minisched.ops.fakes", "")
