// The C++ decoder alone, timed (scripts/codec_decode_cpp.py builds and runs this): decodes
// DIR/NAME.enc into a buffer allocated and touched once, REPEATS times, checks the bytes
// against DIR/NAME.raw, and prints the best and the median wall time. No torch, no Python:
// the sources under csrc/codec/ alone.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "codec.h"

static std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(2);
  }
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s DIR NAME THREADS REPEATS\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1], name = argv[2];
  const int threads = std::atoi(argv[3]), repeats = std::max(1, std::atoi(argv[4]));
  std::vector<uint8_t> enc = read_file(dir + "/" + name + ".enc"), raw = read_file(dir + "/" + name + ".raw");
  std::vector<uint8_t> out(raw.size(), 0xA5);
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    layerwise::codec::decode_into(enc.data(), enc.size(), out.data(), out.size(), threads);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (out != raw) {
    std::fprintf(stderr, "%s: the decoded bytes differ from the raw ones\n", name.c_str());
    return 1;
  }
  std::sort(t.begin(), t.end());
  std::printf("%s %d %.3f %.3f\n", name.c_str(), threads, t[0] * 1e3, t[t.size() / 2] * 1e3);
  return 0;
}
