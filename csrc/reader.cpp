// The disk tier's reader threads (see reader.h for what a read does).
//
// Like the CPU copy engine, a reader thread never drops a reference that could
// be the last one to an event (it would free dst's storage off a Python
// thread): finished jobs' events are handed back ("retired") and dropped on a
// thread that holds the GIL. dst's storage is held by the job's event from the
// moment read_async() is called, so a caller interrupted right after it (Ctrl-C)
// cannot free the memory a read is writing into.
#include "reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <deque>
#include <random>
#include <sstream>
#include <thread>

#include "host_event.h"

namespace layerwise {
namespace {

constexpr long kTmpfsMagic = 0x01021994;
constexpr long kRamfsMagic = 0x858458f6;
constexpr size_t kMaxCachedFiles = 64;
constexpr int kMaxIov = IOV_MAX;

std::string errno_text(int e) {
  char buf[256];
  const char* s = strerror_r(e, buf, sizeof buf);  // the GNU variant: returns the text
  return std::string(s) + " (errno " + std::to_string(e) + ")";
}

// The file an open descriptor names ("/path", "/path (deleted)"), for messages.
std::string fd_path(int fd) {
  char buf[4096];
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = readlink(link.c_str(), buf, sizeof buf - 1);
  if (n <= 0) return "fd " + std::to_string(fd);
  return std::string(buf, static_cast<size_t>(n));
}

int64_t mtime_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

int64_t ctime_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
}

struct UniqueFd {
  int fd = -1;
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() {
    if (fd >= 0) ::close(fd);
  }
};
using SharedFd = std::shared_ptr<UniqueFd>;

// "" when `st` matches `expect`, else why not.
std::string expect_mismatch(const struct stat& st, const FileExpect& expect, const std::string& what,
                            const char* when) {
  if (!expect.any()) return "";
  const bool size_bad = expect.size >= 0 && st.st_size != expect.size;
  const bool mtime_bad = expect.mtime_ns >= 0 && mtime_ns(st) != expect.mtime_ns;
  const bool ctime_bad = expect.ctime_ns >= 0 && ctime_ns(st) != expect.ctime_ns;
  const bool deleted = st.st_nlink == 0;
  if (!size_bad && !mtime_bad && !ctime_bad && !deleted) return "";
  std::ostringstream s;
  s << "layerwise.Reader: " << what << " changed " << when << ": ";
  if (deleted) s << "it was deleted (no name links to it any more); ";
  s << "size " << st.st_size << " bytes (recorded " << expect.size << "), mtime_ns " << mtime_ns(st) << " (recorded "
    << expect.mtime_ns << ")";
  if (ctime_bad) s << ", ctime_ns " << ctime_ns(st) << " (recorded " << expect.ctime_ns << "): written since";
  s << ". Its bytes are not the ones that were recorded: restore the file, or reopen it and record its size and "
    << "mtime again";
  return s.str();
}

struct Failure {
  std::string what;
  int err = 0;
  bool cancelled = false;
  bool failed() const { return !what.empty(); }
};

// One read_async(): what its pieces share. Its event completes when the last piece is done.
struct Read {
  std::string path;  // the file to open (fd < 0), else ""
  int fd = -1;       // a duplicate of the caller's descriptor, closed when the last piece is done
  std::vector<std::pair<uint64_t, uint64_t>> wanted;  // [lo, hi) in dst of every extent, sorted
  uint8_t* dst = nullptr;
  size_t dst_bytes = 0;
  EventPtr after;
  std::shared_ptr<CpuEvent> done;
  FileExpect expect;
  std::atomic<int> left{0};  // pieces not done yet
  std::mutex m;              // guards failure and started
  Failure failure;           // the first piece's failure
  bool started = false;
};

// A piece of a read, run by one reader thread: some of its runs, or a part of one long run.
struct Job {
  std::shared_ptr<Read> read;
  std::vector<Extent> extents;  // sorted by file offset, none empty
};

class ReaderImpl : public Reader {
 public:
  ReaderImpl(int num_threads, bool direct, int64_t delay_us, bool refuse_direct, int64_t chunk_bytes)
      : direct_(direct), refuse_direct_(refuse_direct), delay_us_(delay_us), chunk_bytes_(chunk_bytes) {
    TORCH_CHECK_VALUE(num_threads >= 1 && num_threads <= 64, "Reader: num_threads must lie in [1, 64], got ",
                      num_threads);
    TORCH_CHECK_VALUE(chunk_bytes == 0 || (chunk_bytes >= kDirectAlign && chunk_bytes % kDirectAlign == 0),
                      "Reader: chunk_bytes must be 0 (never split a read) or a multiple of ", kDirectAlign,
                      " bytes, got ", chunk_bytes);
    for (int i = 0; i < num_threads; ++i) threads_.push_back(std::make_unique<std::thread>([this] { loop(); }));
  }

  ~ReaderImpl() override {
    if (origin_.forked()) {
      // The threads stayed in the parent: joining them here would wait forever,
      // and destroying a joinable std::thread calls std::terminate. Leak them.
      for (auto& t : threads_) (void)t.release();
      (void)q_.release();
      return;
    }
    shutdown();
  }

  EventPtr read_async(const std::string& path, int fd, std::vector<Extent> extents, uint8_t* dst, size_t dst_bytes,
                      const EventPtr& after, std::unique_ptr<InFlight> keep, FileExpect expect) override {
    check_usable();
    auto read = std::make_shared<Read>();
    read->dst = dst;
    read->dst_bytes = dst_bytes;
    read->expect = expect;
    prepare_extents(extents, dst_bytes, *read);
    std::vector<std::vector<Extent>> pieces = split(std::move(extents), chunk_bytes_);
    if (after) {
      auto* a = dynamic_cast<CpuEvent*>(after.get());
      if (a && !a->completed() && a->origin.forked()) a->origin.throw_forked("the event `after` names");
      read->after = after;
    }
    if (fd >= 0) {
      // Our own descriptor of the same open file: the caller may close theirs
      // (or reuse its number) while the read is queued.
      read->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (read->fd < 0) {
        const int e = errno;
        TORCH_CHECK_VALUE(e != EBADF, "Reader.read_async: ", fd, " is not an open file descriptor");
        TORCH_CHECK(false, "Reader.read_async: duplicating fd ", fd, " failed: ", errno_text(e));
      }
    } else {
      TORCH_CHECK_VALUE(!path.empty(), "Reader.read_async: the file is an empty path");
      read->path = path;
    }
    auto done = std::make_shared<CpuEvent>();
    done->keepalive = std::move(keep);
    read->done = done;
    read->left = static_cast<int>(pieces.size());
    {
      std::lock_guard<std::mutex> l(m_);
      if (stop_) {
        if (read->fd >= 0) ::close(read->fd);
        throw_reader_shut_down();
      }
      for (auto& piece : pieces) queue_.push_back(Job{read, std::move(piece)});
      n_pieces_ += static_cast<int64_t>(pieces.size());
    }
    if (pieces.size() > 1)
      cv_.notify_all();
    else
      cv_.notify_one();
    track(done);
    return done;
  }

  void check_file(int fd, FileExpect expect) override {
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int e = errno;
      throw ReadError("layerwise.Reader.check_file: fstat of fd " + std::to_string(fd) + " failed: " + errno_text(e),
                      e);
    }
    std::string bad = expect_mismatch(st, expect, "'" + fd_path(fd) + "'", "since it was recorded");
    if (!bad.empty()) throw ReadError(bad, 0);
  }

  void forget(int fd) override {
    struct stat st;
    if (origin_.forked() || fstat(fd, &st) != 0) return;
    SharedFd gone;  // closed outside the lock
    std::lock_guard<std::mutex> l(files_mu_);
    auto it = cache_.find({st.st_dev, st.st_ino});
    if (it != cache_.end()) {
      gone = std::move(it->second.fd);
      cache_.erase(it);
    }
  }

  void synchronize() override {
    if (origin_.forked()) return;  // nothing of this reader runs in a forked child
    std::vector<std::shared_ptr<CpuEvent>> pending;
    {
      std::lock_guard<std::mutex> l(issued_mu_);
      for (auto& w : issued_)
        if (auto e = w.lock())
          if (!e->completed()) pending.push_back(std::move(e));
    }
    for (auto& e : pending) {
      try {
        e->synchronize();
      } catch (const ReadError&) {
        // the event carries it
      }
    }
    // `pending` may hold the last references: dropped by the caller, which holds the GIL
    std::lock_guard<std::mutex> l(retired_.m);
    for (auto& e : pending) retired_.events.push_back(std::move(e));
  }

  void drop_retired() override {
    if (!origin_.forked()) retired_.drop();
  }

  void shutdown() override {
    if (origin_.forked() || shut_down_.exchange(true)) return;
    std::deque<Job> cancelled;
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
      cancelled.swap(queue_);
    }
    cv_.notify_all();
    stop_cv_.notify_all();
    for (auto& job : cancelled)
      piece_done(job, Failure{"layerwise.Reader: read cancelled: the reader was shut down (at interpreter exit, or "
                              "the Reader was destroyed) before this read started",
                              0, true});
    for (auto& t : threads_)
      if (t->joinable()) t->join();
    {
      std::lock_guard<std::mutex> l(files_mu_);
      cache_.clear();
    }
    retired_.drop();
  }

  std::map<std::string, int64_t> stats() const override {
    // In a forked child a reader thread of the parent may have held the lock at fork(): not taken there.
    std::unique_lock<std::mutex> l(files_mu_, std::defer_lock);
    if (!origin_.forked()) l.lock();
    return {
        {"reads", n_reads_.load()},
        {"failed", n_failed_.load()},
        {"cancelled", n_cancelled_.load()},
        {"runs_direct", n_runs_direct_.load()},
        {"runs_buffered", n_runs_buffered_.load()},
        {"runs_unaligned", n_runs_unaligned_.load()},
        {"bytes_direct", n_bytes_direct_.load()},
        {"bytes_buffered", n_bytes_buffered_.load()},
        {"bytes_padding", n_bytes_padding_.load()},
        {"syscalls", n_syscalls_.load()},
        {"direct_refused", n_direct_refused_.load()},
        {"direct_fallbacks", n_direct_fallbacks_.load()},
        {"memory_fs_reads", n_memory_fs_.load()},
        {"pieces", n_pieces_.load()},                  // pieces the reads were done in (see split)
        {"max_in_flight", n_max_in_flight_.load()},    // the most pieces read at the same time, so far
        {"cached_files", origin_.forked() ? 0 : static_cast<int64_t>(cache_.size())},
    };
  }

  int num_threads() const override { return static_cast<int>(threads_.size()); }
  bool direct() const override { return direct_; }
  int64_t debug_delay_us() const override { return delay_us_; }
  int64_t chunk_bytes() const override { return chunk_bytes_; }

 private:
  [[noreturn]] static void throw_reader_shut_down() {
    TORCH_CHECK(false, "layerwise: this disk Reader was shut down (at interpreter exit: layerwise._C.shutdown_all, "
                       "an atexit hook) and reads nothing any more");
  }

  void check_usable() const {
    if (origin_.forked()) origin_.throw_forked("this disk Reader");
    if (shut_down_.load()) throw_reader_shut_down();
  }

  // Checks the extents against dst (raising ValueError on the caller's thread),
  // drops empty ones, sorts them by file offset.
  static void prepare_extents(std::vector<Extent>& extents, size_t dst_bytes, Read& job) {
    for (size_t k = 0; k < extents.size(); ++k) {
      const Extent& e = extents[k];
      TORCH_CHECK_VALUE(e.file_offset >= 0 && e.length >= 0 && e.dst_offset >= 0, "Reader.read_async: extent ", k,
                        " (file_offset ", e.file_offset, ", length ", e.length, ", dst_offset ", e.dst_offset,
                        ") has a negative field");
      TORCH_CHECK_VALUE(e.file_offset <= INT64_MAX - e.length, "Reader.read_async: extent ", k,
                        " ends past the largest file offset");
      TORCH_CHECK_VALUE(static_cast<uint64_t>(e.length) <= dst_bytes &&
                            static_cast<uint64_t>(e.dst_offset) <= dst_bytes - static_cast<uint64_t>(e.length),
                        "Reader.read_async: extent ", k, " (file_offset ", e.file_offset, ", length ", e.length,
                        ", dst_offset ", e.dst_offset, ") ends past the end of dst (", dst_bytes, " bytes)");
    }
    std::erase_if(extents, [](const Extent& e) { return e.length == 0; });
    job.wanted.reserve(extents.size());
    for (const Extent& e : extents)
      job.wanted.emplace_back(static_cast<uint64_t>(e.dst_offset), static_cast<uint64_t>(e.dst_offset + e.length));
    std::sort(job.wanted.begin(), job.wanted.end());
    for (size_t k = 1; k < job.wanted.size(); ++k)
      TORCH_CHECK_VALUE(job.wanted[k].first >= job.wanted[k - 1].second, "Reader.read_async: two extents overlap in "
                        "dst: bytes [", job.wanted[k - 1].first, ", ", job.wanted[k - 1].second, ") and [",
                        job.wanted[k].first, ", ", job.wanted[k].second, ")");
    std::stable_sort(extents.begin(), extents.end(),
                     [](const Extent& a, const Extent& b) { return a.file_offset < b.file_offset; });
  }

  // The pieces a read is done in, each by one reader thread, so that one layer keeps
  // several requests in flight (a drive serves one request at a time below its
  // speed: see reader.h). A run (extents contiguous in the file) longer than `chunk`
  // is cut into about equal parts at file offsets that are multiples of 4096 (so
  // that each part stays an O_DIRECT read straight into place: dst is congruent
  // with the file there); runs shorter than that are grouped, in file order, into
  // pieces of up to `chunk` bytes. chunk 0: one piece.
  static std::vector<std::vector<Extent>> split(std::vector<Extent> extents, int64_t chunk) {
    std::vector<std::vector<Extent>> pieces;
    if (chunk <= 0 || extents.empty()) {
      pieces.push_back(std::move(extents));
      return pieces;
    }
    int64_t piece_bytes = 0;
    size_t k = 0;
    while (k < extents.size()) {
      size_t end = k + 1;
      while (end < extents.size() &&
             extents[end].file_offset == extents[end - 1].file_offset + extents[end - 1].length)
        ++end;
      const int64_t off = extents[k].file_offset;
      const int64_t back = extents[end - 1].file_offset + extents[end - 1].length;
      const int64_t len = back - off;
      std::vector<int64_t> cuts;  // file offsets strictly inside (off, back)
      if (len > chunk) {
        const int64_t n = (len + chunk - 1) / chunk;
        for (int64_t i = 1; i < n; ++i) {
          const int64_t c = (off + len * i / n) / kDirectAlign * kDirectAlign;
          if (c > off && c < back && (cuts.empty() || c > cuts.back())) cuts.push_back(c);
        }
      }
      if (cuts.empty()) {  // one segment: grouped with its neighbours up to `chunk`
        if (pieces.empty() || piece_bytes + len > chunk) {
          pieces.emplace_back();
          piece_bytes = 0;
        }
        pieces.back().insert(pieces.back().end(), extents.begin() + k, extents.begin() + end);
        piece_bytes += len;
      } else {  // a long run: each part a piece of its own
        size_t c = 0;
        pieces.emplace_back();
        for (size_t j = k; j < end; ++j) {
          Extent e = extents[j];
          while (c < cuts.size() && cuts[c] < e.file_offset + e.length) {
            if (cuts[c] > e.file_offset) {
              const int64_t head = cuts[c] - e.file_offset;
              pieces.back().push_back({e.file_offset, head, e.dst_offset});
              e = {cuts[c], e.length - head, e.dst_offset + head};
            }
            pieces.emplace_back();
            ++c;
          }
          pieces.back().push_back(e);
        }
        piece_bytes = chunk;  // nothing is grouped with a part of a long run
      }
      k = end;
    }
    return pieces;
  }

  void track(const std::shared_ptr<CpuEvent>& ev) {
    std::lock_guard<std::mutex> l(issued_mu_);
    if (issued_.size() >= prune_at_) {
      std::erase_if(issued_, [](const std::weak_ptr<CpuEvent>& w) {
        auto e = w.lock();
        return !e || e->completed();
      });
      prune_at_ = std::max<size_t>(64, 2 * issued_.size());
    }
    issued_.push_back(ev);
  }

  void loop() {
    std::mt19937_64 rng(std::random_device{}());
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> l(m_);
        cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped (shutdown() takes what is left of the queue)
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      // An exception must not end the thread (std::terminate): the event completes regardless.
      Read& read = *job.read;
      Failure f;
      {
        std::lock_guard<std::mutex> l(read.m);
        if (read.failure.failed()) f = {"(another piece of this read failed)", 0};  // not reported: that one is
      }
      try {
        if (!f.failed() && read.after) read.after->host_wait();  // a CUDA event: polled, not spun on
      } catch (const ReadError& e) {
        f = {std::string("layerwise.Reader: read not done: the event it waited on failed: ") + e.what(), e.err};
      } catch (const std::exception& e) {
        f = {std::string("layerwise.Reader: read not done: waiting on its `after` event failed: ") + e.what(), 0};
      } catch (...) {
        f = {"layerwise.Reader: read not done: waiting on its `after` event failed", 0};
      }
      bool stopping = false;
      {
        std::unique_lock<std::mutex> l(m_);
        if (!f.failed() && delay_us_ > 0) {
          std::uniform_int_distribution<int64_t> d(0, delay_us_);
          stop_cv_.wait_for(l, std::chrono::microseconds(d(rng)), [&] { return stop_; });
        }
        stopping = stop_;
      }
      if (!f.failed() && stopping) {
        f = {"layerwise.Reader: read cancelled: the reader was shut down (at interpreter exit, or the Reader was "
             "destroyed) before this read started",
             0, true};
      }
      {
        std::lock_guard<std::mutex> l(read.m);
        if (!read.started) read.done->started = HostClock::now();  // the read's first piece
        read.started = true;
      }
      if (!f.failed()) {
        const int64_t now = ++n_in_flight_;
        for (int64_t seen = n_max_in_flight_.load(); now > seen && !n_max_in_flight_.compare_exchange_weak(seen, now);) {
        }
        struct Leave {
          std::atomic<int64_t>& n;
          ~Leave() { --n; }
        } leave{n_in_flight_};
        try {
          run(job, f);
        } catch (const std::exception& e) {
          f = {std::string("layerwise.Reader: ") + e.what(), 0};
        } catch (...) {
          f = {"layerwise.Reader: the read failed", 0};
        }
      }
      piece_done(job, std::move(f));
    }
  }

  // A piece is over; the last one completes the read's event (with the first failure, if any).
  void piece_done(Job& job, Failure f) {
    std::shared_ptr<Read> read = std::move(job.read);
    {
      std::lock_guard<std::mutex> l(read->m);
      if (f.failed() && !read->failure.failed()) read->failure = std::move(f);
    }
    if (--read->left == 0) finish(*read);
  }

  void finish(Read& job) {
    if (job.fd >= 0) {
      ::close(job.fd);
      job.fd = -1;
    }
    if (job.done->keepalive) job.done->keepalive->release();  // dst resizable again once the read is over
    n_reads_++;
    Failure f = std::move(job.failure);
    if (f.failed()) {
      n_failed_++;
      if (f.cancelled) n_cancelled_++;
      job.done->fail(std::move(f.what), f.err);
    } else {
      job.done->set();
    }
    retired_.add(std::move(job.after), std::move(job.done));
  }

  // ------------------------------------------------------------- one job
  void run(const Job& piece, Failure& f) {
    const Read& job = *piece.read;
    UniqueFd opened;
    int fd = job.fd;
    if (fd < 0) {
      fd = ::open(job.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        const int e = errno;
        f = {"layerwise.Reader: cannot open '" + job.path + "': " + errno_text(e), e};
        return;
      }
      opened.fd = fd;
    }
    auto name = [&] { return "'" + (job.path.empty() ? fd_path(fd) : job.path) + "'"; };
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int e = errno;
      f = {"layerwise.Reader: fstat of " + name() + " failed: " + errno_text(e), e};
      return;
    }
    if (std::string bad = expect_mismatch(st, job.expect, name(), "since it was recorded"); !bad.empty()) {
      f = {bad, 0};
      return;
    }
    // The caller's descriptor may itself be O_DIRECT: buffered reads need a plain one.
    UniqueFd plain_reopened;
    int plain = fd;
    const int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_DIRECT)) {
      plain_reopened.fd = ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_CLOEXEC);
      if (plain_reopened.fd >= 0) plain = plain_reopened.fd;
    }
    SharedFd direct = direct_fd(fd, st, /*cacheable=*/job.path.empty(), flags);

    const std::vector<Extent>& extents = piece.extents;
    size_t k = 0;
    while (k < extents.size()) {
      size_t end = k + 1;
      while (end < extents.size() && extents[end].file_offset == extents[end - 1].file_offset + extents[end - 1].length)
        ++end;
      if (!read_run(job, extents, k, end, plain, direct ? direct->fd : -1, name, f)) return;
      k = end;
    }
    if (job.expect.any()) {
      if (fstat(fd, &st) != 0) {
        const int e = errno;
        f = {"layerwise.Reader: fstat of " + name() + " failed: " + errno_text(e), e};
        return;
      }
      if (std::string bad = expect_mismatch(st, job.expect, name(), "while it was being read"); !bad.empty())
        f = {bad, 0};
    }
  }

  // An O_DIRECT descriptor of fd's file, or none (direct reads off, a memory
  // file system, O_DIRECT refused, no /proc). Descriptors of files the caller
  // opened are cached by (device, inode): a live inode's number is not reused
  // while the cached descriptor holds it.
  SharedFd direct_fd(int fd, const struct stat& st, bool cacheable, int flags) {
    // Regular files (and block devices) only: O_DIRECT on anything else says nothing about the file system.
    if (!direct_ || !(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode))) return nullptr;
    const std::pair<dev_t, ino_t> key{st.st_dev, st.st_ino};
    {
      std::lock_guard<std::mutex> l(files_mu_);
      if (no_direct_.count(st.st_dev)) {
        if (no_direct_[st.st_dev] == kMemoryFs) n_memory_fs_++;
        return nullptr;
      }
      if (cacheable) {
        auto it = cache_.find(key);
        if (it != cache_.end()) {
          it->second.used = ++tick_;
          return it->second.fd;
        }
      }
    }
    struct statfs sfs;
    if (fstatfs(fd, &sfs) == 0 && (static_cast<long>(sfs.f_type) == kTmpfsMagic ||
                                   static_cast<long>(sfs.f_type) == kRamfsMagic)) {
      // The page cache is where a memory file system keeps the file: O_DIRECT
      // skips nothing there (and kernels before 6.6 refuse it on tmpfs).
      std::lock_guard<std::mutex> l(files_mu_);
      no_direct_[st.st_dev] = kMemoryFs;
      n_memory_fs_++;
      return nullptr;
    }
    SharedFd dfd;
    if (flags >= 0 && (flags & O_DIRECT)) {
      // Already O_DIRECT: a duplicate will do.
      dfd = std::make_shared<UniqueFd>(fcntl(fd, F_DUPFD_CLOEXEC, 0));
      if (dfd->fd < 0) return nullptr;
    } else {
      int d = -1;
      int e = EINVAL;
      if (!refuse_direct_) {
        d = ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
        e = errno;
      }
      if (d < 0) {
        if (e == EINVAL) {  // the file system refuses O_DIRECT: buffered from now on
          std::lock_guard<std::mutex> l(files_mu_);
          no_direct_[st.st_dev] = "O_DIRECT refused";
          n_direct_refused_++;
        }
        return nullptr;  // else (no /proc, say): buffered, and ask again next time
      }
      dfd = std::make_shared<UniqueFd>(d);
      struct stat dst_st;
      if (fstat(d, &dst_st) != 0 || dst_st.st_dev != st.st_dev || dst_st.st_ino != st.st_ino) return nullptr;
    }
    if (cacheable) {
      SharedFd evicted;  // closed outside the lock
      std::lock_guard<std::mutex> l(files_mu_);
      auto [it, inserted] = cache_.try_emplace(key, Cached{dfd, ++tick_});
      if (!inserted) return it->second.fd;  // another thread got there first
      if (cache_.size() > kMaxCachedFiles) {
        auto lru = std::min_element(cache_.begin(), cache_.end(),
                                    [](const auto& a, const auto& b) { return a.second.used < b.second.used; });
        evicted = std::move(lru->second.fd);
        cache_.erase(lru);
      }
    }
    return dfd;
  }

  // Reads the run extents[first, end) (contiguous in the file). False: `f` says why.
  template <class Name>
  bool read_run(const Read& job, const std::vector<Extent>& extents, size_t first, size_t end, int plain, int direct,
                const Name& name, Failure& f) {
    const int64_t off = extents[first].file_offset;
    const int64_t back = extents[end - 1].file_offset + extents[end - 1].length;
    const uint64_t len = static_cast<uint64_t>(back - off);
    // (dst offset, length) per extent in file order, neighbours in memory merged.
    std::vector<std::pair<uint64_t, uint64_t>> pieces;
    for (size_t k = first; k < end; ++k) {
      const uint64_t o = extents[k].dst_offset, n = extents[k].length;
      if (!pieces.empty() && pieces.back().first + pieces.back().second == o)
        pieces.back().second += n;
      else
        pieces.emplace_back(o, n);
    }
    if (direct >= 0) {
      const uint64_t head = static_cast<uint64_t>(off % kDirectAlign);
      const uint64_t tail = (kDirectAlign - static_cast<uint64_t>(back % kDirectAlign)) % kDirectAlign;
      auto padded = pieces;
      bool ok = padded.front().first >= head;
      if (ok) {
        padded.front().first -= head;
        padded.front().second += head;
        padded.back().second += tail;
        const auto& last = padded.back();
        ok = last.first + last.second <= job.dst_bytes;
        const uintptr_t base = reinterpret_cast<uintptr_t>(job.dst);
        for (const auto& p : padded)
          ok = ok && (base + p.first) % kDirectAlign == 0 && p.second % kDirectAlign == 0;
        // The padding is overwritten with file bytes: it must hold none of the job's wanted bytes.
        ok = ok && !covers_wanted(job, padded.front().first, padded.front().first + head) &&
             !covers_wanted(job, last.first + last.second - tail, last.first + last.second);
      }
      if (ok) {
        const int r = preadv_all(direct, job.dst, padded, off - static_cast<int64_t>(head), head + len, true, f,
                                 name, off, len);
        if (r == 0) {
          n_runs_direct_++;
          n_bytes_direct_ += static_cast<int64_t>(len);
          n_bytes_padding_ += static_cast<int64_t>(head + tail);
          return true;
        }
        if (r < 0) return false;
        n_direct_fallbacks_++;  // O_DIRECT read refused (EINVAL): read it buffered
      } else {
        n_runs_unaligned_++;
      }
    }
    if (preadv_all(plain, job.dst, pieces, off, len, false, f, name, off, len) != 0) return false;
    n_runs_buffered_++;
    n_bytes_buffered_ += static_cast<int64_t>(len);
    return true;
  }

  static bool covers_wanted(const Read& job, uint64_t lo, uint64_t hi) {
    if (lo >= hi) return false;
    auto it = std::upper_bound(job.wanted.begin(), job.wanted.end(), std::make_pair(lo, UINT64_MAX));
    if (it != job.wanted.begin() && std::prev(it)->second > lo) return true;
    return it != job.wanted.end() && it->first < hi;
  }

  // Reads `need` bytes at `pos` into `pieces` of dst (a direct read may be
  // given more room than it needs: the tail padding may lie past the end of the
  // file). 0: done; -1: failed (`f`); 1: O_DIRECT refused (EINVAL), nothing to report.
  template <class Name>
  int preadv_all(int fd, uint8_t* dst, const std::vector<std::pair<uint64_t, uint64_t>>& pieces, int64_t pos,
                 uint64_t need, bool direct, Failure& f, const Name& name, int64_t off, uint64_t len) {
    std::vector<iovec> iov(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) iov[i] = {dst + pieces[i].first, pieces[i].second};
    size_t idx = 0;
    uint64_t got = 0;
    while (got < need && idx < iov.size()) {
      const int cnt = static_cast<int>(std::min<size_t>(iov.size() - idx, kMaxIov));
      const ssize_t n = ::preadv(fd, &iov[idx], cnt, pos);
      n_syscalls_++;
      if (n < 0) {
        const int e = errno;
        if (e == EINTR) continue;
        if (direct && e == EINVAL) return 1;
        std::ostringstream s;
        s << "layerwise.Reader: reading " << name() << " at offset " << pos << " failed ("
          << (direct ? "O_DIRECT" : "buffered") << " read of file bytes [" << off << ", " << off + static_cast<int64_t>(len) << ")): " << errno_text(e);
        f = {s.str(), e};
        return -1;
      }
      if (n == 0) break;  // the end of the file
      got += static_cast<uint64_t>(n);
      pos += n;
      for (size_t left = static_cast<size_t>(n); left && idx < iov.size();) {
        if (left >= iov[idx].iov_len) {
          left -= iov[idx].iov_len;
          ++idx;
        } else {
          iov[idx].iov_base = static_cast<uint8_t*>(iov[idx].iov_base) + left;
          iov[idx].iov_len -= left;
          left = 0;
        }
      }
      if (direct && n % kDirectAlign != 0) break;  // a partial block: the end of the file
    }
    if (got >= need) return 0;
    struct stat st;
    const int64_t size = fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
    const int64_t upto = pos;  // the file offset the read got to
    std::ostringstream s;
    s << "layerwise.Reader: short read of " << name() << ": file bytes [" << off << ", "
      << off + static_cast<int64_t>(len) << ") were asked for, but the file ends at byte " << size
      << " (the read stopped at " << std::min(upto, off + static_cast<int64_t>(len))
      << "): was it truncated or replaced since the extents were taken?";
    f = {s.str(), 0};
    return -1;
  }

  struct Cached {
    SharedFd fd;
    uint64_t used;
  };
  static constexpr const char* kMemoryFs = "memory file system";

  const Origin origin_;
  const bool direct_;
  const bool refuse_direct_;
  const int64_t delay_us_;
  const int64_t chunk_bytes_;

  // The queue and what its threads wait on. In a forked child it is leaked with
  // the threads: destroying a condition variable that the parent's threads were
  // waiting on at fork() waits for them forever (glibc pthread_cond_destroy).
  struct Queue {
    std::mutex m;
    std::condition_variable cv;       // a job was queued, or stop
    std::condition_variable stop_cv;  // stop (ends a debug delay)
    std::deque<Job> jobs;
    bool stop = false;
  };
  std::unique_ptr<Queue> q_ = std::make_unique<Queue>();
  std::mutex& m_ = q_->m;
  std::condition_variable& cv_ = q_->cv;
  std::condition_variable& stop_cv_ = q_->stop_cv;
  std::deque<Job>& queue_ = q_->jobs;
  bool& stop_ = q_->stop;
  std::vector<std::unique_ptr<std::thread>> threads_;
  std::atomic<bool> shut_down_{false};

  std::mutex issued_mu_;
  std::vector<std::weak_ptr<CpuEvent>> issued_;
  size_t prune_at_ = 64;
  Retired retired_;

  mutable std::mutex files_mu_;
  std::map<std::pair<dev_t, ino_t>, Cached> cache_;
  std::map<dev_t, std::string> no_direct_;
  uint64_t tick_ = 0;

  std::atomic<int64_t> n_reads_{0}, n_failed_{0}, n_cancelled_{0}, n_runs_direct_{0}, n_runs_buffered_{0},
      n_runs_unaligned_{0}, n_bytes_direct_{0}, n_bytes_buffered_{0}, n_bytes_padding_{0}, n_syscalls_{0},
      n_direct_refused_{0}, n_direct_fallbacks_{0}, n_memory_fs_{0}, n_pieces_{0}, n_in_flight_{0},
      n_max_in_flight_{0};
};

}  // namespace

ReaderPtr make_reader(int num_threads, bool direct, int64_t debug_delay_us, bool refuse_direct, int64_t chunk_bytes) {
  return std::make_shared<ReaderImpl>(num_threads, direct, debug_delay_us, refuse_direct, chunk_bytes);
}

}  // namespace layerwise
