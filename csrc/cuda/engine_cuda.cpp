// CUDA backend of the copy engine and of arena pinning, written against the
// CUDA runtime API alone (no c10/ATen CUDA headers), so that it compiles and
// links with the toolkit even where torch is a CPU build. torch's compute
// stream is handed in as a raw cudaStream_t.
#include "../engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace layerwise {
namespace {

[[noreturn]] void throw_cuda(const char* call, cudaError_t e) {
  cudaGetLastError();  // clear it, so that torch's next launch check does not report it as its own
  throw std::runtime_error(std::string("layerwise: ") + call + " failed: " + cudaGetErrorString(e) + " (" +
                           cudaGetErrorName(e) + ", error " + std::to_string(static_cast<int>(e)) + ")");
}
#define LW_CUDA(call)                          \
  do {                                         \
    cudaError_t e_ = (call);                   \
    if (e_ != cudaSuccess) throw_cuda(#call, e_); \
  } while (0)

struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int device) {
    LW_CUDA(cudaGetDevice(&prev));
    if (prev != device) LW_CUDA(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};

// Every runtime call runs with the engine's device current: a wait or record on
// the default stream (handle 0) of another device would land on the wrong one.
struct QuietDeviceGuard {  // for destructors: never throws
  int prev = -1;
  bool switched = false;
  explicit QuietDeviceGuard(int device) {
    if (cudaGetDevice(&prev) == cudaSuccess && prev != device) switched = cudaSetDevice(device) == cudaSuccess;
    cudaGetLastError();
  }
  ~QuietDeviceGuard() {
    if (switched) cudaSetDevice(prev);
  }
};

// Copies whose event was dropped before they completed. Their storages (a host
// block's pages, a staging buffer) are held here until the copy has completed,
// so that a host block is freed (and its pages unregistered) only once no copy
// reads it, without a cudaDeviceSynchronize: a layer rewritten in place drops
// the old block from a prefetch, the hottest path there is. One list per
// engine, emptied of completed copies at its next copy, synchronize, shutdown
// and destruction (Python threads: dropping a storage may take the GIL).
struct PendingCopies {
  struct Copy {
    int device;
    cudaEvent_t ev;
    std::unique_ptr<InFlight> keep;
  };
  std::mutex mu;
  std::vector<Copy> copies;

  void add(Copy c) {
    std::lock_guard<std::mutex> l(mu);
    copies.push_back(std::move(c));
  }
  // Drops the copies that have completed.
  void drain() {
    std::vector<Copy> done;
    {
      std::lock_guard<std::mutex> l(mu);
      if (copies.empty()) return;
      auto keep_end = std::partition(copies.begin(), copies.end(), [](const Copy& c) {
        QuietDeviceGuard g(c.device);
        const bool pending = cudaEventQuery(c.ev) == cudaErrorNotReady;  // an error: nothing will complete it
        cudaGetLastError();
        return pending;
      });
      std::move(keep_end, copies.end(), std::back_inserter(done));
      copies.erase(keep_end, copies.end());
    }
    for (Copy& c : done) {
      QuietDeviceGuard g(c.device);
      cudaEventDestroy(c.ev);
    }
    // `done` goes here, outside the lock: the storages, maybe a host block (cudaHostUnregister).
  }
};

struct CudaEvent : Event {
  cudaEvent_t ev = nullptr;
  int device;
  bool timing;  // made with timing (cudaEventDefault): elapsed times can end or start here
  std::shared_ptr<PendingCopies> pending;  // a copy's event: where its storages go if dropped early
  CudaEvent(int device, bool timing) : device(device), timing(timing) {
    DeviceGuard g(device);
    LW_CUDA(cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~CudaEvent() override {
    // A forked child has no CUDA context to free it in.
    if (origin.forked()) return;
    QuietDeviceGuard g(device);
    if (ev && keepalive && pending && cudaEventQuery(ev) == cudaErrorNotReady) {
      cudaGetLastError();
      pending->add({device, ev, std::move(keepalive)});  // the copy still reads its storages
      return;
    }
    cudaGetLastError();
    // (`start` goes with this event: destroying a recorded event that has not completed
    // yet is allowed, its resources are released once it has)
    if (ev) cudaEventDestroy(ev);
  }
  bool query() override {
    check_here();
    DeviceGuard g(device);
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return completed();
    if (e == cudaErrorNotReady) {
      cudaGetLastError();  // NotReady is not sticky, but clear it for later checks
      return false;
    }
    throw_cuda("cudaEventQuery", e);
  }
  void synchronize() override {
    check_here();
    DeviceGuard g(device);
    LW_CUDA(cudaEventSynchronize(ev));
    completed();
  }
  // cudaEventSynchronize spins a core on an event made without cudaEventBlockingSync
  // (every event here: a hook waiting for its layer wants the shortest wake-up). A
  // reader thread waits for the copy out of its staging slot, often for milliseconds:
  // it polls instead, sleeping 20 us, then twice as long each time, up to 1 ms (at
  // most ~1 ms late, against copies of a layer that take milliseconds).
  void host_wait() override {
    auto nap = std::chrono::microseconds(20);
    while (!query()) {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }
  double elapsed_ms(Event& end) override {
    auto* e = dynamic_cast<CudaEvent*>(&end);
    TORCH_CHECK_TYPE(e != nullptr, "Event.elapsed_ms: both events must come from the same backend");
    check_here();
    e->check_here();
    DeviceGuard g(device);
    float ms = 0.f;
    LW_CUDA(cudaEventElapsedTime(&ms, ev, e->ev));
    return ms;
  }
  double copy_ms() override {
    if (!start || origin.forked()) return -1.0;
    auto* s = static_cast<CudaEvent*>(start.get());  // (set_start checked it)
    DeviceGuard g(device);
    if (cudaEventQuery(ev) != cudaSuccess || cudaEventQuery(s->ev) != cudaSuccess) {
      cudaGetLastError();
      return -1.0;
    }
    float ms = 0.f;
    LW_CUDA(cudaEventElapsedTime(&ms, s->ev, ev));
    return ms;
  }
  void set_start(EventPtr st) override {
    if (st) {
      auto* s = dynamic_cast<CudaEvent*>(st.get());
      TORCH_CHECK_TYPE(s != nullptr, "Event.start: the start must be an event of the same backend (a CUDA event)");
      TORCH_CHECK_VALUE(s->device == device, "Event.start: the start is an event of cuda:", s->device,
                        ", this one of cuda:", device);
      TORCH_CHECK_VALUE(timing && s->timing, "Event.start: both events must be made with timing (copy_async or "
                        "record with timing=True); ", timing ? "the start" : "this event", " was not");
    }
    start = std::move(st);
  }
  // The copy is done: its storages may be resized again.
  bool completed() {
    if (keepalive) keepalive->release();
    return true;
  }
  void check_here() const {
    if (origin.forked()) origin.throw_forked("this CUDA event");
  }
};

class CudaEngine : public CopyEngine {
 public:
  CudaEngine(int device, int num_streams) : device_(device) {
    TORCH_CHECK_VALUE(num_streams >= 1, "CopyEngine: num_streams must be >= 1, got ", num_streams);
    int count = cuda_device_count_or_throw("a CUDA CopyEngine");
    TORCH_CHECK_VALUE(device >= 0 && device < count, "CopyEngine: CUDA device ", device, " does not exist (",
                      count, " visible)");
    DeviceGuard g(device_);
    // streams_[num_streams] is the decode stream (decode_stream_handle), a stream of its
    // own: a decode waits on its slot, which must not hold up the next copy behind it.
    for (int i = 0; i <= num_streams; ++i) {
      cudaStream_t s;
      LW_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams_.push_back(s);
    }
    copy_streams_ = static_cast<size_t>(num_streams);
  }
  ~CudaEngine() override {
    if (origin_.forked()) return;  // the parent's CUDA context: not this process's to touch
    {
      QuietDeviceGuard g(device_);
      for (cudaStream_t s : streams_) {
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
      }
    }
    pending_->drain();
  }

  EventPtr copy_async(void* dst, const void* src, size_t n, const EventPtr& after,
                      std::unique_ptr<InFlight> keep, bool timing) override {
    check_usable();
    pending_->drain();
    DeviceGuard g(device_);
    cudaStream_t s = streams_[next_.fetch_add(1, std::memory_order_relaxed) % copy_streams_];
    if (after) {
      auto* a = dynamic_cast<CudaEvent*>(after.get());
      TORCH_CHECK_TYPE(a != nullptr, "copy_async: `after` is not a CUDA event");
      a->check_here();
      LW_CUDA(cudaStreamWaitEvent(s, a->ev, 0));
    }
    auto ev = std::make_shared<CudaEvent>(device_, timing);
    ev->keepalive = std::move(keep);
    ev->pending = pending_;
    if (timing) {  // recorded after the wait for `after`: it completes when the copy starts
      auto start = std::make_shared<CudaEvent>(device_, true);
      LW_CUDA(cudaEventRecord(start->ev, s));
      ev->start = std::move(start);
    }
    if (n) LW_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s));
    LW_CUDA(cudaEventRecord(ev->ev, s));
    track(ev);
    return ev;
  }

  EventPtr decode_async(uint8_t*, const uint8_t*, std::vector<DecodePiece>, const EventPtr&, const EventPtr&,
                        std::unique_ptr<InFlight>, bool) override {
    TORCH_CHECK(false, "decode_async is the CPU backend's decoder; on CUDA the Triton decode kernel runs on the "
                       "decode stream (decode_stream_handle()), see layerwise/stages/decode.py");
  }

  uintptr_t stream_handle(int k) const override {
    TORCH_CHECK_VALUE(k >= 0 && k < static_cast<int>(copy_streams_), "stream_handle: this engine has ",
                      copy_streams_, " copy stream(s), got k=", k);
    return reinterpret_cast<uintptr_t>(streams_[k]);
  }
  uintptr_t decode_stream_handle() const override { return reinterpret_cast<uintptr_t>(streams_[copy_streams_]); }

  void wait(const EventPtr& ev, uintptr_t stream) override {
    check_usable();
    auto* e = dynamic_cast<CudaEvent*>(ev.get());
    TORCH_CHECK_TYPE(e != nullptr, "wait: not a CUDA event");
    e->check_here();
    DeviceGuard g(device_);
    LW_CUDA(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), e->ev, 0));
  }

  EventPtr record(uintptr_t stream, bool timing) override {
    check_usable();
    DeviceGuard g(device_);
    auto ev = std::make_shared<CudaEvent>(device_, timing);
    LW_CUDA(cudaEventRecord(ev->ev, reinterpret_cast<cudaStream_t>(stream)));
    return ev;
  }

  void synchronize() override {
    // See the CPU backend: nothing to wait for in a forked child or after shutdown.
    if (origin_.forked() || shut_down_.load()) return;
    {
      DeviceGuard g(device_);
      for (cudaStream_t s : streams_) LW_CUDA(cudaStreamSynchronize(s));
    }
    release_tracked();
    pending_->drain();
  }

  void shutdown() override {
    if (shut_down_.exchange(true) || origin_.forked()) return;
    int prev = -1;
    if (cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess) {
      for (cudaStream_t s : streams_) cudaStreamSynchronize(s);  // errors ignored: the process is ending
      cudaSetDevice(prev);
    }
    cudaGetLastError();
    release_tracked();
    pending_->drain();
  }

  bool is_cuda() const override { return true; }
  int device_index() const override { return device_; }
  int num_streams() const override { return static_cast<int>(copy_streams_); }

 private:
  void check_usable() const {
    if (origin_.forked()) origin_.throw_forked("this CUDA copy engine");
    if (shut_down_.load()) throw_shut_down();
  }
  // A CUDA copy is seen complete only when someone asks its event; synchronize()
  // knows every copy is, and makes their storages resizable again.
  void track(const std::shared_ptr<CudaEvent>& ev) {
    std::lock_guard<std::mutex> l(mu_);
    if (issued_.size() >= prune_at_) {
      std::erase_if(issued_, [](const std::weak_ptr<CudaEvent>& w) { return w.expired(); });
      prune_at_ = std::max<size_t>(64, 2 * issued_.size());
    }
    issued_.push_back(ev);
  }
  void release_tracked() {
    std::vector<std::weak_ptr<CudaEvent>> done;
    {
      std::lock_guard<std::mutex> l(mu_);
      done.swap(issued_);
    }
    for (auto& w : done)
      if (auto e = w.lock()) e->completed();
  }

  const Origin origin_;
  int device_;
  std::vector<cudaStream_t> streams_;  // the copy streams, then the decode stream
  size_t copy_streams_ = 0;
  std::atomic<size_t> next_{0};
  std::atomic<bool> shut_down_{false};
  std::mutex mu_;
  std::vector<std::weak_ptr<CudaEvent>> issued_;
  size_t prune_at_ = 64;
  std::shared_ptr<PendingCopies> pending_ = std::make_shared<PendingCopies>();
};

}  // namespace

int cuda_device_count_or_throw(const char* what) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw std::runtime_error(std::string("layerwise: no CUDA device for ") + what + ": cudaGetDeviceCount " +
                             (e != cudaSuccess ? std::string("failed: ") + cudaGetErrorString(e) + " (error " +
                                                     std::to_string(static_cast<int>(e)) + ")"
                                               : std::string("found 0 devices")));
  }
  return count;
}

std::string cuda_host_register(void* ptr, size_t n, int device, bool read_only) {
  // Portable: pinned for every device's context. Registered with the target
  // device current, so that no context is created on another device for it.
  // Read-only pages (PROT_READ, a sealed shared arena) cannot be pinned for
  // device writes: without the ReadOnly flag the driver refuses them.
  QuietDeviceGuard g(device < 0 ? 0 : device);
  const unsigned flags = cudaHostRegisterPortable | (read_only ? cudaHostRegisterReadOnly : 0u);
  cudaError_t e = cudaHostRegister(ptr, n, flags);
  if (e == cudaSuccess) return "";
  cudaGetLastError();
  std::string why = std::string(read_only ? "cudaHostRegister of read-only memory (cudaHostRegisterReadOnly) failed: "
                                          : "cudaHostRegister failed: ") +
                    cudaGetErrorString(e) + " (" + cudaGetErrorName(e) + ")";
  if (read_only) {
    int supported = -1;
    if (cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterReadOnlySupported, device < 0 ? 0 : device) !=
        cudaSuccess) {
      cudaGetLastError();
      supported = -1;
    }
    why += supported == 0 ? "; the device does not support registering read-only host memory "
                            "(cudaDevAttrHostRegisterReadOnlySupported is 0)"
                          : "";
    why += "; the shared arena is mapped read-only, so it stays pageable and copies from it run at pageable speed";
  }
  return why;
}

void cuda_wait_for_device(int device) {
  // The arena's pages may still be the source of a copy in flight on some
  // stream of the device it streams to: let every copy finish before they are
  // unpinned and unmapped.
  int cur = 0;
  if (device < 0 && cudaGetDevice(&cur) != cudaSuccess) cur = 0;
  QuietDeviceGuard g(device < 0 ? cur : device);
  if (cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();
}

void cuda_host_unregister(void* ptr) {
  if (cudaHostUnregister(ptr) != cudaSuccess) cudaGetLastError();
}

int cuda_runtime_version_compiled() { return CUDART_VERSION; }

EnginePtr make_cuda_engine(int device, int num_streams) {
  return std::make_shared<CudaEngine>(device, num_streams);
}

}  // namespace layerwise
