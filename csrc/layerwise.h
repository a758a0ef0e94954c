// Shared declarations of the layerwise._C extension: the host arena, and (from
// engine.h) the copy engine interface and its two backends (CPU worker
// threads, CUDA runtime API).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

// ATen alone, not torch/extension.h (pybind11, Python and the C++ frontend): the
// arena needs tensors only, and the extension header triples its compile time
// (gcc 12 on one AMD EPYC core: 24 s against 8 s); bindings.cpp includes it.
#include <ATen/ATen.h>

#include "engine.h"

namespace layerwise {

// One mmap'ed host allocation of exactly the asked size (page-rounded),
// handed out as aligned uint8 tensors; pages are pinned as they are handed
// out, so that packing a model never holds it twice in host memory. If pinning
// fails part way, everything pinned so far is unpinned again: the arena is
// either pinned as asked or pageable, with the reason in pin_error().
class HostArena {
 public:
  enum class PinKind { None, Mlock, Cuda };
  // `device`: the CUDA device the arena streams to (its pages are registered with
  // it current); -1 for the current one.
  HostArena(int64_t nbytes, bool pinned, std::optional<bool> cuda, int device = -1);
  // The arena over [offset, offset + nbytes) of an open file (a memfd shared
  // between processes): a MAP_SHARED mapping, read-only unless `writable`. The
  // mapping holds the file open by itself; the fd stays the caller's. `offset`
  // must be page aligned.
  static std::shared_ptr<HostArena> over_fd(int fd, int64_t offset, int64_t nbytes, bool writable, bool pinned,
                                            std::optional<bool> cuda, int device = -1);
  at::Tensor allocate(int64_t nbytes, int64_t alignment);
  // The bytes [offset, offset + nbytes) of the mapping, pinned like an
  // allocation: how a process that did not pack the arena reaches its blocks.
  // `used` becomes at least offset + nbytes.
  at::Tensor view(int64_t offset, int64_t nbytes, int64_t alignment);
  // Makes the whole mapping read-only (a write through any tensor of it then
  // faults with SIGSEGV); pins stay.
  void protect();
  bool writable() const;
  void pin_range(int64_t offset, int64_t nbytes);
  int64_t capacity() const;
  int64_t used() const;
  bool pinned() const;
  std::string pin_kind() const;
  std::optional<std::string> pin_error() const;  // why pinning asked for failed
  uintptr_t data_ptr() const;
  // Offsets (from `offset`) where a pinned registration boundary falls strictly
  // inside [offset, offset + nbytes): a copy must not span one. Empty unless a
  // block too large to register at once had to be registered in pieces.
  std::vector<int64_t> split_points(int64_t offset, int64_t nbytes) const;

  struct Block;  // the mapping; freed when the arena and all its tensors are gone

 private:
  HostArena(bool pinned, std::optional<bool> cuda, int device);  // the pin kind only; no mapping yet
  // `bounds`: record each registration that begins strictly inside the range
  // in piece_starts_ (a view may span pages pinned by an earlier call).
  void pin_locked(size_t offset, size_t nbytes, bool bounds = false);
  std::string pin_span(size_t begin, size_t end);  // "" when pinned, else why not

  mutable std::mutex mu_;  // allocate and pin_range run with the GIL released
  std::shared_ptr<Block> block_;
  size_t used_ = 0;
  size_t pinned_upto_ = 0;
  // Page ranges below pinned_upto_ that no call has pinned (a range asked
  // above the mark skips them): a later view into one pins it then.
  std::vector<std::pair<size_t, size_t>> unpinned_;
  int device_ = -1;
  std::vector<size_t> piece_starts_;  // registrations that begin inside an allocation
  PinKind pin_kind_ = PinKind::None;
  std::string pin_error_;
};

}  // namespace layerwise
