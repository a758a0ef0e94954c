"""share_host on a GPU (scripts/gpu_check.sh runs these in its `capture` stage;
without a GPU they skip: tests/test_share_host.py and tests/runtime/test_shared_arena.py
cover the CPU backend). The attaching process's mapping of a shared arena is
read-only, so CUDA must pin it with cudaHostRegisterReadOnly: it must be pinned
(not pageable, no pin_error), copies from it must be exact, and two models in
one process (the second attaches) must stream bitwise on the device."""
import time
import uuid

import pytest
import torch

import layerwise
from layerwise import _native
from layerwise.runtime import shared_arena

from helpers.contract import inputs, make
from helpers.devices import cuda_usable

pytestmark = pytest.mark.skipif(not cuda_usable(), reason="needs a GPU (cudaHostRegister of a read-only mapping)")

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def test_a_read_only_shared_mapping_is_pinned_and_copies_exactly():
    n = 256 << 20
    f = shared_arena.SharedFile.create(f"cuda-{uuid.uuid4().hex[:8]}", n)
    try:
        rw = _native.HostArena.over_fd(f.fd, f.data_offset, n, writable=True, pinned=True, cuda=True)
        block = rw.allocate(n, alignment=4096)
        block.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        rw.protect()
        f.seal(b"\0" * 32, {"test": True})
        ro = _native.HostArena.over_fd(f.fd, f.data_offset, n, writable=False, pinned=True, cuda=True)
        view = ro.view(0, n)
        assert ro.pin_kind == "cuda" and ro.pin_error is None, ro.pin_error
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        for _ in range(2):  # the second timed (the first warms up)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(view, non_blocking=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        print(f"h2d from a read-only shared mapping: {n / dt / 2**30:.1f} GiB/s")
        assert torch.equal(dst.cpu(), block)
    finally:
        f.close()


def test_two_models_share_one_arena_on_the_device():
    key = f"cuda-{uuid.uuid4().hex}"
    ref = make(seed=0).cuda()
    a, b = make(seed=0), make(seed=0)
    ma = layerwise.configure_layerwise_offload(a, GROUPS, device="cuda", share_host=key, pin_memory=True)
    mb = layerwise.configure_layerwise_offload(b, GROUPS, device="cuda", share_host=key, pin_memory=True)
    assert [m.stats()["share_host"]["role"] for m in mb] == ["attached", "attached"]
    assert all(m.stats()["arena_pinned"] for m in ma + mb)
    with torch.no_grad():
        for x in inputs():
            x = x.cuda()
            want = ref(x)
            assert torch.equal(a(x), want) and torch.equal(b(x), want)
