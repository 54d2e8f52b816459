"""Builds one extension, minisched.ops._C: the C++ CPU kernels always, the CUDA kernels (sm_90a)
whenever nvcc and a CUDA build of torch are present. A CPU-only torch gets a CPU-only build.

The Triton kernels sit at the top of the tree (triton_kernels/) and ship inside the package as
minisched.triton_kernels (package_dir below): the top-level name `triton_kernels` is Triton's own
kernel library (vLLM imports it), so nothing is installed under it.

MINISCHED_CUDA=0 forces a CPU-only build (quick local iteration); =1 makes a missing CUDA
toolchain an error instead of a fallback.
"""

import glob
import os
import shutil

# torch guesses CUDA_HOME from `which nvcc`, which is a wrapper script here: point it at the toolkit.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
# Without a GPU torch cannot detect the arch (and crashes): Hopper is the target.
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_cuda() -> bool:
    mode = os.environ.get("MINISCHED_CUDA", "auto")
    available = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and (shutil.which("nvcc") is not None or os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))
    )
    if mode == "1" and not available:
        raise RuntimeError("MINISCHED_CUDA=1 but no CUDA build of torch or no nvcc/CUDA_HOME was found")
    return mode != "0" and available


def cuda_include_dirs() -> list:
    """/usr/local/cuda may lack the math-library headers ATen pulls in; the pip CUDA wheels have them."""
    dirs = []
    for pattern in ("nvidia/cu13/include", "nvidia/*/include"):
        for site in __import__("site").getsitepackages():
            dirs += sorted(glob.glob(os.path.join(site, pattern)))
    return dirs


def extension():
    sources = ["csrc/torch_bindings.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3", "-g0", "-std=c++20", "-fopenmp"] + (["-march=x86-64-v3"] if os.uname().machine == "x86_64" else [])
    kwargs = dict(include_dirs=[os.path.join(ROOT, "csrc")], extra_link_args=["-fopenmp"])
    if build_cuda():
        # -warn-spills + -Werror: a register spill in any kernel fails the build (checked in CI).
        nvcc = [
            "-O3",
            "-std=c++20",
            "--use_fast_math",
            "--expt-relaxed-constexpr",
            "-lineinfo",
            "-Xptxas=-warn-spills,-Werror",
        ]
        return CUDAExtension(
            "minisched.ops._C",
            sources + sorted(glob.glob("csrc/cuda/*.cu")),
            extra_compile_args={"cxx": cxx + ["-DMINISCHED_CUDA"], "nvcc": nvcc},
            **kwargs,
        )
    return CppExtension("minisched.ops._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)


class BuildExt(BuildExtension):
    """A fixed build folder, so that pip's editable installs reuse ninja's incremental build."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", "temp")


setup(
    packages=[*find_packages(include=["minisched", "minisched.*"]), "minisched.triton_kernels"],
    package_dir={"minisched.triton_kernels": "triton_kernels"},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
)
