// Lossless codec of 16-bit float segments (bf16, fp16): the CPU encoder and
// decoder. The format is specified in layerwise/codec.py; the Triton decoder
// (triton_kernels/decode.py) reads the same bytes on the device.
//
// Plain C++ (no torch, no Python): the CPU copy engine may call decode_into
// from its worker thread right after a copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace layerwise::codec {

constexpr size_t kHeaderBytes = 128;
constexpr size_t kTableOffset = 96;       // symbol of code c: header byte 96 + c
constexpr size_t kMaxTable = 32;
constexpr int kLog2Block = 10;            // values per block of the exception index
constexpr size_t kBlockValues = size_t{1} << kLog2Block;
constexpr size_t kAlign = 16;             // every stream and the total are 16-byte aligned
constexpr uint8_t kVersion = 1;

enum class DType : uint8_t { Bytes = 0, BFloat16 = 1, Float16 = 2 };
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

// "bfloat16" / "float16" are coded; every other dtype name torch has
// ("float32", "int8", "uint8", ..., or "bytes") is stored as raw bytes.
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

// Decodes the encoded segment enc[0, n) into dst[0, dst_n) (dst_n must equal
// the decoded size in the header). Throws std::invalid_argument on malformed
// input, before reading outside enc or writing outside dst; after such an error
// dst's contents are unspecified. `threads` <= 0: every hardware thread.
void decode_into(const uint8_t* enc, size_t n, uint8_t* dst, size_t dst_n, int threads = 1);

}  // namespace layerwise::codec
