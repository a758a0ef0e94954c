"""What the meter times, checked structurally (tests/runtime/test_cuda_path.py, and
a split-fetch rank of tests/helpers/cuda_path_worker.py): every timed fetch that moved
bytes must come back with a start, and that start must be a copy's start
(`Event.start` of an event the transfer stage issued), whatever stage the fetch
ends in: a copy, a decode, a gather, the last of a disk read's copies. A stage
that loses the start (a decode or gather event with no start, or timed from its
own start instead of the copy's) fails here on the CPU backend as on CUDA.

Identity is the check: a start is a native event whose Python object pybind
hands back as long as one reference to it lives (`starts` below keeps them)."""
from layerwise.runtime.meter import Meter
from layerwise.stages.transfer import Transfer


class FetchLog:
    """Records every copy's start and every timed fetch while installed; a context
    manager (it patches two methods of the classes, and puts them back)."""

    def __init__(self):
        self.starts = []  # the start of every timed copy the transfer stage issued
        self.fetches = []  # (meter, result, bytes) of every fetch issued on a timed step

    def __enter__(self):
        log = self
        self._copy, self._fetched = Transfer.copy, Meter.fetched
        real_copy, real_fetched = self._copy, self._fetched

        def copy(self, *args, **kwargs):
            ev = real_copy(self, *args, **kwargs)
            if ev.start is not None:
                log.starts.append(ev.start)
            return ev

        def fetched(self, src, prefetch, result, layer=-1):
            if self.timing:
                log.fetches.append((self, result, src.transfer_bytes))
            return real_fetched(self, src, prefetch, result, layer)

        Transfer.copy, Meter.fetched = copy, fetched
        return self

    def __exit__(self, *exc):
        Transfer.copy, Meter.fetched = self._copy, self._fetched

    def check(self, managers) -> int:
        """Each timed fetch that moved bytes and completed has a start, one of a
        copy's; the meters counted none without; returns how many were checked."""
        for m in managers:
            m.stats(sync=True)  # every fetch done and its time resolved
        checked = 0
        for meter, result, nbytes in self.fetches:
            if not nbytes or not result.query():  # (a prefetch for the next step: a gather not issued yet)
                continue
            start = result.start
            assert start is not None, f"a timed fetch of {nbytes} bytes ({type(result).__name__}) has no start"
            assert any(start is s for s in self.starts), (
                f"a timed fetch of {nbytes} bytes ({type(result).__name__}) is timed from a start that is no copy's "
                "(a decode's or gather's own): its time leaves out the copy")
            assert result.copy_ms >= 0
            checked += 1
        assert checked, "no timed fetch moved bytes: nothing was checked"
        for m in managers:
            assert m.meter.unstarted == 0, (m.layer_name, m.meter.unstarted)
        return checked
