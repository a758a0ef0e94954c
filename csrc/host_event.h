// The event of host-side asynchronous work: a copy of the CPU copy engine, a
// read of the disk reader. One type for both, so that a copy can wait on a
// read (CopyEngine("cpu").copy_async(..., after=read_event)) and the other way
// round. Completed by the worker thread that did the work; a failed job
// completes its event with an error, which synchronize() (and query()) raise.
#pragma once

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"

namespace layerwise {

using HostClock = std::chrono::steady_clock;

// Waking a sleeping thread through a condition variable costs tens of
// microseconds on a VM (measured ~80 us for a 51 KB copy handed to an idle
// worker, `python -m layerwise.bench hooks`, 2-core VM): both sides spin
// briefly before they block, since a layer's copy usually lands within that.
constexpr auto kHostSpin = std::chrono::microseconds(50);

template <class Ready>
bool spin_until(Ready ready) {
  const auto until = HostClock::now() + kHostSpin;
  do {
    if (ready()) return true;
    std::this_thread::yield();
  } while (HostClock::now() < until);
  return ready();
}

// A read (or a copy that waited on one) that did not happen: raised to Python
// as layerwise._C.ReadError, a subclass of OSError (errno set where there is one).
struct ReadError : std::runtime_error {
  int err;  // errno, 0 when the failure is not a system call's (a short read, a changed file)
  ReadError(const std::string& what, int err) : std::runtime_error(what), err(err) {}
};

struct CpuEvent : Event {
  std::mutex m;
  std::condition_variable cv;
  std::atomic<bool> done{false};
  std::atomic<int> waiters{0};
  HostClock::time_point when{};
  HostClock::time_point started{};  // a disk read's first piece (reader.cpp): its own time, without a start
  // Set (before done) by a job that failed; read only once done is seen.
  std::string error;
  int error_errno = 0;

  double copy_ms() override {
    if (!done.load(std::memory_order_acquire)) return -1.0;
    if (start) {
      auto* s = static_cast<CpuEvent*>(start.get());
      if (!s->completed()) return -1.0;
      return std::chrono::duration<double, std::milli>(when - s->when).count();
    }
    if (started == HostClock::time_point{}) return -1.0;
    return std::chrono::duration<double, std::milli>(when - started).count();
  }

  void set_start(EventPtr s) override {
    TORCH_CHECK_TYPE(!s || dynamic_cast<CpuEvent*>(s.get()) != nullptr,
                     "Event.start: the start must be an event of the same backend (a CPU event)");
    start = std::move(s);
  }

  void set() { set_at(HostClock::now()); }
  // Completed, as of `t` (a simulated bus copy's start lies ahead of the worker's clock).
  void set_at(HostClock::time_point t) {
    when = t;
    {
      std::lock_guard<std::mutex> l(m);
      done.store(true, std::memory_order_release);
    }
    if (waiters.load()) cv.notify_all();
  }
  void fail(std::string what, int err) {
    error = std::move(what);
    error_errno = err;
    set();
  }
  // Completed, successfully or not; never throws (for the engines' own checks).
  bool completed() const { return done.load(std::memory_order_acquire); }
  bool failed() const { return completed() && !error.empty(); }
  void raise_if_failed() const {
    if (failed()) throw ReadError(error, error_errno);
  }
  // A failed event raises here too: a caller that polls query() and then uses
  // the buffer must not see a half-read buffer as a finished one.
  bool query() override {
    if (!completed()) return false;
    raise_if_failed();
    return true;
  }
  void synchronize() override {
    if (!completed()) {
      // Its worker stayed behind in the parent: it would never complete here.
      if (origin.forked()) origin.throw_forked("the copy or read this event waits for");
      if (!spin_until([&] { return completed(); })) {
        std::unique_lock<std::mutex> l(m);
        waiters++;
        cv.wait(l, [&] { return completed(); });
        waiters--;
      }
    }
    raise_if_failed();
  }
  double elapsed_ms(Event& end) override {
    auto* e = dynamic_cast<CpuEvent*>(&end);
    TORCH_CHECK_TYPE(e != nullptr, "Event.elapsed_ms: both events must come from the same backend");
    synchronize();
    e->synchronize();
    return std::chrono::duration<double, std::milli>(e->when - when).count();
  }
};

// Events of finished copies and reads, dropped on a Python thread: the last
// reference to a storage may need the GIL, which a worker must never take
// (interpreter finalisation kills a thread that does).
struct Retired {
  std::mutex m;
  std::vector<EventPtr> events;
  void add(EventPtr a, EventPtr b) {
    std::lock_guard<std::mutex> l(m);
    if (a) events.push_back(std::move(a));
    if (b) events.push_back(std::move(b));
  }
  void drop() {
    std::vector<EventPtr> gone;
    {
      std::lock_guard<std::mutex> l(m);
      gone.swap(events);
    }
  }
};

}  // namespace layerwise
