"""ShareStore / ShareSource: each rank keeps its share of every split layer; a fetch
is transfer (the share) -> gather (the rest from the other ranks)."""
from __future__ import annotations

import hashlib
import time
import weakref
import zlib

import torch

from layerwise import _native
from layerwise.planning.layout import BLOCK_ALIGN, round_up
from layerwise.stages.result import Recovered, detached, is_deferred, then
from layerwise.stages.source import ArenaSource, Source
from layerwise.stages.split import collectives

SHARE_ALIGN = 512  # bytes: every rank's part of a slot starts 512-byte aligned (vectorised copies, NCCL)


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


# -------------------------------------------------------------- the sources
class ShareStore:
    """A manager's shares: one host arena of this rank's parts of its split layers,
    its ShareSources, and the split-fetch figures for stats()."""

    name = "split_fetch"

    def __init__(self, manager, group: collectives.SplitGroup):
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

    def owner(self):
        """The group whose layers it keeps (a LayerwiseOffloadManager), or None once that is gone."""
        return self._manager()

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
            rows = g.agree(collectives.LOAD, self.id, -1, 0, 0, mine)
            if all(r[collectives.SAME:] == rows[0][collectives.SAME:] for r in rows):
                return None
            per = None
            if len({r[collectives.SAME] for r in rows}) == 1 and crcs:  # as many values on every rank: which differs
                out = torch.empty(g.world * len(crcs), dtype=torch.int64)
                g.wait(collectives.gather(out, torch.tensor(crcs, dtype=torch.int64), g.host_pg, async_op=True),
                       f"comparing the values a load_state_dict gives {self.layer_name}")
                per = out.view(g.world, -1).tolist()
            return rows, per

        bad = g.call(compare)
        if bad is None:
            return
        rows, per = bad
        if per is None:
            keys = ", ".join(f"rank {r}: {row[collectives.SAME]}" for r, row in enumerate(rows))
            what = f"different keys ({keys} values)"
        else:
            k = next(k for k in range(len(crcs)) if len({row[k] for row in per}) > 1)
            same = [r for r in range(g.world) if per[r][k] == crcs[k]]
            what = f"different values for {named[k][0]!r} (first of those that differ; ranks with this rank's: {same})"
        raise collectives.SplitError(
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


class ShareSource(Source):
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
        self._gen = 0  # bumped by write(); the same on every rank (writes are collective)

    @property
    def slot_bytes(self) -> int:
        return self.share * self.group.world  # >= nbytes: the gather fills whole shares

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
        tag = (collectives.GATHER, st.id, i, self.nbytes, self._gen)
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
        done = _native.host_event()
        # A timed fetch is timed from its local copy's start; a rank with no local
        # copy (an empty share) from the gather's own start.
        begun = None
        if timing:
            own = getattr(copied, "start", None) if local else None
            begun = None if own is not None else _native.host_event()
            done.start = own if own is not None else begun

        def failed(e):
            done.fail(str(e) if isinstance(e, collectives.SplitError) else
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
                work = collectives.gather(full, part, group.gather_pg, async_op=True)
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
            g.agree(collectives.LOCAL_FAILED, self.store.id, i, self.nbytes, self._gen)
        except collectives.SplitError as e:
            raise collectives.SplitError(f"{e} Here on rank {g.rank}: {local}") from None
        raise g.fail(f"layerwise split fetch of layer {self.store.layer_name}[{i}]: its local copy failed on "
                       f"every rank of the split_fetch group (here on rank {g.rank}: {local}); nothing was gathered")

    def fetch_failed(self, err: BaseException) -> collectives.SplitError:
        """What the manager raises where a fetch of this layer failed (the event's
        error, a ReadError of the native event, becomes the SplitError it was)."""
        self.group.surfaced()
        return err if isinstance(err, collectives.SplitError) else collectives.SplitError(str(err))

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
            collectives.gather(full, part, self.group.gather_pg, async_op=False)
        ev = engine.record(g.cuda_stream, timing)
        if timing:
            ev.start = own if own is not None else begun
        return ev

    # -- the truth on the host (collective)
    def _gather_host(self) -> torch.Tensor:
        g = self.group
        g.agree(collectives.READ, self.store.id, self.index, self.nbytes, self._gen)
        full = torch.empty(self.slot_bytes, dtype=torch.uint8)
        part = full[g.rank * self.share : (g.rank + 1) * self.share]
        part[: self.hi - self.lo].copy_(self.inner.read())
        g.wait(collectives.gather(full, part, g.host_pg, async_op=True),
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
        rows = g.call(lambda: g.agree(collectives.COMPARE, self.store.id, self.index, self.nbytes, self._gen, payload))
        if not all(r[collectives.SAME:] == rows[0][collectives.SAME:] for r in rows):
            same = [r for r in range(g.world) if rows[r][collectives.SAME:] == list(payload)]
            raise collectives.SplitError(
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
            raise collectives.SplitError(
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
        rows = g.agree(collectives.WRITTEN, self.store.id, self.index, self.nbytes, self._gen,
                       (int(failed is not None), 0))
        if not any(r[collectives.SAME] for r in rows):
            return {}
        mine = torch.zeros(collectives.WHY_BYTES, dtype=torch.uint8)
        if failed is not None:
            text = f"{type(failed).__name__}: {failed}".encode()[:collectives.WHY_BYTES]
            mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        out = torch.empty(g.world * collectives.WHY_BYTES, dtype=torch.uint8)
        g.wait(collectives.gather(out, mine, g.host_pg, async_op=True),
               f"telling the ranks why writing {self.store.layer_name}[{self.index}] failed")
        texts = out.view(g.world, collectives.WHY_BYTES).numpy()
        return {r: bytes(texts[r]).rstrip(b"\0").decode(errors="ignore")
                for r in range(g.world) if rows[r][collectives.SAME]}

    def close(self) -> None:
        if self.inner is None:
            return
        g = self.group
        if g.last_read is not None and g.last_read[0] is self:
            g.last_read = None
        self.inner.close()
        self.inner = None
        self.store.source_closed()
