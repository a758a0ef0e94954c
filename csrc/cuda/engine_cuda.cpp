// CUDA backend of the copy engine and of arena pinning, written against the
// CUDA runtime API alone (no c10/ATen CUDA headers), so that it compiles and
// links with the toolkit even where torch is a CPU build. torch's compute
// stream is handed in as a raw cudaStream_t.
#include "../layerwise.h"

#include <cuda_runtime.h>

#include <string>

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

struct CudaEvent : Event {
  cudaEvent_t ev = nullptr;
  int device;
  CudaEvent(int device, bool timing) : device(device) {
    DeviceGuard g(device);
    LW_CUDA(cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~CudaEvent() override {
    if (ev) cudaEventDestroy(ev);  // safe while pending: freed once it completes
  }
  bool query() override {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) {
      cudaGetLastError();  // NotReady is not sticky, but clear it for later checks
      return false;
    }
    throw_cuda("cudaEventQuery", e);
  }
  void synchronize() override { LW_CUDA(cudaEventSynchronize(ev)); }
  double elapsed_ms(Event& end) override {
    auto* e = dynamic_cast<CudaEvent*>(&end);
    TORCH_CHECK_TYPE(e != nullptr, "Event.elapsed_ms: both events must come from the same backend");
    float ms = 0.f;
    LW_CUDA(cudaEventElapsedTime(&ms, ev, e->ev));
    return ms;
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
    for (int i = 0; i < num_streams; ++i) {
      cudaStream_t s;
      LW_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams_.push_back(s);
    }
  }
  ~CudaEngine() override {
    for (cudaStream_t s : streams_) {
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
  }

  EventPtr copy_async(void* dst, const void* src, size_t n, const EventPtr& after) override {
    DeviceGuard g(device_);
    cudaStream_t s = streams_[next_++ % streams_.size()];
    if (after) {
      auto* a = dynamic_cast<CudaEvent*>(after.get());
      TORCH_CHECK_TYPE(a != nullptr, "copy_async: `after` is not a CUDA event");
      LW_CUDA(cudaStreamWaitEvent(s, a->ev, 0));
    }
    if (n) LW_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s));
    auto ev = std::make_shared<CudaEvent>(device_, false);
    LW_CUDA(cudaEventRecord(ev->ev, s));
    return ev;
  }

  void wait(const EventPtr& ev, uintptr_t stream) override {
    auto* e = dynamic_cast<CudaEvent*>(ev.get());
    TORCH_CHECK_TYPE(e != nullptr, "wait: not a CUDA event");
    LW_CUDA(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), e->ev, 0));
  }

  EventPtr record(uintptr_t stream, bool timing) override {
    DeviceGuard g(device_);
    auto ev = std::make_shared<CudaEvent>(device_, timing);
    LW_CUDA(cudaEventRecord(ev->ev, reinterpret_cast<cudaStream_t>(stream)));
    return ev;
  }

  void synchronize() override {
    DeviceGuard g(device_);
    for (cudaStream_t s : streams_) LW_CUDA(cudaStreamSynchronize(s));
  }

  bool is_cuda() const override { return true; }
  int device_index() const override { return device_; }
  int num_streams() const override { return static_cast<int>(streams_.size()); }

 private:
  int device_;
  std::vector<cudaStream_t> streams_;
  size_t next_ = 0;
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

bool cuda_host_register(void* ptr, size_t n) {
  // Portable: pinned for every device's context, not only the current one.
  cudaError_t e = cudaHostRegister(ptr, n, cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

void cuda_wait_for_device() {
  // The arena's pages may still be the source of a copy in flight on some
  // stream: let every copy finish before they are unpinned and unmapped.
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
