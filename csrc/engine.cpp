// What keeps copies safe across storage changes, fork() and process exit:
// in-flight marks on storages, the fork generation, the registry of live engines.
#include "engine.h"

#include <pthread.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <unordered_map>

namespace layerwise {
namespace {

std::atomic<uint64_t> g_generation{0};
std::atomic<int> g_pid{static_cast<int>(getpid())};

struct Mark {
  int count;
  bool was_resizable;
};
std::mutex g_marks_mu;
std::unordered_map<const c10::StorageImpl*, Mark> g_marks;

std::mutex g_engines_mu;
std::vector<std::weak_ptr<Stoppable>> g_engines;

// A mutex some other thread holds at fork() stays locked forever in the child:
// take both around fork() so that the child inherits them unlocked.
void before_fork() {
  g_engines_mu.lock();
  g_marks_mu.lock();
}
void after_fork_parent() {
  g_marks_mu.unlock();
  g_engines_mu.unlock();
}
void after_fork_child() {
  g_generation.fetch_add(1);
  g_pid.store(static_cast<int>(getpid()));
  g_marks_mu.unlock();
  g_engines_mu.unlock();
}
const int g_atfork = pthread_atfork(before_fork, after_fork_parent, after_fork_child);

}  // namespace

Origin::Origin() : generation(g_generation.load(std::memory_order_relaxed)), pid(g_pid.load()) {}

bool Origin::forked() const { return generation != g_generation.load(std::memory_order_relaxed); }

void Origin::throw_forked(const char* what) const {
  (void)g_atfork;
  TORCH_CHECK(false, "layerwise: ", what, " was created in process ", pid, " before fork(); process ", g_pid.load(),
              " has neither its copy threads nor its CUDA context, so it cannot be used here: configure the model "
              "again in this process (layerwise.remove_layerwise_offload(model), then "
              "configure_layerwise_offload), or fork before configuring");
}

InFlight::InFlight(std::vector<c10::Storage> storages)
    : storages_(std::move(storages)), counted_(storages_.size(), 0) {
  std::lock_guard<std::mutex> l(g_marks_mu);
  for (size_t i = 0; i < storages_.size(); ++i) {
    c10::StorageImpl* s = storages_[i].unsafeGetStorageImpl();
    auto it = g_marks.find(s);
    if (it != g_marks.end()) {
      it->second.count++;
    } else if (s->resizable()) {
      g_marks.emplace(s, Mark{1, true});
      s->set_resizable(false);
    } else {
      continue;  // not resizable anyway (an arena block, say): nothing to restore
    }
    counted_[i] = 1;
  }
}

void InFlight::release() {
  if (!held_.exchange(false)) return;
  std::lock_guard<std::mutex> l(g_marks_mu);
  for (size_t i = 0; i < storages_.size(); ++i) {
    if (!counted_[i]) continue;
    c10::StorageImpl* s = storages_[i].unsafeGetStorageImpl();
    auto it = g_marks.find(s);
    if (it == g_marks.end() || --it->second.count > 0) continue;
    s->set_resizable(it->second.was_resizable);
    g_marks.erase(it);
  }
}

void register_engine(const std::shared_ptr<Stoppable>& engine) {
  std::lock_guard<std::mutex> l(g_engines_mu);
  std::erase_if(g_engines, [](const std::weak_ptr<Stoppable>& w) { return w.expired(); });
  g_engines.push_back(engine);
}

void shutdown_all() {
  std::vector<std::shared_ptr<Stoppable>> live;
  {
    std::lock_guard<std::mutex> l(g_engines_mu);
    for (auto& w : g_engines)
      if (auto e = w.lock()) live.push_back(std::move(e));
  }
  for (auto& e : live) e->shutdown();
}

void throw_shut_down() {
  TORCH_CHECK(false, "layerwise: this copy engine was shut down at interpreter exit (layerwise._C.shutdown_all, "
                     "an atexit hook) and copies nothing any more; code that still runs after that cannot stream "
                     "a model (configure it again if this process goes on)");
}

}  // namespace layerwise
