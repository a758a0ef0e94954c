import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before any
# kernel module is imported, so the scatter kernel runs on CPU tensors in CI.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests live in folders that mirror the source (tests/runtime/ for layerwise/runtime/,
# ...; the front doors' own tests at the top). pytest imports this file with its folder on
# sys.path (the default "prepend" import mode), so every test module imports its shared
# fixtures and models from tests/helpers/ as `helpers.<module>`, never from another test
# module (tests/test_layout.py checks it). Test file names are unique across the folders:
# pytest imports each test module by its file name.
from helpers.devices import cuda_usable  # noqa: E402  (imports layerwise, TRITON_INTERPRET set)

# One compute thread: the copy engine's workers need the other core, and an
# OpenMP pool spinning against them on a 2-core machine slows steps 100-fold.
torch.set_num_threads(1)

# The tests send real SIGINTs (here and to the scripts they start). A shell that runs
# pytest as a background job (`cmd &` without job control) starts it with SIGINT
# ignored, Python then keeps it ignored, and so do the children: no interrupt would
# land. Ctrl-C is Python's KeyboardInterrupt here, as for a user at a terminal.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not cuda_usable():
        pytest.skip("no CUDA device (or a CPU-only build): the CUDA variant runs in scripts/gpu_check.sh")
    return request.param


# LAYERWISE_TEST_TIMEOUT=S (scripts/gpu_check.sh sets it): a test still running
# after S seconds fails with a TimeoutError instead of eating the stage's time.
_TEST_TIMEOUT = float(os.environ.get("LAYERWISE_TEST_TIMEOUT", "0") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    import signal
    import threading

    if _TEST_TIMEOUT <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past LAYERWISE_TEST_TIMEOUT={_TEST_TIMEOUT:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, _TEST_TIMEOUT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# LAYERWISE_CUDA_ONLY=1 (scripts/gpu_check.sh): only the tests that run on the GPU,
# so that the GPU's minutes go to what CI cannot run: the "cuda" variants of
# device-parametrized tests, and of the others those whose name says cuda or gpu or
# that skip without a GPU. (`-k cuda` would also take every test of a file whose
# name says cuda, and the cpu variants of tests whose name does.)
def _needs_gpu(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "device" in params:  # (the device fixtures: this one, codec/conftest.py's, test_scatter's)
        return params["device"] == "cuda"
    if "cuda" in item.name or "gpu" in item.name:
        return True
    return any(m.args and "GPU" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LAYERWISE_CUDA_ONLY") != "1":
        return
    keep = [it for it in items if _needs_gpu(it)]
    dropped = [it for it in items if not _needs_gpu(it)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
