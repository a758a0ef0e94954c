"""decode: layers kept encoded in host memory (``compress="lossless"``), and the
stage that brings them to their slot: copy the encoded bytes into a device
staging buffer, then decode them into the slot, where the parameters' views
already point (docs/design.md, "Tiers and stages"; the format: layerwise/codec/__init__.py).

Which layers: the streamed (not resident) layers that have a segment of a
coded dtype (bf16, fp16, fp32, fp8: ``codec.CODED_DTYPES``; ``select_layers``).
At pack time the manager packs each into a host scratch block and hands it
to ``CodecTier.store``, which encodes every segment of the layer (coded
dtypes by the multi-threaded C++ codec; other dtypes
stored as they are, behind a codec header) into one byte string, the
*pieces* one after the other, each 16-byte aligned. A layer whose encoded
bytes are more than ``MIN_SAVING`` of its raw bytes travels raw (random bit
patterns, say): the choice is per layer, logged and in ``stats()``. Either
way the layer's bytes are kept in a host block of its own, exactly sized,
pinned as the raw arena is (``pin_memory``), so host memory holds the encoded
model about once, plus one scratch layer while packing.

Fetch of an encoded layer (``CodecSource.fetch``), one of ``STAGING_BUFFERS``
device staging buffers in turn:

    copy    host block -> staging k on a copy stream, after the last decode out of
            staging k (where that fetch failed or was forgotten: after nothing of
            it is in flight; its error is its own layer's)
    decode  staging k -> the layer's slot on the decode lane, after the copy's
            event and after `after` (the slot is free); the returned event
            completes with the decode

The decode never shares a queue with the copies: a decode waiting for its slot
(the compute still using it) would hold up the copy queued behind it, and the
bus would idle through every decode. On its own lane, ordered by events only,
the copy of layer i+1 (into the other staging buffer) overlaps the decode of
layer i. CPU backend: the decode is a job of the copy engine's decode worker
(``CopyEngine.decode_async``, C++ ``codec::decode_into``), off the Python
thread. CUDA backend: the Triton decoder (layerwise.triton_kernels.decode) is
launched on the engine's decode stream (``CopyEngine.decode_stream_handle``,
wrapped in ``torch.cuda.ExternalStream``), which first waits on the copy and
on `after`; the event recorded there after the launches is the one returned.

Timing (a timed step): the copy is issued with timing, and the decode's event is
given the copy's start (``Event.start``), so that the fetch's copy_ms spans copy
and decode, as the meter and tune read it; the decode's own time (copy_ms of
its own start, ``decode_s``) is kept apart.

The truth of an encoded layer is its encoded block: ``host`` is None,
``read()`` decodes a copy, ``write(block)`` re-encodes (a layer that stops
shrinking becomes raw, one that shrinks again becomes encoded) into a new host
block and swaps it in with one assignment, so an interrupt leaves either the
old or the new bytes; a copy still reading the old block keeps it alive.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from layerwise import _native
from layerwise import codec as _codec
from layerwise.planning.layout import BLOCK_ALIGN
from layerwise.stages.result import Recovered, is_deferred, then
from layerwise.stages.source import Source

log = logging.getLogger("layerwise")

MIN_SAVING = 0.97  # a layer travels encoded only if that moves at most 0.97x its raw bytes
STAGING_BUFFERS = 2  # the copy into one overlaps the decode out of the other (several copy streams)
_ALIGN = 16  # the codec's (and the Triton decoder's) alignment of a segment
_PENDING_MAX = 256  # timed decodes waiting to be read, before the oldest are resolved


def select_layers(plan, resident) -> set[int]:
    """The layers the codec tier keeps: streamed ones with a segment of a coded dtype.
    (Resident layers are read once, at finalisation; there is nothing to move.)"""
    resident = set(resident)
    return {lp.index for lp in plan.layers
            if lp.index not in resident and any(dt in _codec.CODED_DTYPES for dt in lp.segments)}


def segments_of(lp, lo: int = 0, hi: int | None = None) -> tuple:
    """((dtype, offset, nbytes), ...) of the layer's dtype segments that fall in
    bytes [lo, hi) of its plan layout, offsets relative to lo (a split-fetch share
    is encoded on its own: its segments are the layer's, cut at its ends)."""
    hi = lp.nbytes if hi is None else hi
    out = []
    for dtype, (off, n) in sorted(lp.segments.items(), key=lambda kv: kv[1][0]):
        a, b = max(off, lo), min(off + n, hi)
        if a < b:
            out.append((dtype, a - lo, b - a))
    return tuple(out)


@dataclass(frozen=True)
class Piece:
    """One segment of a layer: encoded bytes [enc_off, +enc_n) decode to [dst_off, +dst_n)."""
    enc_off: int
    enc_n: int
    dst_off: int
    dst_n: int
    dtype: torch.dtype
    header: object = None  # codec.Header for the Triton launcher (CUDA), parsed on the host once


def _round16(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_segments(block: torch.Tensor, segments, threads: int = 0) -> tuple[torch.Tensor, list[Piece]]:
    """`block`'s segments encoded: one pageable uint8 tensor holding every segment
    (in offset order, 16-byte aligned), and its pieces."""
    parts, pieces, at = [], [], 0
    for dtype, off, n in segments:
        enc = _codec.encode(block[off : off + n], dtype=dtype, threads=threads)
        pieces.append(Piece(at, enc.numel(), off, n, dtype))
        parts.append(enc)
        at += _round16(enc.numel())  # (encoded segments are 16-byte multiples already)
    out = torch.empty(at, dtype=torch.uint8)
    for p, enc in zip(pieces, parts):
        out[p.enc_off : p.enc_off + p.enc_n].copy_(enc)
    return out, pieces


def encode_layer(block: torch.Tensor, lp, threads: int = 0) -> tuple[torch.Tensor, list[Piece]]:
    """The layer's plan-layout bytes `block` encoded (encode_segments of all of it)."""
    return encode_segments(block, segments_of(lp), threads)


class CodecSource(Source):
    """A payload kept encoded (or raw, where encoding did not pay) by the source
    it wraps (`inner`: a host block, or a file): stages/source.py has the chain.
    `nbytes` is what it decodes to: the layer, or this rank's share of it."""

    kind = "lossless"
    host = None  # the truth is encoded: read() decodes a copy
    fetches_window = True  # (its pieces within the window; a file inner reads their encoded span only)

    def __init__(self, tier: "CodecTier", index: int, segments, nbytes: int, inner, pieces):
        self.tier = tier
        self.index = index
        self.segments = segments
        self.nbytes = nbytes
        self.inner = inner
        self.window = None  # stream_only: what fetch_window decodes, [0, window) of the layer
        self._set_pieces(pieces)
        tier.sources.append(self)

    def _set_pieces(self, pieces) -> None:
        self.pieces = None if pieces is None else tuple(pieces)
        self._ranges: dict = {}  # (lo, hi) -> the pieces within (routed experts: asked at every fetch)
        self.spans = () if pieces is None else tuple((p.enc_off, p.enc_n, p.dst_off, p.dst_n) for p in pieces)
        if self.window is not None:
            self._stream_inner()

    def stream_only(self, hi: int) -> None:
        """fetch_window brings bytes [0, hi) of the layer only (routed experts,
        stages/experts.ExpertSource); where the inner source reads ahead (a file), it
        reads the encoded span of the pieces within only (their encoding is a prefix
        of the payload: the segments are in layout order)."""
        self.window = hi
        self._stream_inner()

    def _stream_inner(self) -> None:
        if not self.inner.fetches_window:
            return
        if self.pieces is None:
            self.inner.stream_only(self.window)
            return
        got = self.within(0, self.window)
        end = got[-1].enc_off + got[-1].enc_n if got else 0
        if got and got[0].enc_off != 0:
            raise ValueError(f"layerwise: internal: the encoding of layer {self.tier.group}[{self.index}] does "
                             "not start with its prefix")
        self.inner.stream_only(end)

    def fetch_window(self, i: int, dst: torch.Tensor, after, timing: bool):
        """Bytes [0, window) of the layer into `dst` (stream_only)."""
        return self.tier.fetch(self, i, dst, after, timing, part=(0, self.window))

    @property
    def encoded(self) -> bool:
        return self.pieces is not None

    @property
    def stored_bytes(self) -> int:
        return self.inner.stored_bytes

    @property
    def transfer_bytes(self) -> int:
        return self.inner.transfer_bytes

    @property
    def writable(self) -> bool:
        return self.inner.writable

    def refuse_write(self) -> None:
        self.inner.refuse_write()

    def version(self) -> int:
        return self.inner.version()

    def read(self) -> torch.Tensor:
        payload = self.inner.read()
        if self.pieces is None:
            return payload.clone() if payload is self.inner.host else payload
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        for p in self.pieces:
            _codec.decode(payload[p.enc_off : p.enc_off + p.enc_n], out[p.dst_off : p.dst_off + p.dst_n])
        return out

    def write(self, block: torch.Tensor, undo: bool = False):
        if block.numel() != self.nbytes:
            raise ValueError(f"layerwise: layer {self.tier.group}[{self.index}] has {self.nbytes} bytes here, "
                             f"got a block of {block.numel()}")
        was = self.pieces
        payload, pieces = self.tier.keep(self.segments, block)
        self.tier.check_growth(self, payload.numel())
        # (the callers hold Ctrl-C back: payload and pieces change together)
        inner_undo = self.inner.write(payload, undo)
        self._set_pieces(pieces)
        if (was is None) != (pieces is None):
            log.info("layerwise: %s[%d] now travels %s after a write", self.tier.group, self.index,
                     "encoded" if self.encoded else "raw (its new weights do not compress)")
        if not undo:
            return None

        def back():
            inner_undo()
            self._set_pieces(was)

        return back

    def fetch(self, i: int, dst: torch.Tensor, after, timing: bool):
        if self.pieces is None:
            return self.inner.fetch(i, dst, after, timing)
        return self.tier.fetch(self, i, dst, after, timing)

    def within(self, lo: int, hi: int) -> tuple:
        """The pieces that decode into bytes [lo, hi) of the layer (routed experts: a
        range is the prefix, or whole experts' rows, each expert its own segment);
        a piece that straddles an end of the range is an error."""
        got = self._ranges.get((lo, hi))
        if got is not None:
            return got
        got = tuple(p for p in self.pieces if lo <= p.dst_off and p.dst_off + p.dst_n <= hi)
        if any(p.dst_off < hi and p.dst_off + p.dst_n > lo for p in self.pieces if p not in got):
            raise ValueError(f"layerwise: internal: bytes [{lo}, {hi}) of layer {self.tier.group}[{self.index}] "
                             "cut a segment of its encoding")
        if len(self._ranges) < 4096:
            self._ranges[(lo, hi)] = got
        return got

    def range_bytes(self, lo: int, hi: int) -> int:
        """The bytes copy_range(dst, lo, hi) moves over the bus: the encoded span of
        the pieces that decode into [lo, hi) (raw: hi - lo)."""
        if self.pieces is None:
            return self.inner.range_bytes(lo, hi)
        got = self.within(lo, hi)
        return got[-1].enc_off + got[-1].enc_n - got[0].enc_off if got else 0

    def copy_range(self, dst: torch.Tensor, lo: int, hi: int, after, timing: bool = False):
        """Queue what makes bytes [lo, hi) of the layer land in the same bytes of `dst`
        (a slot) after `after`: a raw payload's copy, or the copy of the encoded span
        of the pieces that tile [lo, hi) and their decode (routed experts,
        stages/experts.py). The inner source must copy ranges (a host block)."""
        if self.pieces is None:
            return self.inner.copy_range(dst, lo, hi, after, timing)
        return self.tier.fetch(self, self.index, dst, after, timing, part=(lo, hi))

    def close(self) -> None:
        self.inner.close()

    def holders(self):
        yield self
        yield from self.inner.holders()


class CodecTier:
    """The codec stage of one layer group: encodes payloads (at pack time and on
    writes), owns the device staging buffers and the decode figures."""

    def __init__(self, group: str, device: torch.device, pin_memory, threads: int = 0):
        self.group = group
        self.device = device
        self.pin_memory = pin_memory
        self.threads = threads
        self.sources: list[CodecSource] = []
        self.encode_s = 0.0
        self.encoded_input = 0  # raw bytes that went through the encoder at pack time
        self.pin_error = None
        self.engine = self.pending = None
        self._staging: list[torch.Tensor] = []
        self._last: list = []  # per staging buffer: the last result that uses it (a decode, or its start)
        self._next = 0
        self._timed: list = []  # (start event or None, decode event) of timed fetches
        self.decode_s = 0.0
        self.decodes_timed = 0
        self.host_budget = None  # the host budget in force (layerwise.planning.host_budget.HostBudget), or None

    select = staticmethod(select_layers)

    def check_growth(self, src: CodecSource, n: int) -> None:
        """A write is about to keep `n` payload bytes for `src`: in host memory, more
        than it keeps now must fit the host budget (it was planned on the encoded
        sizes at configure), or the write is refused before anything changes."""
        if self.host_budget is None or src.inner.host is None:  # (a file: host memory does not change)
            return
        old = src.inner.stored_bytes
        self.host_budget.check(
            n - old, f"the write into layer {self.group}[{src.index}] (its new weights encode to {n} bytes, "
            f"where it keeps {old} now: the budget was planned on its old weights)",
            "Configure (or load_offloaded) with the weights the model will hold, so that the budget is planned on "
            "their encoded size, or raise host_budget")

    # ------------------------------------------------------------ pack time
    def host_block(self, n: int):
        """An exact-size host block of its own (block, arena), pinned as pin_memory says."""
        cuda = self.device.type == "cuda"
        arena = _native.HostArena(max(n, 1), pinned=self.pin_memory is not False, cuda=cuda,
                                  device=self.device.index if cuda else -1)
        if arena.pin_error:
            _native.check_pinned(arena, self.pin_memory, f"layer group {self.group!r} (its encoded layers)",
                                 warn=self.pin_error is None)
            self.pin_error = self.pin_error or arena.pin_error
        return arena.allocate(max(n, 1), alignment=BLOCK_ALIGN)[:n], arena

    def keep(self, segments, block: torch.Tensor):
        """(payload, pieces): `block` (its `segments`) encoded, or `block` itself and
        None where encoding saves too little (MIN_SAVING)."""
        t0 = time.perf_counter()
        enc, pieces = encode_segments(block, segments, self.threads)
        self.encode_s += time.perf_counter() - t0
        self.encoded_input += block.numel()
        if enc.numel() > MIN_SAVING * block.numel():
            return block, None
        if self.device.type == "cuda":
            pieces = [Piece(p.enc_off, p.enc_n, p.dst_off, p.dst_n, p.dtype,
                            _codec.parse_header(enc[p.enc_off : p.enc_off + p.enc_n], p.enc_n)) for p in pieces]
        return enc, pieces

    def adopt(self, payload: torch.Tensor, pieces) -> list | None:
        """`pieces` of an encoding another process made (a shared arena's manifest,
        stages/shared.py), checked against `payload`'s headers (and given them where
        the device decodes with Triton): a piece whose header does not parse, or does
        not decode to its size, is refused before anything streams."""
        if pieces is None:
            return None
        out = []
        for p in pieces:
            if p.enc_off < 0 or p.enc_n <= 0 or p.enc_off + p.enc_n > payload.numel():
                raise ValueError(f"layerwise: {self.group}: a shared encoded piece [{p.enc_off}, +{p.enc_n}) lies "
                                 f"outside its {payload.numel()}-byte payload")
            head = _codec.parse_header(payload[p.enc_off : p.enc_off + p.enc_n], p.enc_n)
            out.append(Piece(p.enc_off, p.enc_n, p.dst_off, p.dst_n, p.dtype,
                             head if self.device.type == "cuda" else None))
        return out

    # ------------------------------------------------------------ run time
    def start(self, engine, transfer, pending, compute_ready) -> None:
        """Staging buffers on the device (each the largest encoded payload), once packed.
        `compute_ready`: an event on the compute stream after they were allocated
        (CUDA; None on CPU): the first copy into each waits on it."""
        self.engine, self.transfer, self.pending = engine, transfer, pending
        biggest = max((s.transfer_bytes for s in self.sources if s.encoded), default=0)
        n = STAGING_BUFFERS  # (empty where no layer is encoded: a write may make one so, fetch grows them)
        self._staging = [torch.empty(_round16(biggest), dtype=torch.uint8, device=self.device) for _ in range(n)]
        self._last = [compute_ready] * n
        self._fresh = [compute_ready] * n  # what a copy into staging k waits on when nothing of it is in flight
        self._stream = None
        if engine.is_cuda:
            self._stream = torch.cuda.ExternalStream(engine.decode_stream_handle(), device=self.device)
        self.log_summary()

    def forget(self) -> None:
        """After an interrupt (the chain dropped what was queued and not issued): a
        staging buffer whose last use was never issued is free again (what was
        issued is waited for by the engine's synchronize that follows)."""
        self._last = [self._fresh[k] if is_deferred(r) and r.ev is None else r for k, r in enumerate(self._last)]

    def _staging_for(self, k: int, need: int, prev):
        """Staging k, at least `need` bytes, and what a copy into it waits for. A write
        may have made an encoding larger than any at start(): staging k then grows
        once its last decode has finished (rare; the host waits only then), and the
        new memory's first write waits on the compute stream (the caching allocator
        may hand out memory the compute stream still uses)."""
        if need <= self._staging[k].numel():
            return self._staging[k], prev
        if prev is not None:
            prev.synchronize()
        self._staging[k] = torch.empty(_round16(need), dtype=torch.uint8, device=self.device)
        ready = None
        if self.engine.is_cuda:
            ready = self.engine.record(_native.current_stream_handle(self.device), False)
        self._fresh[k] = ready
        return self._staging[k], ready

    def _after_failed(self, k: int):
        """What a copy into staging k waits on where its last user failed (a read that
        failed, a fetch an interrupt made the manager forget): that fetch's error is its
        own layer's (raised where that layer is needed), not the next one's. Whatever it
        queued is waited for (rare: only after a failure)."""
        try:
            self.engine.synchronize()
        except Exception:  # noqa: BLE001 - a failed copy: finished too
            pass
        return self._fresh[k]

    def fetch(self, src: CodecSource, i: int, dst: torch.Tensor, after, timing: bool, part=None):
        """copy (the inner source's fetch) payload -> staging k, after the last decode
        out of staging k; then decode staging k -> dst, after the copy and `after`.
        `part=(lo, hi)`: only the pieces that tile bytes [lo, hi) of the layer: their
        encoded span is copied to the same offsets of staging k (CodecSource.copy_range)."""
        k = self._next
        self._next = (k + 1) % len(self._staging)

        def issue(prev):
            # What the source holds when the copy is issued (a write in between changes
            # payload and pieces together; the manager then reloads the slot anyway).
            pieces, spans, need = src.pieces, src.spans, src.transfer_bytes
            windowed = (part is not None and part[0] == 0 and src.window == part[1]
                        and src.inner.fetches_window)
            if pieces is None:
                if windowed:
                    return src.inner.fetch_window(i, dst, after, timing)
                if part is not None:
                    return src.inner.copy_range(dst, part[0], part[1], after, timing)
                return src.inner.fetch(i, dst, after, timing)
            if part is not None:
                pieces = src.within(*part)
                if not pieces:
                    return after
                spans = tuple((p.enc_off, p.enc_n, p.dst_off, p.dst_n) for p in pieces)
                a, b = pieces[0].enc_off, pieces[-1].enc_off + pieces[-1].enc_n
                staging, ready = self._staging_for(k, b, prev)
                if windowed:
                    copied = src.inner.fetch_window(i, staging, ready, timing)  # (read ahead: a file)
                else:
                    copied = src.inner.copy_range(staging, a, b, ready, timing)
                return then(copied, lambda copy_ev: self._decode(staging, dst, pieces, spans, copy_ev, after,
                                                                 timing), self.pending)
            staging, ready = self._staging_for(k, need, prev)
            staging = staging[:need]
            copied = src.inner.fetch(i, staging, ready, timing)
            return then(copied, lambda copy_ev: self._decode(staging, dst, pieces, spans, copy_ev, after, timing),
                        self.pending)

        last = self._last[k]
        if is_deferred(last):  # its failure is its own layer's, not this one's
            last = Recovered(last, lambda err: self._after_failed(k))
        res = self._last[k] = then(last, issue, self.pending)
        return res

    def _decode(self, staging, dst, pieces, spans, copy_ev, after, timing):
        engine = self.engine
        if engine.is_cuda:
            ev, start = self._decode_cuda(staging, dst, pieces, copy_ev, after, timing)
        else:
            ev = engine.decode_async(dst, staging, spans, copy_ev, after, timing)
            start = ev.start
        if timing:
            if len(self._timed) >= _PENDING_MAX:
                self._resolve()
            self._timed.append((start, ev))
            # The fetch is timed from its copy's start (the meter, tune): copy and decode.
            ev.start = copy_ev.start if copy_ev is not None else None
        return ev

    def _decode_cuda(self, staging, dst, pieces, copy_ev, after, timing):
        """Triton decode on the decode stream, after the copy and after `after`;
        (the event recorded there after the launches, the decode's own start)."""
        from layerwise.triton_kernels.decode import decode_segment

        engine, h = self.engine, self._stream.cuda_stream
        if copy_ev is not None:
            engine.wait(copy_ev, h)
        if after is not None:
            engine.wait(after, h)
        start = engine.record(h, True) if timing else None
        with torch.cuda.stream(self._stream):
            for p in pieces:
                decode_segment(staging[p.enc_off : p.enc_off + p.enc_n], dst[p.dst_off : p.dst_off + p.dst_n],
                               header=p.header)
        return engine.record(h, timing), start

    def _resolve(self) -> None:
        pending = []
        for start, ev in self._timed:
            if not ev.query():
                pending.append((start, ev))
                continue
            ms = start.elapsed_ms(ev) if start is not None else -1.0
            if ms >= 0:
                self.decode_s += ms / 1e3
                self.decodes_timed += 1
        self._timed = pending

    # ------------------------------------------------------------ figures
    def stats(self) -> dict:
        """Raw and transferred bytes per dtype and in total, the ratio, the layers
        that travel raw, encode throughput and (CPU, timed steps) decode time."""
        self._resolve()
        per: dict[str, dict] = {}
        raw_layers = []
        raw = moved = 0
        for s in self.sources:
            raw += s.nbytes
            moved += s.transfer_bytes
            if s.pieces is None:
                raw_layers.append(s.index)
                continue
            for p in s.pieces:
                d = per.setdefault(_codec.dtype_name(p.dtype), {"raw_bytes": 0, "encoded_bytes": 0})
                d["raw_bytes"] += p.dst_n
                d["encoded_bytes"] += p.enc_n
        for d in per.values():
            d["ratio"] = d["encoded_bytes"] / d["raw_bytes"] if d["raw_bytes"] else None
        return {
            "codec": "lossless",
            "layers": len(self.sources),
            "layers_raw": raw_layers,
            "raw_bytes": raw,
            "stored_bytes": moved,
            "ratio": moved / raw if raw else None,
            "per_dtype": per,
            "encode_s": self.encode_s,
            "encode_gbps": self.encoded_input / self.encode_s / 1e9 if self.encode_s else None,
            "decode_s": self.decode_s,
            "decodes_timed": self.decodes_timed,
            "pinned": self.pin_error is None and self.pin_memory is not False,
            "pin_error": self.pin_error,
        }

    def log_summary(self) -> None:
        st = self.stats()
        log.info(
            "layerwise: %s: compress='lossless': %d layer(s), %.1f MiB -> %.1f MiB (%.3fx%s), encoded at %s GB/s "
            "(C++ codec); %s",
            self.group, st["layers"], st["raw_bytes"] / 2**20, st["stored_bytes"] / 2**20, st["ratio"] or 1.0,
            "".join(f", {k} {v['ratio']:.3f}x" for k, v in st["per_dtype"].items() if v["ratio"] is not None),
            f"{st['encode_gbps']:.2f}" if st["encode_gbps"] else "-",
            f"{len(st['layers_raw'])} travel raw (encoding saved < {100 * (1 - MIN_SAVING):.0f}%): "
            f"{st['layers_raw']}" if st["layers_raw"] else "all travel encoded")

    def close(self) -> None:
        self._staging, self._last, self._timed = [], [], []
        self.engine = self._stream = self.transfer = self.pending = None
