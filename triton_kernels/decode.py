"""Decode one losslessly encoded segment straight into its destination, in one launch.

The format (written by the C++ encoder, ``layerwise._C.codec.encode``) is
specified in ``layerwise/codec/__init__.py``, whose :func:`~layerwise.codec.parse_header`
is the one Python parser of a header: the launcher and the reference decoder
take the header's offsets and sizes from it.

Per chunk of 2**16 values, canonical Huffman codes (<= 12 bits) of the value's
top field (the exponent; fp16 and fp32 also top mantissa bits, fp32 its low
byte too, fp8 the whole byte), up to 4 codes per field chosen by the previous
value's symbol (its *context*), and a raw stream of the rest; every sub-block
of 2**10 values (the encoder's default; the header says) of a code stream
records its bit length. The kernel (``_decode_kernel``) runs one program per
chunk with one lane per sub-block: each lane decodes its sub-block's values
one after the other, each value from a 12-bit window of its code stream
compared with its context's 12 length limits (no table to build, no per-bit
loop), a symbol gathered from the table, and its raw bits. A segment that did
not shrink is *stored*: header, then the bytes as they are (``_copy_kernel``).

Layout of this file: the chunk checks and the pure-torch reference
(:func:`check_chunks`, :func:`decode_segment_ref`), the Triton kernels, the
launcher (``_launch``), then the public entry points (:func:`decode_segment`,
:func:`triton_available_for`).

The kernels never trust the encoded bytes for memory safety: every load is
masked or clamped to the buffer, every store to the destination. The kernel
takes the header parsed on the host (its launcher needs it: the dtype picks
the kernel's specialisation, the chunk count its grid) and decodes whatever
the chunk index says, inside the buffer. It cannot report *why* bytes are
corrupt (a kernel cannot raise): validate encoded bytes on the host once,
where they are produced (``layerwise.codec.decode`` or :func:`check_chunks`).
Values are handled as integers throughout, so the same kernels run under the
Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) and compiled on a
GPU, and the result is bitwise whatever the bits (NaN payloads, infinities,
signed zeros, subnormals).

Performance: no GPU was available when this was written, so nothing here is
measured (``python -m layerwise.bench compress --device cuda`` measures it).
By design: a 64 MB bf16 segment is 512 programs of 128 lanes; per
value a lane reads 3 code bytes and its raw bits (gathered: lanes are 512
values apart, L1/L2 hits after the first), selects its context's 16 limits,
compares one window with them, gathers one table symbol, and writes its value
; the sequential part is the 512-value loop of a lane, not a per-bit loop.
An estimate, not a measurement: the context selects, the 16-wide compare and
the base select are about 200 integer operations per value and coded field;
at an H200's ~33 T int32 operations/s (132 SMs x 128 lanes x ~2 GHz) that is
~170 G values/s, ~330 GB/s of bf16, below the 1000 GB/s target: the kernel
is likely compute-bound. Next steps: select the context's limits once per
symbol with a gather instead of three 16-wide wheres, decode two symbols per
window where both fit (the encoder knows the next context), and measure.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple, Optional

import torch

from layerwise.codec import ENTRY_BYTES, LAYOUT, MAX_CODE_BITS, MAX_CONTEXTS, MAX_SYMBOL_BITS, Header, parse_header

try:  # Triton is optional: the reference path must work without it.
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except Exception as _exc:  # noqa: BLE001 - ImportError or a broken install
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = _exc

# Read once, like Triton itself does when it decorates the kernel.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

ALIGN = 16  # every stream of a segment starts at a multiple of 16 bytes


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _bad(msg: str) -> ValueError:
    return ValueError(f"layerwise codec: {msg}")


class ChunkView(NamedTuple):
    """One checked chunk of a segment: its values and, per field, the
    table (counts by length, symbols in code order, sub-block bit counts) and the
    stream offsets; tables and code offsets are None for fields not coded."""

    first_value: int
    n: int
    mask: int
    raw_bits: int
    off_raw: int
    counts: tuple  # per field: per context its 16 counts, or None
    symbols: tuple  # per field: per context its symbols in code order, or None
    sub_bits: tuple  # per field: bit count of each sub-block, or None
    off_code: tuple  # per field: byte offset of the codes, or None
    thresholds: tuple = (None, None, None)  # per field: the context thresholds (nctx - 1 of them), or None


def _stream_bytes(bits: int) -> int:
    return _align(-(-bits // 8) + 8)


def check_chunks(encoded, h: Header) -> list:
    """Every chunk of a coded segment checked as the C++ decoder checks
    it (each stream where the previous one ended, tables that make a prefix code,
    symbols in range and distinct, sub-block bit counts possible); ValueError
    naming the chunk otherwise. ``encoded``: bytes or a uint8 tensor (copied to
    the host once)."""
    buf = bytes(encoded.cpu().numpy().tobytes()) if isinstance(encoded, torch.Tensor) else bytes(encoded)
    n_total = h.encoded_bytes
    vb, widths = LAYOUT[h.dtype_code]
    nv = h.n_bytes // vb
    C, S = 1 << h.log2_chunk, 1 << h.log2_sub
    at = h.off_data
    out = []
    for c in range(h.n_chunks):
        e = h.off_index + ENTRY_BYTES * c
        where = f"chunk {c}: "
        mask, raw_bits = buf[e], buf[e + 1]
        if any(buf[e + 2 : e + 8]):
            raise _bad(where + "reserved entry bytes are not zero")
        off_raw, *offs = struct.unpack_from("<7Q", buf, e + 8)
        tables, codes = offs[:3], offs[3:]
        n = min(C, nv - c * C)
        n_sub = -(-n // S)
        if mask >> 3:
            raise _bad(where + f"coded mask {mask} names fields that do not exist")
        want_raw = 0
        for f in range(3):
            coded = mask >> f & 1
            if coded and (f >= len(widths) or widths[f] > MAX_SYMBOL_BITS):
                raise _bad(where + f"field {f} marked coded; {h.dtype} codes only fields of <= 9 bits")
            if not coded:
                if tables[f] or codes[f]:
                    raise _bad(where + f"offsets set for the uncoded field {f}")
                if f < len(widths):
                    want_raw += widths[f]
        if raw_bits != want_raw:
            raise _bad(where + f"{raw_bits} raw bits per value; its coded fields leave {want_raw}")
        counts, symbols, sub_bits, off_code, thresholds = [None] * 3, [None] * 3, [None] * 3, [None] * 3, [None] * 3
        for f in range(len(widths)):
            if not mask >> f & 1:
                continue
            fw = where + f"field {f}: "
            if tables[f] != at:
                raise _bad(fw + f"table at {tables[f]}, expected {at}")
            if at + 8 > n_total:
                raise _bad(fw + "table past the end of the buffer")
            nctx, *thr = struct.unpack_from("<4H", buf, at)
            alphabet = 1 << widths[f]
            if not 1 <= nctx <= MAX_CONTEXTS:
                raise _bad(fw + f"{nctx} contexts (1..{MAX_CONTEXTS})")
            used, rest = thr[: nctx - 1], thr[nctx - 1 :]
            if any(rest) or any(t >= alphabet for t in used) or any(b <= a for a, b in zip(used, used[1:])):
                raise _bad(fw + "context thresholds not increasing within the alphabet, or set past the contexts")
            sb = 2 if widths[f] > 8 else 1
            q, lens, cnts, syms_c = at + 8, set(), [], []
            for ctx in range(nctx):
                if q + 32 > n_total:
                    raise _bad(fw + "table past the end of the buffer")
                cnt = struct.unpack_from("<16H", buf, q)
                if cnt[0] or any(cnt[MAX_CODE_BITS + 1 :]):
                    raise _bad(fw + f"codes of length 0 or > {MAX_CODE_BITS}")
                n_sym = sum(cnt)
                if not 1 <= n_sym <= alphabet:
                    raise _bad(fw + f"{n_sym} symbols in the table of context {ctx}")
                if sum(cnt[l] << (MAX_CODE_BITS - l) for l in range(1, MAX_CODE_BITS + 1)) > 1 << MAX_CODE_BITS:
                    raise _bad(fw + "code lengths over-subscribe the code space (not a prefix code)")
                q += 32
                if q + sb * n_sym > n_total:
                    raise _bad(fw + "table past the end of the buffer")
                syms = struct.unpack_from(f"<{n_sym}{'H' if sb == 2 else 'B'}", buf, q)
                if len(set(syms)) != n_sym or max(syms) >= alphabet:
                    raise _bad(fw + "table symbols out of range or repeated")
                q += sb * n_sym
                lens |= {l for l in range(1, MAX_CODE_BITS + 1) if cnt[l]}
                cnts.append(cnt)
                syms_c.append(syms)
            tb = _align(8 + 32 * nctx + sb * sum(len(x) for x in syms_c) + 2 * n_sub)
            if at + tb > n_total:
                raise _bad(fw + f"table of {tb} bytes past the end of the buffer")
            sbits = struct.unpack_from(f"<{n_sub}H", buf, q)
            for k, b in enumerate(sbits):
                vals = min(S, n - k * S)
                if not vals * min(lens) <= b <= vals * max(lens):
                    raise _bad(fw + f"sub-block {k} of {vals} values holds {b} bits")
            thresholds[f] = tuple(used)
            at += tb
            if codes[f] != at:
                raise _bad(fw + f"code stream at {codes[f]}, expected {at}")
            cb = _stream_bytes(sum(sbits))
            if at + cb > n_total:
                raise _bad(fw + f"code stream of {cb} bytes past the end of the buffer")
            counts[f], symbols[f], sub_bits[f], off_code[f] = tuple(cnts), tuple(syms_c), sbits, at
            at += cb
        if off_raw != at:
            raise _bad(where + f"raw stream at {off_raw}, expected {at}")
        rb = _stream_bytes(n * raw_bits)
        if at + rb > n_total:
            raise _bad(where + f"raw stream of {rb} bytes past the end of the buffer")
        at += rb
        out.append(ChunkView(c * C, n, mask, raw_bits, off_raw, tuple(counts), tuple(symbols), tuple(sub_bits),
                             tuple(off_code), tuple(thresholds)))
    if at != n_total:
        raise _bad(f"the chunks end at {at} but the segment at {n_total}")
    return out


def canonical_limits(counts) -> tuple:
    """(limit, base) of a canonical code with `counts` codes of each length: a
    12-bit window x starts a code of length L = 1 + #{l in 1..12: x >= limit[l]},
    the code of index base[L] + (x >> (12 - L)) in code order (the kernel's rule)."""
    first, limit, base, f, off = [0] * 16, [1 << 20] * 16, [0] * 16, 0, 0
    for l in range(1, MAX_CODE_BITS + 1):
        f = (f + counts[l - 1]) << 1 if l > 1 else 0
        first[l] = f
        limit[l] = (f + counts[l]) << (MAX_CODE_BITS - l)
        base[l] = off - f
        off += counts[l]
    return limit, base


def _dst_bytes(dst: torch.Tensor, what: str = "dst") -> torch.Tensor:
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(dst).__name__}")
    if not dst.is_contiguous():
        raise ValueError(f"{what} must be contiguous (the segment decodes to its bytes in order)")
    return dst.reshape(-1).view(torch.uint8)


def _check_encoded(encoded: torch.Tensor) -> None:
    if not isinstance(encoded, torch.Tensor):
        raise TypeError(f"encoded must be a torch.Tensor, got {type(encoded).__name__}")
    if encoded.dtype != torch.uint8 or encoded.dim() != 1 or not encoded.is_contiguous():
        raise ValueError(f"encoded must be a 1-D contiguous uint8 tensor, got {encoded.dtype} of shape "
                         f"{tuple(encoded.shape)}")


# --------------------------------------------------------------------------
# Pure-torch reference
# --------------------------------------------------------------------------
def decode_segment_ref(encoded: torch.Tensor, dst: torch.Tensor) -> None:
    """Reference decoder: whole-tensor torch integer ops on ``encoded``'s device.

    Checks everything the C++ decoder checks (header, chunk index, tables,
    code streams) and raises ValueError before writing ``dst``.
    """
    _check_encoded(encoded)
    h = parse_header(encoded, encoded.numel())
    out = _dst_bytes(dst)
    if out.numel() != h.n_bytes:
        raise ValueError(f"dst has {out.numel()} bytes but the segment decodes to {h.n_bytes}")
    if out.device != encoded.device:
        raise ValueError(f"dst is on {out.device} but the encoded segment on {encoded.device}")
    _decode_ref(encoded, out, h)


def _decode_ref(encoded: torch.Tensor, out: torch.Tensor, h: Header) -> None:
    """Whole-tensor torch ops: every sub-block of every chunk is a lane,
    decoded one value per step as the kernel does (checks first: check_chunks)."""
    if not h.coded:
        out.copy_(encoded[h.off_data : h.off_data + h.n_bytes])
        return
    views = check_chunks(encoded, h)
    dev = encoded.device
    vb, widths = LAYOUT[h.dtype_code]
    nv = h.n_bytes // vb
    S = 1 << h.log2_sub
    enc = torch.cat([encoded.to(torch.int64), torch.zeros(8, dtype=torch.int64, device=dev)])
    i = torch.arange(nv, device=dev, dtype=torch.int64)
    chunk = i >> h.log2_chunk
    local = i - (chunk << h.log2_chunk)
    mask = torch.tensor([v.mask for v in views], dtype=torch.int64, device=dev)[chunk]
    rbits = torch.tensor([v.raw_bits for v in views], dtype=torch.int64, device=dev)[chunk]
    bit = torch.tensor([v.off_raw for v in views], dtype=torch.int64, device=dev)[chunk] * 8 + local * rbits
    word = sum(enc[(bit >> 3) + k] << (8 * k) for k in range(5))
    r = (word >> (bit & 7)) & ((1 << rbits) - 1)
    pos_of_field = []
    bits_total = 8 * vb
    p = bits_total
    for w in widths:
        p -= w
        pos_of_field.append(p)
    u = torch.zeros(nv, dtype=torch.int64, device=dev)
    for f in reversed(range(len(widths))):
        coded = (mask >> f & 1).bool()
        piece = r & ((1 << widths[f]) - 1)
        r = torch.where(coded, r, r >> widths[f])
        if bool(coded.any()):
            piece = torch.where(coded, _huffman_ref(enc, views, f, S, nv, dev), piece)
        u |= piece << pos_of_field[f]
    v = (u >> 1) | ((u & 1) << (bits_total - 1))
    if vb == 2:
        res = (v - ((v >> 15) << 16)).to(torch.int16)
    elif vb == 4:
        res = (v - ((v >> 31) << 32)).to(torch.int32)
    else:
        res = v.to(torch.uint8)
    out.copy_(res.view(torch.uint8))


def _huffman_ref(enc: torch.Tensor, views, f: int, S: int, nv: int, dev) -> torch.Tensor:
    """The symbols of field f of every value (0 where the chunk does not code f): one lane
    per sub-block, its context the number of thresholds its previous symbol reaches."""
    NC = MAX_CONTEXTS
    lim_rows, base_rows, sym_base, thr_rows, start, end, vals, first, allsyms = [], [], [], [], [], [], [], [], []
    for v in views:
        if not v.mask >> f & 1:
            continue
        lims, bases, offs = [], [], []
        for cnt, syms in zip(v.counts[f], v.symbols[f]):
            limit, base = canonical_limits(cnt)
            lims.append(limit)
            bases.append(base)
            offs.append(len(allsyms))
            allsyms.extend(syms)
        pad = NC - len(lims)
        lims, bases, offs = lims + [lims[0]] * pad, bases + [bases[0]] * pad, offs + [offs[0]] * pad
        thr = list(v.thresholds[f]) + [1 << 20] * (NC - 1 - len(v.thresholds[f]))
        at = 8 * v.off_code[f]
        for k, b in enumerate(v.sub_bits[f]):
            lim_rows.append(lims)
            base_rows.append(bases)
            sym_base.append(offs)
            thr_rows.append(thr)
            start.append(at)
            end.append(at + b)
            vals.append(min(S, v.n - k * S))
            first.append(v.first_value + k * S)
            at += b
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    lim, base, sym_base, thr = t(lim_rows), t(base_rows), t(sym_base), t(thr_rows)  # [lanes, NC, 16], [lanes, NC]
    pos, ends, vals, first, allsyms = t(start), t(end), t(vals), t(first), t(allsyms)
    lanes = torch.arange(pos.numel(), device=dev)
    ctx = torch.zeros_like(pos)
    out = torch.zeros(nv, dtype=torch.int64, device=dev)
    for j in range(S):
        act = j < vals
        if not bool(act.any()):
            break
        byte = (pos >> 3).clamp(max=enc.numel() - 3)  # (a corrupt lane may run past its stream)
        w = (enc[byte] << 16) | (enc[byte + 1] << 8) | enc[byte + 2]
        x = (w >> (12 - (pos & 7))) & 0xFFF
        length = 1 + (x[:, None] >= lim[lanes, ctx]).sum(1)
        if bool((act & (length > MAX_CODE_BITS)).any()):
            raise _bad(f"field {f}: a code stream holds bits that no code of its table starts with "
                       "(corrupt encoded segment)")
        length = length.clamp(max=MAX_CODE_BITS)
        idx = base[lanes, ctx].gather(1, length[:, None])[:, 0] + (x >> (MAX_CODE_BITS - length))
        sym = allsyms[(sym_base[lanes, ctx] + idx).clamp(0, allsyms.numel() - 1)]
        out[(first + j)[act]] = sym[act]
        pos = torch.where(act, pos + length, pos)
        ctx = (sym[:, None] >= thr).sum(1)
    if not torch.equal(pos, ends):
        raise _bad(f"field {f}: a code stream does not decode to its sub-blocks' recorded lengths "
                   "(corrupt encoded segment)")
    return out


# --------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _bytes_at(enc_ptr, off, enc_len, m, N: tl.constexpr):
        """N bytes at `off` (any alignment), little-endian, as int64; loads clamped inside the buffer."""
        w = tl.zeros_like(off).to(tl.int64)
        for k in tl.static_range(N):
            a = tl.minimum(tl.maximum(off + k, 0), enc_len - 1)
            w = w | (tl.load(enc_ptr + a, mask=m, other=0).to(tl.int64) << (8 * k))
        return w

    @triton.jit
    def _ctx_code(enc_ptr, enc_len, c_off):
        """The canonical code of one context at `c_off` (16 counts, then its symbols): the 16
        length limits and bases (canonical_limits), where its symbols start, how many."""
        l = tl.arange(0, 16)
        ok = (l >= 1) & (l <= 12)
        cnt = tl.where(ok, _bytes_at(enc_ptr, c_off + 2 * l, enc_len, l >= 0, 2).to(tl.int32), 0)
        below = l[None, :] < l[:, None]  # [L, k]: k < L
        shift = tl.maximum(l[:, None] - l[None, :], 0)
        first = tl.sum(tl.where(below, cnt[None, :] << shift, 0), axis=1)  # first code of each length
        offset = tl.sum(tl.where(below, cnt[None, :], 0), axis=1)  # codes shorter than it
        limit = tl.where(ok, (first + cnt) << tl.maximum(12 - l, 0), 1 << 20)
        return limit, offset - first, c_off + 32, tl.sum(cnt, axis=0)

    @triton.jit
    def _field_code(enc_ptr, enc_len, t_off, lane, n_sub, SYM_BYTES: tl.constexpr):
        """A coded field's table in a chunk: up to 4 context codes (an absent context's
        threshold is out of reach), the 3 thresholds, and each lane's first bit."""
        one = t_off >= 0
        nctx = tl.minimum(tl.maximum(_bytes_at(enc_ptr, t_off, enc_len, one, 2), 1), 4)
        th0 = tl.where(nctx > 1, _bytes_at(enc_ptr, t_off + 2, enc_len, one, 2), 1 << 20).to(tl.int32)
        th1 = tl.where(nctx > 2, _bytes_at(enc_ptr, t_off + 4, enc_len, one, 2), 1 << 20).to(tl.int32)
        th2 = tl.where(nctx > 3, _bytes_at(enc_ptr, t_off + 6, enc_len, one, 2), 1 << 20).to(tl.int32)
        lim0, base0, so0, ns0 = _ctx_code(enc_ptr, enc_len, t_off + 8)
        lim1, base1, so1, ns1 = _ctx_code(enc_ptr, enc_len, so0 + SYM_BYTES * ns0)
        lim2, base2, so2, ns2 = _ctx_code(enc_ptr, enc_len, so1 + SYM_BYTES * ns1)
        lim3, base3, so3, ns3 = _ctx_code(enc_ptr, enc_len, so2 + SYM_BYTES * ns2)
        ends = tl.where(nctx == 1, so0 + SYM_BYTES * ns0,
                        tl.where(nctx == 2, so1 + SYM_BYTES * ns1,
                                 tl.where(nctx == 3, so2 + SYM_BYTES * ns2, so3 + SYM_BYTES * ns3)))
        sub_bits = _bytes_at(enc_ptr, ends + 2 * lane, enc_len, lane < n_sub, 2)
        start = tl.cumsum(sub_bits, axis=0) - sub_bits  # exclusive: the lane's first bit in its code stream
        return (lim0, lim1, lim2, lim3, base0, base1, base2, base3, so0, so1, so2, so3, ns0, ns1, ns2, ns3,
                th0, th1, th2, start)

    @triton.jit
    def _pick(ctx, a, b, c, d):
        return tl.where(ctx == 0, a, tl.where(ctx == 1, b, tl.where(ctx == 2, c, d)))

    @triton.jit
    def _huff_step(enc_ptr, enc_len, pos, ctx, lim0, lim1, lim2, lim3, base0, base1, base2, base3,
                   so0, so1, so2, so3, ns0, ns1, ns2, ns3, th0, th1, th2, act, SYM_BYTES: tl.constexpr):
        """Each lane's next symbol at bit `pos` (absolute, MSB first) in its context's code:
        the symbol, its code length and the next value's context."""
        w = _bytes_at(enc_ptr, pos >> 3, enc_len, act, 3)
        # the 3 bytes as a big-endian 24-bit word, then the 12 bits from bit (pos & 7)
        w = ((w & 0xFF) << 16) | (w & 0xFF00) | ((w >> 16) & 0xFF)
        x = ((w >> (12 - (pos & 7))) & 0xFFF).to(tl.int32)
        c2 = ctx[:, None]
        limit = _pick(c2, lim0[None, :], lim1[None, :], lim2[None, :], lim3[None, :])
        length = 1 + tl.sum((x[:, None] >= limit).to(tl.int32), axis=1)
        length = tl.minimum(length, 12)  # (only a corrupt stream reaches past the limits)
        base = _pick(c2, base0[None, :], base1[None, :], base2[None, :], base3[None, :])
        sel = tl.sum(tl.where(tl.arange(0, 16)[None, :] == length[:, None], base, 0), axis=1)
        n_sym = _pick(ctx, ns0, ns1, ns2, ns3)
        idx = tl.minimum(tl.maximum(sel + (x >> (12 - length)), 0), tl.maximum(n_sym - 1, 0))
        sym = _bytes_at(enc_ptr, _pick(ctx, so0, so1, so2, so3) + SYM_BYTES * idx, enc_len, act, SYM_BYTES)
        s32 = sym.to(tl.int32)
        nxt = (s32 >= th0).to(tl.int32) + (s32 >= th1).to(tl.int32) + (s32 >= th2).to(tl.int32)
        return sym, length, nxt

    @triton.jit
    def _decode_kernel(enc_ptr, enc_len, dst_ptr, n_values, VB: tl.constexpr, W0: tl.constexpr,
                       W1: tl.constexpr, W2: tl.constexpr, LOG2_CHUNK: tl.constexpr, LANES: tl.constexpr,
                       SUB: tl.constexpr, OFF_INDEX: tl.constexpr, ENTRY: tl.constexpr):
        """Program `pid` decodes chunk `pid` (its entry at OFF_INDEX + ENTRY * pid): lane k its
        sub-block k, one value per step."""
        pid = tl.program_id(0).to(tl.int64)
        e = OFF_INDEX + ENTRY * pid
        e64 = (enc_ptr + e).to(tl.pointer_type(tl.int64))  # 8-byte aligned: the base is 16-byte aligned
        mask = tl.load(enc_ptr + e).to(tl.int32)
        rbits = tl.minimum(tl.load(enc_ptr + e + 1).to(tl.int64), 32)
        off_raw = tl.load(e64 + 1)
        n = tl.minimum(n_values - (pid << LOG2_CHUNK), 1 << LOG2_CHUNK)
        lane = tl.arange(0, LANES)
        n_sub = (n + SUB - 1) // SUB
        BITS: tl.constexpr = 8 * VB
        P0: tl.constexpr = BITS - W0
        P1: tl.constexpr = P0 - W1
        P2: tl.constexpr = P1 - W2
        SB0: tl.constexpr = 2 if W0 > 8 else 1
        SB1: tl.constexpr = 2 if W1 > 8 else 1
        SB2: tl.constexpr = 2 if W2 > 8 else 1
        coded0 = (mask & 1) != 0
        coded1 = ((mask & 2) != 0) & (W1 <= 9) & (W1 > 0)
        coded2 = ((mask & 4) != 0) & (W2 <= 9) & (W2 > 0)
        (a0, b0, c0, d0, e0, f0, g0, h0, so0, sp0, sq0, sr0, n0, m0, k0, j0,
         t00, t01, t02, st0) = _field_code(enc_ptr, enc_len, tl.load(e64 + 2), lane, n_sub, SB0)
        pos0 = tl.load(e64 + 5) * 8 + st0
        ctx0 = tl.zeros_like(lane)
        if W1 > 0:
            (a1, b1, c1, d1, e1, f1, g1, h1, so1, sp1, sq1, sr1, n1, m1, k1, j1,
             t10, t11, t12, st1) = _field_code(enc_ptr, enc_len, tl.load(e64 + 3), lane, n_sub, SB1)
            pos1 = tl.load(e64 + 6) * 8 + st1
            ctx1 = tl.zeros_like(lane)
        if W2 > 0:
            (a2, b2, c2, d2, e2, f2, g2, h2, so2, sp2, sq2, sr2, n2, m2, k2, j2,
             t20, t21, t22, st2) = _field_code(enc_ptr, enc_len, tl.load(e64 + 4), lane, n_sub, SB2)
            pos2 = tl.load(e64 + 7) * 8 + st2
            ctx2 = tl.zeros_like(lane)
        RAW_BYTES: tl.constexpr = VB + 1  # a raw word of <= 8 * VB bits at any bit offset
        for j in range(SUB):
            li = lane * SUB + j
            act = li < n
            bit = li.to(tl.int64) * rbits
            r = _bytes_at(enc_ptr, off_raw + (bit >> 3), enc_len, act, RAW_BYTES) >> (bit & 7)
            r = r & ((1 << rbits) - 1)
            u = tl.zeros_like(r)
            if W2 > 0:
                piece2 = r & ((1 << W2) - 1)
                r = tl.where(coded2, r, r >> W2)
                if coded2:
                    s2, l2, ctx2 = _huff_step(enc_ptr, enc_len, pos2, ctx2, a2, b2, c2, d2, e2, f2, g2, h2,
                                              so2, sp2, sq2, sr2, n2, m2, k2, j2, t20, t21, t22, act, SB2)
                    piece2 = s2
                    pos2 = pos2 + tl.where(act, l2, 0)
                u = u | ((piece2 & ((1 << W2) - 1)) << P2)
            if W1 > 0:
                piece1 = r & ((1 << W1) - 1)
                r = tl.where(coded1, r, r >> W1)
                if coded1:
                    s1, l1, ctx1 = _huff_step(enc_ptr, enc_len, pos1, ctx1, a1, b1, c1, d1, e1, f1, g1, h1,
                                              so1, sp1, sq1, sr1, n1, m1, k1, j1, t10, t11, t12, act, SB1)
                    piece1 = s1
                    pos1 = pos1 + tl.where(act, l1, 0)
                u = u | ((piece1 & ((1 << W1) - 1)) << P1)
            piece0 = r & ((1 << W0) - 1)
            if coded0:
                s0, l0, ctx0 = _huff_step(enc_ptr, enc_len, pos0, ctx0, a0, b0, c0, d0, e0, f0, g0, h0,
                                          so0, sp0, sq0, sr0, n0, m0, k0, j0, t00, t01, t02, act, SB0)
                piece0 = s0
                pos0 = pos0 + tl.where(act, l0, 0)
            u = u | ((piece0 & ((1 << W0) - 1)) << P0)
            v = (u >> 1) | ((u & 1) << (BITS - 1))  # undo the rotation: the sign back on top
            gi = (pid << LOG2_CHUNK) + li
            if VB == 2:
                tl.store(dst_ptr.to(tl.pointer_type(tl.int16)) + gi, (v - ((v >> 15) << 16)).to(tl.int16), mask=act)
            elif VB == 4:
                tl.store(dst_ptr.to(tl.pointer_type(tl.int32)) + gi, (v - ((v >> 31) << 32)).to(tl.int32), mask=act)
            else:
                tl.store(dst_ptr + gi, v.to(tl.uint8), mask=act)

    @triton.jit
    def _copy_kernel(enc_ptr, enc_len, dst_ptr, n_bytes, BLOCK: tl.constexpr, OFF_DATA: tl.constexpr):
        """Bytes [pid * BLOCK, ...) of a stored segment: they follow the header (at OFF_DATA)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = (offs < n_bytes) & (offs < enc_len - OFF_DATA)
        tl.store(dst_ptr + offs, tl.load(enc_ptr + OFF_DATA + offs, mask=m, other=0), mask=m)

else:  # pragma: no cover - without triton
    _decode_kernel = None
    _copy_kernel = None


# --------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------
def _require_triton() -> None:
    if triton is None:
        raise ImportError(
            "the Triton decode path needs the 'triton' package, which could not be imported "
            f"({_TRITON_IMPORT_ERROR!r}); install triton or use decode_segment_ref"
        )


STORED_BLOCK = 4096  # bytes per program of a stored segment


def _launch(encoded: torch.Tensor, out: torch.Tensor, h: Header) -> None:
    """One launch for a segment whose header was parsed on the host (its offsets and sizes
    come from it)."""
    _require_triton()
    _check_device(encoded, out)
    if encoded.numel() != h.encoded_bytes or out.numel() != h.n_bytes:
        raise ValueError(f"layerwise codec: the header is for {h.encoded_bytes} encoded / {h.n_bytes} decoded bytes, "
                         f"got {encoded.numel()} / {out.numel()}")
    if encoded.data_ptr() % ALIGN:
        raise ValueError(f"the encoded segment must start at a {ALIGN}-byte aligned address (the kernel reads its "
                         f"chunk index as 8-byte words); got one at {encoded.data_ptr():#x}")
    if not h.coded:
        grid = (-(-h.n_bytes // STORED_BLOCK),)
        if grid[0]:
            _run(encoded, _copy_kernel, grid, (encoded, encoded.numel(), out, h.n_bytes),
                 dict(BLOCK=STORED_BLOCK, OFF_DATA=h.off_data, num_warps=4))
        return
    vb, widths = LAYOUT[h.dtype_code]
    if out.data_ptr() % vb:
        raise ValueError(f"dst must start at a multiple of {vb} bytes (values are stored as {8 * vb}-bit words)")
    w = tuple(widths) + (0,) * (3 - len(widths))
    lanes = 1 << (h.log2_chunk - h.log2_sub)
    meta = dict(VB=vb, W0=w[0], W1=w[1], W2=w[2], LOG2_CHUNK=h.log2_chunk, LANES=lanes, SUB=1 << h.log2_sub,
                OFF_INDEX=h.off_index, ENTRY=ENTRY_BYTES, num_warps=4 if lanes >= 128 else 1)
    _run(encoded, _decode_kernel, (h.n_chunks,), (encoded, encoded.numel(), out, h.n_bytes // vb), meta)


def _check_device(encoded: torch.Tensor, out: torch.Tensor) -> None:
    if out.device != encoded.device:
        raise ValueError(f"dst is on {out.device} but the encoded segment on {encoded.device}")
    if _INTERPRET:
        if encoded.device.type != "cpu":
            raise RuntimeError("TRITON_INTERPRET=1 is set: the interpreted decode kernel only supports CPU tensors")
    elif encoded.device.type != "cuda":
        raise RuntimeError(
            f"the Triton decode kernel needs CUDA tensors (got {encoded.device}); set TRITON_INTERPRET=1 before "
            "importing to run it on CPU, or decode on the host with layerwise.codec.decode"
        )


def _run(encoded: torch.Tensor, kernel, grid, args, meta) -> None:
    if encoded.device.type == "cuda":
        with torch.cuda.device(encoded.device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------
def decode_segment(encoded: torch.Tensor, dst: torch.Tensor, header: Optional[Header] = None) -> None:
    """Decode the encoded segment ``encoded`` (1-D uint8, 16-byte aligned) into ``dst``
    (contiguous, any dtype, exactly the decoded size in bytes) with one kernel launch on
    the current stream; nothing is synchronised.

    ``header`` (from :func:`layerwise.codec.parse_header` on the host copy, once) is
    checked against the sizes without touching device memory. Without it, a CPU segment
    (interpreter) is parsed and checked here, chunks included; a CUDA segment's 128-byte
    header is copied to the host and parsed (one small synchronising copy: pass
    ``header`` on a stream that must not wait).
    """
    _check_encoded(encoded)
    out = _dst_bytes(dst)
    if header is None:
        header = parse_header(encoded, encoded.numel())
        if encoded.device.type == "cpu" and header.coded:
            check_chunks(encoded, header)
    _launch(encoded, out, header)


def triton_available_for(device) -> bool:
    """Whether the Triton kernel runs for tensors on ``device`` here."""
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return not _INTERPRET
    if device.type == "cpu":
        return _INTERPRET
    return False
