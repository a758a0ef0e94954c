#include "layerwise.h"
#include "sim_bus.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace layerwise {

namespace {
size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}
size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
// Each allocation (a layer block) is registered in one call, so that one copy
// never spans two registrations; only if that fails is it registered in
// pieces, and then split_points() tells the copies where to split. A copy
// should not span two registrations, so a chunk is larger than any one layer
// block is likely to be (a 70B-parameter model's layer is ~1.7 GB in bf16).
constexpr size_t kPinChunk = size_t(1) << 30;  // the piece size of the fallback

std::string mib(rlim_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

// 1: has CAP_IPC_LOCK, 0: has not, -1: cannot tell (no /proc).
int has_cap_ipc_lock() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      unsigned long long caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return (caps >> 14) & 1;  // CAP_IPC_LOCK = 14
    }
  }
  return -1;
}

// Why mlock failed, in terms a user can act on. No sizes or addresses: one
// text per cause, so that a warning about it is given once.
std::string mlock_failure(int err) {
  std::ostringstream s;
  s << "mlock failed: " << std::strerror(err) << " (errno " << err << ")";
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
    s << "; the RLIMIT_MEMLOCK soft limit (ulimit -l) is ";
    if (rl.rlim_cur == RLIM_INFINITY)
      s << "unlimited";
    else
      s << mib(rl.rlim_cur) << " (" << rl.rlim_cur << " bytes)";
  }
  const int cap = has_cap_ipc_lock();
  s << (cap == 1   ? " and the process has CAP_IPC_LOCK, so the limit does not apply: the system is short of memory"
        : cap == 0 ? " and the process does not have CAP_IPC_LOCK"
                   : "; whether the process has CAP_IPC_LOCK is unknown");
  return s.str();
}
}  // namespace

struct HostArena::Block {
  void* base = nullptr;
  size_t capacity = 0;
  std::vector<std::pair<void*, size_t>> mlocked;
  std::vector<void*> cuda_registered;
  const Origin origin;
  int device = -1;

  // `in_use`: tensors of the block may be the source of copies in flight (a pin
  // that failed part way: earlier allocations are out), so wait for the device
  // first. Not when the block is freed: every copy of the engine holds the
  // storages it reads until it has completed (engine.h, Event::keepalive), so by
  // then none reads it, and a freed block costs no device-wide synchronize. (A
  // copy issued through torch from an arena tensor is its issuer's to finish
  // before the tensor goes, as for any memory torch's allocator did not pin.)
  void unpin_all(bool in_use) {
#ifdef LAYERWISE_WITH_CUDA
    // A forked child has no CUDA context: the parent's registrations are not its to undo.
    if (!cuda_registered.empty() && !origin.forked()) {
      if (in_use) cuda_wait_for_device(device);
      for (void* p : cuda_registered) cuda_host_unregister(p);
    }
#endif
    (void)in_use;
    cuda_registered.clear();
    for (auto& r : mlocked) {
      note_pinned_range(r.first, r.second, false);
      munlock(r.first, r.second);
    }
    mlocked.clear();
  }
  ~Block() {
    unpin_all(/*in_use=*/false);
    if (base) munmap(base, capacity);
  }
};

HostArena::HostArena(int64_t nbytes, bool pinned, std::optional<bool> cuda, int device) : device_(device) {
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
              "LAYERWISE_BUILD=cuda (see docs/api.md, \"Build and kernels\")");
#endif
  pin_kind_ = !pinned ? PinKind::None : (use_cuda ? PinKind::Cuda : PinKind::Mlock);

  block_ = std::make_shared<Block>();
  block_->device = device;
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

int64_t HostArena::used() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int64_t>(used_);
}

bool HostArena::pinned() const {
  std::lock_guard<std::mutex> l(mu_);
  return pin_kind_ != PinKind::None;
}

std::string HostArena::pin_kind() const {
  std::lock_guard<std::mutex> l(mu_);
  switch (pin_kind_) {
    case PinKind::Mlock: return "mlock";
    case PinKind::Cuda: return "cuda";
    default: return "none";
  }
}

std::optional<std::string> HostArena::pin_error() const {
  std::lock_guard<std::mutex> l(mu_);
  if (pin_error_.empty()) return std::nullopt;
  return pin_error_;
}

at::Tensor HostArena::allocate(int64_t nbytes, int64_t alignment) {
  TORCH_CHECK_VALUE(nbytes >= 0, "HostArena.allocate: nbytes must be >= 0, got ", nbytes);
  TORCH_CHECK_VALUE(alignment > 0 && (alignment & (alignment - 1)) == 0,
                    "HostArena.allocate: alignment must be a power of two, got ", alignment);
  std::lock_guard<std::mutex> l(mu_);
  const uintptr_t base = reinterpret_cast<uintptr_t>(block_->base);
  const size_t cap = block_->capacity;
  const size_t a = static_cast<size_t>(alignment);
  // Compared without sums that could wrap: an alignment or size near 2^63 is an error, not a small offset.
  const size_t at = base + used_;
  const size_t pad = (a - at % a) % a;
  if (pad > cap - used_ || static_cast<size_t>(nbytes) > cap - used_ - pad) {
    std::ostringstream msg;
    msg << "HostArena exhausted: asked for " << nbytes << " bytes at alignment " << alignment << ", but only "
        << cap - used_ << " of " << cap << " bytes are free (" << used_ << " used)";
    throw std::runtime_error(msg.str());
  }
  const size_t offset = used_ + pad;
  used_ = offset + static_cast<size_t>(nbytes);
  if (pin_kind_ != PinKind::None && nbytes > 0) pin_locked(offset, static_cast<size_t>(nbytes));
  auto keep = block_;
  return at::from_blob(static_cast<char*>(block_->base) + offset, {nbytes}, [keep](void*) {},
                       at::TensorOptions().dtype(at::kByte));
}

void HostArena::pin_range(int64_t offset, int64_t nbytes) {
  const int64_t cap = static_cast<int64_t>(block_->capacity);
  TORCH_CHECK_VALUE(offset >= 0 && nbytes >= 0 && offset <= cap && nbytes <= cap - offset,
                    "HostArena.pin_range: offset ", offset, ", nbytes ", nbytes, " is outside the arena of ", cap,
                    " bytes (both must be >= 0 and offset + nbytes <= ", cap, ")");
  std::lock_guard<std::mutex> l(mu_);
  pin_locked(static_cast<size_t>(offset), static_cast<size_t>(nbytes));
}

void HostArena::pin_locked(size_t offset, size_t nbytes) {
  if (pin_kind_ == PinKind::None) return;
  // Pages are pinned once, in increasing order: a range that starts below the
  // high-water mark only pins what lies above it.
  size_t begin = std::max(offset / page_size() * page_size(), pinned_upto_);
  const size_t end = round_up(offset + nbytes, page_size());
  char* base = static_cast<char*>(block_->base);
  while (begin < end) {
    size_t n = end - begin;  // the whole allocation in one registration
    std::string failure;
    if (pin_kind_ == PinKind::Mlock) {
      if (mlock(base + begin, n) == 0) {
        block_->mlocked.emplace_back(base + begin, n);
        note_pinned_range(base + begin, n, true);  // (the CPU backend's simulated bus: sim_bus.h)
      } else
        failure = mlock_failure(errno);
    } else if (block_->origin.forked()) {
      failure = "cudaHostRegister not tried: the arena was created in process " +
                std::to_string(block_->origin.pid) + " before fork(), and a forked child cannot use its CUDA context";
    } else {
#ifdef LAYERWISE_WITH_CUDA
      failure = cuda_host_register(base + begin, n, device_);
      if (failure.empty()) {
        block_->cuda_registered.push_back(base + begin);
      } else if (n > kPinChunk) {
        // Too large for one registration: in pieces, each a registration of its own.
        std::string piece_failure;
        size_t at = begin;
        while (at < end && piece_failure.empty()) {
          const size_t m = std::min(kPinChunk, end - at);
          piece_failure = cuda_host_register(base + at, m, device_);
          if (piece_failure.empty()) {
            block_->cuda_registered.push_back(base + at);
            if (at != begin) piece_starts_.push_back(at);
          }
          at += m;
        }
        failure = piece_failure;
      }
#endif
    }
    if (!failure.empty()) {
      // Half a pinned arena would hold locked memory and still copy at pageable
      // speed: give it all back and say why.
      block_->unpin_all(/*in_use=*/true);
      pin_kind_ = PinKind::None;
      pin_error_ = std::move(failure);
      return;
    }
    begin += n;
    pinned_upto_ = begin;
  }
}

std::vector<int64_t> HostArena::split_points(int64_t offset, int64_t nbytes) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<int64_t> out;
  for (size_t p : piece_starts_)
    if (static_cast<int64_t>(p) > offset && static_cast<int64_t>(p) < offset + nbytes)
      out.push_back(static_cast<int64_t>(p) - offset);
  return out;
}

}  // namespace layerwise
