"""disk: the disk tier. Layers that do not fit the host budget stay in files (the
checkpoint's own, or spill files written at pack time) and reach their ring
slot as read -> transfer: the reader threads read a layer into a pinned,
page-aligned staging slot (`disk/reader.py`), then the copy engine copies staging ->
device slot (docs/design.md, "Tiers and stages").

The read's event is a host event, which a CUDA stream cannot wait on. So the
copy out of staging is *deferred*: `DiskSource.fetch` queues the read and
returns a `ReadCopy` (a deferred result, stages/result.py), which issues the copy once the read has completed. The
manager's hooks `pump()` the tier (copies of finished reads are issued without
blocking) and `resolve()` a layer's ReadCopy where the layer is needed: the
host blocks only there, and only if the read is not done yet. The same logic
runs on the CPU backend, so CI exercises it.

Staging: `num_slots` slots (OffloadOptions.disk_staging_slots), each the size of the
largest disk layer's staging layout. A slot is read into only after the copy
out of it was issued (the read waits on that copy's event), and the next disk
layers are read ahead (`read_ahead`) while slots are free.

Files and errors: every file is opened once and recorded (size, mtime,
ctime); a read of a file that changed since (or was replaced, or deleted), a
short read (truncated) or an I/O error fails its event. The file's identity
is its content, not its metadata: where the read's layer is needed, the file
is reopened (`DiskFile.revalidate`: its layout must be the one recorded) and
the layer read again and checked against the CRC-32 taken when the model was
loaded; every other layer read from the file is checked once, at its next
read. A change of metadata only (chmod, a hard link, atime, an xattr, an
atomic replace by an identical copy, a touch) therefore streams on exactly; a
file whose bytes differ raises ReadError (an OSError, naming the file) at
every forward that needs them, and streams exactly again once restored.

Spill files (`SpillFile`): one per group in `spill_dir`, each layer at a page
boundary in plan layout (one O_DIRECT read per layer, one copy to the slot);
written as the layers are packed, rewritten by load_state_dict, deleted by
remove_layerwise_offload, by a failed configure, when the model is garbage
collected without a remove, and at exit (by the process that made them).
"""
from layerwise.stages.disk.files import DiskFile, SpillFile, crc_of, spill_store  # noqa: F401
from layerwise.stages.disk.reader import ReadError  # noqa: F401
from layerwise.stages.disk.source import DiskSource  # noqa: F401
from layerwise.stages.disk.staging import DiskTier, ReadCopy  # noqa: F401
