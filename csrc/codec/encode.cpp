// The encoder (format: layerwise/codec/__init__.py, "Format"). A value v (8, 16 or 32 bits) is
// rotated left by one (the sign goes to bit 0), then cut into fields from the top: bf16/fp16
// [8, 8], fp32 [9, 15, 8], fp8 [8]. The first field is the exponent (fp16: and the top 3
// mantissa bits; fp32: the top one), the part of a weight that is far from random. Per chunk
// of 2^16 values each field of at most 9 bits gets canonical Huffman codes (lengths <= 12,
// up to 4 chosen by the previous symbol) when that pays, else it travels with the raw bits;
// each sub-block of 1024 values (by default) records its bit length, so decoders start every
// sub-block on its own.
#include <algorithm>
#include <cstring>
#include <queue>
#include <string>
#include <vector>

#include "format.h"

namespace layerwise::codec {

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

namespace {

// Huffman code lengths of `hist` (size nsym) limited to kMaxLen: a Huffman tree,
// then lengths over the limit cut to it and the Kraft sum repaired by lengthening
// the least frequent codes that still can be. lengths[s] = 0 for absent symbols.
void code_lengths(const uint64_t* hist, int nsym, uint8_t* len) {
  std::fill(len, len + nsym, 0);
  std::vector<int> syms;
  for (int s = 0; s < nsym; ++s)
    if (hist[s]) syms.push_back(s);
  if (syms.empty()) return;
  if (syms.size() == 1) {
    len[syms[0]] = 1;
    return;
  }
  // nodes: leaves 0..k-1, internal k..2k-2; parent links give the depths
  size_t k = syms.size();
  std::vector<uint64_t> w(2 * k - 1);
  std::vector<int> parent(2 * k - 1, -1);
  using Item = std::pair<uint64_t, int>;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> q;
  for (size_t i = 0; i < k; ++i) q.push({w[i] = hist[syms[i]], static_cast<int>(i)});
  for (size_t next = k; q.size() > 1; ++next) {
    auto a = q.top(); q.pop();
    auto b = q.top(); q.pop();
    w[next] = a.first + b.first;
    parent[a.second] = parent[b.second] = static_cast<int>(next);
    q.push({w[next], static_cast<int>(next)});
  }
  std::vector<int> depth(2 * k - 1, 0);
  for (int i = static_cast<int>(2 * k - 3); i >= 0; --i) depth[i] = depth[parent[i]] + 1;
  uint64_t kraft = 0;  // in units of 2^-kMaxLen
  for (size_t i = 0; i < k; ++i) {
    int l = std::min(depth[i], kMaxLen);
    len[syms[i]] = static_cast<uint8_t>(l);
    kraft += uint64_t{1} << (kMaxLen - l);
  }
  if (kraft > (uint64_t{1} << kMaxLen)) {
    // least frequent first; among them the longest codes below the limit grow by one
    std::vector<int> order(syms);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return hist[a] < hist[b]; });
    while (kraft > (uint64_t{1} << kMaxLen)) {
      int best = -1;
      for (int s : order)
        if (len[s] < kMaxLen && (best < 0 || len[s] > len[best])) best = s;
      kraft -= uint64_t{1} << (kMaxLen - len[best] - 1);
      ++len[best];
    }
  }
}

// Canonical codes from lengths: symbols ordered by (length, symbol).
struct Canon {
  uint16_t count[16] = {};
  std::vector<uint16_t> sorted;  // symbols in code order
};
Canon canon_of(const uint8_t* len, int nsym, uint16_t* code) {
  Canon c;
  for (int s = 0; s < nsym; ++s)
    if (len[s]) ++c.count[len[s]];
  uint32_t next[17] = {}, first = 0;
  for (int l = 1; l <= kMaxLen; ++l) {
    first = (first + c.count[l - 1]) << 1;
    next[l] = first;
  }
  for (int l = 1; l <= kMaxLen; ++l)
    for (int s = 0; s < nsym; ++s)
      if (len[s] == l) {
        c.sorted.push_back(static_cast<uint16_t>(s));
        if (code) code[s] = static_cast<uint16_t>(next[l]++);
      }
  return c;
}

// What the encoder decided for one chunk.
// A coded field's code in one chunk: one canonical code per context; a value's context
// is the number of thresholds its predecessor's symbol (in the same sub-block) reaches,
// 0 for a sub-block's first value.
struct FieldCode {
  int nctx = 0;
  uint16_t thr[kMaxContexts - 1] = {};
  std::vector<uint8_t> len[kMaxContexts];  // code length of each symbol, per context
  uint64_t bits = 0;                        // coded bits of the field in the chunk
  uint64_t table = 0;                       // bytes of its table
};

struct ChunkPlan {
  uint8_t mask = 0;   // bit f: field f is coded
  uint8_t raw_bits = 0;
  FieldCode code[kMaxFields];
  uint64_t bytes = 0;  // the chunk's streams
};

// symbol -> the context it gives its successor, for an alphabet of 2^width
std::vector<uint8_t> context_map(const uint16_t* thr, int nctx, int width) {
  std::vector<uint8_t> m(size_t{1} << width);
  for (size_t v = 0; v < m.size(); ++v) m[v] = static_cast<uint8_t>(context_of(static_cast<uint32_t>(v), thr, nctx));
  return m;
}

}  // namespace

struct Plan {
  Header h;
  Layout lay;
  std::vector<ChunkPlan> chunks;
  std::vector<uint64_t> at;  // each chunk's first stream
};

namespace {

// The field's symbols in the chunk, in value order.
std::vector<uint16_t> field_symbols(const uint8_t* src, uint64_t n, DType dtype, int f) {
  std::vector<uint16_t> out(n);
  with_kind(dtype, [&](auto kind) {
    using Y = Lay<decltype(kind)::value>;
    for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(Y::field(Y::rotl(Y::load(src + i * Y::VB)), f));
  });
  return out;
}

// The cheapest code of one field's symbols: 1..kMaxContexts contexts, thresholds at the
// quantiles of the symbols; nctx = 0 when no code beats nothing (all contexts must be used).
FieldCode best_code(const std::vector<uint16_t>& syms, int width, uint64_t sub, uint64_t n_sub) {
  const int nsym = 1 << width;
  const uint64_t n = syms.size();
  std::vector<uint64_t> hist(nsym, 0);
  for (uint16_t v : syms) ++hist[v];
  FieldCode best;
  uint64_t best_bytes = UINT64_MAX;
  for (int nctx = 1; nctx <= kMaxContexts; ++nctx) {
    FieldCode fc;
    fc.nctx = nctx;
    // thresholds: the symbols at which the cumulative count passes k / nctx of the values
    uint64_t cum = 0;
    int k = 0;
    for (int v = 0; v < nsym && k < nctx - 1; ++v) {
      cum += hist[v];
      while (k < nctx - 1 && cum * nctx > (k + 1) * n && v + 1 < nsym) fc.thr[k++] = static_cast<uint16_t>(v + 1);
    }
    if (k < nctx - 1) break;
    bool distinct = true;
    for (int q = 1; q < nctx - 1; ++q) distinct &= fc.thr[q] > fc.thr[q - 1];
    if (!distinct) continue;
    std::vector<uint64_t> h(static_cast<size_t>(nctx) * nsym, 0);
    if (nctx == 1) {
      h = hist;
    } else {
      std::vector<uint8_t> cmap = context_map(fc.thr, nctx, width);
      for (uint64_t s0 = 0; s0 < n; s0 += sub) {
        ++h[syms[s0]];  // a sub-block's first value: context 0
        for (uint64_t i = s0 + 1, end = std::min(n, s0 + sub); i < end; ++i)
          ++h[static_cast<size_t>(cmap[syms[i - 1]]) * nsym + syms[i]];
      }
    }
    uint64_t used = 0, bits = 0;
    bool empty = false;
    for (int c = 0; c < nctx; ++c) {
      fc.len[c].assign(nsym, 0);
      code_lengths(h.data() + static_cast<size_t>(c) * nsym, nsym, fc.len[c].data());
      uint64_t u = 0;
      for (int v = 0; v < nsym; ++v)
        bits += h[static_cast<size_t>(c) * nsym + v] * fc.len[c][v], u += fc.len[c][v] != 0;
      empty |= u == 0;
      used += u;
    }
    if (empty) continue;
    fc.bits = bits;
    fc.table = table_bytes(nctx, used, width, n_sub);
    uint64_t bytes = fc.table + stream_bytes(bits);
    if (bytes < best_bytes) best_bytes = bytes, best = std::move(fc);
    if (nctx == 1 && 100 * 8 * bytes > 99 * n * width) break;  // near-random: no context will make it pay
  }
  return best;
}

void plan_chunk(const uint8_t* src, uint64_t n, DType dtype, const Layout& L, int log2s, ChunkPlan& cp) {
  uint64_t sub = uint64_t{1} << log2s, n_sub = ceil_div(n, sub);
  cp.mask = 0;
  cp.raw_bits = 0;
  cp.bytes = 0;
  for (int f = 0; f < L.n_fields; ++f) {
    cp.code[f] = FieldCode{};
    if (candidate(L, f)) {
      FieldCode fc = best_code(field_symbols(src, n, dtype, f), L.width[f], sub, n_sub);
      // coded when it beats the field's raw bits (the raw stream's rounding is the same either way, near enough)
      if (fc.nctx && 8 * (fc.table + stream_bytes(fc.bits)) < n * L.width[f]) {
        cp.mask |= 1 << f;
        cp.bytes += fc.table + stream_bytes(fc.bits);
        cp.code[f] = std::move(fc);
        continue;
      }
    }
    cp.raw_bits += L.width[f];
  }
  cp.bytes += stream_bytes(n * cp.raw_bits);
}

}  // namespace

std::shared_ptr<Plan> plan_encode(const uint8_t* src, size_t n, DType dtype, int threads, int log2c, int log2s) {
  if (log2c < kMinLog2Chunk || log2c > kMaxLog2Chunk || log2s < kMinLog2Sub || log2s > kMaxLog2Sub ||
      log2c - log2s < kMinLog2Lanes)
    fail("chunk 2^" + S(log2c) + " / sub-block 2^" + S(log2s) + " values out of range (chunk 2^" +
         S(kMinLog2Chunk) + "..2^" + S(kMaxLog2Chunk) + ", sub-block 2^" + S(kMinLog2Sub) + "..2^" +
         S(kMaxLog2Sub) + ", at least 2^" + S(kMinLog2Lanes) + " sub-blocks per chunk)");
  auto p = std::make_shared<Plan>();
  Header& h = p->h;
  h.dtype = dtype;
  h.n_bytes = n;
  p->lay = layout_of(dtype);
  const Layout& L = p->lay;
  auto stored = [&] {
    h.coded = false;
    h.log2_chunk = h.log2_sub = h.max_len = 0;
    h.n_chunks = h.off_index = 0;
    h.off_data = kHeaderBytes;
    h.encoded_bytes = a16(kHeaderBytes + n);
    p->chunks.clear();
    return p;
  };
  if (L.n_fields == 0) return stored();
  if (n % L.value_bytes)
    fail(dname(dtype) + " segment of " + S(n) + " bytes: not a whole number of " + S(L.value_bytes) +
         "-byte values");
  uint64_t nv = n / L.value_bytes;
  if (nv == 0) return stored();
  h.coded = true;
  h.log2_chunk = log2c;
  h.log2_sub = log2s;
  h.max_len = kMaxLen;
  h.n_chunks = ceil_div(nv, uint64_t{1} << log2c);
  h.off_index = kHeaderBytes;
  h.off_data = a16(kHeaderBytes + kEntryBytes * h.n_chunks);
  p->chunks.resize(h.n_chunks);
  parallel(h.n_chunks, resolve_threads(threads, h.n_chunks / 4), [&](size_t c0, size_t c1) {
    for (size_t c = c0; c < c1; ++c)
      plan_chunk(src + (c << log2c) * L.value_bytes, chunk_values(nv, log2c, c), dtype, L, log2s, p->chunks[c]);
  });
  p->at.resize(h.n_chunks);
  uint64_t at = h.off_data;
  for (size_t c = 0; c < h.n_chunks; ++c) p->at[c] = at, at += p->chunks[c].bytes;
  h.encoded_bytes = at;
  if (at * 100 > static_cast<uint64_t>(n) * 97) return stored();  // coded only when it saves >= 3%
  return p;
}

const Header& plan_header(const Plan& p) { return p.h; }

namespace {

void write_header(const Header& h, uint8_t* out) {
  std::memset(out, 0, kHeaderBytes);
  std::memcpy(out, kMagic, 4);
  out[kOffVersion] = kVersion;
  out[kOffDtype] = static_cast<uint8_t>(h.dtype);
  out[kOffMode] = h.coded ? 1 : 0;
  out[kOffLog2Chunk] = static_cast<uint8_t>(h.log2_chunk);
  out[kOffLog2Sub] = static_cast<uint8_t>(h.log2_sub);
  out[kOffMaxLen] = static_cast<uint8_t>(h.max_len);
  put_u64(out + kOffNBytes, h.n_bytes);
  put_u64(out + kOffNChunks, h.n_chunks);
  put_u64(out + kOffTotal, h.encoded_bytes);
  put_u64(out + kOffIndex, h.off_index);
  put_u64(out + kOffData, h.off_data);
}

// MSB-first bit writer (codes), LSB-first (raw words).
struct MsbWriter {
  uint8_t* p;
  uint64_t acc = 0;
  int n = 0;
  void put(uint32_t code, int len) {
    acc = (acc << len) | code;
    n += len;
    if (n >= 32) {
      n -= 32;
      uint32_t w = __builtin_bswap32(static_cast<uint32_t>(acc >> n));
      std::memcpy(p, &w, 4);
      p += 4;
    }
  }
  void flush() {
    while (n > 0) {
      int take = std::min(n, 8);
      *p++ = static_cast<uint8_t>(((acc >> (n - take)) & ((1u << take) - 1)) << (8 - take));
      n -= take;
    }
  }
};
struct LsbWriter {
  uint8_t* p;
  uint64_t acc = 0;
  int n = 0;
  void put(uint64_t v, int len) {
    if (!len) return;
    acc |= v << n;
    n += len;
    if (n >= 32) {
      uint32_t w = static_cast<uint32_t>(acc);
      std::memcpy(p, &w, 4);
      p += 4;
      acc >>= 32;
      n -= 32;
    }
  }
  void flush() {
    for (; n > 0; n -= 8, acc >>= 8) *p++ = static_cast<uint8_t>(acc);
    n = 0;
  }
};

void encode_chunk(const Plan& P, size_t c, const uint8_t* src, uint8_t* out) {
  const Header& h = P.h;
  const Layout& L = P.lay;
  const ChunkPlan& cp = P.chunks[c];
  uint64_t nv = h.n_bytes / L.value_bytes;
  uint64_t n = chunk_values(nv, h.log2_chunk, c);
  uint64_t sub = uint64_t{1} << h.log2_sub, n_sub = ceil_div(n, sub);
  src += (c << h.log2_chunk) * L.value_bytes;
  uint8_t* e = out + h.off_index + kEntryBytes * c;
  std::memset(e, 0, kEntryBytes);
  e[kEMask] = cp.mask;
  e[kERawBits] = cp.raw_bits;
  uint64_t at = P.at[c];
  std::memset(out + at, 0, cp.bytes);  // padding and slack are zero
  for (int f = 0; f < L.n_fields; ++f) {
    if (!(cp.mask >> f & 1)) continue;
    const FieldCode& fc = cp.code[f];
    int nsym = 1 << L.width[f], sb = sym_bytes(L.width[f]);
    std::vector<uint16_t> code(static_cast<size_t>(fc.nctx) * nsym);
    uint8_t* t = out + at;
    put_u64(e + kETable + 8 * f, at);
    put_u16(t, static_cast<uint16_t>(fc.nctx));
    for (int k = 0; k < fc.nctx - 1; ++k) put_u16(t + 2 + 2 * k, fc.thr[k]);
    uint8_t* q = t + 8;
    for (int c = 0; c < fc.nctx; ++c) {
      Canon cn = canon_of(fc.len[c].data(), nsym, code.data() + static_cast<size_t>(c) * nsym);
      for (int l = 0; l < 16; ++l) put_u16(q + 2 * l, cn.count[l]);
      q += 32;
      for (uint16_t v : cn.sorted) {
        if (sb == 2) put_u16(q, v); else *q = static_cast<uint8_t>(v);
        q += sb;
      }
    }
    uint8_t* sub_bits = q;
    at += fc.table;
    put_u64(e + kECode + 8 * f, at);
    MsbWriter w{out + at};
    std::vector<uint16_t> syms = field_symbols(src, n, h.dtype, f);
    std::vector<uint8_t> cmap = context_map(fc.thr, fc.nctx, L.width[f]);
    for (uint64_t s = 0; s < n_sub; ++s) {
      uint64_t b = 0;
      for (uint64_t i = s * sub, end = std::min(n, i + sub); i < end; ++i) {
        int c = i == s * sub ? 0 : cmap[syms[i - 1]];
        size_t k = static_cast<size_t>(c) * nsym + syms[i];
        w.put(code[k], fc.len[c][syms[i]]);
        b += fc.len[c][syms[i]];
      }
      put_u16(sub_bits + 2 * s, static_cast<uint16_t>(b));
    }
    w.flush();
    at += stream_bytes(fc.bits);
  }
  put_u64(e + kERaw, at);
  LsbWriter w{out + at};
  with_kind(h.dtype, [&](auto kind) {
    using Y = Lay<decltype(kind)::value>;
    for (uint64_t i = 0; i < n; ++i) {
      uint32_t u = Y::rotl(Y::load(src + i * Y::VB));
      uint64_t r = 0;
      for (int f = 0; f < Y::NF; ++f)
        if (!(cp.mask >> f & 1)) r = (r << Y::W[f]) | Y::field(u, f);
      w.put(r, cp.raw_bits);
    }
  });
  w.flush();
}

}  // namespace

void encode_into(const Plan& P, const uint8_t* src, size_t n, uint8_t* out, size_t out_n, int threads) {
  const Header& h = P.h;
  if (n != h.n_bytes) fail("encode_into: the plan is for " + S(h.n_bytes) + " bytes, got " + S(n));
  if (out_n != h.encoded_bytes) fail("encode_into: output of " + S(out_n) + " bytes, the plan needs " +
                                     S(h.encoded_bytes));
  write_header(h, out);
  if (!h.coded) {
    if (n) std::memcpy(out + kHeaderBytes, src, n);
    std::memset(out + kHeaderBytes + n, 0, out_n - kHeaderBytes - n);
    return;
  }
  std::memset(out + h.off_index + kEntryBytes * h.n_chunks, 0, h.off_data - h.off_index - kEntryBytes * h.n_chunks);
  parallel(h.n_chunks, resolve_threads(threads, h.n_chunks / 4), [&](size_t c0, size_t c1) {
    for (size_t c = c0; c < c1; ++c) encode_chunk(P, c, src, out);
  });
}

}  // namespace layerwise::codec
