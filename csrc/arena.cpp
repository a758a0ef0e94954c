#include "layerwise.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

namespace layerwise {

namespace {
size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}
size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
// Registering very large ranges in one call can fail: pin in chunks. A copy
// should not span two registrations, so a chunk is larger than any one layer
// block is likely to be (a 70B-parameter model's layer is ~1.7 GB in bf16).
constexpr size_t kPinChunk = size_t(8) << 30;
}  // namespace

struct HostArena::Block {
  void* base = nullptr;
  size_t capacity = 0;
  std::vector<std::pair<void*, size_t>> mlocked;
  std::vector<void*> cuda_registered;
  ~Block() {
#ifdef LAYERWISE_WITH_CUDA
    if (!cuda_registered.empty()) cuda_wait_for_device();
    for (void* p : cuda_registered) cuda_host_unregister(p);
#endif
    for (auto& r : mlocked) munlock(r.first, r.second);
    if (base) munmap(base, capacity);
  }
};

HostArena::HostArena(int64_t nbytes, bool pinned, std::optional<bool> cuda) {
  TORCH_CHECK_VALUE(nbytes >= 0, "HostArena: nbytes must be >= 0, got ", nbytes);
  bool use_cuda = false;
#ifdef LAYERWISE_WITH_CUDA
  if (pinned && cuda.value_or(false)) {
    cuda_device_count_or_throw("a CUDA-pinned HostArena");
    use_cuda = true;
  } else if (pinned && !cuda.has_value()) {
    try {
      use_cuda = cuda_device_count_or_throw("a CUDA-pinned HostArena") > 0;
    } catch (const std::exception&) {
      use_cuda = false;
    }
  }
#else
  TORCH_CHECK(!(pinned && cuda.value_or(false)),
              "HostArena(cuda=True): layerwise was built without CUDA; rebuild with "
              "LAYERWISE_BUILD=cuda (see README)");
#endif
  pin_kind_ = !pinned ? PinKind::None : (use_cuda ? PinKind::Cuda : PinKind::Mlock);

  block_ = std::make_shared<Block>();
  block_->capacity = round_up(static_cast<size_t>(nbytes), page_size());
  if (block_->capacity > 0) {
    // Anonymous pages are committed only when first written: an arena for a
    // whole model costs host memory only as it is filled.
    void* p = mmap(nullptr, block_->capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "HostArena: mmap of ", block_->capacity, " bytes failed: ", std::strerror(errno));
    block_->base = p;
  }
}

int64_t HostArena::capacity() const { return static_cast<int64_t>(block_->capacity); }
uintptr_t HostArena::data_ptr() const { return reinterpret_cast<uintptr_t>(block_->base); }

std::string HostArena::pin_kind() const {
  switch (pin_kind_) {
    case PinKind::Mlock: return "mlock";
    case PinKind::Cuda: return "cuda";
    default: return "none";
  }
}

at::Tensor HostArena::allocate(int64_t nbytes, int64_t alignment) {
  TORCH_CHECK_VALUE(nbytes >= 0, "HostArena.allocate: nbytes must be >= 0, got ", nbytes);
  TORCH_CHECK_VALUE(alignment > 0 && (alignment & (alignment - 1)) == 0,
                    "HostArena.allocate: alignment must be a power of two, got ", alignment);
  const uintptr_t base = reinterpret_cast<uintptr_t>(block_->base);
  const size_t offset = round_up(base + used_, static_cast<size_t>(alignment)) - base;
  if (offset + static_cast<size_t>(nbytes) > block_->capacity) {
    std::ostringstream msg;
    msg << "HostArena exhausted: asked for " << nbytes << " bytes at alignment " << alignment
        << ", but only " << (block_->capacity > used_ ? block_->capacity - used_ : 0) << " of "
        << block_->capacity << " bytes are free (" << used_ << " used)";
    throw std::runtime_error(msg.str());
  }
  used_ = offset + static_cast<size_t>(nbytes);
  if (pin_kind_ != PinKind::None && nbytes > 0) pin_range(static_cast<int64_t>(offset), nbytes);
  auto keep = block_;
  return torch::from_blob(static_cast<char*>(block_->base) + offset, {nbytes}, [keep](void*) {},
                          torch::TensorOptions().dtype(torch::kUInt8));
}

void HostArena::pin_range(int64_t offset, int64_t nbytes) {
  TORCH_CHECK_VALUE(offset >= 0 && nbytes >= 0 && static_cast<size_t>(offset + nbytes) <= block_->capacity,
                    "HostArena.pin_range: [", offset, ", ", offset + nbytes, ") is outside the arena of ",
                    block_->capacity, " bytes");
  if (pin_kind_ == PinKind::None || !pin_ok_) return;
  // Pages are pinned once, in increasing order: a range that starts below the
  // high-water mark only pins what lies above it.
  size_t begin = std::max(static_cast<size_t>(offset) / page_size() * page_size(), pinned_upto_);
  const size_t end = round_up(static_cast<size_t>(offset + nbytes), page_size());
  char* base = static_cast<char*>(block_->base);
  while (begin < end) {
    const size_t n = std::min(kPinChunk, end - begin);
    bool ok = false;
    if (pin_kind_ == PinKind::Mlock) {
      ok = mlock(base + begin, n) == 0;
      if (ok) block_->mlocked.emplace_back(base + begin, n);
    } else {
#ifdef LAYERWISE_WITH_CUDA
      ok = cuda_host_register(base + begin, n);
      if (ok) block_->cuda_registered.push_back(base + begin);
#endif
    }
    if (!ok) {  // not allowed here (memlock limit): plain memory from now on
      pin_ok_ = false;
      return;
    }
    begin += n;
    pinned_upto_ = begin;
  }
}

}  // namespace layerwise
