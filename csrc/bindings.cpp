// Python bindings of layerwise._C. Only layerwise/_native.py imports this module.
#include "layerwise.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

namespace py = pybind11;
using namespace layerwise;

namespace {

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << t.sizes() << " strides " << t.strides() << " on " << t.device();
  return s.str();
}

// Copies are raw bytes between contiguous tensors the engine's backend can reach.
void check_copy_args(const CopyEngine& engine, const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK_VALUE(dst.is_contiguous(), "copy_async: dst is not contiguous: ", describe(dst));
  TORCH_CHECK_VALUE(src.is_contiguous(), "copy_async: src is not contiguous: ", describe(src));
  TORCH_CHECK_VALUE(dst.nbytes() == src.nbytes(), "copy_async: dst has ", dst.nbytes(), " bytes but src has ",
                    src.nbytes(), " (dst ", describe(dst), ", src ", describe(src), ")");
  for (const at::Tensor* t : {&dst, &src}) {
    const char* name = t == &dst ? "dst" : "src";
    TORCH_CHECK_VALUE(t->has_storage(), "copy_async: ", name, " has no storage of its own (", describe(*t),
                      "); pass a plain dense tensor");
    if (engine.is_cuda()) {
      TORCH_CHECK_VALUE(t->is_cpu() || (t->is_cuda() && t->get_device() == engine.device_index()), "copy_async: ",
                        name, " is on ", t->device(), " but this engine copies between the host and cuda:",
                        engine.device_index());
    } else {
      TORCH_CHECK_VALUE(t->is_cpu(), "copy_async: ", name, " is on ", t->device(),
                        " but a CPU engine only copies host tensors");
    }
  }
}

// A debug delay is per copy: more than a second only turns a test into a hang.
constexpr int64_t kMaxDebugDelayUs = 1000000;

int64_t debug_delay(std::optional<int64_t> arg) {
  if (arg && *arg != -1) {  // -1: from the environment, as None
    TORCH_CHECK_VALUE(*arg >= 0 && *arg <= kMaxDebugDelayUs, "CopyEngine: debug_delay_us must lie in [0, ",
                      kMaxDebugDelayUs, "] microseconds (a random delay of up to that much per copy), got ", *arg,
                      "; pass None or -1 to read LAYERWISE_DEBUG_COPY_DELAY_US");
    return *arg;
  }
  const char* v = std::getenv("LAYERWISE_DEBUG_COPY_DELAY_US");
  if (!v || !*v) return 0;
  int64_t d = 0;
  bool ok = true;
  for (const char* c = v; *c && ok; ++c) {
    ok = *c >= '0' && *c <= '9';
    d = std::min<int64_t>(d * 10 + (*c - '0'), kMaxDebugDelayUs + 1);  // saturates: no overflow
  }
  TORCH_CHECK_VALUE(ok && d <= kMaxDebugDelayUs, "LAYERWISE_DEBUG_COPY_DELAY_US must be a whole number of "
                    "microseconds from 0 to ", kMaxDebugDelayUs, " (digits only), got '", v,
                    "'; unset it for no delay");
  return d;
}

struct PyEngine {
  EnginePtr impl;
  std::string device;
  int64_t debug_delay_us = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "layerwise native core: host arena and copy engine";

  py::class_<Event, EventPtr>(m, "Event")
      .def("query", &Event::query, "True once the event has completed")
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Block the calling thread until the event has completed")
      .def("elapsed_ms", [](Event& self, Event& end) {
        py::gil_scoped_release r;
        return self.elapsed_ms(end);
      })
      .def_property_readonly("copy_ms", &Event::copy_ms,
                             "Milliseconds the event's copy took once it has completed (CUDA: only for a copy "
                             "issued with timing=True), else -1");

  py::class_<HostArena, std::shared_ptr<HostArena>>(m, "HostArena")
      .def(py::init<int64_t, bool, std::optional<bool>, int>(), py::arg("nbytes"), py::arg("pinned") = true,
           py::arg("cuda") = py::none(), py::arg("device") = -1)
      .def("split_points", &HostArena::split_points, py::arg("offset"), py::arg("nbytes"))
      .def("allocate", &HostArena::allocate, py::arg("nbytes"), py::arg("alignment") = 256,
           py::call_guard<py::gil_scoped_release>())
      .def("pin_range", &HostArena::pin_range, py::arg("offset"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("capacity", &HostArena::capacity)
      .def_property_readonly("used", &HostArena::used)
      .def_property_readonly("pinned", &HostArena::pinned)
      .def_property_readonly("pin_kind", &HostArena::pin_kind)
      .def_property_readonly("pin_error", &HostArena::pin_error,
                             "Why pinning that was asked for failed (the arena is then pageable), else None")
      .def_property_readonly("data_ptr", &HostArena::data_ptr);

  py::class_<PyEngine>(m, "CopyEngine")
      .def(py::init([](const std::string& device, int num_streams, std::optional<int64_t> debug_delay_us) {
             c10::Device d(device);
             PyEngine e;
             if (d.is_cpu()) {
               e.debug_delay_us = debug_delay(debug_delay_us);
               e.impl = make_cpu_engine(num_streams, e.debug_delay_us);
             } else if (d.is_cuda()) {
#ifdef LAYERWISE_WITH_CUDA
               TORCH_CHECK_VALUE(debug_delay_us.value_or(-1) <= 0, "CopyEngine: debug_delay_us is a CPU-backend mode");
               e.impl = make_cuda_engine(d.has_index() ? d.index() : 0, num_streams);
#else
               TORCH_CHECK(false, "CopyEngine('", device,
                           "'): layerwise was built without CUDA; rebuild with LAYERWISE_BUILD=cuda (see README)");
#endif
             } else {
               TORCH_CHECK_VALUE(false, "CopyEngine: unsupported device '", device, "' (use 'cpu' or 'cuda[:N]')");
             }
             register_engine(e.impl);
             e.device = e.impl->is_cuda() ? "cuda:" + std::to_string(e.impl->device_index()) : "cpu";
             return e;
           }),
           py::arg("device"), py::arg("num_streams") = 1, py::arg("debug_delay_us") = py::none())
      .def(
          "copy_async",
          [](PyEngine& self, const at::Tensor& dst, const at::Tensor& src, EventPtr after, bool timing) {
            check_copy_args(*self.impl, dst, src);
            // The storages are marked in flight before their addresses are read:
            // from here on neither can be reallocated under the copy.
            auto keep = std::make_unique<InFlight>(std::vector<c10::Storage>{dst.storage(), src.storage()});
            void* to = dst.data_ptr();
            const void* from = src.data_ptr();
            py::gil_scoped_release r;
            return self.impl->copy_async(to, from, dst.nbytes(), after, std::move(keep), timing);
          },
          py::arg("dst"), py::arg("src"), py::arg("after") = py::none(), py::arg("timing") = false)
      .def(
          "wait", [](PyEngine& self, const EventPtr& ev, uintptr_t stream) { self.impl->wait(ev, stream); },
          py::arg("event"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "record", [](PyEngine& self, uintptr_t stream, bool timing) { return self.impl->record(stream, timing); },
          py::arg("stream") = 0, py::arg("timing") = false)
      .def(
          "synchronize", [](PyEngine& self) { self.impl->synchronize(); }, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("device", [](const PyEngine& self) { return self.device; })
      .def_property_readonly("is_cuda", [](const PyEngine& self) { return self.impl->is_cuda(); })
      .def_property_readonly("num_streams", [](const PyEngine& self) { return self.impl->num_streams(); })
      .def_property_readonly("debug_delay_us", [](const PyEngine& self) { return self.debug_delay_us; });

  m.def("build_info", []() {
    py::dict d;
#ifdef LAYERWISE_WITH_CUDA
    d["with_cuda"] = true;
    int v = cuda_runtime_version_compiled();
    d["cuda_version"] = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
#else
    d["with_cuda"] = false;
    d["cuda_version"] = py::none();
#endif
    return d;
  });
  m.def("shutdown_all", &shutdown_all,
        "Finish every queued copy and stop every copy engine's threads (layerwise._native runs it at exit)");
  void bind_codec(py::module_&); bind_codec(m);  // layerwise._C.codec: csrc/codec.cpp
  m.def("cuda_device_count", []() {
#ifdef LAYERWISE_WITH_CUDA
    try {
      return cuda_device_count_or_throw("a device count");
    } catch (const std::exception&) {
      return 0;
    }
#else
    return 0;
#endif
  });
}
