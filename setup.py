"""Build of layerwise and its native core, layerwise._C.

Which variant is built is chosen here, never from a visible GPU:
  LAYERWISE_BUILD=auto (default)  CUDA when torch is a CUDA build and a CUDA toolkit is found
  LAYERWISE_BUILD=cuda            CUDA; fails if no toolkit (cuda_runtime.h + libcudart) is found
  LAYERWISE_BUILD=cpu             CPU backend only
The CUDA variant uses the CUDA runtime API alone, so it needs no nvcc and also
builds against a CPU-only torch (what `make check-cuda` does).

The object files carry no debug information (-g0 over the -g of Python's own
build flags): it costs 40% of the compile time of a file that includes torch's
headers (gcc 12 on an AMD EPYC VM) and 31 of the library's 32 MB.
LAYERWISE_DEBUG_INFO=1 keeps it, for a debugger or a symbolized crash report.
"""
import glob
import os
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def find_cuda_runtime():
    """(include_dir, lib_dir, libcudart file name) of a CUDA toolkit, or None."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.environ[var])
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME:
            candidates.append(CUDA_HOME)
    except Exception:  # noqa: BLE001 - an odd toolkit layout must not break a CPU build
        pass
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for home in candidates:
        inc = os.path.join(home, "include")
        if not os.path.exists(os.path.join(inc, "cuda_runtime.h")):
            continue
        for lib in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            libdir = os.path.join(home, lib)
            if os.path.exists(os.path.join(libdir, "libcudart.so")):
                return inc, libdir, "cudart"
            versioned = sorted(glob.glob(os.path.join(libdir, "libcudart.so.*")))
            if versioned:
                return inc, libdir, ":" + os.path.basename(versioned[0])
    return None


def build_mode():
    mode = os.environ.get("LAYERWISE_BUILD", "auto").strip().lower()
    if mode not in ("auto", "cpu", "cuda"):
        sys.exit(f"LAYERWISE_BUILD must be auto, cpu or cuda, got {mode!r}")
    cuda = find_cuda_runtime()
    if mode == "cuda" and cuda is None:
        sys.exit(
            "LAYERWISE_BUILD=cuda but no CUDA toolkit was found (looked for include/cuda_runtime.h and "
            "libcudart under CUDA_HOME, CUDA_PATH and /usr/local/cuda*). Set CUDA_HOME to the toolkit."
        )
    use_cuda = mode == "cuda" or (mode == "auto" and torch.version.cuda is not None and cuda is not None)
    return use_cuda, cuda


def extension():
    use_cuda, cuda = build_mode()
    sources = ["csrc/bindings.cpp", "csrc/arena.cpp", "csrc/engine.cpp", "csrc/cpu/engine_cpu.cpp",
               "csrc/reader.cpp"]
    kwargs = dict(extra_compile_args=["-O3", "-std=c++20", "-fvisibility=hidden"], include_dirs=[os.path.join(ROOT, "csrc")])
    # lossless codec (layerwise._C.codec; its bindings are in bindings.cpp) and its AVX-512 decode (whose
    # functions carry their own target attribute: the rest of the build stays baseline x86-64)
    sources += ["csrc/codec/encode.cpp", "csrc/codec/decode.cpp", "csrc/codec/decode_avx512.cpp"]
    if use_cuda:
        inc, libdir, lib = cuda
        # Only relevant to device code, of which there is none here; set so that
        # torch's build helpers do not probe for a GPU on a build node.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        sources.append("csrc/cuda/engine_cuda.cpp")
        kwargs["extra_compile_args"].append("-DLAYERWISE_WITH_CUDA")
        kwargs.update(include_dirs=kwargs["include_dirs"] + [inc], library_dirs=[libdir], libraries=[lib],
                      runtime_library_dirs=[libdir])
    if os.environ.get("LAYERWISE_DEBUG_INFO", "0") in ("", "0"):
        kwargs["extra_compile_args"].append("-g0")
    print(f"layerwise: building the {'CUDA' if use_cuda else 'CPU'} variant of layerwise._C", file=sys.stderr)
    return CppExtension("layerwise._C", sources, **kwargs)


setup(
    packages=["layerwise", "layerwise.bench", "layerwise.codec", "layerwise.contract", "layerwise.formats",
              "layerwise.planning", "layerwise.runtime", "layerwise.stages", "layerwise.stages.disk",
              "layerwise.stages.split", "layerwise.triton_kernels"],
    package_dir={"layerwise.triton_kernels": "triton_kernels"},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
