"""gather: split fetch over torch.distributed (docs/design.md, "Tiers and stages").

Ranks that run the same model in lockstep (sequence / context parallel
inference: every rank holds the full weights and runs every layer) each keep
only a contiguous share of every streamed layer's block in host memory and copy
only that share over their own host link; an all-gather over the group then
completes the layer in every rank's slot:

    share (host, this rank's part of the layer)
      -> transfer  copy engine: share -> this rank's part of the slot
      -> gather    all_gather_single(slot, this rank's part)   (NCCL / gloo)

Shares: ``share = round_up(ceil(nbytes / world), SHARE_ALIGN)``; rank r holds
bytes ``[r * share, min((r + 1) * share, nbytes))`` of the plan-layout block
(the last rank's may be shorter, a rank's may be empty for a tiny layer). The
gather needs ``world * share`` bytes of slot, a little more than ``nbytes``:
``ShareSource.slot_bytes`` tells the manager how large its ring slots must be.

Ordering. A collective must be issued by every rank of the group in the same
order. The manager's prefetch order is deterministic and its synchronous loads
follow the layers called, so lockstep ranks issue the same gathers in the same
order. Our collectives run on a private gloo group over the same ranks, made at
configure, so they never interleave with the user's own collectives on their
group (a sequence-parallel model's all-to-alls). On the CPU backend every
collective of a group (the slot gathers and the host-side ones below) runs on
one thread per group, in the order issued: a
gather waits for its local copy there, then completes a host event
(``_C.host_event``) that the compute waits on and that the next copy into the
slot chains after, so no slot is overwritten while a gather into it is in
flight. On CUDA the gather is issued from the hook on a dedicated stream that
first waits (on the device) for the local copy's event; NCCL orders itself
after that stream and the stream after NCCL, and an event recorded there is
what the compute stream and the slot's next copy wait on: no host sync in the
hot path (the CUDA path is written for NCCL and not run in CI: no GPU there).
Host-side collectives go through the private gloo group.

The lockstep check. Every collective on the private group is
preceded by an all-gather of a 64-byte tag per rank (``SplitGroup.agree``): what
it is (a forward's gather, a host read, a check of new values), the layer group,
the layer, its bytes and version. Ranks about to run different collectives (one
calls the blocks in another order, one calls state_dict() while another runs a
forward) find out there - before a byte of the layer moves, and before gloo
sees buffers of different sizes (it aborts the process then) - and raise
``SplitError`` on every rank naming what each wanted. On CPU the collectives
queued behind a failed one fail too, without being issued, until the failure
has reached the user (``surfaced``); every manager of the group then reloads its
slots, so the next calls made in lockstep pair up again and are exact. A local
part that fails on one rank (its copy, or a read of a changed file, when queued
or when deferred) still goes to its gather, in order, which tells the others
(``LOCAL_FAILED``: they raise at once) instead of leaving them waiting for the
timeout (which would leave the group unusable). Cost:
one small all-gather per collective; on CPU a second thread waits for each
gather, so the next check overlaps the transfer (BENCHMARKS.md). On CUDA the
check runs on the host, from the hook, before the local copy and the NCCL
gather are issued (a host round trip per layer; written, not run: no GPU).

At configure the validation all-gather also carries a CRC-32 of every split
layer's bytes (``layer_values``): ranks built with different weights are refused
on every rank, naming the first differing layer. load_offloaded, where each rank
reads only its share, compares what every rank can read cheaply instead
(loading._sampled_values).

Which operations are collective (every rank of the group must call them, in the
same order, or they raise SplitError: at once where the ranks disagree, after
``timeout_s`` where a rank does not take part):

    configure_layerwise_offload / load_offloaded / offload_pipeline with
        split_fetch (one all-gather validates the configuration on every rank)
    every forward (the slot gathers): ranks run the same layers in the same order
    state_dict()       a streamed layer's true bytes are gathered on the host
    load_state_dict()  and peft merge/unmerge: the layer is gathered, edited and
                       the edited bytes compared across ranks (a digest); ranks
                       that loaded different values refuse on every rank, the
                       model unchanged. Then each rank writes its share and the
                       ranks agree on how that went (WRITTEN); where one failed
                       (a full disk, an encode out of memory) the others undo
                       theirs (Source.write(undo=True)) and every rank raises the
                       same SplitError, naming the rank and its error, the layer
                       unchanged on every rank and the group usable
    remove_layerwise_offload()  gathers every layer to give back full parameters
    a backward that needs a layer's weights again (rare: after its slot refilled)

Non-collective (never issue a collective): stats(), report(), `.to(device)`,
attribute access, hooks of resident layers.

Not supported: DTensor (tensor-parallel) weights - each rank's weights differ
already, there is nothing to split - refused at configure. An interrupt or an
error on one rank only, or a rank that skips a call, leaves the others waiting:
their next collective times out (``timeout_s``) and raises SplitError; a gloo
group with a timed-out collective should then be torn down.

Compression composes at the ``share`` step: a rank would encode its
share when storing it and its local stage would become transfer -> decode into
its part of the slot; the gather is unchanged. Not wired here.
"""
from layerwise.stages.split.collectives import _LIVE, SplitError  # noqa: F401
from layerwise.stages.split.source import SHARE_ALIGN, ShareSource, share_span  # noqa: F401
from layerwise.stages.split.validate import attach  # noqa: F401
