// The disk tier's reader: file -> pinned host staging, on a small pool of
// reader threads (docs/design.md, "Tiers and stages": the read stage).
//
// One read_async() reads one layer: a list of extents (file offset, length,
// offset in dst). Extents that are contiguous in the file form a run, read with
// one vectored read (preadv, one iovec per extent, adjacent iovecs merged).
// Queue depth: a drive serves one request in flight below its speed (a virtio
// disk measured 1.1 GB/s with one O_DIRECT reader, 1.5 GB/s with 2-4), so a read
// is done in pieces of about `chunk_bytes` (a long run cut at page-aligned file
// offsets, short runs grouped), queued together and run by the reader threads
// side by side; its event completes when the last piece is done. chunk_bytes 0:
// a read is one piece, its runs read one after the other on one thread.
//
// O_DIRECT, zero-copy: a run is read with O_DIRECT into dst itself when the
// aligned file span that covers it, [floor(off, 4096), ceil(end, 4096)), can
// be laid into dst page for page: every iovec (the first grown by the head,
// the last by the tail) starts and ends on a 4096 boundary of memory, lies
// inside dst, and the head and tail padding cover none of the job's wanted
// bytes. With a page-aligned dst that holds exactly when each run's
// dst_offset == file_offset (mod 4096) and the padded spans of different runs
// do not share a page: the layout `stages.read.staging_layout` computes. The
// bytes of the padding pages outside the extents are overwritten by file
// bytes. Otherwise (or on a file system where O_DIRECT is refused, or a memory
// file system where it gains nothing) the run is read buffered with pread(v).
//
// Events are CpuEvents (host_event.h), the CPU copy engine's own type, so a
// CPU copy can wait on a read and a read on a copy; `after` may be any event
// (a CUDA event too: the reader thread waits on it with Event::host_wait, which
// polls with back-off rather than spin a core in cudaEventSynchronize). A read that fails
// (an I/O error, a short read, a file changed since it was recorded) completes
// its event with an error that synchronize() and query() raise (ReadError);
// the reader carries on with later reads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"

namespace layerwise {

struct Extent {
  int64_t file_offset;
  int64_t length;
  int64_t dst_offset;
};

// What the caller recorded about a file (os.stat: st_size, st_mtime_ns, st_ctime_ns); -1:
// not checked. Checked with fstat right before and right after every read of a
// job that carries it; a file deleted since it was opened (st_nlink 0) fails too.
struct FileExpect {
  int64_t size = -1;
  int64_t mtime_ns = -1;
  int64_t ctime_ns = -1;  // the inode's change time: moves on every write, whatever mtime is set back to
  bool any() const { return size >= 0 || mtime_ns >= 0 || ctime_ns >= 0; }
};

constexpr int64_t kDirectAlign = 4096;  // O_DIRECT alignment of buffer, offset and length

class Reader : public Stoppable {
 public:
  // Reads `extents` of the file `path` (fd < 0: opened by the reader thread)
  // or of the open file `fd` (duplicated here, so the caller may close it at
  // once) into dst[0, dst_bytes), after `after` has completed. Extents are
  // checked here (bounds, no overlap in dst): a bad one raises at once;
  // everything that touches the file happens on a reader thread and is
  // reported by the event. `keep` holds dst's storage until the read is done.
  virtual EventPtr read_async(const std::string& path, int fd, std::vector<Extent> extents, uint8_t* dst,
                              size_t dst_bytes, const EventPtr& after, std::unique_ptr<InFlight> keep,
                              FileExpect expect) = 0;
  // fstat(fd) against `expect`, on the calling thread: throws ReadError if it differs.
  virtual void check_file(int fd, FileExpect expect) = 0;
  // Closes the reader's cached O_DIRECT descriptor of fd's file, if any (call it
  // when a file is closed for good: the cached descriptor keeps a deleted file's
  // blocks allocated). Reads in flight keep theirs.
  virtual void forget(int fd) = 0;
  // Blocks until every read issued so far has completed (failed ones included:
  // their events carry the errors; this does not raise them).
  virtual void synchronize() = 0;
  // Drops events finished jobs handed back; only on a thread that may drop the
  // last reference to a storage (the GIL held).
  virtual void drop_retired() = 0;
  virtual std::map<std::string, int64_t> stats() const = 0;
  virtual int num_threads() const = 0;
  virtual bool direct() const = 0;
  virtual int64_t debug_delay_us() const = 0;
  virtual int64_t chunk_bytes() const = 0;
};
using ReaderPtr = std::shared_ptr<Reader>;

// `refuse_direct`: a test mode that acts as if every file system refused
// O_DIRECT (open fails with EINVAL), to exercise that fallback anywhere.
constexpr int64_t kDefaultChunkBytes = int64_t{4} << 20;  // a read's pieces (see above)
ReaderPtr make_reader(int num_threads, bool direct, int64_t debug_delay_us, bool refuse_direct = false,
                      int64_t chunk_bytes = kDefaultChunkBytes);

}  // namespace layerwise
