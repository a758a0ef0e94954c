"""Ctrl-C held back while a step that must not be split runs (a rollback, a removal's
commit, a file and the record that closes it), then delivered."""
from __future__ import annotations

import contextlib
import os
import signal
import threading


# ------------------------------------------------------------- interrupts
@contextlib.contextmanager
def defer_interrupts():
    """Hold SIGINT back while a rollback runs (main thread only), then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if previous is signal.default_int_handler:
                raise KeyboardInterrupt
            if previous == signal.SIG_DFL:  # the default action: the process ends by SIGINT
                os.kill(os.getpid(), signal.SIGINT)
            elif callable(previous):
                previous(*caught[0])
