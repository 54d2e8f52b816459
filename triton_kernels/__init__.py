"""Triton kernels of minisched: one file per op family (kernel(s), launcher, nothing else).

Each module registers its ops as `torch.ops.minisched_triton.<op>` (torch.library.triton_op,
so torch.compile sees the kernels) and exposes a plain launcher named after the op with the
op's argument list (outputs preallocated, returns None). minisched.ops imports them by name
(`ops.triton_launchers`) when the "triton" backend is first asked for: triton is optional.

This folder sits at the top of the tree and is installed as `minisched.triton_kernels`
(setup.py's package_dir), never as `triton_kernels`: that name is Triton's own kernel
library. The modules import only torch, triton and each other (tests/test_layers.py).
"""
