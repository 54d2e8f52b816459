"""Triton kernels of minisched: one file per op family (kernel(s), launcher, nothing else).

Each module registers its ops as `torch.ops.minisched_triton.<op>` (torch.library.triton_op,
so torch.compile sees the kernels) and exposes a plain launcher named after the op with the
op's argument list (outputs preallocated, returns None). minisched/ops imports a module
only when the "triton" backend is asked for. It lives inside the package because a top-level
`triton_kernels` would collide with Triton's own kernel library of that name.
"""
