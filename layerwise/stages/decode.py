"""decode: layers kept encoded in host memory (``compress="lossless"``), and the
stage that brings them to their slot: copy the encoded bytes into a device
staging buffer, then decode them into the slot, where the parameters' views
already point (DESIGN.md, "Tiers and stages"; the format: layerwise/codec.py).

Which layers: the streamed (not resident) layers that have a bf16 or fp16
segment (``select_layers``). At pack time the manager packs each into a host
scratch block and hands it to ``CodecTier.store``, which encodes every segment
of the layer (bf16/fp16 coded by the multi-threaded C++ codec; other dtypes
stored as they are, behind a codec header) into one byte string, the
*pieces* one after the other, each 16-byte aligned. A layer whose encoded
bytes are more than ``MIN_SAVING`` of its raw bytes travels raw (random bit
patterns, say): the choice is per layer, logged and in ``stats()``. Either
way the layer's bytes are kept in a host block of its own, exactly sized,
pinned as the raw arena is (``pin_memory``), so host memory holds the encoded
model about once, plus one scratch layer while packing.

Fetch of an encoded layer (``CodecSource.fetch``), one of ``STAGING_BUFFERS``
device staging buffers in turn:

    copy    host block -> staging k, after the last decode out of staging k
    decode  staging k -> the layer's slot, after the copy and after `after`
            (the slot is free); the returned event completes with the decode

CPU backend: the decode is a job of the copy engine's worker
(``CopyEngine.decode_async``, C++ ``codec::decode_into``), queued right after
the copy and ordered after it by its event, so it runs off the Python thread
and the event the compute waits on covers it. CUDA backend: the Triton decoder
(layerwise.triton_kernels.decode) is launched on the copy engine's stream 0
(``CopyEngine.stream_handle``, wrapped in ``torch.cuda.ExternalStream``),
which first waits on the copy and on `after`; the event recorded there after
the launches is the one returned. Not run on a GPU yet.

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

from .. import _native
from .. import codec as _codec
from ..plan import BLOCK_ALIGN

log = logging.getLogger("layerwise")

MIN_SAVING = 0.97  # a layer travels encoded only if that moves at most 0.97x its raw bytes
STAGING_BUFFERS = 2  # the copy into one overlaps the decode out of the other (several copy streams)
_ALIGN = 16  # the codec's (and the Triton decoder's) alignment of a segment
_PENDING_MAX = 256  # timed decodes waiting to be read, before the oldest are resolved


def select_layers(plan, resident) -> set[int]:
    """The layers the codec tier keeps: streamed ones with a bf16 or fp16 segment.
    (Resident layers are read once, at finalisation; there is nothing to move.)"""
    resident = set(resident)
    return {lp.index for lp in plan.layers
            if lp.index not in resident and any(dt in _codec.CODED_DTYPES for dt in lp.segments)}


@dataclass(frozen=True)
class Piece:
    """One segment of a layer: encoded bytes [enc_off, +enc_n) decode to [dst_off, +dst_n)."""
    enc_off: int
    enc_n: int
    dst_off: int
    dst_n: int
    dtype: torch.dtype
    header: object = None  # SegmentHeader for the Triton launcher (CUDA), parsed on the host once


@dataclass(frozen=True)
class _State:
    """What an encoded layer's source holds; replaced whole by write()."""
    block: torch.Tensor  # host uint8: the encoded pieces, or the raw layer (pieces None)
    pieces: tuple | None
    version: int
    spans: tuple = ()  # (enc_off, enc_n, dst_off, dst_n) per piece, as the CPU decode job takes them


def _round16(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_layer(block: torch.Tensor, lp, threads: int = 0) -> tuple[torch.Tensor, list[Piece]]:
    """The layer's plan-layout bytes `block` encoded: one pageable uint8 tensor
    holding every segment (in offset order, 16-byte aligned), and its pieces."""
    parts, pieces, at = [], [], 0
    for dtype, (off, n) in sorted(lp.segments.items(), key=lambda kv: kv[1][0]):
        enc = _codec.encode(block[off : off + n], dtype=dtype, threads=threads)
        pieces.append(Piece(at, enc.numel(), off, n, dtype))
        parts.append(enc)
        at += _round16(enc.numel())  # (encoded segments are 16-byte multiples already)
    out = torch.empty(at, dtype=torch.uint8)
    for p, enc in zip(pieces, parts):
        out[p.enc_off : p.enc_off + p.enc_n].copy_(enc)
    return out, pieces


class CodecSource:
    """A layer kept encoded (or raw, where encoding did not pay) in a host block
    of its own (stages/source.py has the interface)."""

    kind = "lossless"
    host = None  # the truth is encoded: read() decodes a copy
    writable = True  # write() re-encodes

    def __init__(self, tier: "CodecTier", lp, state: _State):
        self.tier = tier
        self.index = lp.index
        self.lp = lp
        self.nbytes = lp.nbytes
        self._state = state

    @property
    def encoded(self) -> bool:
        return self._state.pieces is not None

    @property
    def stored_bytes(self) -> int:
        return self._state.block.numel()

    @property
    def transfer_bytes(self) -> int:
        return self._state.block.numel()

    def version(self) -> int:
        return self._state.version

    def read(self) -> torch.Tensor:
        st = self._state
        if st.pieces is None:
            return st.block.clone()
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        for p in st.pieces:
            _codec.decode(st.block[p.enc_off : p.enc_off + p.enc_n], out[p.dst_off : p.dst_off + p.dst_n])
        return out

    def write(self, block: torch.Tensor) -> None:
        if block.numel() != self.nbytes:
            raise ValueError(f"layerwise: layer {self.tier.group}[{self.index}] has {self.nbytes} bytes, "
                             f"got a block of {block.numel()}")
        was = self.encoded
        state = self.tier.keep(self.lp, block, self._state.version + 1)
        self._state = state  # one assignment: an interrupt leaves the old state or the new one
        if was != self.encoded:
            log.info("layerwise: %s[%d] now travels %s after a write", self.tier.group, self.index,
                     "encoded" if self.encoded else "raw (its new weights do not compress)")

    def fetch(self, i: int, dst: torch.Tensor, after, timing: bool):
        return self.tier.fetch(self._state, dst, after, timing)

    def close(self) -> None:
        self._state = _State(torch.empty(0, dtype=torch.uint8), None, self._state.version + 1)


class CodecTier:
    """The codec tier of one layer group: stores layers encoded at pack time,
    owns the device staging buffers and the decode figures."""

    def __init__(self, group: str, device: torch.device, pin_memory, threads: int = 0):
        self.group = group
        self.device = device
        self.pin_memory = pin_memory
        self.threads = threads
        self.sources: list[CodecSource] = []
        self.encode_s = 0.0
        self.encoded_input = 0  # raw bytes that went through the encoder at pack time
        self.pin_error = None
        self.engine = None
        self._staging: list[torch.Tensor] = []
        self._staging_event: list = []
        self._next = 0
        self._timed: list = []  # (start event or None, decode event) of timed fetches
        self.decode_s = 0.0
        self.decodes_timed = 0

    select = staticmethod(select_layers)

    # ------------------------------------------------------------ pack time
    def _host_block(self, src: torch.Tensor):
        """A copy of `src` in an exact-size host block, pinned as pin_memory says."""
        cuda = self.device.type == "cuda"
        arena = _native.HostArena(max(src.numel(), 1), pinned=self.pin_memory is not False, cuda=cuda,
                                  device=self.device.index if cuda else -1)
        if arena.pin_error:
            if self.pin_memory is True:
                raise RuntimeError(
                    f"layerwise: pin_memory=True, but the host memory of layer group {self.group!r} (its encoded "
                    f"layers) could not be pinned: {arena.pin_error}. Raise the locked-memory limit or grant "
                    "CAP_IPC_LOCK, or pass pin_memory='auto' (pinned where possible, else pageable with a warning) "
                    "or pin_memory=False.")
            if self.pin_error is None:
                self.pin_error = arena.pin_error
                if self.pin_memory == "auto":
                    _native.warn_unpinned(arena, f"layer group {self.group!r} (encoded layers)")
        block = arena.allocate(max(src.numel(), 1), alignment=BLOCK_ALIGN)[: src.numel()]
        block.copy_(src)
        return block  # (it keeps its arena's mapping alive)

    def keep(self, lp, block: torch.Tensor, version: int) -> _State:
        """Encode the layer's plan-layout bytes `block` and keep the result (or the
        raw bytes, where encoding saves too little) in a host block of its own."""
        t0 = time.perf_counter()
        enc, pieces = encode_layer(block, lp, self.threads)
        self.encode_s += time.perf_counter() - t0
        self.encoded_input += block.numel()
        if enc.numel() > MIN_SAVING * block.numel():
            enc, pieces = block, None
        if self.device.type == "cuda" and pieces is not None:
            from ..triton_kernels.decode import parse_header

            pieces = [Piece(p.enc_off, p.enc_n, p.dst_off, p.dst_n, p.dtype,
                            parse_header(enc[p.enc_off : p.enc_off + p.enc_n], p.enc_n)) for p in pieces]
        host = self._host_block(enc)
        if pieces is None:
            return _State(host, None, version)
        return _State(host, tuple(pieces), version, tuple((p.enc_off, p.enc_n, p.dst_off, p.dst_n) for p in pieces))

    def store(self, lp, scratch: torch.Tensor) -> CodecSource:
        """The manager's `_store` hook: layer `lp`, packed into `scratch`, kept encoded."""
        src = CodecSource(self, lp, self.keep(lp, scratch, 0))
        self.sources.append(src)
        return src

    # ------------------------------------------------------------ run time
    def start(self, engine, device: torch.device) -> None:
        """Staging buffers on the device (each the largest encoded layer), once packed."""
        self.engine = engine
        biggest = max((s.transfer_bytes for s in self.sources if s.encoded), default=0)
        n = STAGING_BUFFERS  # (empty where no layer is encoded: a write may make one so, fetch grows them)
        self._staging = [torch.empty(_round16(biggest), dtype=torch.uint8, device=device) for _ in range(n)]
        self._staging_event = [None] * n
        self._stream = None
        if engine.is_cuda:
            self._stream = torch.cuda.ExternalStream(engine.stream_handle(0), device=device)
        self.log_summary()

    def fetch(self, state: _State, dst: torch.Tensor, after, timing: bool):
        engine = self.engine
        if state.pieces is None:  # travels raw
            return engine.copy_async(dst, state.block, after, timing)
        k = self._next
        self._next = (k + 1) % len(self._staging)
        prev = self._staging_event[k]
        need = state.block.numel()
        if need > self._staging[k].numel():
            # A write made this layer's encoding larger than any at start(): grow staging k
            # once its last decode has finished (rare; the host waits here only then).
            if prev is not None:
                prev[0].synchronize()
            self._staging[k] = torch.empty(_round16(need), dtype=torch.uint8, device=self._staging[k].device)
        staging = self._staging[k][:need]
        # The copy into staging k waits for the last decode out of it.
        copy_ev = engine.copy_async(staging, state.block, prev[0] if prev else None)
        if engine.is_cuda:
            ev, start = self._decode_cuda(staging, dst, state.pieces, copy_ev, after, timing)
        else:
            ev = engine.decode_async(dst, staging, state.spans, copy_ev, after, timing)
            start = None
        # The copy's event is held until staging k is reused: it keeps the host block
        # it reads alive (a write() may replace the block while the copy is in flight).
        self._staging_event[k] = (ev, copy_ev)
        if timing:
            if len(self._timed) >= _PENDING_MAX:
                self._resolve()
            self._timed.append((start, ev))
        return ev

    def _decode_cuda(self, staging, dst, pieces, copy_ev, after, timing):
        """Triton decode on copy stream 0, after the copy and after `after`; the
        event recorded there after the launches covers copy and decode."""
        from ..triton_kernels.decode import decode_segment

        engine, h = self.engine, self._stream.cuda_stream
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
            ms = ev.copy_ms if start is None else start.elapsed_ms(ev)
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
            st = s._state
            raw += s.nbytes
            moved += st.block.numel()
            if st.pieces is None:
                raw_layers.append(s.index)
                continue
            for p in st.pieces:
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
        self._staging, self._staging_event, self._timed = [], [], []
        self.engine = self._stream = None
