// Shared declarations of the layerwise._C extension: the host arena, the copy
// engine interface and its two backends (CPU worker threads, CUDA runtime API).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/extension.h>

namespace layerwise {

// An event marks the completion of a copy, or a point on a compute stream.
struct Event {
  virtual ~Event() = default;
  virtual bool query() = 0;
  virtual void synchronize() = 0;
  // Milliseconds from this event to `end`; both must be complete (CUDA: both
  // recorded with timing enabled).
  virtual double elapsed_ms(Event& end) = 0;
  // Tensors a copy reads or writes stay alive as long as its event does.
  std::vector<at::Tensor> keepalive;
};
using EventPtr = std::shared_ptr<Event>;

struct CopyEngine {
  virtual ~CopyEngine() = default;
  // Copies n bytes src -> dst on one of the engine's streams, after `after`
  // (if given) has completed. Returns the event that completes with the copy.
  virtual EventPtr copy_async(void* dst, const void* src, size_t n, const EventPtr& after) = 0;
  // Makes the compute stream (CUDA: handle `stream`) wait for `ev` (CPU: blocks).
  virtual void wait(const EventPtr& ev, uintptr_t stream) = 0;
  // An event recorded on the compute stream (CPU: already complete).
  virtual EventPtr record(uintptr_t stream, bool timing) = 0;
  // Blocks until every copy issued so far has completed.
  virtual void synchronize() = 0;
  virtual bool is_cuda() const = 0;
  virtual int device_index() const = 0;
  virtual int num_streams() const = 0;
};
using EnginePtr = std::shared_ptr<CopyEngine>;

EnginePtr make_cpu_engine(int num_streams, int64_t debug_delay_us);

// One mmap'ed host allocation of exactly the asked size (page-rounded),
// handed out as aligned uint8 tensors; pages are pinned as they are handed
// out, so that packing a model never holds it twice in host memory.
class HostArena {
 public:
  enum class PinKind { None, Mlock, Cuda };
  HostArena(int64_t nbytes, bool pinned, std::optional<bool> cuda);
  at::Tensor allocate(int64_t nbytes, int64_t alignment);
  void pin_range(int64_t offset, int64_t nbytes);
  int64_t capacity() const;
  int64_t used() const { return static_cast<int64_t>(used_); }
  bool pinned() const { return pin_kind_ != PinKind::None && pin_ok_; }
  std::string pin_kind() const;
  uintptr_t data_ptr() const;

  struct Block;  // the mapping; freed when the arena and all its tensors are gone

 private:
  std::shared_ptr<Block> block_;
  size_t used_ = 0;
  size_t pinned_upto_ = 0;
  PinKind pin_kind_ = PinKind::None;
  bool pin_ok_ = true;
};

#ifdef LAYERWISE_WITH_CUDA
EnginePtr make_cuda_engine(int device, int num_streams);
int cuda_device_count_or_throw(const char* what);
bool cuda_host_register(void* ptr, size_t n);  // false when the driver refuses
void cuda_host_unregister(void* ptr);
void cuda_wait_for_device();
int cuda_runtime_version_compiled();
#endif

}  // namespace layerwise
