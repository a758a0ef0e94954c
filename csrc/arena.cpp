#include "layerwise.h"
#include "sim_bus.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
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

// Where an fd leads, for errors ("/memfd:layerwise:key (deleted)"), or "fd N".
std::string fd_target(int fd) {
  char buf[512];
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(link.c_str(), buf, sizeof buf - 1);
  if (n <= 0) return "fd " + std::to_string(fd);
  return "fd " + std::to_string(fd) + " (" + std::string(buf, static_cast<size_t>(n)) + ")";
}

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1; older libc headers lack it
#endif

// Why a read-write mapping of `fd` failed, in terms a caller can act on.
std::string rw_map_failure(int fd, int err) {
  if (err == EPERM) {
    const int seals = fcntl(fd, F_GET_SEALS);
    if (seals > 0 && (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)))
      return "the file is sealed against writing (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE): its bytes are final, "
             "map it with writable=False";
  }
  if (err == EACCES) return "the fd is not open for writing: map it with writable=False, or pass a read-write fd";
  return "";
}
}  // namespace

// One pin-kind selection for every arena: CUDA where asked for (or, with
// cuda=None, where a device is present), else mlock; none unless pinned.
static HostArena::PinKind choose_pin_kind(bool pinned, std::optional<bool> cuda) {
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
  return !pinned ? HostArena::PinKind::None : (use_cuda ? HostArena::PinKind::Cuda : HostArena::PinKind::Mlock);
}

struct HostArena::Block {
  void* base = nullptr;
  size_t capacity = 0;
  std::vector<std::pair<void*, size_t>> mlocked;
  std::vector<void*> cuda_registered;
  const Origin origin;
  int device = -1;
  bool shared = false;    // a MAP_SHARED mapping of a file (over_fd), not anonymous memory
  bool writable = true;   // PROT_WRITE; false once protect()ed or when mapped read-only

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
  pin_kind_ = choose_pin_kind(pinned, cuda);

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

HostArena::HostArena(bool pinned, std::optional<bool> cuda, int device) : device_(device) {
  pin_kind_ = choose_pin_kind(pinned, cuda);
  block_ = std::make_shared<Block>();
  block_->device = device;
}

std::shared_ptr<HostArena> HostArena::over_fd(int fd, int64_t offset, int64_t nbytes, bool writable, bool pinned,
                                              std::optional<bool> cuda, int device) {
  TORCH_CHECK_VALUE(nbytes >= 0, "HostArena.over_fd: nbytes must be >= 0, got ", nbytes);
  TORCH_CHECK_VALUE(offset >= 0 && static_cast<size_t>(offset) % page_size() == 0,
                    "HostArena.over_fd: offset must be a multiple of the page size (", page_size(),
                    " bytes) and >= 0, got ", offset);
  struct stat st {};
  TORCH_CHECK_VALUE(fstat(fd, &st) == 0, "HostArena.over_fd: fd ", fd,
                    " is not an open file descriptor: ", std::strerror(errno));
  TORCH_CHECK_VALUE(S_ISREG(st.st_mode), "HostArena.over_fd: ", fd_target(fd),
                    " is not a regular file (a memfd is one)");
  // Pages past the end of the file fault with SIGBUS when touched: refuse them here instead.
  TORCH_CHECK_VALUE(offset <= st.st_size && nbytes <= st.st_size - offset, "HostArena.over_fd: ",
                    fd_target(fd), " is ", st.st_size, " bytes, too short for offset ", offset, " + nbytes ", nbytes,
                    " (a mapping past the end of a file faults when touched)");
  std::shared_ptr<HostArena> arena(new HostArena(pinned, cuda, device));
  Block& b = *arena->block_;
  b.shared = true;
  b.writable = writable;
  b.capacity = round_up(static_cast<size_t>(nbytes), page_size());
  if (b.capacity > 0) {
    // MAP_SHARED: every process that maps the file reads the same pages. The
    // mapping keeps the file alive after its last fd is closed.
    void* p = mmap(nullptr, b.capacity, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, offset);
    if (p == MAP_FAILED) {
      const int err = errno;
      const std::string why = writable ? rw_map_failure(fd, err) : "";
      TORCH_CHECK(false, "HostArena.over_fd: mmap(", writable ? "PROT_READ|PROT_WRITE" : "PROT_READ",
                  ", MAP_SHARED) of ", b.capacity, " bytes at offset ", offset, " of ", fd_target(fd),
                  " failed: ", std::strerror(err), " (errno ", err, ")", why.empty() ? "" : "; ", why);
    }
    b.base = p;
  }
  return arena;
}

void HostArena::protect() {
  std::lock_guard<std::mutex> l(mu_);
  if (block_->capacity > 0 && block_->writable)
    TORCH_CHECK(mprotect(block_->base, block_->capacity, PROT_READ) == 0, "HostArena.protect: mprotect(PROT_READ) of ",
                block_->capacity, " bytes failed: ", std::strerror(errno));
  block_->writable = false;
}

bool HostArena::writable() const {
  std::lock_guard<std::mutex> l(mu_);
  return block_->writable;
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
  TORCH_CHECK(block_->writable, "HostArena.allocate: the arena is read-only (",
              block_->shared ? "a shared mapping, mapped read-only or protect()ed" : "protect()ed",
              "): its bytes are final; reach them with view(offset, nbytes)");
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

at::Tensor HostArena::view(int64_t offset, int64_t nbytes, int64_t alignment) {
  TORCH_CHECK_VALUE(alignment > 0 && (alignment & (alignment - 1)) == 0,
                    "HostArena.view: alignment must be a power of two, got ", alignment);
  const int64_t cap = static_cast<int64_t>(block_->capacity);
  TORCH_CHECK_VALUE(offset >= 0 && nbytes >= 0 && offset <= cap && nbytes <= cap - offset, "HostArena.view: offset ",
                    offset, ", nbytes ", nbytes, " is outside the arena's capacity of ", cap,
                    " bytes (both must be >= 0 and offset + nbytes <= ", cap, ")");
  char* at = static_cast<char*>(block_->base) + offset;
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(at) % static_cast<uintptr_t>(alignment) == 0, "HostArena.view: offset ",
                    offset, " is not aligned to ", alignment, " bytes");
  std::lock_guard<std::mutex> l(mu_);
  used_ = std::max(used_, static_cast<size_t>(offset + nbytes));
  if (pin_kind_ != PinKind::None && nbytes > 0)
    pin_locked(static_cast<size_t>(offset), static_cast<size_t>(nbytes), /*bounds=*/true);
  auto keep = block_;
  return at::from_blob(at, {nbytes}, [keep](void*) {}, at::TensorOptions().dtype(at::kByte));
}

void HostArena::pin_range(int64_t offset, int64_t nbytes) {
  const int64_t cap = static_cast<int64_t>(block_->capacity);
  TORCH_CHECK_VALUE(offset >= 0 && nbytes >= 0 && offset <= cap && nbytes <= cap - offset,
                    "HostArena.pin_range: offset ", offset, ", nbytes ", nbytes, " is outside the arena of ", cap,
                    " bytes (both must be >= 0 and offset + nbytes <= ", cap, ")");
  std::lock_guard<std::mutex> l(mu_);
  pin_locked(static_cast<size_t>(offset), static_cast<size_t>(nbytes));
}

void HostArena::pin_locked(size_t offset, size_t nbytes, bool bounds) {
  if (pin_kind_ == PinKind::None) return;
  // Pages are pinned once. Above the high-water mark a range pins what lies
  // above it (the pages between the mark and the range are left for later);
  // below it, only the pages that an earlier range left unpinned.
  const size_t lo = offset / page_size() * page_size();
  const size_t hi = round_up(offset + nbytes, page_size());
  std::vector<std::pair<size_t, size_t>> todo, left;
  for (const auto& g : unpinned_) {
    const size_t a = std::max(g.first, lo), b = std::min(g.second, hi);
    if (a >= b) {
      left.push_back(g);
      continue;
    }
    todo.emplace_back(a, b);
    if (g.first < a) left.emplace_back(g.first, a);
    if (b < g.second) left.emplace_back(b, g.second);
  }
  if (hi > pinned_upto_) {
    if (lo > pinned_upto_) left.emplace_back(pinned_upto_, lo);
    todo.emplace_back(std::max(lo, pinned_upto_), hi);
  }
  for (const auto& span : todo) {
    std::string failure = pin_span(span.first, span.second);
    if (!failure.empty()) {
      // Half a pinned arena would hold locked memory and still copy at pageable
      // speed: give it all back and say why.
      block_->unpin_all(/*in_use=*/true);
      pin_kind_ = PinKind::None;
      pin_error_ = std::move(failure);
      return;
    }
    // A copy must not span two registrations: a view whose pages begin in one
    // registered earlier is split where its own begins.
    if (bounds && pin_kind_ == PinKind::Cuda && span.first > offset && span.first < offset + nbytes)
      piece_starts_.push_back(span.first);
  }
  unpinned_ = std::move(left);
  pinned_upto_ = std::max(pinned_upto_, hi);
}

std::string HostArena::pin_span(size_t begin, size_t end) {
  char* base = static_cast<char*>(block_->base);
  const size_t n = end - begin;  // the whole range in one registration
  std::string failure;
  if (pin_kind_ == PinKind::Mlock) {
    if (mlock(base + begin, n) == 0) {
      block_->mlocked.emplace_back(base + begin, n);
      note_pinned_range(base + begin, n, true);  // (the CPU backend's simulated bus: sim_bus.h)
    } else
      failure = mlock_failure(errno);
  } else if (block_->origin.forked()) {
    failure = "cudaHostRegister not tried: the arena was created in process " + std::to_string(block_->origin.pid) +
              " before fork(), and a forked child cannot use its CUDA context";
  } else {
#ifdef LAYERWISE_WITH_CUDA
    // A read-only mapping cannot be registered for device writes: it is registered read-only.
    const bool read_only = !block_->writable;
    failure = cuda_host_register(base + begin, n, device_, read_only);
    if (failure.empty()) {
      block_->cuda_registered.push_back(base + begin);
    } else if (n > kPinChunk) {
      // Too large for one registration: in pieces, each a registration of its own.
      std::string piece_failure;
      size_t at = begin;
      while (at < end && piece_failure.empty()) {
        const size_t m = std::min(kPinChunk, end - at);
        piece_failure = cuda_host_register(base + at, m, device_, read_only);
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
  return failure;
}

std::vector<int64_t> HostArena::split_points(int64_t offset, int64_t nbytes) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<int64_t> out;
  for (size_t p : piece_starts_)
    if (static_cast<int64_t>(p) > offset && static_cast<int64_t>(p) < offset + nbytes)
      out.push_back(static_cast<int64_t>(p) - offset);
  std::sort(out.begin(), out.end());  // views pinned out of order record their starts out of order
  return out;
}

}  // namespace layerwise
