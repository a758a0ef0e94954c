"""A real SIGINT at a random moment of a call (the tests of interrupts that land
anywhere: tests/runtime/test_residency.py, tests/contract/test_compile_native.py)."""
import os
import signal
import threading
import time


def call_with_a_random_sigint(call, rng, span: float, within: float = 1.5, after: float = 1.6) -> None:
    """Run `call()` while a timer sends this process a real SIGINT at a random moment
    within `within * span` seconds; the KeyboardInterrupt, wherever it lands (inside
    the call, in the `after * span` s waited after it, or while the timer is joined),
    is swallowed. How many land is the machine's business."""
    timer = threading.Timer(rng.uniform(0, within * span), os.kill, (os.getpid(), signal.SIGINT))
    try:
        try:
            timer.start()  # (a timer that fires at once interrupts its own start)
            call()
            time.sleep(after * span)  # (an interrupt after the call lands here)
        finally:
            timer.cancel()
            timer.join()
        time.sleep(0.005)  # (a signal sent while joining is taken here)
    except KeyboardInterrupt:
        pass
