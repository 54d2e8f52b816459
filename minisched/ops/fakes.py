"""The fake (meta) kernels of the native ops, registered from the op table: an op's fake is its input checks.

torch.compile and torch.library.opcheck run an op on FakeTensors (shapes, dtypes and devices, no
data) through these. The ops write into preallocated outputs and return nothing, so a fake only runs
the op's input checks (ops/checks.py, with the op's own argument list) -- without the ones that read
index values, which a FakeTensor does not have -- and so raises the errors the op raises.
csrc/torch_bindings.cpp names this module (`m.set_python_module`): torch checks that the fakes are
registered from here and, where one is missing, names the module in its error. minisched.ops imports
it right after the extension.
"""

from __future__ import annotations

import torch

from minisched.ops.table import OPS

for _spec in OPS.values():
    torch.library.register_fake(f"minisched::{_spec.name}", _spec.input_checks(values=False))
