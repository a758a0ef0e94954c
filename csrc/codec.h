// Lossless codec of float segments (bf16, fp16, fp32, fp8: per-chunk canonical Huffman
// codes of each value's exponent field, the rest raw). One format, specified in
// layerwise/codec/__init__.py; the Triton decoder (triton_kernels/decode.py) reads the same bytes
// on the device. Encoded bytes never outlive the process (they live in the host arena or
// in spill files deleted at exit), so there is no older format to read.
//
// Sources: codec/format.h (the byte layout, what encoder and decoder share),
// codec/encode.cpp, codec/decode.cpp (the header check and the decoder),
// codec/decode_avx512.cpp (its AVX-512 lanes); the Python bindings are in bindings.cpp.
//
// Plain C++ (no torch, no Python): the CPU copy engine calls decode_into from its worker
// thread right after a copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace layerwise::codec {

constexpr int kLog2Chunk = 16;  // the encoder's default values per chunk (each chunk has codes of its own)
constexpr int kLog2Sub = 10;    // and per sub-block (each decodes without the ones before it)

// The header's dtype codes.
enum class DType : uint8_t { Bytes = 0, BFloat16 = 1, Float16 = 2, Float32 = 3, Float8E4M3 = 4, Float8E5M2 = 5 };

// "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2" have codes of
// their own; every other dtype name torch has ("int8", "uint8", ..., or "bytes")
// is Bytes (stored as raw bytes).
// Throws std::invalid_argument for a name it does not know.
DType dtype_from_name(const std::string& name);
const char* dtype_name(DType d);

// The parsed and checked header of an encoded segment.
struct Header {
  DType dtype = DType::Bytes;
  bool coded = false;  // false: stored (the bytes follow the header as they are)
  int log2_chunk = 0, log2_sub = 0, max_len = 0;
  uint64_t n_bytes = 0, n_chunks = 0, encoded_bytes = 0, off_index = 0, off_data = 0;
};
// The one parser of a header: parses the header of the encoded segment enc[0, n) and checks
// it against n and the layout its sizes imply, before any other byte is trusted (the chunks
// are checked by decode_into). Throws std::invalid_argument naming the problem.
Header read_header(const uint8_t* enc, size_t n);

// Encoding in two steps, so that the caller can allocate the output in between.
struct Plan;  // per chunk: which fields are coded, code lengths; the total size
// Histograms, codes and sizes; stored when coding does not save at least 3%.
// `threads` <= 0: every hardware thread.
std::shared_ptr<Plan> plan_encode(const uint8_t* src, size_t n, DType dtype, int threads, int log2_chunk = kLog2Chunk,
                                  int log2_sub = kLog2Sub);
const Header& plan_header(const Plan& p);
// Writes plan_header(p).encoded_bytes bytes to out (out_n must equal that).
void encode_into(const Plan& p, const uint8_t* src, size_t n, uint8_t* out, size_t out_n, int threads);

// Decodes the encoded segment enc[0, n) into dst[0, dst_n) (dst_n must equal the decoded
// size in the header): the header and every chunk checked, then the chunks decoded in
// parallel. Throws std::invalid_argument on malformed input, before reading outside enc or
// writing outside dst; after such an error dst's contents are unspecified.
// `threads` <= 0: every hardware thread. fresh: dst was just allocated (no page of it
// touched): each thread backs its part first (decode.cpp, populate).
void decode_into(const uint8_t* enc, size_t n, uint8_t* dst, size_t dst_n, int threads = 1, bool fresh = false);

// The AVX-512 decode of coded fields (codec/decode_avx512.cpp), used by decode_into where
// enabled(): on by default where the CPU has AVX-512F/BW/VL/VBMI2 and BMI2, off with
// LAYERWISE_CODEC_SIMD=0.
namespace avx512 {
bool supported();  // the CPU has it (and this build has the code)
bool enabled();
bool set_enabled(bool on);  // returns the previous state; on where !supported() throws
uint64_t calls();           // calls of the lanes so far in the process (which path ran, for tests)
}  // namespace avx512

}  // namespace layerwise::codec
