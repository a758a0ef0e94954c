// Lossless codec of 16-bit float segments: CPU encoder and decoder, and their
// Python bindings (layerwise._C.codec). Format: layerwise/codec.py.
//
// Every 16-bit value is split into a symbol (its exponent) and raw bits (sign
// and mantissa). Symbols get a W-bit code over the segment's 2^W - 1 most
// frequent ones; the code of all ones sends the symbol to the exception stream.
// Each value's field (code + fp16's 3 raw bits that do not fit a byte) sits at
// bit i * F of the field stream, so any value decodes without its neighbours;
// the block index (exceptions before each block of 1024 values) lets threads
// (and GPU programs) start anywhere.
#include "codec.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

static_assert(std::endian::native == std::endian::little, "the codec writes its integers little-endian as they are");

namespace layerwise::codec {
namespace {

constexpr char kMagic[4] = {'L', 'W', 'C', 'S'};
// Header byte offsets (layerwise/codec.py has the table).
enum : size_t {
  kOffMagic = 0, kOffVersion = 4, kOffDtype = 5, kOffMode = 6, kOffWidth = 7, kOffFieldBits = 8,
  kOffLog2Block = 9, kOffTableSize = 10, kOffNBytes = 16, kOffNExc = 24, kOffTotal = 32,
  kOffIndex = 40, kOffFields = 48, kOffRaw = 56, kOffExc = 64,
};
// A thread gets at least this many blocks (64 Ki values): starting one costs tens of microseconds.
constexpr size_t kMinBlocksPerThread = 64;

std::string prefix() { return "layerwise codec: "; }

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument(prefix() + what); }

constexpr uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
constexpr uint64_t align_up(uint64_t a) { return ceil_div(a, kAlign) * kAlign; }

uint64_t get_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
void put_u64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
void put_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// Raw bits that travel in the field next to the code: 0 for bf16 (sign and
// 7 mantissa bits make the raw byte), 3 for fp16 (sign and the top 2 mantissa
// bits; the low 8 mantissa bits make the raw byte).
int extra_bits(DType d) { return d == DType::Float16 ? 3 : 0; }
int max_width(DType d) { return d == DType::Float16 ? 4 : 5; }
int symbol_limit(DType d) { return d == DType::Float16 ? 32 : 256; }

struct Layout {
  uint64_t off_index, off_fields, off_raw, off_exc, total;
};

// n_values < 2^32 (checked by the callers), so nothing here overflows.
Layout coded_layout(uint64_t n_values, int field_bits, uint64_t n_exc) {
  Layout l{};
  uint64_t nblocks = ceil_div(n_values, kBlockValues);
  l.off_index = kHeaderBytes;
  l.off_fields = align_up(l.off_index + 4 * (nblocks + 1));
  l.off_raw = align_up(l.off_fields + ceil_div(n_values * field_bits, 8));
  l.off_exc = align_up(l.off_raw + n_values);
  l.total = align_up(l.off_exc + n_exc);
  return l;
}

uint64_t stored_total(uint64_t n_bytes) { return align_up(kHeaderBytes + n_bytes); }

int resolve_threads(int requested, size_t nblocks) {
  int hc = std::max(1u, std::thread::hardware_concurrency());
  int t = requested <= 0 ? hc : std::min(requested, hc);
  size_t most = std::max<size_t>(1, nblocks / kMinBlocksPerThread);
  return static_cast<int>(std::min<size_t>(t, most));
}

// fn(chunk, first block, end block) over `chunks` contiguous ranges of [0, nblocks):
// chunk 0 on the calling thread, the others on threads of their own (inline if
// a thread cannot be started). The first exception thrown is rethrown after all joined.
template <class Fn>
void parallel_chunks(size_t nblocks, int chunks, Fn&& fn) {
  auto lo = [&](int k) { return nblocks * k / chunks; };
  if (chunks <= 1) {
    fn(0, size_t{0}, nblocks);
    return;
  }
  std::vector<std::exception_ptr> errors(chunks);
  std::vector<std::thread> pool;
  std::vector<int> inline_chunks;
  pool.reserve(chunks - 1);
  for (int k = 1; k < chunks; ++k) {
    try {
      pool.emplace_back([&, k] {
        try {
          fn(k, lo(k), lo(k + 1));
        } catch (...) {
          errors[k] = std::current_exception();
        }
      });
    } catch (...) {  // no thread to be had (std::system_error, std::bad_alloc): run it here
      inline_chunks.push_back(k);
    }
  }
  inline_chunks.insert(inline_chunks.begin(), 0);
  for (int k : inline_chunks) {
    try {
      fn(k, lo(k), lo(k + 1));
    } catch (...) {
      errors[k] = std::current_exception();
    }
  }
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// ---------------------------------------------------------------- splitting
template <DType D>
struct Split;

template <>
struct Split<DType::BFloat16> {  // s eeeeeeee mmmmmmm
  static constexpr int X = 0;
  static uint32_t symbol(uint32_t v) { return (v >> 7) & 0xFF; }
  static uint8_t raw(uint32_t v) { return static_cast<uint8_t>(((v >> 8) & 0x80) | (v & 0x7F)); }
  static uint32_t extra(uint32_t) { return 0; }
  // The value without its raw byte, from the symbol and the extra bits.
  static uint32_t high(uint32_t sym, uint32_t) { return sym << 7; }
  static uint32_t with_raw(uint32_t hi, uint8_t r) { return hi | ((r & 0x80u) << 8) | (r & 0x7Fu); }
};

template <>
struct Split<DType::Float16> {  // s eeeee mm mmmmmmmm
  static constexpr int X = 3;
  static uint32_t symbol(uint32_t v) { return (v >> 10) & 0x1F; }
  static uint8_t raw(uint32_t v) { return static_cast<uint8_t>(v & 0xFF); }
  static uint32_t extra(uint32_t v) { return ((v >> 13) & 4) | ((v >> 8) & 3); }
  static uint32_t high(uint32_t sym, uint32_t ex) { return ((ex & 4) << 13) | (sym << 10) | ((ex & 3) << 8); }
  static uint32_t with_raw(uint32_t hi, uint8_t r) { return hi | r; }
};

uint32_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ----------------------------------------------------------------- encoding
template <DType D>
void histogram(const uint8_t* src, size_t n_values, int threads, uint64_t* out) {
  size_t nblocks = ceil_div(n_values, kBlockValues);
  int chunks = resolve_threads(threads, nblocks);
  std::vector<std::array<uint64_t, 256>> parts(chunks);
  parallel_chunks(nblocks, chunks, [&](int k, size_t b0, size_t b1) {
    // Four interleaved counters: consecutive equal symbols do not wait on each other.
    std::array<std::array<uint64_t, 256>, 4> c{};
    size_t i = b0 * kBlockValues, end = std::min<size_t>(n_values, b1 * kBlockValues);
    for (; i + 4 <= end; i += 4)
      for (int j = 0; j < 4; ++j) ++c[j][Split<D>::symbol(load16(src + 2 * (i + j)))];
    for (; i < end; ++i) ++c[0][Split<D>::symbol(load16(src + 2 * i))];
    for (int s = 0; s < 256; ++s) parts[k][s] = c[0][s] + c[1][s] + c[2][s] + c[3][s];
  });
  std::fill(out, out + 256, 0);
  for (auto& p : parts)
    for (int s = 0; s < 256; ++s) out[s] += p[s];
}

// A growable byte buffer that may be written up to its capacity before its size
// is moved (std::vector forbids that): exceptions are stored without a branch.
struct ByteBuf {
  std::unique_ptr<uint8_t[]> data;
  size_t size = 0, cap = 0;
  void reserve_more(size_t more) {
    if (size + more <= cap) return;
    size_t c = std::max(size + more, 2 * cap);
    auto d = std::make_unique<uint8_t[]>(c);
    if (size) std::memcpy(d.get(), data.get(), size);
    data = std::move(d);
    cap = c;
  }
};

template <DType D, int F>
void encode_chunk(const EncodePlan& plan, const uint8_t* src, size_t n_values, size_t b0, size_t b1, uint8_t* out,
                  ByteBuf& exc) {
  constexpr int X = Split<D>::X;
  constexpr int W = F - X;
  constexpr uint32_t esc = (1u << W) - 1;
  const Header& h = plan.header;
  uint8_t* fields = out + h.off_fields;
  uint8_t* raw = out + h.off_raw;
  for (size_t b = b0; b < b1; ++b) {
    put_u32(out + h.off_index + 4 * b, static_cast<uint32_t>(exc.size));  // local; rebased after the join
    size_t end = std::min<size_t>(n_values, (b + 1) * kBlockValues);
    exc.reserve_more(kBlockValues);
    uint8_t* ex = exc.data.get();
    size_t e = exc.size;
    for (size_t i = b * kBlockValues; i < end; i += 8) {
      size_t cnt = std::min<size_t>(8, end - i);
      uint64_t acc = 0;
      for (size_t k = 0; k < cnt; ++k) {
        uint32_t v = load16(src + 2 * (i + k));
        uint32_t sym = Split<D>::symbol(v);
        uint32_t code = plan.code_of[sym];
        ex[e] = static_cast<uint8_t>(sym);  // kept only when the code is the escape
        e += code == esc;
        acc |= static_cast<uint64_t>(code | (Split<D>::extra(v) << W)) << (k * F);
        raw[i + k] = Split<D>::raw(v);
      }
      if (cnt == 8)  // i is a multiple of 8: eight fields fill F whole bytes
        std::memcpy(fields + (i / 8) * F, &acc, F);
      else
        for (size_t j = 0; j < (cnt * F + 7) / 8; ++j) fields[(i / 8) * F + j] = static_cast<uint8_t>(acc >> (8 * j));
    }
    exc.size = e;
  }
}

template <DType D, int F>
void encode_coded(const EncodePlan& plan, const uint8_t* src, size_t n_values, uint8_t* out, int threads) {
  const Header& h = plan.header;
  size_t nblocks = ceil_div(n_values, kBlockValues);
  int chunks = resolve_threads(threads, nblocks);
  std::vector<ByteBuf> exc(chunks);
  parallel_chunks(nblocks, chunks, [&](int k, size_t b0, size_t b1) {
    encode_chunk<D, F>(plan, src, n_values, b0, b1, out, exc[k]);
  });
  std::vector<uint64_t> base(chunks + 1, 0);
  for (int k = 0; k < chunks; ++k) base[k + 1] = base[k] + exc[k].size;
  if (base[chunks] != h.n_exceptions)  // the histogram and the pass disagree: a bug, not bad input
    throw std::logic_error(prefix() + "encoder counted " + std::to_string(base[chunks]) + " exceptions, planned " +
                           std::to_string(h.n_exceptions));
  parallel_chunks(nblocks, chunks, [&](int k, size_t b0, size_t b1) {
    for (size_t b = b0; b < b1; ++b) {
      uint8_t* p = out + h.off_index + 4 * b;
      put_u32(p, static_cast<uint32_t>(get_u32(p) + base[k]));
    }
    if (exc[k].size) std::memcpy(out + h.off_exceptions + base[k], exc[k].data.get(), exc[k].size);
  });
  put_u32(out + h.off_index + 4 * nblocks, static_cast<uint32_t>(h.n_exceptions));
}

template <DType D>
void encode_dispatch(const EncodePlan& plan, const uint8_t* src, size_t n_values, uint8_t* out, int threads) {
  switch (plan.header.field_bits) {
#define LW_CASE(F) \
  case F:          \
    if constexpr (F > Split<D>::X) return encode_coded<D, F>(plan, src, n_values, out, threads); \
    break;
    LW_CASE(1) LW_CASE(2) LW_CASE(3) LW_CASE(4) LW_CASE(5) LW_CASE(6) LW_CASE(7) LW_CASE(8)
#undef LW_CASE
    default:
      break;
  }
  throw std::logic_error(prefix() + "no encoder for " + std::to_string(plan.header.field_bits) + "-bit fields");
}

void write_header(const Header& h, uint8_t* out) {
  std::memset(out, 0, kHeaderBytes);
  std::memcpy(out + kOffMagic, kMagic, 4);
  out[kOffVersion] = kVersion;
  out[kOffDtype] = static_cast<uint8_t>(h.dtype);
  out[kOffMode] = static_cast<uint8_t>(h.mode);
  out[kOffWidth] = static_cast<uint8_t>(h.width);
  out[kOffFieldBits] = static_cast<uint8_t>(h.field_bits);
  out[kOffLog2Block] = h.mode == Mode::Coded ? kLog2Block : 0;
  out[kOffTableSize] = static_cast<uint8_t>(h.table_size);
  put_u64(out + kOffNBytes, h.n_bytes);
  put_u64(out + kOffNExc, h.n_exceptions);
  put_u64(out + kOffTotal, h.encoded_bytes);
  put_u64(out + kOffIndex, h.off_index);
  put_u64(out + kOffFields, h.off_fields);
  put_u64(out + kOffRaw, h.off_raw);
  put_u64(out + kOffExc, h.off_exceptions);
  std::memcpy(out + kTableOffset, h.table, kMaxTable);
}

// ----------------------------------------------------------------- decoding
template <DType D, int F>
void decode_chunk(const Header& h, const uint8_t* enc, size_t n_values, size_t b0, size_t b1, uint8_t* dst) {
  constexpr int X = Split<D>::X;
  constexpr int W = F - X;
  constexpr uint32_t esc = (1u << W) - 1;
  constexpr uint64_t mask = (uint64_t{1} << F) - 1;
  constexpr uint32_t kExc = 1u << 16, kPastTable = 1u << 17;
  // field -> the value's bits outside its raw byte (an exception's symbol is
  // or-ed in by the second pass), | kExc for the escape, | kPastTable for a code the table lacks
  std::array<uint32_t, 256> lut{};
  for (uint32_t f = 0; f <= mask; ++f) {
    uint32_t code = f & esc, ex = f >> W;
    bool in_table = code < static_cast<uint32_t>(h.table_size);
    lut[f] = Split<D>::high(in_table ? h.table[code] : 0, ex) | (code == esc ? kExc : 0) |
             (code != esc && !in_table ? kPastTable : 0);
  }
  const uint8_t* fields = enc + h.off_fields;
  const uint8_t* raw = enc + h.off_raw;
  const uint8_t* exc = enc + h.off_exceptions;
  const uint8_t* index = enc + h.off_index;
  uint16_t where[kBlockValues + 1];  // offsets in the block of its exceptions (one spare slot: written, not kept)
  for (size_t b = b0; b < b1; ++b) {
    // check_index made sure that e0 <= e_end <= n_exceptions and e_end - e0 <= the block's values
    const uint64_t e0 = get_u32(index + 4 * b), e_end = get_u32(index + 4 * (b + 1));
    const size_t start = b * kBlockValues, end = std::min<size_t>(n_values, start + kBlockValues);
    uint32_t flags = 0;
    size_t ne = 0;
    // Pass 1, without branches: every value from its field and raw byte; note where the escapes are.
    auto one = [&](size_t i, uint64_t f) {
      uint32_t l = lut[f];
      flags |= l;
      where[ne < kBlockValues ? ne : kBlockValues] = static_cast<uint16_t>(i - start);
      ne += (l >> 16) & 1;
      uint16_t out = static_cast<uint16_t>(Split<D>::with_raw(l, raw[i]));
      std::memcpy(dst + 2 * i, &out, 2);
    };
    size_t i = start;
    // Eight values' fields are F bytes: one 8-byte load while it stays inside the buffer.
    for (; i + 8 <= end && h.off_fields + (i / 8) * F + 8 <= h.encoded_bytes; i += 8) {
      uint64_t acc;
      std::memcpy(&acc, fields + (i / 8) * F, 8);
      for (int k = 0; k < 8; ++k) one(i + k, (acc >> (k * F)) & mask);
    }
    for (; i < end; i += 8) {
      size_t cnt = std::min<size_t>(8, end - i);
      uint64_t acc = 0;
      for (size_t j = 0; j < (cnt * F + 7) / 8; ++j) acc |= uint64_t{fields[(i / 8) * F + j]} << (8 * j);
      for (size_t k = 0; k < cnt; ++k) one(i + k, (acc >> (k * F)) & mask);
    }
    if (flags & kPastTable)
      fail("block " + std::to_string(b) + " holds a code past the table's " + std::to_string(h.table_size) +
           " entries: corrupt encoded segment");
    if (ne != e_end - e0)
      fail("block " + std::to_string(b) + " holds " + std::to_string(ne) + " exception codes but its index entry "
           "says " + std::to_string(e_end - e0) + ": corrupt encoded segment");
    // Pass 2: the exceptions' symbols.
    for (size_t j = 0; j < ne; ++j) {
      uint32_t sym = exc[e0 + j];
      if (sym >= static_cast<uint32_t>(symbol_limit(D)))
        fail("exception " + std::to_string(e0 + j) + " holds " + std::to_string(sym) + ", not a " +
             std::string(dtype_name(D)) + " exponent: corrupt encoded segment");
      uint8_t* p = dst + 2 * (start + where[j]);
      uint16_t v;
      std::memcpy(&v, p, 2);
      v = static_cast<uint16_t>(v | Split<D>::high(sym, 0));
      std::memcpy(p, &v, 2);
    }
  }
}

template <DType D>
void decode_dispatch(const Header& h, const uint8_t* enc, size_t n_values, size_t b0, size_t b1, uint8_t* dst) {
  switch (h.field_bits) {
#define LW_CASE(F) \
  case F:          \
    if constexpr (F > Split<D>::X) return decode_chunk<D, F>(h, enc, n_values, b0, b1, dst); \
    break;
    LW_CASE(1) LW_CASE(2) LW_CASE(3) LW_CASE(4) LW_CASE(5) LW_CASE(6) LW_CASE(7) LW_CASE(8)
#undef LW_CASE
    default:
      break;
  }
  fail("no decoder for " + std::to_string(h.field_bits) + "-bit fields");  // read_header refuses these
}

void check_index(const Header& h, const uint8_t* enc, uint64_t n_values) {
  uint64_t nblocks = ceil_div(n_values, kBlockValues);
  const uint8_t* index = enc + h.off_index;
  if (get_u32(index) != 0) fail("exception index starts at " + std::to_string(get_u32(index)) + ", not 0");
  for (uint64_t b = 0; b < nblocks; ++b) {
    uint64_t a = get_u32(index + 4 * b), z = get_u32(index + 4 * (b + 1));
    uint64_t values = std::min<uint64_t>(kBlockValues, n_values - b * kBlockValues);
    if (z < a || z - a > values)
      fail("exception index entry " + std::to_string(b + 1) + " (" + std::to_string(z) + ") after " +
           std::to_string(a) + " is not within the " + std::to_string(values) + " values of block " +
           std::to_string(b) + ": corrupt encoded segment");
  }
  if (get_u32(index + 4 * nblocks) != h.n_exceptions)
    fail("exception index ends at " + std::to_string(get_u32(index + 4 * nblocks)) + " but the header counts " +
         std::to_string(h.n_exceptions) + " exceptions");
}

}  // namespace

// ------------------------------------------------------------------ public
DType dtype_from_name(const std::string& name) {
  if (name == "bfloat16") return DType::BFloat16;
  if (name == "float16") return DType::Float16;
  if (name == "float32") return DType::Float32;
  if (name == "float8_e4m3fn") return DType::Float8E4M3;
  if (name == "float8_e5m2") return DType::Float8E5M2;
  static const char* stored[] = {"bytes", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
                                 "float8_e4m3fnuz", "float8_e5m2fnuz", "complex64", "complex128", "uint16",
                                 "uint32", "uint64"};
  for (const char* s : stored)
    if (name == s) return DType::Bytes;
  fail("unknown dtype '" + name + "': bfloat16, float16, float32, float8_e4m3fn and float8_e5m2 are coded; "
       "other torch dtype names (int8, ..., or 'bytes') are stored as raw bytes");
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::BFloat16: return "bfloat16";
    case DType::Float16: return "float16";
    case DType::Float32: return "float32";
    case DType::Float8E4M3: return "float8_e4m3fn";
    case DType::Float8E5M2: return "float8_e5m2";
    default: return "bytes";
  }
}

Header read_header(const uint8_t* enc, size_t n) {
  if (n < kHeaderBytes)
    fail("encoded segment has " + std::to_string(n) + " bytes, fewer than its " + std::to_string(kHeaderBytes) +
         "-byte header (truncated?)");
  if (std::memcmp(enc, kMagic, 4) != 0)
    fail("encoded segment does not start with the magic 'LWCS' (not an encoded segment, or the wrong offset)");
  if (enc[kOffVersion] != kVersion)
    fail("encoded segment has format version " + std::to_string(enc[kOffVersion]) + "; this build reads versions " +
         std::to_string(kVersion) + " and " + std::to_string(v2::kVersion));
  Header h;
  if (enc[kOffDtype] > 2) fail("unknown dtype code " + std::to_string(enc[kOffDtype]) + " in the header");
  if (enc[kOffMode] > 1) fail("unknown mode " + std::to_string(enc[kOffMode]) + " in the header");
  for (size_t i : {11, 12, 13, 14, 15})
    if (enc[i]) fail("reserved header byte " + std::to_string(i) + " is not zero");
  for (size_t i = 72; i < kTableOffset; ++i)
    if (enc[i]) fail("reserved header byte " + std::to_string(i) + " is not zero");
  h.dtype = static_cast<DType>(enc[kOffDtype]);
  h.mode = static_cast<Mode>(enc[kOffMode]);
  h.width = enc[kOffWidth];
  h.field_bits = enc[kOffFieldBits];
  h.table_size = enc[kOffTableSize];
  h.n_bytes = get_u64(enc + kOffNBytes);
  h.n_exceptions = get_u64(enc + kOffNExc);
  h.encoded_bytes = get_u64(enc + kOffTotal);
  h.off_index = get_u64(enc + kOffIndex);
  h.off_fields = get_u64(enc + kOffFields);
  h.off_raw = get_u64(enc + kOffRaw);
  h.off_exceptions = get_u64(enc + kOffExc);
  std::memcpy(h.table, enc + kTableOffset, kMaxTable);
  if (h.encoded_bytes != n)
    fail("header says the encoded segment has " + std::to_string(h.encoded_bytes) + " bytes, the buffer has " +
         std::to_string(n) + " (truncated, or not the whole segment)");
  Layout want{};
  if (h.mode == Mode::Stored) {
    if (h.width || h.field_bits || h.table_size || enc[kOffLog2Block] || h.n_exceptions)
      fail("stored segment with code fields set in its header");
    if (h.n_bytes > n) fail("stored segment claims " + std::to_string(h.n_bytes) + " bytes in a buffer of " +
                            std::to_string(n));
    want = {0, 0, kHeaderBytes, 0, stored_total(h.n_bytes)};
    for (size_t c = 0; c < kMaxTable; ++c)
      if (h.table[c]) fail("stored segment with a code table");
  } else {
    if (h.dtype == DType::Bytes) fail("coded segment of dtype 'bytes' (only bfloat16 and float16 are coded)");
    if (h.n_bytes % 2) fail("coded segment of " + std::to_string(h.n_bytes) + " bytes, not whole 16-bit values");
    uint64_t n_values = h.n_bytes / 2;
    if (n_values >= (uint64_t{1} << 32)) fail("coded segment of " + std::to_string(n_values) + " values (>= 2^32)");
    if (enc[kOffLog2Block] != kLog2Block)
      fail("block size 2^" + std::to_string(enc[kOffLog2Block]) + "; this build reads 2^" +
           std::to_string(kLog2Block));
    if (h.width < 1 || h.width > max_width(h.dtype))
      fail("code width " + std::to_string(h.width) + " out of range 1.." + std::to_string(max_width(h.dtype)) +
           " for " + dtype_name(h.dtype));
    if (h.field_bits != h.width + extra_bits(h.dtype))
      fail("field of " + std::to_string(h.field_bits) + " bits for " + std::to_string(h.width) + "-bit codes of " +
           dtype_name(h.dtype));
    if (h.table_size > (1 << h.width) - 1)
      fail("table of " + std::to_string(h.table_size) + " symbols for " + std::to_string(h.width) + "-bit codes");
    if (h.n_exceptions > n_values)
      fail(std::to_string(h.n_exceptions) + " exceptions in " + std::to_string(n_values) + " values");
    for (int c = 0; c < static_cast<int>(kMaxTable); ++c) {
      if (c >= h.table_size && h.table[c]) fail("table entry " + std::to_string(c) + " past the table is set");
      if (h.table[c] >= symbol_limit(h.dtype))
        fail("table entry " + std::to_string(c) + " (" + std::to_string(h.table[c]) + ") is not a " +
             dtype_name(h.dtype) + " exponent");
    }
    want = coded_layout(n_values, h.field_bits, h.n_exceptions);
  }
  if (h.off_index != want.off_index || h.off_fields != want.off_fields || h.off_raw != want.off_raw ||
      h.off_exceptions != want.off_exc || h.encoded_bytes != want.total)
    fail("stream offsets (index " + std::to_string(h.off_index) + ", fields " + std::to_string(h.off_fields) +
         ", raw " + std::to_string(h.off_raw) + ", exceptions " + std::to_string(h.off_exceptions) + ", total " +
         std::to_string(h.encoded_bytes) + ") differ from the layout the header's sizes imply (" +
         std::to_string(want.off_index) + ", " + std::to_string(want.off_fields) + ", " +
         std::to_string(want.off_raw) + ", " + std::to_string(want.off_exc) + ", " + std::to_string(want.total) +
         ")");
  return h;
}

EncodePlan plan_encode(const uint8_t* src, size_t n, DType dtype, int threads) {
  EncodePlan p{};
  Header& h = p.header;
  if (dtype != DType::BFloat16 && dtype != DType::Float16) dtype = DType::Bytes;  // version 1 codes 16-bit floats only
  h.dtype = dtype;
  h.n_bytes = n;
  auto stored = [&] {
    h.mode = Mode::Stored;
    h.width = h.field_bits = h.table_size = 0;
    h.n_exceptions = 0;
    h.off_index = h.off_fields = h.off_exceptions = 0;
    h.off_raw = kHeaderBytes;
    h.encoded_bytes = stored_total(n);
    std::fill(std::begin(h.table), std::end(h.table), 0);
    return p;
  };
  if (dtype == DType::Bytes) return stored();
  if (n % 2)
    fail(std::string(dtype_name(dtype)) + " segment of " + std::to_string(n) +
         " bytes: not a whole number of 2-byte values");
  uint64_t n_values = n / 2;
  if (n_values == 0 || n_values >= (uint64_t{1} << 32)) return stored();  // the index counts in 32 bits
  uint64_t hist[256];
  if (dtype == DType::BFloat16)
    histogram<DType::BFloat16>(src, n_values, threads, hist);
  else
    histogram<DType::Float16>(src, n_values, threads, hist);
  std::vector<int> order(symbol_limit(dtype));
  for (size_t s = 0; s < order.size(); ++s) order[s] = static_cast<int>(s);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return hist[a] > hist[b]; });
  int distinct = static_cast<int>(std::count_if(order.begin(), order.end(), [&](int s) { return hist[s] > 0; }));
  uint64_t best_total = UINT64_MAX, best_exc = 0;
  int best_w = 0;
  for (int w = 1; w <= max_width(dtype); ++w) {
    int t = std::min((1 << w) - 1, distinct);
    uint64_t covered = 0;
    for (int c = 0; c < t; ++c) covered += hist[order[c]];
    uint64_t n_exc = n_values - covered;
    uint64_t total = coded_layout(n_values, w + extra_bits(dtype), n_exc).total;
    if (total < best_total) best_total = total, best_w = w, best_exc = n_exc;
  }
  // Coded only when it saves at least 3% of the raw bytes.
  if (best_total * 100 > static_cast<uint64_t>(n) * 97) return stored();
  h.mode = Mode::Coded;
  h.width = best_w;
  h.field_bits = best_w + extra_bits(dtype);
  h.table_size = std::min((1 << best_w) - 1, distinct);
  h.n_exceptions = best_exc;
  Layout l = coded_layout(n_values, h.field_bits, best_exc);
  h.off_index = l.off_index;
  h.off_fields = l.off_fields;
  h.off_raw = l.off_raw;
  h.off_exceptions = l.off_exc;
  h.encoded_bytes = l.total;
  std::fill(std::begin(p.code_of), std::end(p.code_of), static_cast<uint8_t>((1 << best_w) - 1));
  for (int c = 0; c < h.table_size; ++c) {
    h.table[c] = static_cast<uint8_t>(order[c]);
    p.code_of[order[c]] = static_cast<uint8_t>(c);
  }
  return p;
}

void encode_into(const EncodePlan& plan, const uint8_t* src, size_t n, uint8_t* out, size_t out_n, int threads) {
  const Header& h = plan.header;
  if (n != h.n_bytes) fail("encode_into: the plan is for " + std::to_string(h.n_bytes) + " bytes, got " +
                           std::to_string(n));
  if (out_n != h.encoded_bytes)
    fail("encode_into: output of " + std::to_string(out_n) + " bytes, the plan needs " +
         std::to_string(h.encoded_bytes));
  write_header(h, out);
  if (h.mode == Mode::Stored) {
    if (n) std::memcpy(out + kHeaderBytes, src, n);
    std::memset(out + kHeaderBytes + n, 0, out_n - kHeaderBytes - n);
    return;
  }
  uint64_t n_values = n / 2;
  // Padding between the streams is zero (the streams themselves are written in full).
  uint64_t nblocks = ceil_div(n_values, kBlockValues);
  auto zero = [&](uint64_t from, uint64_t to) { std::memset(out + from, 0, to - from); };
  zero(h.off_index + 4 * (nblocks + 1), h.off_fields);
  zero(h.off_fields + ceil_div(n_values * h.field_bits, 8), h.off_raw);
  zero(h.off_raw + n_values, h.off_exceptions);
  zero(h.off_exceptions + h.n_exceptions, h.encoded_bytes);
  if (h.dtype == DType::BFloat16)
    encode_dispatch<DType::BFloat16>(plan, src, n_values, out, threads);
  else
    encode_dispatch<DType::Float16>(plan, src, n_values, out, threads);
}

void decode_into(const uint8_t* enc, size_t n, uint8_t* dst, size_t dst_n, int threads, bool fresh) {
  if (n > kOffVersion && std::memcmp(enc, kMagic, 4) == 0 && enc[kOffVersion] == v2::kVersion)
    return v2::decode_into(enc, n, dst, dst_n, threads, fresh);
  Header h = read_header(enc, n);
  if (dst_n != h.n_bytes)
    fail("destination has " + std::to_string(dst_n) + " bytes but the segment decodes to " +
         std::to_string(h.n_bytes));
  if (h.mode == Mode::Stored) {
    if (dst_n) std::memcpy(dst, enc + h.off_raw, dst_n);
    return;
  }
  uint64_t n_values = h.n_bytes / 2;
  check_index(h, enc, n_values);
  size_t nblocks = ceil_div(n_values, kBlockValues);
  parallel_chunks(nblocks, resolve_threads(threads, nblocks), [&](int, size_t b0, size_t b1) {
    if (h.dtype == DType::BFloat16)
      decode_dispatch<DType::BFloat16>(h, enc, n_values, b0, b1, dst);
    else
      decode_dispatch<DType::Float16>(h, enc, n_values, b0, b1, dst);
  });
}

}  // namespace layerwise::codec

// ------------------------------------------------------------------ Python
// (LAYERWISE_CODEC_STANDALONE: the codec alone, for a C++ harness without torch)
#ifndef LAYERWISE_CODEC_STANDALONE
#include <torch/extension.h>

namespace {

namespace py = pybind11;
namespace lc = layerwise::codec;

void check_bytes(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "layerwise codec ", fn, ": ", name, " is on ", t.device(),
                    "; the C++ codec works on host tensors (decode on a GPU with "
                    "layerwise.triton_kernels.decode.decode_segment)");
  TORCH_CHECK_VALUE(t.scalar_type() == at::kByte, "layerwise codec ", fn, ": ", name, " must be a uint8 tensor, got ",
                    t.scalar_type(), " (view it with .view(torch.uint8))");
  TORCH_CHECK_VALUE(t.is_contiguous(), "layerwise codec ", fn, ": ", name, " must be contiguous");
}

// Errors of the codec core are std::invalid_argument, which pybind11 turns into ValueError.
py::dict header_dict(const lc::Header& h) {
  py::dict d;
  d["version"] = 1;
  d["dtype"] = lc::dtype_name(h.dtype);
  d["mode"] = h.mode == lc::Mode::Coded ? "coded" : "stored";
  d["width"] = h.width;
  d["field_bits"] = h.field_bits;
  d["table"] = std::vector<int>(h.table, h.table + h.table_size);
  d["n_bytes"] = h.n_bytes;
  d["n_exceptions"] = h.n_exceptions;
  d["encoded_bytes"] = h.encoded_bytes;
  d["off_index"] = h.off_index;
  d["off_fields"] = h.off_fields;
  d["off_raw"] = h.off_raw;
  d["off_exceptions"] = h.off_exceptions;
  return d;
}

py::dict header_dict(const lc::v2::Header& h) {
  py::dict d;
  d["version"] = 2;
  d["dtype"] = lc::dtype_name(h.dtype);
  d["mode"] = h.coded ? "coded" : "stored";
  d["chunk_values"] = h.coded ? uint64_t{1} << h.log2_chunk : 0;
  d["sub_values"] = h.coded ? uint64_t{1} << h.log2_sub : 0;
  d["max_code_bits"] = h.max_len;
  d["n_bytes"] = h.n_bytes;
  d["n_chunks"] = h.n_chunks;
  d["encoded_bytes"] = h.encoded_bytes;
  d["off_index"] = h.off_index;
  d["off_data"] = h.off_data;
  return d;
}

bool is_v2(const uint8_t* e, size_t n) { return n > 4 && std::memcmp(e, "LWCS", 4) == 0 && e[4] == lc::v2::kVersion; }

}  // namespace

void bind_codec(pybind11::module_& m) {
  auto c = m.def_submodule("codec", "Lossless codec of float segments (format: layerwise/codec.py)");
  c.attr("HEADER_BYTES") = lc::kHeaderBytes;
  c.attr("BLOCK_VALUES") = lc::kBlockValues;
  c.attr("VERSION") = lc::v2::kVersion;
  c.attr("LOG2_CHUNK") = lc::v2::kLog2Chunk;
  c.attr("LOG2_SUB") = lc::v2::kLog2Sub;
  c.def(
      "encode",
      [](const at::Tensor& src, const std::string& dtype, int threads, int version, int log2_chunk, int log2_sub,
         bool size_only) -> py::object {
        check_bytes(src, "encode", "src");
        lc::DType d = lc::dtype_from_name(dtype);
        const uint8_t* p = src.data_ptr<uint8_t>();
        size_t n = src.numel();
        TORCH_CHECK_VALUE(version == 1 || version == 2, "layerwise codec encode: version must be 1 or 2, got ",
                          version);
        if (version == 1) {
          lc::EncodePlan plan;
          {
            py::gil_scoped_release r;
            plan = lc::plan_encode(p, n, d, threads);
          }
          if (size_only) return py::int_(plan.header.encoded_bytes);
          at::Tensor out = at::empty({static_cast<int64_t>(plan.header.encoded_bytes)}, src.options());
          {
            py::gil_scoped_release r;
            lc::encode_into(plan, p, n, out.data_ptr<uint8_t>(), out.numel(), threads);
          }
          return py::cast(out);
        }
        std::shared_ptr<lc::v2::Plan> plan;
        {
          py::gil_scoped_release r;
          plan = lc::v2::plan_encode(p, n, d, threads, log2_chunk, log2_sub);
        }
        uint64_t total = lc::v2::plan_header(*plan).encoded_bytes;
        if (size_only) return py::int_(total);
        at::Tensor out = at::empty({static_cast<int64_t>(total)}, src.options());
        {
          py::gil_scoped_release r;
          lc::v2::encode_into(*plan, p, n, out.data_ptr<uint8_t>(), out.numel(), threads);
        }
        return py::cast(out);
      },
      py::arg("src"), py::arg("dtype"), py::arg("threads") = 0, py::arg("version") = 2,
      py::arg("log2_chunk") = lc::v2::kLog2Chunk, py::arg("log2_sub") = lc::v2::kLog2Sub,
      py::arg("size_only") = false,
      "Encode the bytes of src (uint8, contiguous, host) holding values of `dtype`: a new uint8 tensor (size_only: "
      "its size in bytes, nothing written)");
  c.def(
      "decode",
      [](const at::Tensor& enc, const at::Tensor& dst, int threads, bool fresh) {
        check_bytes(enc, "decode", "encoded");
        check_bytes(dst, "decode", "dst");
        const uint8_t* e = enc.data_ptr<uint8_t>();
        uint8_t* d = dst.data_ptr<uint8_t>();
        size_t en = enc.numel(), dn = dst.numel();
        TORCH_CHECK_VALUE(dn == 0 || en == 0 || d + dn <= e || e + en <= d,
                          "layerwise codec decode: dst overlaps the encoded bytes");
        py::gil_scoped_release r;
        lc::decode_into(e, en, d, dn, threads, fresh);
      },
      py::arg("encoded"), py::arg("dst"), py::arg("threads") = 0, py::arg("fresh") = false,
      "Decode `encoded` (either version) into dst (uint8, contiguous, host, exactly the decoded size); fresh: dst "
      "was just allocated, untouched (its pages are backed by the decoding threads, huge pages while they come fast)");
  c.def(
      "read_header",
      [](const at::Tensor& enc) {
        check_bytes(enc, "read_header", "encoded");
        const uint8_t* e = enc.data_ptr<uint8_t>();
        size_t n = enc.numel();
        return is_v2(e, n) ? header_dict(lc::v2::read_header(e, n)) : header_dict(lc::read_header(e, n));
      },
      py::arg("encoded"), "The checked header of a whole encoded segment (either version), as a dict");
  c.def("simd_supported", &lc::v2::avx512::supported,
        "Whether this CPU (and build) has the AVX-512 decode of version 2's coded fields (AVX-512F/BW/VL/VBMI2, BMI2)");
  c.def("simd_enabled", &lc::v2::avx512::enabled, "Whether decode uses the AVX-512 path (LAYERWISE_CODEC_SIMD=0: off)");
  c.def("simd_calls", &lc::v2::avx512::calls, "Calls of the AVX-512 lanes so far in this process (groups of 16-64 "
        "sub-blocks): which path decoded");
  c.def("set_simd", &lc::v2::avx512::set_enabled, py::arg("on"),
        "Turn the AVX-512 decode on or off for the process; returns the previous state (on where it is not "
        "supported raises ValueError). Both paths decode the same bytes bitwise (tests/test_codec_v2.py).");
}
#endif  // LAYERWISE_CODEC_STANDALONE
