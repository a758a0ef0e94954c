// The copy engine interface shared by both backends, and what keeps a copy
// safe while it is in flight: the storages it touches, fork() and process exit.
// Only light c10 headers here: the backends compile without all of torch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Storage.h>
#include <c10/util/Exception.h>

namespace layerwise {

// Where an object was created. Worker threads and CUDA contexts do not survive
// fork(): in a forked child an object of the parent's must not touch them.
struct Origin {
  uint64_t generation;  // bumped in the child on every fork
  int pid;
  Origin();
  bool forked() const;
  // "created in process X before fork()": names `what` and says what to do.
  [[noreturn]] void throw_forked(const char* what) const;
};

// The storages a copy reads and writes. They live as long as the copy's event;
// until release() (the copy is known complete) they cannot be resized, so that
// `resize_` raises torch's "not resizable" error instead of freeing memory
// under the copy. Counted per storage: several copies may share one.
class InFlight {
 public:
  explicit InFlight(std::vector<c10::Storage> storages);
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  ~InFlight() { release(); }
  void release();  // idempotent, any thread; touches no Python object

 private:
  std::vector<c10::Storage> storages_;
  std::vector<char> counted_;  // whether storages_[i] was made non-resizable here
  std::atomic<bool> held_{true};
};

struct Event;
using EventPtr = std::shared_ptr<Event>;

// An event marks the completion of a copy, or a point on a compute stream.
struct Event {
  virtual ~Event() = default;
  virtual bool query() = 0;
  virtual void synchronize() = 0;
  // synchronize() for a worker thread that may wait long (a disk reader waiting
  // for the copy out of its staging slot): it must not spin a core meanwhile.
  // A CUDA event, made without cudaEventBlockingSync so that the hooks' waits
  // stay short, is polled with back-off instead (csrc/cuda/engine_cuda.cpp).
  virtual void host_wait() { synchronize(); }
  // Milliseconds from this event to `end`; both must be complete (CUDA: both
  // recorded with timing enabled).
  virtual double elapsed_ms(Event& end) = 0;
  // Milliseconds from `start` (below) to this event, once both have completed;
  // else -1 (no start: the work was not timed). A disk read of the CPU backend
  // without a start reports its own time (reader.cpp).
  virtual double copy_ms() = 0;
  // Makes `s` this event's start (null: none), checking that both can be timed
  // against each other (same backend; CUDA: same device, both with timing).
  virtual void set_start(EventPtr s) = 0;
  // When the timed work this event ends began: a copy issued with timing gets
  // one (completed when the copy starts, on its stream), a decode issued with
  // timing one completed when the decode starts. A fetch that ends in another
  // stage (a decode, a gather, the last of several chained copies) is timed
  // from its first copy: that stage's event is given the first copy's start
  // (set_start), so copy_ms() spans the whole fetch on both backends.
  // Only a marker: it holds no storage, so keeping it alive costs nothing.
  EventPtr start;
  // The storages of this event's copy (none for a recorded event). Dropping
  // the last reference to a storage may need the GIL: an event is only ever
  // destroyed on a thread that may take it, never on a copy worker. They are
  // held until the copy has completed, even where the event is dropped before
  // (CUDA: the engine keeps them until then), so that freeing a host block
  // never has to wait for the device.
  std::unique_ptr<InFlight> keepalive;
  const Origin origin;
};

// What shutdown_all() stops before the interpreter finalises: copy engines and
// disk readers (reader.h), anything that owns threads.
struct Stoppable {
  virtual ~Stoppable() = default;
  virtual void shutdown() = 0;
};

struct DecodePiece {
  size_t enc_off, enc_n, dst_off, dst_n;
};

struct CopyEngine : Stoppable {
  virtual ~CopyEngine() = default;
  // Copies n bytes src -> dst on one of the engine's streams, after `after`
  // (if given) has completed. Returns the event that completes with the copy
  // and owns `keep` (taken before dst/src were read, so they cannot move).
  // `timing`: the event gets a start (Event::start), completed when the copy
  // starts (after `after`), so that copy_ms() is the copy's time; without it
  // copy_ms() is -1 on both backends.
  virtual EventPtr copy_async(void* dst, const void* src, size_t n, const EventPtr& after,
                              std::unique_ptr<InFlight> keep, bool timing) = 0;
  // Decodes lossless-codec segments (csrc/codec.h) from `enc` into `dst` once
  // `after` and `after2` (either may be null) have completed; piece k is
  // enc[enc_off, +enc_n) -> dst[dst_off, +dst_n). The event completes with the
  // decode (a malformed segment fails it, naming why); `timing` gives it a start
  // at the decode's own start. CPU backend only, on a worker of its own (the
  // decode lane), never behind or in front of a copy: the copy of the next
  // layer's bytes overlaps this decode. On CUDA the Triton decoder runs on
  // decode_stream_handle() (layerwise/stages/decode.py).
  virtual EventPtr decode_async(uint8_t* dst, const uint8_t* enc, std::vector<DecodePiece> pieces,
                                const EventPtr& after, const EventPtr& after2, std::unique_ptr<InFlight> keep,
                                bool timing) = 0;
  // The raw handle of copy stream k (a cudaStream_t; 0 on the CPU backend).
  virtual uintptr_t stream_handle(int k) const = 0;
  // The raw handle of the decode stream (a cudaStream_t of its own, none of the
  // copy streams, so that a decode waiting for its slot never holds up the next
  // copy; 0 on the CPU backend, whose decodes run on their own worker).
  virtual uintptr_t decode_stream_handle() const = 0;
  // Makes the compute stream (CUDA: handle `stream`) wait for `ev` (CPU: blocks).
  virtual void wait(const EventPtr& ev, uintptr_t stream) = 0;
  // An event recorded on the compute stream (CPU: already complete).
  virtual EventPtr record(uintptr_t stream, bool timing) = 0;
  // Blocks until every copy issued so far has completed.
  virtual void synchronize() = 0;
  // Finishes every queued copy and stops the engine's threads; later use
  // raises. Called for every live engine before the interpreter finalises.
  virtual void shutdown() = 0;
  virtual bool is_cuda() const = 0;
  virtual int device_index() const = 0;
  virtual int num_streams() const = 0;
};
using EnginePtr = std::shared_ptr<CopyEngine>;

// Live engines and readers, so that shutdown_all() (an atexit hook) can stop them all.
void register_engine(const std::shared_ptr<Stoppable>& engine);
void shutdown_all();
[[noreturn]] void throw_shut_down();

EnginePtr make_cpu_engine(int num_streams, int64_t debug_delay_us);

#ifdef LAYERWISE_WITH_CUDA
EnginePtr make_cuda_engine(int device, int num_streams);
int cuda_device_count_or_throw(const char* what);
// "" when pinned, else why not. `read_only`: the pages are mapped PROT_READ
// (a shared arena), registered with cudaHostRegisterReadOnly.
std::string cuda_host_register(void* ptr, size_t n, int device, bool read_only);
void cuda_host_unregister(void* ptr);
void cuda_wait_for_device(int device);  // device < 0: the current one
int cuda_runtime_version_compiled();
#endif

}  // namespace layerwise
