// Python bindings of layerwise._C. Only layerwise/_native.py imports this module.
#include "layerwise.h"
#include "codec.h"
#include "host_event.h"
#include "reader.h"
#include "sim_bus.h"

#include <torch/extension.h>
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

int64_t debug_delay(std::optional<int64_t> arg, const char* what = "CopyEngine") {
  if (arg && *arg != -1) {  // -1: from the environment, as None
    TORCH_CHECK_VALUE(*arg >= 0 && *arg <= kMaxDebugDelayUs, what, ": debug_delay_us must lie in [0, ",
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

struct PyReader {
  ReaderPtr impl;
};

// layerwise._C.ReadError, a subclass of OSError: OSError(errno, message) where
// the failure has an errno (e.errno set), else OSError(message).
PyObject* g_read_error = nullptr;

std::vector<Extent> to_extents(const std::vector<std::tuple<int64_t, int64_t, int64_t>>& list) {
  std::vector<Extent> out;
  out.reserve(list.size());
  for (const auto& [file_offset, length, dst_offset] : list) out.push_back(Extent{file_offset, length, dst_offset});
  return out;
}

FileExpect to_expect(const std::optional<std::vector<int64_t>>& expect) {
  FileExpect e;
  if (expect) {
    const auto& v = *expect;
    TORCH_CHECK_VALUE(v.size() == 2 || v.size() == 3, "Reader: expect=(size, mtime_ns[, ctime_ns]) as os.stat "
                      "gives them, got ", v.size(), " values");
    e.size = v[0];
    e.mtime_ns = v[1];
    e.ctime_ns = v.size() == 3 ? v[2] : -1;
    TORCH_CHECK_VALUE(e.size >= -1 && e.mtime_ns >= -1 && e.ctime_ns >= -1, "Reader: expect=(size, mtime_ns"
                      "[, ctime_ns]) as os.stat gives them (-1: not checked), got (", e.size, ", ", e.mtime_ns, ", ",
                      e.ctime_ns, ")");
  }
  return e;
}

// ------------------------------------------------------------------ layerwise._C.codec
// The codec core (codec.h) throws std::invalid_argument, which pybind11 turns into ValueError.
void check_codec_bytes(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "layerwise codec ", fn, ": ", name, " is on ", t.device(),
                    "; the C++ codec works on host tensors (decode on a GPU with "
                    "layerwise.triton_kernels.decode.decode_segment)");
  TORCH_CHECK_VALUE(t.scalar_type() == at::kByte, "layerwise codec ", fn, ": ", name, " must be a uint8 tensor, got ",
                    t.scalar_type(), " (view it with .view(torch.uint8))");
  TORCH_CHECK_VALUE(t.is_contiguous(), "layerwise codec ", fn, ": ", name, " must be contiguous");
}

void bind_codec(py::module_& m) {
  auto c = m.def_submodule("codec", "Lossless codec of float segments (format: layerwise/codec/__init__.py)");
  c.attr("LOG2_CHUNK") = codec::kLog2Chunk;
  c.attr("LOG2_SUB") = codec::kLog2Sub;
  c.def(
      "encode",
      [](const at::Tensor& src, const std::string& dtype, int threads, int log2_chunk, int log2_sub,
         bool size_only) -> py::object {
        check_codec_bytes(src, "encode", "src");
        codec::DType d = codec::dtype_from_name(dtype);
        const uint8_t* p = src.data_ptr<uint8_t>();
        size_t n = src.numel();
        std::shared_ptr<codec::Plan> plan;
        {
          py::gil_scoped_release r;
          plan = codec::plan_encode(p, n, d, threads, log2_chunk, log2_sub);
        }
        uint64_t total = codec::plan_header(*plan).encoded_bytes;
        if (size_only) return py::int_(total);
        at::Tensor out = at::empty({static_cast<int64_t>(total)}, src.options());
        {
          py::gil_scoped_release r;
          codec::encode_into(*plan, p, n, out.data_ptr<uint8_t>(), out.numel(), threads);
        }
        return py::cast(out);
      },
      py::arg("src"), py::arg("dtype"), py::arg("threads") = 0, py::arg("log2_chunk") = codec::kLog2Chunk,
      py::arg("log2_sub") = codec::kLog2Sub, py::arg("size_only") = false,
      "Encode the bytes of src (uint8, contiguous, host) holding values of `dtype`: a new uint8 tensor (size_only: "
      "its size in bytes, nothing written)");
  c.def(
      "decode",
      [](const at::Tensor& enc, const at::Tensor& dst, int threads, bool fresh) {
        check_codec_bytes(enc, "decode", "encoded");
        check_codec_bytes(dst, "decode", "dst");
        const uint8_t* e = enc.data_ptr<uint8_t>();
        uint8_t* d = dst.data_ptr<uint8_t>();
        size_t en = enc.numel(), dn = dst.numel();
        TORCH_CHECK_VALUE(dn == 0 || en == 0 || d + dn <= e || e + en <= d,
                          "layerwise codec decode: dst overlaps the encoded bytes");
        py::gil_scoped_release r;
        codec::decode_into(e, en, d, dn, threads, fresh);
      },
      py::arg("encoded"), py::arg("dst"), py::arg("threads") = 0, py::arg("fresh") = false,
      "Decode `encoded` into dst (uint8, contiguous, host, exactly the decoded size); fresh: dst was just "
      "allocated, untouched (its pages are backed by the decoding threads, huge pages while they come fast)");
  c.def("simd_supported", &codec::avx512::supported,
        "Whether this CPU (and build) has the AVX-512 decode of coded fields (AVX-512F/BW/VL/VBMI2, BMI2)");
  c.def("simd_enabled", &codec::avx512::enabled, "Whether decode uses the AVX-512 path (LAYERWISE_CODEC_SIMD=0: off)");
  c.def("simd_calls", &codec::avx512::calls, "Calls of the AVX-512 lanes so far in this process (groups of 16-64 "
        "sub-blocks): which path decoded");
  c.def("set_simd", &codec::avx512::set_enabled, py::arg("on"),
        "Turn the AVX-512 decode on or off for the process; returns the previous state (on where it is not "
        "supported raises ValueError). Both paths decode the same bytes bitwise (tests/codec/test_codec_v2.py).");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "layerwise native core: host arena and copy engine";

  py::class_<Event, EventPtr>(m, "Event")
      .def("query", &Event::query, "True once the event has completed")
      // A stage's result is an event or a deferred one (layerwise/stages/result.py): both answer
      // resolve() with the event to wait on, so the manager treats every result alike.
      .def("resolve", [](py::object self) { return self; }, "The event itself (a stage result, resolved)")
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Block the calling thread until the event has completed")
      .def("elapsed_ms", [](Event& self, Event& end) {
        py::gil_scoped_release r;
        return self.elapsed_ms(end);
      })
      .def_property_readonly("copy_ms", &Event::copy_ms,
                             "Milliseconds from the event's start (`start`) to the event once both have completed "
                             "(a copy issued with timing=True: the copy's time), else -1")
      .def_property(
          "start", [](Event& self) { return self.start; },
          [](Event& self, EventPtr s) { self.set_start(std::move(s)); },
          "The event that marks when this event's timed work began (a copy or decode issued with timing=True "
          "gets one), or None. A fetch that ends in another stage (a decode, a gather) is given its first "
          "copy's start, so that copy_ms spans the whole fetch.")
      // A host event completed by Python (split fetch: a gather thread completes it once the
      // ranks' shares are in the slot), so that the CPU engine's waits and copies chain on it.
      .def("set", [](Event& self) {
        auto* e = dynamic_cast<CpuEvent*>(&self);
        TORCH_CHECK_TYPE(e != nullptr, "Event.set: only a host event (layerwise._C.host_event()) can be set");
        TORCH_CHECK(!e->completed(), "Event.set: the event has completed already");
        e->set();
      })
      .def("fail", [](Event& self, const std::string& what) {
        auto* e = dynamic_cast<CpuEvent*>(&self);
        TORCH_CHECK_TYPE(e != nullptr, "Event.fail: only a host event (layerwise._C.host_event()) can fail");
        TORCH_CHECK(!e->completed(), "Event.fail: the event has completed already");
        e->fail(what, 0);
      }, py::arg("what"));
  m.def("host_event", []() -> EventPtr { return std::make_shared<CpuEvent>(); },
        "A host event that completes when Python calls its set() (or fail(what): waiting on it then raises "
        "ReadError with `what`); CPU copy engines wait on it and chain copies after it");

  g_read_error = PyErr_NewExceptionWithDoc(
      "layerwise._C.ReadError",
      "A read of the disk tier failed: an I/O error, a short read (the file was truncated), a file changed since "
      "it was recorded, or a copy that waited on such a read. Raised by Event.synchronize()/query(); the message "
      "names the file, the offset and the errno text.",
      PyExc_OSError, nullptr);
  m.attr("ReadError") = py::handle(g_read_error);  // the module keeps a reference; g_read_error's own is never dropped
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ReadError& e) {
      py::object args = e.err > 0 ? py::object(py::make_tuple(e.err, e.what())) : py::object(py::make_tuple(e.what()));
      PyErr_SetObject(g_read_error, args.ptr());
    }
  });

  py::class_<HostArena, std::shared_ptr<HostArena>>(m, "HostArena")
      .def(py::init<int64_t, bool, std::optional<bool>, int>(), py::arg("nbytes"), py::arg("pinned") = true,
           py::arg("cuda") = py::none(), py::arg("device") = -1)
      .def_static("over_fd", &HostArena::over_fd, py::arg("fd"), py::arg("offset"), py::arg("nbytes"),
                  py::arg("writable"), py::arg("pinned") = true, py::arg("cuda") = py::none(), py::arg("device") = -1,
                  "An arena over [offset, offset + nbytes) of the open file `fd` (a memfd shared between processes), "
                  "mapped MAP_SHARED, read-only unless `writable`; `offset` must be page aligned. The mapping keeps "
                  "the file alive; the fd stays the caller's to close. Pinned like HostArena(...), as its bytes are "
                  "handed out by allocate() or view()")
      .def("split_points", &HostArena::split_points, py::arg("offset"), py::arg("nbytes"))
      .def("allocate", &HostArena::allocate, py::arg("nbytes"), py::arg("alignment") = 256,
           py::call_guard<py::gil_scoped_release>())
      .def("pin_range", &HostArena::pin_range, py::arg("offset"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>())
      .def("view", &HostArena::view, py::arg("offset"), py::arg("nbytes"), py::arg("alignment") = 256,
           py::call_guard<py::gil_scoped_release>(),
           "A uint8 tensor of the arena's bytes [offset, offset + nbytes), pinned as allocate() pins and keeping "
           "the mapping alive like its tensors (how a process that did not pack a shared arena reaches its blocks). "
           "`used` becomes at least offset + nbytes")
      .def("protect", &HostArena::protect,
           "Make the whole mapping read-only: a later write through any tensor of the arena faults with "
           "SIGSEGV, and allocate() raises. Pins stay")
      .def_property_readonly("writable", &HostArena::writable,
                             "False once protect()ed or where the arena was mapped read-only")
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
                           "'): layerwise was built without CUDA; rebuild with LAYERWISE_BUILD=cuda (see docs/api.md, \"Build and kernels\")");
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
          "decode_async",
          [](PyEngine& self, const at::Tensor& dst, const at::Tensor& enc,
             const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>& pieces, EventPtr after,
             EventPtr after2, bool timing) {
            TORCH_CHECK_VALUE(!self.impl->is_cuda(), "decode_async: the CPU backend's decoder; on CUDA launch the "
                              "Triton decoder on decode_stream_handle() (layerwise/stages/decode.py)");
            for (const at::Tensor* t : {&dst, &enc}) {
              const char* name = t == &dst ? "dst" : "encoded";
              TORCH_CHECK_VALUE(t->is_cpu() && t->has_storage() && t->is_contiguous() &&
                                t->scalar_type() == at::kByte, "decode_async: ", name,
                                " must be a contiguous uint8 host tensor with storage, got ", describe(*t));
            }
            const auto dn = static_cast<uint64_t>(dst.numel()), en = static_cast<uint64_t>(enc.numel());
            std::vector<DecodePiece> list;
            for (const auto& [eo, el, doff, dl] : pieces) {
              TORCH_CHECK_VALUE(eo >= 0 && el >= 0 && doff >= 0 && dl >= 0 && static_cast<uint64_t>(eo + el) <= en &&
                                static_cast<uint64_t>(doff + dl) <= dn, "decode_async: piece (", eo, ", ", el, ", ",
                                doff, ", ", dl, ") lies outside encoded (", en, " bytes) or dst (", dn, " bytes)");
              list.push_back(DecodePiece{size_t(eo), size_t(el), size_t(doff), size_t(dl)});
            }
            auto keep = std::make_unique<InFlight>(std::vector<c10::Storage>{dst.storage(), enc.storage()});
            auto* to = static_cast<uint8_t*>(dst.data_ptr());
            const auto* from = static_cast<const uint8_t*>(enc.data_ptr());
            TORCH_CHECK_VALUE(dn == 0 || en == 0 || to + dn <= from || from + en <= to,
                              "decode_async: dst overlaps the encoded bytes");
            py::gil_scoped_release r;
            return self.impl->decode_async(to, from, std::move(list), after, after2, std::move(keep), timing);
          },
          py::arg("dst"), py::arg("encoded"), py::arg("pieces"), py::arg("after") = py::none(),
          py::arg("after2") = py::none(), py::arg("timing") = false,
          "Queue a decode of codec segments: piece (enc_off, enc_n, dst_off, dst_n) of `encoded` into `dst`, "
          "after `after` and `after2`, on the engine's decode lane (a worker of its own, beside the copy "
          "workers); returns its Event (CPU backend)")
      .def(
          "stream_handle", [](PyEngine& self, int k) { return self.impl->stream_handle(k); }, py::arg("k") = 0,
          "The raw handle of copy stream k (cudaStream_t; 0 on CPU): torch.cuda.ExternalStream wraps it")
      .def(
          "decode_stream_handle", [](PyEngine& self) { return self.impl->decode_stream_handle(); },
          "The raw handle of the decode stream (cudaStream_t, none of the copy streams; 0 on CPU, where decodes "
          "run on a worker of their own)")
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

  py::class_<PyReader>(m, "Reader", "Reader threads of the disk tier: file extents -> a host (staging) buffer")
      .def(py::init([](int num_threads, bool direct, std::optional<int64_t> debug_delay_us, bool refuse_direct,
                       int64_t chunk_bytes) {
             PyReader r;
             r.impl = make_reader(num_threads, direct, debug_delay(debug_delay_us, "Reader"), refuse_direct,
                                  chunk_bytes);
             register_engine(r.impl);
             return r;
           }),
           py::arg("num_threads") = 2, py::arg("direct") = true, py::arg("debug_delay_us") = py::none(),
           py::arg("_refuse_direct") = false, py::arg("chunk_bytes") = kDefaultChunkBytes)
      .def(
          "read_async",
          [](PyReader& self, py::object file, const std::vector<std::tuple<int64_t, int64_t, int64_t>>& extents,
             const at::Tensor& dst, EventPtr after, std::optional<std::vector<int64_t>> expect) {
            std::string path;
            int fd = -1;
            if (py::isinstance<py::int_>(file) && !py::isinstance<py::bool_>(file)) {
              fd = file.cast<int>();
              TORCH_CHECK_VALUE(fd >= 0, "Reader.read_async: a file descriptor must be >= 0, got ", fd);
            } else {
              py::object p = py::module_::import("os").attr("fsdecode")(file);  // str, bytes or os.PathLike
              path = p.cast<std::string>();
            }
            TORCH_CHECK_VALUE(dst.is_cpu() && dst.has_storage(), "Reader.read_async: dst must be a host tensor "
                              "with storage of its own (a pinned staging buffer), got ", describe(dst));
            TORCH_CHECK_VALUE(dst.is_contiguous() && dst.scalar_type() == at::kByte, "Reader.read_async: dst must "
                              "be a contiguous uint8 tensor (use .view(torch.uint8)), got ", describe(dst));
            std::vector<Extent> ext = to_extents(extents);
            FileExpect exp = to_expect(expect);
            self.impl->drop_retired();  // with the GIL: may free storages
            // Marked in flight before its address is read: from here on dst cannot move under the read.
            auto keep = std::make_unique<InFlight>(std::vector<c10::Storage>{dst.storage()});
            auto* to = static_cast<uint8_t*>(dst.data_ptr());
            const size_t n = dst.nbytes();
            py::gil_scoped_release r;
            return self.impl->read_async(path, fd, std::move(ext), to, n, after, std::move(keep), exp);
          },
          py::arg("file"), py::arg("extents"), py::arg("dst"), py::arg("after") = py::none(),
          py::arg("expect") = py::none(),
          "Queue a read of `extents` [(file_offset, length, dst_offset), ...] of `file` (a path, or an open file "
          "descriptor, duplicated here) into the uint8 host tensor `dst`, after `after`; returns its Event. "
          "`expect`=(st_size, st_mtime_ns[, st_ctime_ns]): the read fails if the file differs (or was deleted) when "
          "it is read.")
      .def(
          "check_file",
          [](PyReader& self, int fd, int64_t size, int64_t mtime_ns, int64_t ctime_ns) {
            self.impl->check_file(fd, to_expect(std::vector<int64_t>{size, mtime_ns, ctime_ns}));
          },
          py::arg("fd"), py::arg("size"), py::arg("mtime_ns"), py::arg("ctime_ns") = -1,
          "Raise ReadError unless fstat(fd) shows this size, mtime and ctime (-1: not checked) and the file still has "
          "a name")
      .def(
          "forget", [](PyReader& self, int fd) { self.impl->forget(fd); }, py::arg("fd"),
          "Close the reader's cached O_DIRECT descriptor of fd's file (when that file is closed for good)")
      .def("synchronize",
           [](PyReader& self) {
             {
               py::gil_scoped_release r;
               self.impl->synchronize();
             }
             self.impl->drop_retired();
           },
           "Block until every read issued so far has completed (failed ones raise on their own events)")
      .def("shutdown", [](PyReader& self) { self.impl->shutdown(); },
           "Stop the reader threads (reads not started yet fail with 'cancelled'); later reads raise")
      .def("stats", [](PyReader& self) { return self.impl->stats(); },
           "Counters: reads, failed, runs_direct / runs_buffered (vectored reads of contiguous runs), bytes_direct, "
           "bytes_buffered, bytes_padding, syscalls, direct_refused, direct_fallbacks, ...")
      .def_property_readonly("num_threads", [](const PyReader& self) { return self.impl->num_threads(); })
      .def_property_readonly("direct", [](const PyReader& self) { return self.impl->direct(); })
      .def_property_readonly("debug_delay_us", [](const PyReader& self) { return self.impl->debug_delay_us(); })
      .def_property_readonly("chunk_bytes", [](const PyReader& self) { return self.impl->chunk_bytes(); })
      .def_property_readonly_static("alignment", [](py::object) { return kDirectAlign; },
                                    "O_DIRECT alignment of buffer, file offset and length (bytes)");

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
  m.def("sim_bus", []() {
    const SimBusConfig c = sim_bus_config();
    py::dict d;
    d["gbps"] = c.gbps;
    d["pageable_gbps"] = c.pageable_gbps;
    d["latency_us"] = c.latency_us;
    return d;
  }, "The CPU backend's simulated bus as the last CPU copy engine created read it (gbps 0: none; sim_bus.h)");
  m.def("shutdown_all", &shutdown_all,
        "Finish every queued copy, stop every copy engine's and disk reader's threads (layerwise._native runs it "
        "at exit)");
  bind_codec(m);  // layerwise._C.codec
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
