"""Smoke test of the CUDA variant of layerwise._C on a machine without a GPU.

Usage: python scripts/check_cuda_build.py BUILD_LIB_DIR
Imports the CUDA build found under BUILD_LIB_DIR/layerwise/, checks that it says
it is a CUDA build, that the CPU backend still works in it, and that asking for a
CUDA engine or a CUDA-pinned arena fails with a clear "no CUDA device" error
instead of crashing. Where a GPU is visible it checks one real copy instead.
"""
import glob
import importlib.util
import os
import sys

import torch


def load(build_lib):
    found = glob.glob(os.path.join(build_lib, "layerwise", "_C*.so"))
    if not found:
        sys.exit(f"check-cuda: no layerwise/_C*.so under {build_lib}")
    spec = importlib.util.spec_from_file_location("_C", found[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def expect_no_device(what, fn):
    try:
        fn()
    except RuntimeError as e:
        if "no CUDA device" not in str(e):
            sys.exit(f"check-cuda: {what} raised an unclear error: {e}")
        print(f"check-cuda: {what}: {e}")
        return
    sys.exit(f"check-cuda: {what} did not fail on a machine without a GPU")


def main():
    C = load(sys.argv[1] if len(sys.argv) > 1 else "build/cuda-check/lib")
    info = C.build_info()
    print(f"check-cuda: build_info {info}")
    assert info["with_cuda"] is True, info

    # The CPU backend is part of every build and must keep working.
    eng = C.CopyEngine("cpu")
    src = torch.arange(1 << 16, dtype=torch.uint8)
    arena = C.HostArena(1 << 16, pinned=False)
    dst = arena.allocate(1 << 16)
    eng.copy_async(dst, src).synchronize()
    assert torch.equal(dst, src)

    if C.cuda_device_count() == 0:
        expect_no_device("CopyEngine('cuda')", lambda: C.CopyEngine("cuda"))
        expect_no_device("HostArena(cuda=True)", lambda: C.HostArena(1 << 20, pinned=True, cuda=True))
        # cuda=None asks for CUDA pinning only where a device exists.
        a = C.HostArena(1 << 20, pinned=True)
        assert a.pin_kind in ("mlock",), a.pin_kind
    else:
        a = C.HostArena(1 << 20, pinned=True, cuda=True)
        host = a.allocate(1 << 20)
        host.copy_(torch.randint(0, 255, (1 << 20,), dtype=torch.uint8))
        dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        e = C.CopyEngine("cuda")
        e.copy_async(dev, host).synchronize()
        assert torch.equal(dev.cpu(), host)
        print(f"check-cuda: real copy on {torch.cuda.get_device_name()} ok, arena pinned={a.pinned}")
    print("check-cuda: ok")


if __name__ == "__main__":
    main()
