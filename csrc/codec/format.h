// The byte layout of an encoded segment (format: layerwise/codec/__init__.py, "Format"), and what
// the encoder (encode.cpp) and the decoder (decode.cpp, decode_avx512.cpp) share: the
// header's and a chunk entry's offsets, the dtypes' fields, stream and table sizes, the
// threads. Only the codec's sources include this; everyone else includes codec.h.
#pragma once

#include <algorithm>
#include <bit>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../codec.h"

static_assert(std::endian::native == std::endian::little, "the codec writes its integers little-endian as they are");

namespace layerwise::codec {

constexpr char kMagic[4] = {'L', 'W', 'C', 'S'};
constexpr uint8_t kVersion = 2;  // the one format: nothing older is read (codec.h)
constexpr size_t kHeaderBytes = 128;
// Header byte offsets (the bytes not named here are reserved, zero).
enum : size_t {
  kOffVersion = 4, kOffDtype = 5, kOffMode = 6, kOffLog2Chunk = 7, kOffLog2Sub = 8, kOffMaxLen = 9,
  kOffNBytes = 16, kOffNChunks = 24, kOffTotal = 32, kOffIndex = 40, kOffData = 48,
};
constexpr size_t kEntryBytes = 64;  // one chunk index entry; its fields:
enum : size_t { kEMask = 0, kERawBits = 1, kERaw = 8, kETable = 16, kECode = 40 };

constexpr int kMaxFields = 3;
constexpr int kMaxSymbolBits = 9;  // fields of at most 9 bits may be coded
constexpr int kMaxLen = 12;        // longest code: a 2^12-entry decode table
constexpr int kMaxContexts = 4;    // codes per field and chunk, chosen by the previous symbol
constexpr int kMinLog2Chunk = 8, kMaxLog2Chunk = 18;  // values per chunk
constexpr int kMinLog2Sub = 4, kMaxLog2Sub = 12;      // values per sub-block
constexpr int kMinLog2Lanes = 4;  // at least 16 sub-blocks per chunk (the Triton kernel's lanes)

// A dtype's split: value_bytes per value; the value rotated left by one bit,
// cut from the top into n_fields fields of width[f] bits.
struct Layout {
  int value_bytes, n_fields, width[kMaxFields];
};
inline Layout layout_of(DType d) {
  switch (d) {
    case DType::BFloat16: return {2, 2, {8, 8, 0}};
    case DType::Float16: return {2, 2, {8, 8, 0}};
    case DType::Float32: return {4, 3, {9, 15, 8}};
    case DType::Float8E4M3: case DType::Float8E5M2: return {1, 1, {8, 0, 0}};
    default: return {1, 0, {0, 0, 0}};
  }
}

[[noreturn]] inline void fail(const std::string& what) { throw std::invalid_argument("layerwise codec: " + what); }
inline std::string S(uint64_t v) { return std::to_string(v); }

constexpr uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
constexpr uint64_t a16(uint64_t a) { return ceil_div(a, 16) * 16; }

inline uint64_t get_u64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline uint16_t get_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline void put_u64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
inline void put_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline uint64_t load_be64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return __builtin_bswap64(v); }
inline uint64_t load_le64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }

// Bytes of a table and of a stream (each stream keeps >= 8 zero bytes of slack
// after its data, so 8-byte loads at any position inside it stay inside it).
// Symbols of a field of at most 8 bits are stored in one byte, of 9 bits in two.
inline int sym_bytes(int width) { return width > 8 ? 2 : 1; }
// A table: u16 contexts, u16 thresholds[3], then per context u16 counts[16] and its symbols,
// then u16 bits[sub-blocks]. n_sym: the symbols of all its contexts.
inline uint64_t table_bytes(int nctx, uint64_t n_sym, int width, uint64_t n_sub) {
  return a16(8 + 32 * nctx + sym_bytes(width) * n_sym + 2 * n_sub);
}
inline uint16_t get_sym(const uint8_t* p, int width, uint64_t k) { return width > 8 ? get_u16(p + 2 * k) : p[k]; }
inline uint64_t stream_bytes(uint64_t bits) { return a16(ceil_div(bits, 8) + 8); }

inline int resolve_threads(int requested, size_t units) {
  int hc = std::max(1u, std::thread::hardware_concurrency());
  int t = requested <= 0 ? hc : std::min(requested, hc);
  return static_cast<int>(std::min<size_t>(t, std::max<size_t>(1, units)));
}

// fn(first, end) over `parts` contiguous ranges of [0, n); part 0 on this thread.
template <class Fn>
inline void parallel(size_t n, int parts, Fn&& fn) {
  if (parts <= 1) return fn(size_t{0}, n);
  std::vector<std::exception_ptr> err(parts);
  std::vector<std::thread> pool;
  std::vector<int> here{0};
  auto run = [&](int k) {
    try {
      fn(n * k / parts, n * (k + 1) / parts);
    } catch (...) {
      err[k] = std::current_exception();
    }
  };
  for (int k = 1; k < parts; ++k) {
    try {
      pool.emplace_back(run, k);
    } catch (...) {
      here.push_back(k);  // no thread to be had: run it here
    }
  }
  for (int k : here) run(k);
  for (auto& t : pool) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

// The layouts again, at compile time, for the per-value loops. K: 1 fp8, 2 bf16, 3 fp16, 4 fp32.
template <int K>
struct Lay {
  static constexpr int VB = K == 1 ? 1 : K == 4 ? 4 : 2;
  static constexpr int bits = 8 * VB;
  static constexpr int NF = K == 1 ? 1 : K == 4 ? 3 : 2;
  static constexpr int W[3] = {K == 1 ? 8 : K <= 3 ? 8 : 9, K == 1 ? 0 : K <= 3 ? 8 : 15, K == 4 ? 8 : 0};
  static constexpr int P[3] = {bits - W[0], bits - W[0] - W[1], bits - W[0] - W[1] - W[2]};
  static uint32_t load(const uint8_t* p) {
    if constexpr (VB == 1) return *p;
    if constexpr (VB == 2) { uint16_t v; std::memcpy(&v, p, 2); return v; }
    if constexpr (VB == 4) { uint32_t v; std::memcpy(&v, p, 4); return v; }
  }
  static uint32_t rotl(uint32_t v) {
    if constexpr (VB == 4) return (v << 1) | (v >> 31);
    else return ((v << 1) | (v >> (bits - 1))) & ((1u << bits) - 1);
  }
  static uint32_t field(uint32_t u, int f) { return (u >> P[f]) & ((1u << W[f]) - 1); }
};

inline int kind_of(DType d) {
  switch (d) {
    case DType::BFloat16: return 2;
    case DType::Float16: return 3;
    case DType::Float32: return 4;
    default: return 1;
  }
}

// fn(std::integral_constant<int, K>) for the dtype's layout.
template <class Fn>
decltype(auto) with_kind(DType d, Fn&& fn) {
  switch (kind_of(d)) {
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    default: return fn(std::integral_constant<int, 1>{});
  }
}

inline bool candidate(const Layout& L, int f) { return L.width[f] <= kMaxSymbolBits; }

inline int context_of(uint32_t prev, const uint16_t* thr, int nctx) {
  int c = 0;
  for (int k = 0; k < nctx - 1; ++k) c += prev >= thr[k];
  return c;
}

inline uint64_t chunk_values(uint64_t n_values, int log2c, uint64_t c) {
  uint64_t cv = uint64_t{1} << log2c;
  return std::min(cv, n_values - c * cv);
}


inline std::string dname(DType d) { return dtype_name(d); }

// A context's canonical code as decoders read it: kMaxCodes entries, the codes in canonical
// order (by length, then symbol), then len 0.
struct Code {
  uint16_t sym;
  uint8_t len;
};
constexpr int kMaxCodes = 513;

namespace avx512 {
// Pair tables, per context 2^12 u32 entries: a 12-bit window -> the codes that lie whole inside
// it, one or two: bits 0-3 the bits they take (0: no code starts there, with kPairInvalid set),
// 4-7 the first code's length when there are two (else 0), 12-13 the context after the last,
// the first symbol at kPairSym1, the second at kPairSym2 (fields of <= 8 bits: bytes 2 and 3).
constexpr uint32_t kPairInvalid = 0x100;
template <int Y> constexpr int kPairSym1 = Y == 1 ? 16 : 14;
template <int Y> constexpr int kPairSym2 = Y == 1 ? 24 : 23;
// The pair tables (pair: nctx * 2^12) of a field's codes (codes: nctx * kMaxCodes; ctx_of: the
// context each symbol gives its successor); scratch: nctx * 2^12 u32.
void build_pairs(const Code* codes, int nctx, const uint8_t* ctx_of, int symbol_bytes, uint32_t* pair,
                 uint32_t* scratch);
// 16 * groups (1, 2 or 4) whole sub-blocks of `sub` values (a multiple of 16), sub-block k's
// codes at bit start[k] of `code`, which has code_bytes bytes (every 8-byte load of a lane
// must lie inside them: start[k] / 8 + 12 * sub / 8 + 8 <= code_bytes), through the pair
// tables `pair`; symbols (symbol_bytes 1: u8, fields of <= 8 bits; 2: u16, of 9) to
// out[k * sub ..]; each lane's end bit to end_pos[k]; `invalid` set when a lane met a window
// no code starts with.
void pair_lanes(const uint8_t* code, uint64_t code_bytes, const uint32_t* pair, const uint64_t* start, uint64_t sub,
                int groups, int symbol_bytes, void* out, uint32_t* end_pos, bool& invalid);
}  // namespace avx512

}  // namespace layerwise::codec
