"""torch.library.opcheck over the op table: every op, on every device its native kernels have here, in every
dtype they take (OpSpec.dtypes), on every argument list of its sample builder (OpSpec.samples, ops/samples.py).

opcheck runs the op and checks its schema (it writes only the outputs marked `Tensor(a!)`), its fake (ops/fakes.py:
the op's input checks, on FakeTensors), its autograd registration and AOT dispatch (torch.compile's path). The
Triton kernels are plain launchers, not torch.ops: opcheck does not apply to them (tests/ops/test_<family>.py and
test_triton_compile.py test them).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from minisched import ops
from minisched.ops.table import OPS

HAS_CUDA = torch.cuda.is_available()
needs_native = pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))


def _cases() -> list:
    cases = []
    for name, spec in sorted(OPS.items()):
        for device in ("cpu", "cuda") if spec.cuda else ("cpu",):
            marks = [pytest.mark.skip(reason="no CUDA device")] if device == "cuda" and not HAS_CUDA else []
            for dtype in spec.dtypes:
                dt = str(dtype).removeprefix("torch.")
                cases.append(pytest.param(name, device, dtype, id=f"{name}-{device}-{dt}", marks=marks))
    return cases


@needs_native
@pytest.mark.parametrize("name,device,dtype", _cases())
def test_opcheck(name, device, dtype, gen):
    samples = OPS[name].samples(torch.device(device), dtype, gen)
    assert samples, f"{name}: its sample builder gave no argument list"
    for args in samples:
        torch.library.opcheck(getattr(torch.ops.minisched, name).default, args)


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_samples_are_valid_inputs(name, gen):
    """Every sample passes all of the op's checks, the ones that read index values too, and runs on the
    reference (so opcheck is not passing inputs a kernel would only half read)."""
    for args in OPS[name].samples(torch.device("cpu"), torch.float32, gen):
        assert len(args) <= len(getattr(torch.ops.minisched, name).default._schema.arguments)
        ops.call_op(name, args, "torch")


def _first_tensor(args: tuple) -> int:
    return next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))


def _broken(args: tuple, how: str) -> tuple:
    """The sample with its first tensor argument (an input every op checks first) of a dtype no op takes,
    or with one dimension too few."""
    i = _first_tensor(args)
    bad = args[i].to(torch.int16) if how == "dtype" else args[i][0]
    return (*args[:i], bad, *args[i + 1 :])


def _error(fn) -> BaseException:
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    return info.value


@needs_native
@pytest.mark.parametrize("how", ["dtype", "rank"])
@pytest.mark.parametrize("tensors", ["fake", "meta"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_the_fake_raises_the_kernels_error(name, tensors, how, gen):
    """On FakeTensors (torch.compile's tracing) and on meta tensors the op runs its fake, which raises what
    the native kernel raises: the same exception, the op's name first, the same words (the lists of allowed
    dtypes differ: checks.py lets float64 through for the reference)."""
    op = getattr(torch.ops.minisched, name)
    args = _broken(OPS[name].samples(torch.device("cpu"), torch.float32, gen)[0], how)
    eager = _error(lambda: op(*args))
    if tensors == "meta":
        fake = _error(lambda: op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)))
    else:
        mode = FakeTensorMode()
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with mode:
            fake = _error(lambda: op(*fake_args))
    assert type(fake) is type(eager)
    assert str(fake).startswith(f"{name}: ")
    if how == "dtype":
        assert str(fake).split(", expected")[0] == str(eager).split(", expected")[0]
    else:
        assert str(fake) == str(eager)
