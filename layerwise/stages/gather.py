"""gather: split fetch over torch.distributed (issue 16; DESIGN.md, "Tiers and stages").

Ranks that run the same model in lockstep (sequence / context parallel
inference: every rank holds the full weights and runs every layer) each keep
only a contiguous share of every streamed layer's block in host memory and copy
only that share over their own host link; an all-gather over the group then
completes the layer in every rank's slot:

    share (host, this rank's part of the layer)
      -> transfer  copy engine: share -> this rank's part of the slot
      -> gather    all_gather_single(slot, this rank's part)   (NCCL / gloo)

Shares: ``share = round_up(ceil(nbytes / world), SHARE_ALIGN)``; rank r holds
bytes ``[r * share, min((r + 1) * share, nbytes))`` of the plan-layout block
(the last rank's may be shorter, a rank's may be empty for a tiny layer). The
gather needs ``world * share`` bytes of slot, a little more than ``nbytes``:
``ShareSource.slot_bytes`` tells the manager how large its ring slots must be.

Ordering. A collective must be issued by every rank of the group in the same
order. The manager's prefetch order is deterministic and its synchronous loads
follow the layers called, so lockstep ranks issue the same gathers in the same
order. Our collectives run on a private gloo group over the same ranks, made at
configure, so they never interleave with the user's own collectives on their
group (a sequence-parallel model's all-to-alls). On the CPU backend every
collective of a group (the slot gathers and the host-side ones below) runs on
one thread per group, in the order issued: a
gather waits for its local copy there, then completes a host event
(``_C.host_event``) that the compute waits on and that the next copy into the
slot chains after, so no slot is overwritten while a gather into it is in
flight. On CUDA the gather is issued from the hook on a dedicated stream that
first waits (on the device) for the local copy's event; NCCL orders itself
after that stream and the stream after NCCL, and an event recorded there is
what the compute stream and the slot's next copy wait on: no host sync in the
hot path (the CUDA path is written for NCCL and not run in CI: no GPU there).
Host-side collectives go through the private gloo group.

The lockstep check (issue 21). Every collective on the private group is
preceded by an all-gather of a 64-byte tag per rank (``SplitGroup.agree``): what
it is (a forward's gather, a host read, a check of new values), the layer group,
the layer, its bytes and version. Ranks about to run different collectives (one
calls the blocks in another order, one calls state_dict() while another runs a
forward) find out there - before a byte of the layer moves, and before gloo
sees buffers of different sizes (it aborts the process then) - and raise
``SplitError`` on every rank naming what each wanted. On CPU the collectives
queued behind a failed one fail too, without being issued, until the failure
has reached the user (``surfaced``); every manager of the group then reloads its
slots, so the next calls made in lockstep pair up again and are exact. A local
part that fails on one rank (its copy, or a read of a changed file, when queued
or when deferred) still goes to its gather, in order, which tells the others
(``LOCAL_FAILED``: they raise at once) instead of leaving them waiting for the
timeout (which would leave the group unusable). Cost:
one small all-gather per collective; on CPU a second thread waits for each
gather, so the next check overlaps the transfer (BENCHMARKS.md). On CUDA the
check runs on the host, from the hook, before the local copy and the NCCL
gather are issued (a host round trip per layer; written, not run: no GPU).

At configure the validation all-gather also carries a CRC-32 of every split
layer's bytes (``layer_values``): ranks built with different weights are refused
on every rank, naming the first differing layer. load_offloaded, where each rank
reads only its share, compares what every rank can read cheaply instead
(loading._sampled_values).

Which operations are collective (every rank of the group must call them, in the
same order, or they raise SplitError: at once where the ranks disagree, after
``timeout_s`` where a rank does not take part):

    configure_layerwise_offload / load_offloaded / offload_pipeline with
        split_fetch (one all-gather validates the configuration on every rank)
    every forward (the slot gathers): ranks run the same layers in the same order
    state_dict()       a streamed layer's true bytes are gathered on the host
    load_state_dict()  and peft merge/unmerge: the layer is gathered, edited and
                       the edited bytes compared across ranks (a digest); ranks
                       that loaded different values refuse on every rank, the
                       model unchanged. Then each rank writes its share and the
                       ranks agree on how that went (WRITTEN); where one failed
                       (a full disk, an encode out of memory) the others undo
                       theirs (Source.write(undo=True)) and every rank raises the
                       same SplitError, naming the rank and its error, the layer
                       unchanged on every rank and the group usable
    remove_layerwise_offload()  gathers every layer to give back full parameters
    a backward that needs a layer's weights again (rare: after its slot refilled)

Non-collective (never issue a collective): stats(), report(), `.to(device)`,
attribute access, hooks of resident layers.

Not supported: DTensor (tensor-parallel) weights - each rank's weights differ
already, there is nothing to split - refused at configure. An interrupt or an
error on one rank only, or a rank that skips a call, leaves the others waiting:
their next collective times out (``timeout_s``) and raises SplitError; a gloo
group with a timed-out collective should then be torn down.

Compression (issue 15) composes at the ``share`` step: a rank would encode its
share when storing it and its local stage would become transfer -> decode into
its part of the slot; the gather is unchanged. Not wired here.
"""
from __future__ import annotations

import atexit
import datetime
import hashlib
import os
import queue
import threading
import time
import weakref
import zlib

import torch

from layerwise import _native
from layerwise.plan import BLOCK_ALIGN, round_up
from layerwise.stages.result import Recovered, detached, is_deferred, then
from layerwise.stages.source import ArenaSource

SHARE_ALIGN = 512  # bytes: every rank's part of a slot starts 512-byte aligned (vectorised copies, NCCL)


def default_timeout_s() -> float:
    """Seconds a split-fetch collective may wait for the other ranks before it
    raises (LAYERWISE_COLLECTIVE_TIMEOUT_S, default 300)."""
    return float(os.environ.get("LAYERWISE_COLLECTIVE_TIMEOUT_S", "300"))


def share_span(nbytes: int, rank: int, world: int) -> tuple[int, int, int]:
    """(share, lo, hi): every rank's share size and this rank's byte range of a block."""
    share = round_up(-(-nbytes // world), SHARE_ALIGN) if nbytes else 0
    lo = min(rank * share, nbytes)
    return share, lo, min(lo + share, nbytes)


def split_layers(manager) -> frozenset:
    """The layers split across ranks: every streamed (non-resident) layer with bytes.
    A small function of its own, so that tiers can be combined (disk, compression)."""
    resident = set(manager.resident)
    return frozenset(lp.index for lp in manager.plan.layers if lp.index not in resident and lp.nbytes)


_ALL_GATHER = []  # the all-gather into one tensor this torch has, looked up once


def _gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
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
GATHER, READ, COMPARE, LOAD, LOCAL_FAILED, WRITTEN = 1, 2, 3, 4, 5, 6
_KIND = {GATHER: "a forward's gather of", READ: "a host read (state_dict, load_state_dict, remove) of",
         COMPARE: "the check of new values (load_state_dict, an edit) of",
         LOAD: "the check of a load_state_dict's values for",
         LOCAL_FAILED: "to say that its local copy failed, a forward's gather of",
         WRITTEN: "the check that every rank wrote its share (load_state_dict, an edit) of"}
_MAGIC = 0x4C57_5350  # "LWSP": a tag, not a stray tensor
_TAG = 8  # int64s: magic, kind, layer group, layer, bytes, version, and two words of payload (a digest)
_SAME = 6  # the fields every rank must agree on
_WHY_BYTES = 1024  # a failed write's error text, per rank (gathered only where a write failed)


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
            raise self._break(self._failed(what, e)) from None
        if ok is False:
            raise self._break(self._failed(what, "timed out"))

    def _break(self, why: str) -> SplitError:
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
        self.wait(_gather(out, mine, self.host_pg, async_op=True),
                  f"the lockstep check before {self._what(mine.tolist())}")
        rows = out.view(self.world, _TAG).tolist()
        if all(r[:_SAME] == rows[0][:_SAME] for r in rows):
            return rows
        sides = {}
        for r, row in enumerate(rows):
            sides.setdefault(self._what(row), []).append(r)
        told = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} wanted {what}"
                         for what, rs in sides.items())
        raise self._break(
            f"layerwise split fetch: the ranks of the split_fetch group are out of lockstep (rank {self.rank} of "
            f"{self.world} here): {told}. Every rank must make the same calls in the same order (the same layers "
            "in every forward, state_dict / load_state_dict / remove_layerwise_offload on every rank at the same "
            "point). Nothing was gathered: no rank computed with another layer's bytes; the layers are fetched "
            "again at the next calls, once every rank makes them in the same order.")

    def _what(self, row) -> str:
        if row[0] != _MAGIC:
            return f"a collective that is not layerwise's ({row[:3]}...)"
        kind, store_id, layer, nbytes, version = row[1:_SAME]
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
            m = store._manager() if store is not None else None
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


# ------------------------------------------------------------ configure time
def _digest(value) -> int:
    h = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


_FIELDS = ("layer groups", "layers per group", "bytes per layer", "dtypes per layer", "resident layers",
           "prefetch_depth", "split layers", "device type", "world size", "streamed layers' values")
_VALUES = len(_FIELDS) - 1


def layer_crc(lp):
    """CRC-32 of a layer's parameters' bytes (each storage span, in plan order: the
    bytes its block packs), or None where a parameter has no values yet (meta).
    zlib.crc32 runs at 4.9 GB/s on one core of the 2-core CPU VM (blake2b: 1.3;
    BENCHMARKS.md, "The lockstep check's cost"): about 0.2 s per GB streamed."""
    crc = 0
    for e in lp.params:
        data = e.source()
        if data.is_meta:
            return None
        flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset()).view(torch.uint8)
        crc = zlib.crc32(flat.cpu().numpy(), crc)
    return crc


def layer_values(managers, values=None) -> list:
    """Per split layer (in manager, layer order): a digest of its values that must be
    the same on every rank. `values(manager, lp)` gives it where the parameters have
    no values yet (load_offloaded: layerwise.loading says what it compares); None
    (not compared) where neither can."""
    out = []
    for m in managers:
        for i in sorted(split_layers(m)):
            lp = m.plan.layers[i]
            crc = layer_crc(lp)
            if crc is None and values is not None:
                crc = values(m, lp)
            out.append(-1 if crc is None else int(crc))
    return out


def describe(managers, world: int, device: torch.device, crcs=()) -> list:
    """What must match on every rank, field by field (see _FIELDS)."""
    return [
        [m.layer_name for m in managers],
        [m.num_layers for m in managers],
        [[lp.nbytes for lp in m.plan.layers] for m in managers],
        [[(str(e.dtype), e.shape, e.stride, e.offset) for e in lp.params] for m in managers for lp in m.plan.layers],
        [list(m.resident) for m in managers],
        [m.prefetch_depth for m in managers],
        [sorted(split_layers(m)) for m in managers],
        device.type,
        world,
        list(crcs),
    ]


def _summary(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _all_gather_rows(group: SplitGroup, row: list, what: str) -> list:
    dev = group.device if group.device.type == "cuda" else torch.device("cpu")
    mine = torch.tensor(row, dtype=torch.int64).to(dev)
    out = torch.empty(group.world * mine.numel(), dtype=torch.int64, device=dev)
    group.wait(_gather(out, mine, group.pg, async_op=True), what)
    return out.view(group.world, -1).cpu().tolist()


def validate(group: SplitGroup, managers, values=None) -> None:
    """ONE all-gather of every rank's configuration digests (the streamed layers'
    values among them: a CRC per split layer); raises the same error on every rank
    (naming the fields that differ) if they disagree, and a timeout error if a rank
    does not take part. Where only the values differ, a second all-gather of the
    per-layer CRCs (the same length on every rank then) names the first layer."""
    crcs = layer_values(managers, values)
    desc = describe(managers, group.world, group.device, crcs)
    # Per field its digest, then two readable figures: layers and managed bytes.
    row = [_digest(v) for v in desc]
    total = [sum(m.num_layers for m in managers), sum(m.plan.managed_bytes for m in managers)]
    rows = _all_gather_rows(group, row + total, "the configuration check at configure time (one all-gather)")
    bad = [k for k in range(len(_FIELDS)) if len({r[k] for r in rows}) > 1]
    if not bad:
        return
    if bad == [_VALUES]:
        _refuse_values(group, managers, crcs)
    ranks_like_me = [r for r, row_r in enumerate(rows) if row_r == rows[group.rank]]
    parts = []
    for k in bad:
        groups = {}
        for r, row_r in enumerate(rows):
            groups.setdefault(row_r[k], []).append(r)
        parts.append(f"{_FIELDS[k]} (ranks grouped by value: {sorted(groups.values())}; here on rank "
                     f"{group.rank}: {_summary(desc[k])})")
    raise SplitError(
        "layerwise split fetch: the ranks of the split_fetch group configure different models or settings, "
        f"so they cannot share the layers' bytes: {'; '.join(parts)}. Per rank (layers, managed bytes): "
        f"{[(r[-2], r[-1]) for r in rows]}. Every rank must configure the same model the same way (same "
        "layer_names, prefetch_depth, resident_layers, dtypes). Rank(s) with this rank's configuration: "
        f"{ranks_like_me}. Nothing was changed."
    )


def _refuse_values(group: SplitGroup, managers, crcs: list) -> None:
    """Every rank configures the same layers, with different values (built with other
    seeds, another checkpoint): name the first layer whose values differ."""
    rows = _all_gather_rows(group, crcs, "the comparison of the streamed layers' values at configure time")
    names = [f"{m.layer_name}[{i}]" for m in managers for i in sorted(split_layers(m))]
    k = next(k for k in range(len(crcs)) if len({r[k] for r in rows}) > 1)
    groups = {}
    for r, row_r in enumerate(rows):
        groups.setdefault(row_r[k], []).append(r)
    others = sum(1 for j in range(len(crcs)) if len({r[j] for r in rows}) > 1) - 1
    raise SplitError(
        f"layerwise split fetch: the ranks of the split_fetch group hold different weights in layer {names[k]} "
        f"(the first of {others + 1} streamed layer(s) whose bytes differ; ranks grouped by its CRC-32: "
        f"{sorted(groups.values())}). With split_fetch every rank computes with a layer stitched from every "
        "rank's share, so every rank must hold the same weights: build the model with the same seed, or load "
        "the same checkpoint on every rank. Nothing was changed.")


def attach(managers, pg, device: torch.device, timeout_s: float | None = None, values=None) -> SplitGroup:
    """Validate (one collective) and make every manager keep only this rank's
    share of its split layers (set before packing). Raises, with nothing changed,
    for DTensor weights, a backend that does not fit the device, or ranks that
    disagree (in settings, or in the streamed layers' values: `values` as in
    layer_values)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("split_fetch: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (or pass split_fetch=None)")
    for m in managers:
        for lp in m.plan.layers:
            for e in lp.params:
                if e.dspec is not None:
                    raise ValueError(
                        f"split_fetch: {e.qualname} is a DTensor (tensor-parallel weights): each rank holds its "
                        "own shard already, there is no replicated layer to split. Pass split_fetch=None; split "
                        "fetch is for ranks that hold the same full weights (sequence / context parallel).")
    group = SplitGroup(pg, device, timeout_s)
    want = {"cpu": "gloo", "cuda": "nccl"}[device.type]
    if want not in group.backend:  # "gloo", "nccl", or a device map such as "cpu:gloo,cuda:nccl"
        raise ValueError(f"split_fetch: streaming to {device} needs a {want} process group, got a "
                         f"{group.backend} one (create it with dist.new_group(backend={want!r}))")
    validate(group, managers, values)
    group.make_private_groups()
    for m in managers:
        if not m.enabled:
            continue
        m.tiers.use_split(ShareStore(m, group))  # its tier plan splits the streamed layers (layerwise.tierplan)
    return group


# -------------------------------------------------------------- the sources
class ShareStore:
    """A manager's shares: one host arena of this rank's parts of its split layers,
    its ShareSources, and the split-fetch figures for stats()."""

    name = "split_fetch"

    def __init__(self, manager, group: SplitGroup):
        self.group = group
        self.layer_name = manager.layer_name
        self.spans = {}
        capacity = 0
        for i in split_layers(manager):
            nbytes = manager.plan.layers[i].nbytes
            span = share_span(nbytes, group.rank, group.world)
            self.spans[i] = span
            capacity += round_up(span[2] - span[1], BLOCK_ALIGN)
        self.capacity = capacity
        self._arena = None
        self._manager = weakref.ref(manager)
        self.local_bytes = 0  # copied host -> this rank's part of a slot
        self.gathered_bytes = 0  # received from the other ranks by the gathers
        self.gathers = 0
        self.copy_wait_s = 0.0  # the gather thread waiting for the local copies (CPU)
        self.gather_s = 0.0  # time in the all-gathers (CPU)
        self._open = 0  # sources kept and not closed yet
        self.engine = self.pending = None  # set by start()
        self._views = {}  # (slot address, bytes) -> the gather's view of the slot
        self.last_gather = {}  # slot address -> the event of the last gather into it
        group.acquire()
        self._released = False
        self.id = group.register(self)  # its number in the lockstep tags

    def hold(self, payload: torch.Tensor) -> ArenaSource:
        """This rank's share of a packed layer (raw), in the store's arena."""
        if self._arena is None:
            m = self._manager()
            cuda = m.device.type == "cuda"
            self._arena = _native.HostArena(max(self.capacity, 1), pinned=m.pin_memory is not False, cuda=cuda,
                                            device=m.device.index if cuda else -1)
            _native.check_pinned(self._arena, m.pin_memory, f"layer group {self.layer_name!r} (its shares)")
        n = payload.numel()
        block = self._arena.allocate(max(n, 1), alignment=BLOCK_ALIGN)[:n]
        block.copy_(payload)
        return ArenaSource(block, self._arena)

    def start(self, engine, pending) -> None:
        self.engine, self.pending = engine, pending

    def synchronize(self) -> None:
        """Wait for every gather issued into a slot (on CUDA: the gather stream's
        event after it), failed ones included: what frees the ring comes after."""
        for ev in list(self.last_gather.values()):
            try:
                ev = ev.resolve()
                if ev is not None:
                    ev.synchronize()
            except Exception:  # noqa: BLE001 - a failed gather wrote nothing more; raised where it was needed
                pass

    def wrap(self, index: int, nbytes: int, inner) -> ShareSource:
        """Layer `index`'s source: its share kept by `inner` (raw or encoded, in memory or a file)."""
        self._open += 1
        return ShareSource(self, index, nbytes, inner)

    def slot_view(self, dst: torch.Tensor, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of dst's slot as a tensor with a version counter of its own:
        a collective bumps its output's counter, which on the slot's own would read
        as a user's in-place write (manager._check_slot_writes). One per slot and size."""
        key = (dst.data_ptr(), nbytes)
        view = self._views.get(key)
        if view is None:
            with torch.inference_mode(False):
                view = torch.empty(0, dtype=torch.uint8, device=dst.device)
                view.set_(dst.untyped_storage(), dst.storage_offset(), (nbytes,))
            self._views[key] = view
        return view

    def check_load(self, named: list) -> None:
        """Before a load_state_dict changes any of this group's split layers: ONE
        collective compares a CRC-32 of the (key, dtype, shape, bytes) of every value
        it would load into them; raises SplitError on every rank, naming the first key
        whose values differ, before anything changed (contract._split_load_guards).
        Every rank calls it (even with nothing to load), so the ranks stay in step."""
        g = self.group
        crcs = []
        for key, value in named:
            t = value.detach()
            t = t.to_local() if hasattr(t, "to_local") else t
            crc = zlib.crc32(repr((key, str(t.dtype), tuple(t.shape))).encode())
            try:
                raw = t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
            except (RuntimeError, TypeError, NotImplementedError):  # a meta or wrapper tensor: no bytes to compare
                raw = b""  # (write() compares the bytes the layer gets, if it gets any)
            crcs.append(zlib.crc32(raw, crc))
        mine = (len(crcs), zlib.crc32(repr(crcs).encode()))

        def compare():
            rows = g.agree(LOAD, self.id, -1, 0, 0, mine)
            if all(r[_SAME:] == rows[0][_SAME:] for r in rows):
                return None
            per = None
            if len({r[_SAME] for r in rows}) == 1 and crcs:  # as many values on every rank: which differs
                out = torch.empty(g.world * len(crcs), dtype=torch.int64)
                g.wait(_gather(out, torch.tensor(crcs, dtype=torch.int64), g.host_pg, async_op=True),
                       f"comparing the values a load_state_dict gives {self.layer_name}")
                per = out.view(g.world, -1).tolist()
            return rows, per

        bad = g.call(compare)
        if bad is None:
            return
        rows, per = bad
        if per is None:
            what = f"different keys ({', '.join(f'rank {r}: {row[_SAME]}' for r, row in enumerate(rows))} values)"
        else:
            k = next(k for k in range(len(crcs)) if len({row[k] for row in per}) > 1)
            same = [r for r in range(g.world) if per[r][k] == crcs[k]]
            what = f"different values for {named[k][0]!r} (first of those that differ; ranks with this rank's: {same})"
        raise SplitError(
            f"layerwise split fetch: load_state_dict gives the split layers of {self.layer_name!r} {what} on the "
            f"ranks of the split_fetch group (rank {g.rank} of {g.world} here). Every rank computes with layers "
            "stitched from every rank's share, so every rank must load the same state dict. Nothing was changed.")

    @property
    def share_bytes(self) -> int:
        return sum(hi - lo for _, lo, hi in self.spans.values())

    def stats(self) -> dict:
        cuda = self.group.device.type == "cuda"
        return {self.name: {
            "rank": self.group.rank, "world": self.group.world, "backend": self.group.backend,
            "split_layers": len(self.spans),
            "share_bytes": self.share_bytes,  # host bytes this rank holds for its split layers
            "host_bytes": self._arena.capacity if self._arena is not None else 0,
            "bytes_local": self.local_bytes, "bytes_gathered": self.gathered_bytes, "gathers": self.gathers,
            # CUDA: waits happen on the device (events), not timed here
            "copy_wait_s": None if cuda else self.copy_wait_s,
            "gather_s": None if cuda else self.gather_s,
        }}

    def source_closed(self) -> None:
        self._open -= 1
        if self._open <= 0:
            self.release()

    def release(self) -> None:
        """The manager is done with its shares: the group's thread ends with its last user."""
        self._views = {}
        self.last_gather = {}
        if not self._released:
            self._released = True
            self.group.release()


class _LocalFailed:
    """This rank's part of a layer that never reached its slot (its read failed, say):
    what the gather gets instead of the copy's event. The gather then tells the other
    ranks (LOCAL_FAILED: they raise at once) instead of leaving them waiting in the
    lockstep check until the timeout, which would break the group for good."""

    __slots__ = ("error",)
    copy_ms = -1.0
    start = None

    def __init__(self, error: Exception):
        self.error = error

    def resolve(self):
        return self

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        raise detached(self.error)


class ShareSource:
    """A split layer's source (stages/source.py): this rank's share, kept by the
    source it wraps (`inner`: a host block, encoded or not, or a file); the full
    layer exists only in a slot after a gather, or on the host after a collective
    read()."""

    kind = "share"
    host = None  # the truth is spread over the ranks

    def __init__(self, store: ShareStore, index: int, nbytes: int, inner):
        self.store = store
        self.group = store.group
        self.index = index
        self.nbytes = nbytes
        self.share, self.lo, self.hi = share_span(nbytes, self.group.rank, self.group.world)
        self.inner = inner  # bytes [lo, hi) of the layer
        self.slot_bytes = self.share * self.group.world  # >= nbytes: the gather fills whole shares
        self._gen = 0  # bumped by write(); the same on every rank (writes are collective)

    @property
    def stored_bytes(self) -> int:
        return self.inner.stored_bytes

    @property
    def transfer_bytes(self) -> int:
        return self.inner.transfer_bytes if self.hi > self.lo else 0

    @property
    def writable(self) -> bool:  # write() is collective: every rank writes its share of the same bytes
        return self.inner.writable

    def refuse_write(self) -> None:
        self.inner.refuse_write()

    def version(self) -> int:
        return self._gen

    def holders(self):
        yield self
        yield from self.inner.holders()

    # -- the fetch: share -> this rank's part of the slot (the inner chain) -> all-gather
    def fetch(self, i: int, dst: torch.Tensor, after, timing: bool):
        engine = self.store.engine
        full = self.store.slot_view(dst, self.slot_bytes)
        part = full[self.group.rank * self.share : (self.group.rank + 1) * self.share]
        n = self.hi - self.lo
        st = self.store
        key = dst.data_ptr()
        prev = st.last_gather.get(key)
        if prev is not None and prev is not after:
            # The manager forgot the slot's last event (a resync after an interrupt): a gather
            # into the slot may still be in flight, and the local copy must not overtake it.
            try:
                prev = prev.resolve()
            except Exception:  # noqa: BLE001 - a failed or forgotten gather: nothing in flight
                prev = None
            if prev is not None and engine.is_cuda:
                stream = _native.current_stream_handle(self.group.device)
                engine.wait(prev, stream)
                after = engine.record(stream, False)
            elif prev is not None:
                try:
                    prev.synchronize()
                except Exception:  # noqa: BLE001 - a failed gather: the layer that waited on it raised
                    pass
        tag = (GATHER, st.id, i, self.nbytes, self._gen)
        copied = after
        if n:
            # A local part that fails (a read of a changed file, now or when deferred) is handed to the
            # gather, which tells the other ranks in order instead of leaving them waiting for the timeout.
            try:
                copied = self.inner.fetch(i, part[:n], after, timing)
            except Exception as err:  # noqa: BLE001 - raised where the layer is needed (fetch_failed)
                copied = _LocalFailed(err)
            if is_deferred(copied):  # (a read, the decode after it): its failure too
                copied = Recovered(copied, _LocalFailed)
        st.local_bytes += self.transfer_bytes
        st.gathered_bytes += self.nbytes - n
        st.gathers += 1
        # The gather is a collective: issued where every rank issues it in the same order
        # (Pending.settle: after the forward of the layer that prefetched it, or where the
        # layer is needed), never while the user's collectives of that layer may queue behind it.
        res = st.last_gather[key] = then(copied, lambda ev: self._gather(engine, i, full, part, ev, tag, timing,
                                                                         local=n > 0), st.pending, collective=True)
        return res

    def _gather(self, engine, i, full, part, copied, tag, timing, local):
        """`copied`: this rank's part in the slot (`local`: its copy, else what it waited on)."""
        st, group = self.store, self.group
        if engine.is_cuda:  # the lockstep check first, on the host: nothing is issued if it fails
            if isinstance(copied, _LocalFailed):
                self._local_failed(i, copied.error)
            group.agree(*tag)
            return self._gather_cuda(engine, full, part, copied, timing, local)
        done = _native._C.host_event()
        # A timed fetch is timed from its local copy's start; a rank with no local
        # copy (an empty share) from the gather's own start.
        begun = None
        if timing:
            own = getattr(copied, "start", None) if local else None
            begun = None if own is not None else _native._C.host_event()
            done.start = own if own is not None else begun

        def failed(e):
            done.fail(str(e) if isinstance(e, SplitError) else
                      f"layerwise split fetch of layer {st.layer_name}[{i}] failed: {e}")

        def job(later):
            if begun is not None:
                begun.set()
            try:
                t0 = time.perf_counter()
                local = None
                if copied is not None:
                    try:
                        copied.synchronize()
                    except Exception as e:  # noqa: BLE001 - the others are told below instead of left waiting
                        local = e
                t1 = time.perf_counter()
                st.copy_wait_s += t1 - t0
                if local is not None:
                    self._local_failed(i, local)
                group.agree(*tag)
                work = _gather(full, part, group.gather_pg, async_op=True)
            except BaseException as e:  # noqa: BLE001 - the compute learns it from the event (fetch_failed)
                failed(e)
                return

            def finish():
                try:
                    group.wait(work, f"the gather of {st.layer_name}[{i}]")
                    st.gather_s += time.perf_counter() - t1
                    done.set()
                except BaseException as e:  # noqa: BLE001 - as above
                    failed(e)

            later(finish)  # waited for on the second thread: the next job's check overlaps this transfer

        group.submit(job)
        return done

    def _local_failed(self, i: int, local: BaseException) -> None:
        """This rank's part of layer i did not reach its slot: the tag exchange tells
        the other ranks (their tags differ: they raise at once instead of waiting for
        the timeout), then this rank raises the local error; no gather is issued."""
        g = self.group
        try:
            g.agree(LOCAL_FAILED, self.store.id, i, self.nbytes, self._gen)
        except SplitError as e:
            raise SplitError(f"{e} Here on rank {g.rank}: {local}") from None
        raise g._break(f"layerwise split fetch of layer {self.store.layer_name}[{i}]: its local copy failed on "
                       f"every rank of the split_fetch group (here on rank {g.rank}: {local}); nothing was gathered")

    def fetch_failed(self, err: BaseException) -> SplitError:
        """What the manager raises where a fetch of this layer failed (the event's
        error, a ReadError of the native event, becomes the SplitError it was)."""
        self.group.surfaced()
        return err if isinstance(err, SplitError) else SplitError(str(err))

    def _gather_cuda(self, engine, full, part, copied, timing, local):
        # Written for NCCL, not run in CI (no GPU): the gather stream waits on the
        # local copy's event on the device; a blocking NCCL collective enqueues on its
        # own stream after the current one (the gather stream) and makes the current
        # stream wait for it, so the event recorded after it completes with the layer.
        # Timed (a timed step): from the local copy's start, or where this rank copied
        # nothing, from the gather's own start on its stream.
        g = self.group.stream
        if copied is not None:
            engine.wait(copied, g.cuda_stream)
        own = getattr(copied, "start", None) if timing and local else None
        begun = engine.record(g.cuda_stream, True) if timing and own is None else None
        with torch.cuda.stream(g):
            _gather(full, part, self.group.gather_pg, async_op=False)
        ev = engine.record(g.cuda_stream, timing)
        if timing:
            ev.start = own if own is not None else begun
        return ev

    # -- the truth on the host (collective)
    def _gather_host(self) -> torch.Tensor:
        g = self.group
        g.agree(READ, self.store.id, self.index, self.nbytes, self._gen)
        full = torch.empty(self.slot_bytes, dtype=torch.uint8)
        part = full[g.rank * self.share : (g.rank + 1) * self.share]
        part[: self.hi - self.lo].copy_(self.inner.read())
        g.wait(_gather(full, part, g.host_pg, async_op=True),
               f"reading layer {self.store.layer_name}[{self.index}] (state_dict, load_state_dict or remove)")
        return full[: self.nbytes]

    def read(self) -> torch.Tensor:
        """The full layer on the host, a copy of its own: COLLECTIVE (every rank
        must read it too). Never the cached block itself: a caller that edits what
        it got (load_state_dict, then refused) must not change what later reads give."""
        g = self.group
        last = g.last_read
        if last is not None and last[0] is self and last[1] == self._gen:
            return last[2].clone()
        block = g.call(self._gather_host)
        g.last_read = (self, self._gen, block)
        return block.clone()

    def write(self, block: torch.Tensor) -> None:
        """Keep this rank's share of `block`: COLLECTIVE. The ranks compare a digest
        of `block` first; if they differ (different values loaded on different
        ranks), every rank refuses and nothing changes. Then every rank writes its
        share and the ranks agree on how that went (WRITTEN: ok or failed); where
        it failed on any rank (a full disk, an encode out of memory), the ranks
        whose write succeeded undo it and every rank raises the same SplitError
        (naming the ranks and their errors), the layer unchanged everywhere."""
        g = self.group
        digest = hashlib.blake2b(block.numpy(), digest_size=16).digest()
        payload = (int.from_bytes(digest[:8], "little", signed=True), int.from_bytes(digest[8:], "little", signed=True))
        rows = g.call(lambda: g.agree(COMPARE, self.store.id, self.index, self.nbytes, self._gen, payload))
        if not all(r[_SAME:] == rows[0][_SAME:] for r in rows):
            same = [r for r in range(g.world) if rows[r][_SAME:] == list(payload)]
            raise SplitError(
                f"layerwise split fetch: the ranks wrote different values into layer {self.store.layer_name}"
                f"[{self.index}] (load_state_dict or an edit); ranks with this rank's values: {same}. With "
                "split_fetch every rank holds the same weights: load the same state dict on every rank. "
                "Nothing was changed.")
        undo = failed = None
        try:
            undo = self.inner.write(block[self.lo : self.hi].clone(), undo=True)
        except Exception as err:  # noqa: BLE001 - told to the others below; the old bytes stay (Source.write)
            failed = err
        try:
            why = g.call(lambda: self._written(failed))
        except BaseException:  # the exchange itself failed (a rank left): keep what the layer had
            if undo is not None:
                undo()
            raise
        if why:
            if undo is not None:
                undo()
            raise SplitError(
                f"layerwise split fetch: writing layer {self.store.layer_name}[{self.index}] (load_state_dict or an "
                f"edit) failed on rank{'s' if len(why) > 1 else ''} {', '.join(map(str, why))} of the {g.world} "
                f"ranks of the split_fetch group ({'; '.join(f'rank {r}: {t}' for r, t in why.items())}). Nothing "
                "of it was changed: the ranks whose write succeeded put their old bytes back, so the layer keeps "
                "its old values on every rank and the model streams on (layers written before it keep their new "
                "values). Fix what failed there (its error says what) and load again, on every rank.") from failed
        self._gen += 1
        g.last_read = (self, self._gen, block)  # the caller's fresh block: what every rank now holds

    def _written(self, failed: Exception | None) -> dict:
        """The tag exchange after every rank wrote its share (on the group's thread): {rank:
        its error} of the ranks whose write failed (their texts gathered only then)."""
        g = self.group
        rows = g.agree(WRITTEN, self.store.id, self.index, self.nbytes, self._gen, (int(failed is not None), 0))
        if not any(r[_SAME] for r in rows):
            return {}
        mine = torch.zeros(_WHY_BYTES, dtype=torch.uint8)
        if failed is not None:
            text = f"{type(failed).__name__}: {failed}".encode()[:_WHY_BYTES]
            mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        out = torch.empty(g.world * _WHY_BYTES, dtype=torch.uint8)
        g.wait(_gather(out, mine, g.host_pg, async_op=True),
               f"telling the ranks why writing {self.store.layer_name}[{self.index}] failed")
        texts = out.view(g.world, _WHY_BYTES).numpy()
        return {r: bytes(texts[r]).rstrip(b"\0").decode(errors="ignore") for r in range(g.world) if rows[r][_SAME]}

    def close(self) -> None:
        if self.inner is None:
            return
        g = self.group
        if g.last_read is not None and g.last_read[0] is self:
            g.last_read = None
        self.inner.close()
        self.inner = None
        self.store.source_closed()

