// CPU backend of the copy engine: each "stream" is a worker thread with a FIFO
// queue. The copy runs off the calling thread, events are real, and a debug
// mode delays every copy by a random amount so that a missing wait in the
// layers above shows up as a wrong output instead of passing by luck. Decodes
// run on a worker of their own (the decode lane, started at the first decode),
// as the CUDA backend runs them on a stream of their own: a decode waiting for
// its slot never holds up the next copy, and the order between them is only
// what their events say.
//
// A worker never drops a reference that could be the last one to an event:
// that would free the copy's storages on the worker, and freeing a storage that
// has a Python object takes the GIL, which a finalising interpreter answers by
// ending the thread (pthread_exit through noexcept code: std::terminate).
// Finished jobs' events are handed back ("retired") to be dropped on a Python
// thread instead.
#include "../codec.h"
#include "../host_event.h"
#include "../sim_bus.h"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

namespace layerwise {

// ------------------------------------------------------------ simulated bus
namespace {
std::mutex g_bus_mutex;
SimBusConfig g_bus;
std::atomic<bool> g_bus_on{false};  // (read without the mutex: a copy with no bus takes no lock)
HostClock::time_point g_bus_free;             // when the bus has carried every copy reserved so far
std::map<uintptr_t, size_t> g_pinned_ranges;  // base -> length (mlocked arena ranges)

double env_number(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  TORCH_CHECK_VALUE(end != v && *end == '\0' && x >= 0 && x < 1e9, name, "=", v,
                    " is not a number of GB/s or microseconds >= 0 (the simulated bus of the CPU backend; unset it "
                    "for none)");
  return x;
}
}  // namespace

void note_pinned_range(const void* base, size_t n, bool pinned) {
  std::lock_guard<std::mutex> l(g_bus_mutex);
  if (pinned)
    g_pinned_ranges[reinterpret_cast<uintptr_t>(base)] = n;
  else
    g_pinned_ranges.erase(reinterpret_cast<uintptr_t>(base));
}

static bool in_pinned_range_locked(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = g_pinned_ranges.upper_bound(a);
  if (it == g_pinned_ranges.begin()) return false;
  --it;
  return a < it->first + it->second;
}

bool in_pinned_range(const void* p) {
  std::lock_guard<std::mutex> l(g_bus_mutex);
  return in_pinned_range_locked(p);
}

SimBusConfig sim_bus_from_env() {
  SimBusConfig c;
  c.gbps = env_number("LAYERWISE_SIM_BUS_GBPS", 0);
  c.pageable_gbps = env_number("LAYERWISE_SIM_BUS_PAGEABLE_GBPS", c.gbps / 2);
  c.latency_us = env_number("LAYERWISE_SIM_BUS_LATENCY_US", 0);
  TORCH_CHECK_VALUE(c.gbps > 0 || (c.latency_us == 0 && !std::getenv("LAYERWISE_SIM_BUS_PAGEABLE_GBPS")),
                    "LAYERWISE_SIM_BUS_LATENCY_US / _PAGEABLE_GBPS describe the simulated bus: give "
                    "LAYERWISE_SIM_BUS_GBPS too");
  TORCH_CHECK_VALUE(c.gbps == 0 || c.pageable_gbps > 0, "LAYERWISE_SIM_BUS_PAGEABLE_GBPS must be > 0");
  std::lock_guard<std::mutex> l(g_bus_mutex);
  g_bus = c;
  g_bus_on.store(c.gbps > 0, std::memory_order_release);
  return c;
}

SimBusConfig sim_bus_config() {
  std::lock_guard<std::mutex> l(g_bus_mutex);
  return g_bus;
}

HostClock::time_point sim_bus_reserve(size_t n, const void* src, HostClock::time_point ready,
                                      HostClock::time_point* start_out) {
  if (!g_bus_on.load(std::memory_order_acquire)) return {};
  std::lock_guard<std::mutex> l(g_bus_mutex);
  if (g_bus.gbps <= 0) return {};
  const double gbps = in_pinned_range_locked(src) ? g_bus.gbps : g_bus.pageable_gbps;
  const auto start = std::max(ready, g_bus_free);
  const auto carry = std::chrono::duration_cast<HostClock::duration>(
      std::chrono::duration<double, std::nano>(static_cast<double>(n) / gbps));  // bytes / (GB/s) = ns
  g_bus_free = start + carry;
  if (start_out) *start_out = start;
  return g_bus_free + std::chrono::duration_cast<HostClock::duration>(
                          std::chrono::duration<double, std::micro>(g_bus.latency_us));
}

namespace {

using Clock = HostClock;

struct Job {
  void* dst;
  const void* src;
  size_t n;
  EventPtr after;
  std::shared_ptr<CpuEvent> done;
  // A decode job (CopyEngine::decode_async): src holds codec segments, not bytes to copy.
  bool decode = false;
  std::vector<DecodePiece> pieces;
  EventPtr after2;
  // The start of a timed job (Event::start of `done`): completed when the work
  // starts, after the waits (a copy: when it goes on the simulated bus).
  std::shared_ptr<CpuEvent> start;
  HostClock::time_point queued = HostClock::now();  // (the simulated bus: when the copy was ready to go)
};

class Worker {
 public:
  Worker(int64_t delay_us, std::shared_ptr<Retired> retired)
      : delay_us_(delay_us), rng_(std::random_device{}()), retired_(std::move(retired)) {
    thread_ = std::thread([this] { loop(); });
  }
  // Not called in a forked child, where the thread does not exist (the engine
  // leaks its workers there instead).
  ~Worker() { stop(); }
  // Finishes the queue without the debug delay, then ends the thread.
  void stop() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void push(Job job) {
    bool wake;
    {
      std::lock_guard<std::mutex> l(m_);
      if (stop_) throw_shut_down();  // a job queued now would never run
      last_ = job.done;
      queue_.push_back(std::move(job));
      pending_.store(queue_.size());
      wake = sleeping_;
    }
    if (wake) cv_.notify_one();
  }
  std::shared_ptr<CpuEvent> last() {
    std::lock_guard<std::mutex> l(m_);
    return last_;
  }

 private:
  void loop() {
    for (;;) {
      Job job;
      spin_until([&] { return pending_.load() > 0; });
      {
        std::unique_lock<std::mutex> l(m_);
        sleeping_ = true;
        cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
        sleeping_ = false;
        if (queue_.empty()) return;  // stop requested and nothing left to copy
        job = std::move(queue_.front());
        queue_.pop_front();
        pending_.store(queue_.size());
      }
      // An exception must not end the thread (std::terminate): the event completes regardless.
      // A copy after a failed read (a disk tier's staging buffer) copies nothing and fails
      // with the read's error: whoever waits on the copy learns that its bytes are not there.
      std::string failed_after;
      int failed_errno = 0;
      auto pending = [](const EventPtr& e) { return e && !static_cast<CpuEvent*>(e.get())->completed(); };
      const bool waited = pending(job.after) || pending(job.after2);
      try {
        if (job.after) job.after->synchronize();
        if (job.after2) job.after2->synchronize();
        if (delay_us_ > 0) {
          std::uniform_int_distribution<int64_t> d(0, delay_us_);
          std::unique_lock<std::mutex> l(m_);
          cv_.wait_for(l, std::chrono::microseconds(d(rng_)), [&] { return stop_; });
        }
      } catch (const ReadError& e) {
        failed_after = e.what();
        failed_errno = e.err;
      } catch (...) {
      }
      auto mark_start = [&](HostClock::time_point t) {
        if (job.start && !job.start->completed()) job.start->set_at(t);
      };
      std::string failed_decode;
      if (failed_after.empty() && job.decode) {
        mark_start(Clock::now());
        try {
          auto* dst = static_cast<uint8_t*>(job.dst);
          auto* enc = static_cast<const uint8_t*>(job.src);
          for (const DecodePiece& p : job.pieces)
            codec::decode_into(enc + p.enc_off, p.enc_n, dst + p.dst_off, p.dst_n, 1);
        } catch (const std::exception& e) {
          failed_decode = e.what();
        }
      } else if (failed_after.empty() && job.n) {
        // (the simulated bus, sim_bus.h: ready when queued, or when what it waited on completed)
        HostClock::time_point on_bus{};
        const auto crossed = sim_bus_reserve(job.n, job.src, waited ? HostClock::now() : job.queued, &on_bus);
        mark_start(crossed != HostClock::time_point{} ? on_bus : Clock::now());  // (copy_ms: its time on the bus)
        std::memcpy(job.dst, job.src, job.n);
        if (crossed != HostClock::time_point{}) {
          std::unique_lock<std::mutex> l(m_);
          cv_.wait_until(l, crossed, [&] { return stop_; });
        }
      }
      mark_start(Clock::now());  // nothing ran (a failed wait, no bytes): it started as it ends
      if (job.done->keepalive) job.done->keepalive->release();  // resizable again once the copy is done
      if (!failed_after.empty())
        job.done->fail("layerwise: copy not done: the read it waited on failed: " + failed_after, failed_errno);
      else if (!failed_decode.empty())
        job.done->fail("layerwise: decode failed (its encoded bytes are not a valid segment): " + failed_decode, 0);
      else
        job.done->set();
      retired_->add(std::move(job.after), std::move(job.done));
      retired_->add(std::move(job.after2), std::move(job.start));
    }
  }

  int64_t delay_us_;
  std::mt19937_64 rng_;
  std::shared_ptr<Retired> retired_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::shared_ptr<CpuEvent> last_;
  std::atomic<size_t> pending_{0};
  bool sleeping_ = false;
  bool stop_ = false;
  std::thread thread_;
};

class CpuEngine : public CopyEngine {
 public:
  CpuEngine(int num_streams, int64_t delay_us) : delay_us_(delay_us), retired_(std::make_shared<Retired>()) {
    TORCH_CHECK_VALUE(num_streams >= 1, "CopyEngine: num_streams must be >= 1, got ", num_streams);
    sim_bus_from_env();
    for (int i = 0; i < num_streams; ++i) workers_.emplace_back(std::make_unique<Worker>(delay_us, retired_));
  }
  ~CpuEngine() override {
    if (origin_.forked()) {
      // The threads stayed in the parent: joining them here would wait forever,
      // and destroying a joinable std::thread calls std::terminate. Leak them.
      for (auto& w : workers_) (void)w.release();
      (void)decoder_.release();
      return;
    }
    for (auto& w : workers_) w->stop();
    if (decoder_) decoder_->stop();
    retired_->drop();
  }

  EventPtr copy_async(void* dst, const void* src, size_t n, const EventPtr& after,
                      std::unique_ptr<InFlight> keep, bool timing) override {
    check_usable();
    if (after) {
      TORCH_CHECK_TYPE(dynamic_cast<CpuEvent*>(after.get()), "copy_async: `after` is not a CPU event");
      if (!static_cast<CpuEvent*>(after.get())->completed() && after->origin.forked())
        after->origin.throw_forked("the copy `after` waits for");
    }
    retired_->drop();
    auto done = std::make_shared<CpuEvent>();
    done->keepalive = std::move(keep);
    Job job{dst, src, n, after, done};
    if (timing) done->start = job.start = std::make_shared<CpuEvent>();
    Worker& w = *workers_[next_.fetch_add(1, std::memory_order_relaxed) % workers_.size()];
    w.push(std::move(job));
    return done;
  }

  EventPtr decode_async(uint8_t* dst, const uint8_t* enc, std::vector<DecodePiece> pieces, const EventPtr& after,
                        const EventPtr& after2, std::unique_ptr<InFlight> keep, bool timing) override {
    check_usable();
    for (const EventPtr* a : {&after, &after2}) {
      if (!*a) continue;
      TORCH_CHECK_TYPE(dynamic_cast<CpuEvent*>(a->get()), "decode_async: `after` is not a CPU event");
      if (!static_cast<CpuEvent*>(a->get())->completed() && (*a)->origin.forked())
        (*a)->origin.throw_forked("the work `after` waits for");
    }
    retired_->drop();
    auto done = std::make_shared<CpuEvent>();
    done->keepalive = std::move(keep);
    Job job{dst, enc, 0, after, done};
    job.decode = true;
    job.pieces = std::move(pieces);
    job.after2 = after2;
    if (timing) done->start = job.start = std::make_shared<CpuEvent>();
    decoder().push(std::move(job));
    return done;
  }

  uintptr_t stream_handle(int) const override { return 0; }
  uintptr_t decode_stream_handle() const override { return 0; }

  void wait(const EventPtr& ev, uintptr_t) override {
    check_usable();
    ev->synchronize();
  }

  EventPtr record(uintptr_t, bool) override {
    check_usable();
    retired_->drop();
    auto ev = std::make_shared<CpuEvent>();
    ev->set();  // CPU compute is synchronous: everything before this point is done
    return ev;
  }

  void synchronize() override {
    // Nothing of this engine runs in a forked child, and after shutdown every
    // copy has finished: returning lets remove_layerwise_offload work there.
    if (origin_.forked() || shut_down_.load()) return;
    for (auto& w : workers_)
      if (auto last = w->last()) last->synchronize();
    if (Worker* d = decoder_if_started())
      if (auto last = d->last()) last->synchronize();
    retired_->drop();
  }

  void shutdown() override {
    if (shut_down_.exchange(true) || origin_.forked()) return;
    for (auto& w : workers_) w->stop();
    {
      std::lock_guard<std::mutex> l(decoder_mu_);
      if (decoder_) decoder_->stop();
    }
    retired_->drop();
  }

  bool is_cuda() const override { return false; }
  int device_index() const override { return -1; }
  int num_streams() const override { return static_cast<int>(workers_.size()); }

 private:
  void check_usable() const {
    if (origin_.forked()) origin_.throw_forked("this copy engine");
    if (shut_down_.load()) throw_shut_down();
  }
  // The decode lane, started at the first decode (a group without encoded layers
  // never starts it). Once started it lives as long as the engine.
  Worker& decoder() {
    std::lock_guard<std::mutex> l(decoder_mu_);
    if (shut_down_.load()) throw_shut_down();
    if (!decoder_) decoder_ = std::make_unique<Worker>(delay_us_, retired_);
    return *decoder_;
  }
  Worker* decoder_if_started() {
    std::lock_guard<std::mutex> l(decoder_mu_);
    return decoder_.get();
  }

  const Origin origin_;
  const int64_t delay_us_;
  std::shared_ptr<Retired> retired_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex decoder_mu_;
  std::unique_ptr<Worker> decoder_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> shut_down_{false};
};

}  // namespace

EnginePtr make_cpu_engine(int num_streams, int64_t debug_delay_us) {
  return std::make_shared<CpuEngine>(num_streams, debug_delay_us);
}

}  // namespace layerwise
