"""SplitGroup: the private process group of a split-fetch group and the thread that
issues its collectives in order, each preceded by the lockstep check (see the
package doc)."""
from __future__ import annotations

import atexit
import datetime
import os
import queue
import threading
import weakref

import torch

from layerwise import _native


def default_timeout_s() -> float:
    """Seconds a split-fetch collective may wait for the other ranks before it
    raises (LAYERWISE_COLLECTIVE_TIMEOUT_S, default 300)."""
    return float(os.environ.get("LAYERWISE_COLLECTIVE_TIMEOUT_S", "300"))


_ALL_GATHER = []  # the all-gather into one tensor this torch has, looked up once


def gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    if not _ALL_GATHER:
        import torch.distributed as dist

        _ALL_GATHER.append(getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)
    return _ALL_GATHER[0](out, inp, group=group, async_op=async_op)


class SplitError(RuntimeError):
    """A split-fetch collective failed or the ranks disagree."""


# Every collective on the private group is preceded by an all-gather of a fixed-size
# tag saying what it is (the lockstep check): ranks that would gather different
# layers (or a layer and a host read) find out there, before a byte of the layer
# moves and before gloo sees buffers of different sizes, and raise on every rank.
GATHER, READ, COMPARE, LOAD, LOCAL_FAILED, WRITTEN, TURN = 1, 2, 3, 4, 5, 6, 7
_KIND = {GATHER: "a forward's gather of", READ: "a host read (state_dict, load_state_dict, remove) of",
         COMPARE: "the check of new values (load_state_dict, an edit) of",
         LOAD: "the check of a load_state_dict's values for",
         LOCAL_FAILED: "to say that its local copy failed, a forward's gather of",
         WRITTEN: "the check that every rank wrote its share (load_state_dict, an edit) of",
         TURN: "the start of run_together's turn"}
_MAGIC = 0x4C57_5350  # "LWSP": a tag, not a stray tensor
_TAG = 8  # int64s: magic, kind, layer group, layer, bytes, version, and two words of payload (a digest)
SAME = 6  # the fields every rank must agree on
WHY_BYTES = 1024  # a failed write's error text, per rank (gathered only where a write failed)


# ------------------------------------------------------------------ the group
class SplitGroup:
    """One process group's split fetch: its rank and size, the timeout, the gloo
    group for host-side collectives and (CPU) the thread that runs every
    collective of the group in the order issued. Shared by the managers of one
    configure call (several layer groups stream through the same ranks)."""

    def __init__(self, pg, device: torch.device, timeout_s: float | None = None):
        import torch.distributed as dist

        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.world = dist.get_world_size(pg)
        self.backend = str(dist.get_backend(pg)).lower()
        self.device = device
        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        self.gather_pg = pg  # the slot gathers (CPU: a private gloo group, made by make_private_groups)
        self.host_pg = None  # host-side collectives: a private gloo group (make_private_groups)
        self.stream = None  # CUDA: the gather stream
        self._jobs: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._users = 0
        self._closed = False  # close(): the private group is gone, no collective may be issued
        self._lock = threading.Lock()
        self.last_read = None  # (source id, version, full block): consecutive reads of one layer gather once
        self.layer_names: list[str] = []  # the layer groups streamed through this group, in attach order
        self._stores: list = []  # weakrefs to their ShareStores
        # CPU: why the group's last collective failed, until the failure reached the user
        # (the queued collectives after it fail without being issued: every rank drops the
        # same ones, so that the next call made in lockstep pairs up again).
        self._broken: str | None = None

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def make_private_groups(self) -> None:
        """A gloo group of our own over the same ranks, so that our collectives never
        interleave with the user's on their group (a sequence-parallel model's
        all-to-alls): on CPU our thread issues them while the model computes, in an
        order the user's code does not see. It carries the CPU slot gathers and the
        host-side collectives; on CUDA the slot gathers stay on the NCCL group, issued
        from the hooks in program order. Collective itself: attach() calls it on every
        rank, right after validation."""
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self.pg)
        self.host_pg = dist.new_group(ranks, backend="gloo", timeout=self.timeout, use_local_synchronization=True)
        _LIVE.add(self)  # close() destroys it at exit (_stop_all)
        if self.device.type == "cuda":
            self.stream = _native.dedicated_cuda_stream(self.device)  # not torch's pool: no one else's
        else:
            self.gather_pg = self.host_pg

    def register(self, store) -> int:
        """A ShareStore's number in this group (the same on every rank: validated order)."""
        self.layer_names.append(store.layer_name)
        self._stores.append(weakref.ref(store))
        return len(self.layer_names) - 1

    def wait(self, work, what: str) -> None:
        try:
            ok = work.wait(timeout=self.timeout)
        except RuntimeError as e:
            raise self.fail(self._failed(what, e)) from None
        if ok is False:
            raise self.fail(self._failed(what, "timed out"))

    def fail(self, why: str) -> SplitError:
        """The SplitError to raise for `why`; on the host backends the group is broken
        from now on (the collectives queued behind fail without being issued)."""
        if self.device.type != "cuda":  # CUDA issues from the caller's thread: nothing queued behind it
            self._broken = why
        return SplitError(why)

    def agree(self, kind: int, store_id: int, layer: int, nbytes: int, version: int, payload=(0, 0)) -> list:
        """The tag exchange before a collective (on the private gloo group, host
        tensors: 64 bytes per rank). Raises SplitError on every rank, naming what
        each rank wanted, if they are about to run different collectives; the
        tags (every rank's row) otherwise. Its cost: one small all-gather per
        collective (measured in BENCHMARKS.md / the report)."""
        if self._broken is not None:
            raise SplitError(self._broken)
        mine = torch.tensor([_MAGIC, kind, store_id, layer, nbytes, version, *payload], dtype=torch.int64)
        out = torch.empty(self.world * _TAG, dtype=torch.int64)
        self.wait(gather(out, mine, self.host_pg, async_op=True),
                  f"the lockstep check before {self._what(mine.tolist())}")
        rows = out.view(self.world, _TAG).tolist()
        if all(r[:SAME] == rows[0][:SAME] for r in rows):
            return rows
        sides = {}
        for r, row in enumerate(rows):
            sides.setdefault(self._what(row), []).append(r)
        told = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} wanted {what}"
                         for what, rs in sides.items())
        raise self.fail(
            f"layerwise split fetch: the ranks of the split_fetch group are out of lockstep (rank {self.rank} of "
            f"{self.world} here): {told}. Every rank must make the same calls in the same order (the same layers "
            "in every forward, state_dict / load_state_dict / remove_layerwise_offload on every rank at the same "
            "point). Nothing was gathered: no rank computed with another layer's bytes; the layers are fetched "
            "again at the next calls, once every rank makes them in the same order.")

    def _what(self, row) -> str:
        if row[0] != _MAGIC:
            return f"a collective that is not layerwise's ({row[:3]}...)"
        kind, store_id, layer, nbytes, version = row[1:SAME]
        if kind == TURN:  # (runtime/turns.py: the turn's number, the session's calls)
            return f"{_KIND[TURN]} {layer} of {nbytes} calls"
        name = self.layer_names[store_id] if 0 <= store_id < len(self.layer_names) else f"layer group #{store_id}"
        extra = f", version {version}" if version else ""
        what = _KIND.get(kind, f"collective kind {kind} of")
        return f"{what} {name}" if layer < 0 else f"{what} {name}[{layer}] ({nbytes} bytes{extra})"

    def surfaced(self) -> None:
        """A failed collective reached the user (raised from a hook or a host read):
        the collectives queued before now fail too, without being issued, and the
        ones issued after run again; every manager of the group reloads its slots
        (a failed gather left its slot's bytes unknown)."""
        for ref in self._stores:
            store = ref()
            m = store.owner() if store is not None else None
            if m is not None:
                m.forget_slots()
        if self.device.type == "cuda" or self._broken is None:
            return

        def clear(later):
            self._broken = None

        try:
            self.submit(clear)
        except SplitError:
            pass  # closed: nothing can be issued any more

    def _failed(self, what: str, why) -> str:
        return (f"layerwise split fetch: {what} failed on rank {self.rank} of {self.world}: {why}. Every rank of "
                f"the split_fetch group must make the same calls in the same order (forward passes, state_dict, "
                f"load_state_dict, remove_layerwise_offload); a rank that stopped, raised or fell out of lockstep "
                f"leaves the others waiting until the timeout ({self.timeout_s:g} s, "
                "LAYERWISE_COLLECTIVE_TIMEOUT_S). Tear the process group down and start again.")

    # -- the CPU collective thread
    def _run(self, jobs: queue.Queue) -> None:
        # A second thread waits for the slot gathers this one issued, so that the next
        # gather's lockstep check (a small all-gather: a round trip) overlaps the
        # transfer of the one before; gloo runs the two at once, in the order issued.
        pending: queue.Queue = queue.Queue()
        waiter = threading.Thread(target=self._finish, args=(pending,), daemon=True,
                                  name=f"layerwise-gather-wait-r{self.rank}")
        waiter.start()
        try:
            while True:
                job = jobs.get()
                if job is None:
                    return
                job(pending.put)
        finally:
            pending.put(None)
            waiter.join()

    @staticmethod
    def _finish(pending: queue.Queue) -> None:
        while True:
            finish = pending.get()
            if finish is None:
                return
            finish()

    def _check_open(self) -> None:
        if self._closed:
            raise SplitError(f"layerwise split fetch: rank {self.rank}'s split-fetch group was closed (its last "
                             "layer group was removed, or the interpreter exits): no collective can run on it")

    def submit(self, job) -> None:
        with self._lock:
            self._check_open()
            if self._thread is None:
                self._jobs = queue.Queue()
                self._thread = threading.Thread(target=self._run, args=(self._jobs,), daemon=True,
                                                 name=f"layerwise-gather-r{self.rank}")
                self._thread.start()
        self._jobs.put(job)

    def call(self, fn):
        """Run fn() after every collective issued so far (host-side collectives:
        the same order as the slot gathers on every rank); its result or error."""
        if self.device.type == "cuda":
            self._check_open()
            try:
                return fn()  # host collectives have a gloo group of their own
            except SplitError:
                self.surfaced()
                raise
        done = threading.Event()
        box = {}

        def job(later):
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            done.set()

        self.submit(job)
        done.wait()
        if "error" in box:
            if isinstance(box["error"], SplitError):
                self.surfaced()
            raise box["error"]
        return box["value"]

    def acquire(self) -> None:
        self._users += 1

    def release(self) -> None:
        self._users -= 1
        if self._users <= 0:
            self.stop()  # the private group stays until exit (_stop_all): destroyed, a new group over the
            self.pg = None  # same ranks would take its hashed name and find its stale rendezvous keys

    def stop(self, join_s: float | None = None) -> bool:
        """End the thread once the collectives queued so far have run (or failed);
        False if it is still running after join_s (stuck in a collective)."""
        with self._lock:
            thread, jobs, self._thread, self._jobs = self._thread, self._jobs, None, None
        ended = True
        if thread is not None:
            jobs.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout=self.timeout_s if join_s is None else join_s)
                ended = not thread.is_alive()
        self.last_read = None
        return ended

    def close(self, join_s: float | None = None) -> None:
        """At exit (_stop_all), before the interpreter finalises: end the thread, then destroy
        the private gloo group and drop every reference to a process group, while the
        interpreter is whole. A gloo group that outlives it (never destroyed, or kept
        alive by a reference of ours after the user's destroy_process_group) keeps its
        worker threads; one that drops its last work (which holds Python tensors)
        during finalisation needs the GIL, is ended by the interpreter and aborts the
        process (SIGABRT, "terminate called without an active exception").
        Destroying the group joins its threads; gloo's teardown is local, not
        collective. Not collective; nothing can be issued on the group afterwards."""
        import torch.distributed as dist

        if not self.stop(join_s):
            return  # our thread is stuck in a collective on the group: leave the group be
        with self._lock:
            self._closed = True
            host_pg, self.host_pg, self.gather_pg, self.pg = self.host_pg, None, None, None
        _LIVE.discard(self)
        if host_pg is not None:
            try:
                dist.destroy_process_group(host_pg)
            except (ValueError, RuntimeError, AssertionError):
                pass  # already gone: the user's destroy_process_group() destroyed every group
        del host_pg  # the last reference: ~ProcessGroupGloo joins its threads (it releases the GIL)


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # the collective threads and our private groups end before the interpreter does
    for g in list(_LIVE):
        g.close(join_s=1.0)  # a daemon thread stuck on a peer that is gone must not hold up the exit
