// The simulated bus of the CPU backend (LAYERWISE_SIM_BUS_GBPS): a model of one
// direction of a host->device link, so that scheduling can be measured against
// a transfer cost on a machine without an accelerator. Every copy of the CPU
// engine then takes at least `latency + bytes / bandwidth` of wall time; the
// bus is one per process, shared by every copy in flight (they queue on it, as
// copies of one PCIe direction share its bandwidth), and a copy waits on a
// condition variable for its end rather than spinning, so it steals no compute.
// Sources inside pinned (mlocked) host arenas move at the full rate, others at
// the pageable rate (LAYERWISE_SIM_BUS_PAGEABLE_GBPS, default half).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace layerwise {

// Pinned (mlocked) host ranges of this process (HostArena), for the bus model.
void note_pinned_range(const void* base, size_t n, bool pinned);
bool in_pinned_range(const void* p);

struct SimBusConfig {
  double gbps = 0;           // 0: no simulated bus
  double pageable_gbps = 0;  // from sources outside pinned arenas
  double latency_us = 0;     // per copy
};

// Read from the environment (each CPU engine reads it when it is created: the
// bus itself, and its queue, stay one per process). Raises on a malformed value.
SimBusConfig sim_bus_from_env();
SimBusConfig sim_bus_config();

// The time at which a copy of `n` bytes from `src`, ready to go at `ready` (when it
// was queued, or when what it waited on completed), has crossed the bus: it starts
// at `ready` or when the bus is free, whichever is later (so that copies queued
// back to back cross back to back however late a worker thread wakes), and
// reserves its share. HostClock::time_point{} when there is no bus. `start`, if
// given, gets the time the copy starts on the bus (its event's copy time counts
// from there: the time on the bus, not the worker's pick-up).
std::chrono::steady_clock::time_point sim_bus_reserve(size_t n, const void* src,
                                                      std::chrono::steady_clock::time_point ready,
                                                      std::chrono::steady_clock::time_point* start = nullptr);

}  // namespace layerwise
