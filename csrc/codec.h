// Lossless codec of float segments: the CPU encoders and decoders of format
// versions 1 (bf16/fp16, fixed-width exponent codes: codec.cpp) and 2 (bf16,
// fp16, fp32, fp8: per-chunk canonical Huffman codes: codec_v2.cpp). The
// format is specified in layerwise/codec.py; the Triton decoder
// (triton_kernels/decode.py) reads the same bytes on the device.
//
// Plain C++ (no torch, no Python): the CPU copy engine may call decode_into
// from its worker thread right after a copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace layerwise::codec {

constexpr size_t kHeaderBytes = 128;
constexpr size_t kTableOffset = 96;       // symbol of code c: header byte 96 + c
constexpr size_t kMaxTable = 32;
constexpr int kLog2Block = 10;            // values per block of the exception index
constexpr size_t kBlockValues = size_t{1} << kLog2Block;
constexpr size_t kAlign = 16;             // every stream and the total are 16-byte aligned
constexpr uint8_t kVersion = 1;

// The header's dtype codes (version 1 writes and reads only 0..2).
enum class DType : uint8_t { Bytes = 0, BFloat16 = 1, Float16 = 2, Float32 = 3, Float8E4M3 = 4, Float8E5M2 = 5 };
enum class Mode : uint8_t { Stored = 0, Coded = 1 };

// The parsed and checked header of an encoded segment.
struct Header {
  DType dtype = DType::Bytes;
  Mode mode = Mode::Stored;
  int width = 0;        // W: bits of a code (1..5); code 2^W - 1 = exception
  int field_bits = 0;   // F = W + raw bits that ride with the code (fp16: 3)
  int table_size = 0;   // T <= 2^W - 1 symbols in the table
  uint64_t n_bytes = 0;          // decoded size
  uint64_t n_exceptions = 0;
  uint64_t encoded_bytes = 0;    // total, header and padding included
  uint64_t off_index = 0, off_fields = 0, off_raw = 0, off_exceptions = 0;
  uint8_t table[kMaxTable] = {};
};

// "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2" have codes of
// their own; every other dtype name torch has ("int8", "uint8", ..., or "bytes")
// is Bytes (stored as raw bytes).
// Throws std::invalid_argument for a name it does not know.
DType dtype_from_name(const std::string& name);
const char* dtype_name(DType d);

// Parses the header of the encoded segment enc[0, n) and checks it against the
// layout it implies (sizes, offsets, n == encoded_bytes) before any byte of it
// is trusted. Throws std::invalid_argument naming the problem.
Header read_header(const uint8_t* enc, size_t n);

// Encoding in two steps, so that the caller can allocate the output in between.
struct EncodePlan {
  Header header;         // everything but what depends on the data's order
  uint8_t code_of[256];  // symbol -> code (2^W - 1 for exceptions)
};
// Histogram, code width, table, total size; picks Stored when coding does not
// save at least 3%. `threads` <= 0: every hardware thread.
EncodePlan plan_encode(const uint8_t* src, size_t n, DType dtype, int threads);
// Writes plan.header.encoded_bytes bytes to out (out_n must equal that).
void encode_into(const EncodePlan& plan, const uint8_t* src, size_t n, uint8_t* out, size_t out_n, int threads);

// Decodes the encoded segment enc[0, n) of either version into dst[0, dst_n) (dst_n must equal
// the decoded size in the header). Throws std::invalid_argument on malformed
// input, before reading outside enc or writing outside dst; after such an error
// dst's contents are unspecified. `threads` <= 0: every hardware thread.
// fresh: dst was just allocated (no page of it touched): each thread backs its part first
// (version 2, coded segments; codec_v2.cpp, populate).
void decode_into(const uint8_t* enc, size_t n, uint8_t* dst, size_t dst_n, int threads = 1, bool fresh = false);

// ------------------------------------------------------------ version 2
namespace v2 {
constexpr uint8_t kVersion = 2;
constexpr size_t kEntryBytes = 64;   // one chunk index entry
constexpr int kMaxFields = 3;
constexpr int kMaxSymbolBits = 9;    // fields of at most 9 bits may be coded
constexpr int kMaxLen = 12;          // longest code: a 2^12-entry decode table
constexpr int kMaxContexts = 4;      // codes per field and chunk, chosen by the previous symbol
constexpr int kLog2Chunk = 16, kMinLog2Chunk = 8, kMaxLog2Chunk = 18;   // values per chunk (default 2^16)
constexpr int kLog2Sub = 10, kMinLog2Sub = 4, kMaxLog2Sub = 12;         // values per sub-block (default 2^10)
constexpr int kMinLog2Lanes = 4;     // at least 16 sub-blocks per chunk (the Triton kernel's lanes)

// A dtype's split: value_bytes per value; the value rotated left by one bit,
// cut from the top into n_fields fields of width[f] bits.
struct Layout {
  int value_bytes, n_fields, width[kMaxFields];
};
Layout layout_of(DType d);

struct Header {
  DType dtype = DType::Bytes;
  bool coded = false;
  int log2_chunk = 0, log2_sub = 0, max_len = 0;
  uint64_t n_bytes = 0, n_chunks = 0, encoded_bytes = 0, off_index = 0, off_data = 0;
};
// The header, checked against n (the chunks are checked by decode_into).
Header read_header(const uint8_t* enc, size_t n);

struct Plan;  // per chunk: which fields are coded, code lengths; the total size
std::shared_ptr<Plan> plan_encode(const uint8_t* src, size_t n, DType dtype, int threads, int log2_chunk = kLog2Chunk,
                                  int log2_sub = kLog2Sub);
const Header& plan_header(const Plan& p);
void encode_into(const Plan& p, const uint8_t* src, size_t n, uint8_t* out, size_t out_n, int threads);
// Every chunk checked, then decoded (chunks in parallel). Throws std::invalid_argument.
void decode_into(const uint8_t* enc, size_t n, uint8_t* dst, size_t dst_n, int threads, bool fresh = false);

// A context's canonical code as decoders read it: kMaxCodes entries, the codes in canonical
// order (by length, then symbol), then len 0.
struct Code {
  uint16_t sym;
  uint8_t len;
};
constexpr int kMaxCodes = 513;

// The AVX-512 decode of coded fields (codec_v2_avx512.cpp), used by decode_into where
// enabled(): on by default where the CPU has AVX-512F/BW/VL/VBMI2 and BMI2, off with
// LAYERWISE_CODEC_SIMD=0.
namespace avx512 {
bool supported();  // the CPU has it (and this build has the code)
bool enabled();
bool set_enabled(bool on);  // returns the previous state; on where !supported() throws
uint64_t calls();           // calls of pair_lanes() so far in the process (which path ran, for tests)
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
}  // namespace v2

}  // namespace layerwise::codec
