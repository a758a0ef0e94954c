"""One rank of the split-fetch checks of tests/runtime/test_cuda_path.py that need
several ranks: gloo ranks on CPU here, NCCL ranks (one GPU each) on a GPU host.

    python tests/helpers/cuda_path_worker.py RANK WORLD PORT TMPDIR SCENARIO DEVICE

(helpers/ranks.py's run_ranks starts it.) DEVICE: "cpu" (gloo) or "cuda" (NCCL,
rank r on cuda:r). SCENARIO: alltoall (the model's forward runs an all-to-all on
the split_fetch group itself, between the layer groups' gathers) or remove_skew
(the ranks reach remove at different times), timed (every fetch, a gather at its
end, timed from its local copy's start: raw and compressed shares). Each checks
outputs and weights bitwise against a resident copy; on CUDA with two copy
streams and the compute stream slowed before every block (the GPU runs behind
the host, so that a missing event edge shows as a wrong output).
"""
import copy
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import layerwise
from layerwise.stages import split

from helpers.split_worker import Net


class AllToAllNet(Net):
    """A sequence-parallel-like model: the tokens change ranks between the two
    layer groups, on the same group the split fetch gathers on."""

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x.contiguous())
        for b in self.extra:
            y = b(y)
        return self.head(y)


def behind_the_host(model, device, ms=1.0):
    """On CUDA: a GPU sleep of about `ms` queued on the compute stream before every
    block's kernels (pre-hooks registered after configure run after layerwise's, so
    the sleep lies between the block's wait for its copy and its kernels): the host
    runs ahead, and every later fetch and slot reuse is ordered by events alone."""
    if device.type != "cuda":
        return []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * ms / start.elapsed_time(end))
    return [b.register_forward_pre_hook(lambda *a: torch.cuda._sleep(cycles))
            for b in (*model.blocks, *model.extra)]


def streams(device):
    return {"num_copy_streams": 2} if device.type == "cuda" else {}


def check_outputs(model, reference, rank, device, steps=3):
    torch.manual_seed(100 + rank)  # different inputs on every rank
    xs = [torch.randn(2 * dist.get_world_size(), 48).to(device) for _ in range(2)]
    with torch.no_grad():
        for _ in range(steps):
            for x in xs:  # the same collectives in the same order on every rank
                out, ref = model(x), reference(x)
                assert torch.equal(out, ref), (rank, (out - ref).abs().max().item())


def same_weights(model, reference):
    for (k, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.to(q.device), q), k


def scenario_alltoall(rank, device):
    torch.manual_seed(0)
    model = AllToAllNet()
    reference = copy.deepcopy(model).to(device)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device=device, prefetch_depth=2,
                                          split_fetch=dist.group.WORLD, **streams(device))
    behind_the_host(model, device)
    check_outputs(model, reference, rank, device)
    if device.type == "cuda":
        (group,) = [g for g in split._LIVE if g.stream is not None]
        pool = {torch.cuda.Stream(device).cuda_stream for _ in range(80)}
        pool |= {torch.cuda.Stream(device, priority=-1).cuda_stream for _ in range(80)}
        assert group.stream.cuda_stream not in pool, "the gather stream is one of torch's pool streams"
        with torch.cuda.stream(torch.cuda.Stream(device)):  # the user's work on a pool stream
            check_outputs(model, reference, rank, device, steps=1)
    layerwise.remove_layerwise_offload(model)
    same_weights(model, reference)


def scenario_remove_skew(rank, device):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model).to(device)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device=device, prefetch_depth=1,
                                          resident_layers=1, split_fetch=dist.group.WORLD, **streams(device))
    behind_the_host(model, device)
    check_outputs(model, reference, rank, device, steps=2)
    time.sleep(1.5 * rank)  # the later ranks reach remove 1.5 s after the one before
    layerwise.remove_layerwise_offload(model)
    same_weights(model, reference)
    check_outputs(model, reference, rank, device, steps=1)


def scenario_timed(rank, device):
    from helpers.fetch_timing import FetchLog

    for compress in (None, "lossless"):
        torch.manual_seed(0)
        model = Net()
        reference = copy.deepcopy(model).to(device)
        managers = layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device=device,
                                                         prefetch_depth=1, split_fetch=dist.group.WORLD,
                                                         compress=compress, **streams(device))
        behind_the_host(model, device)
        with FetchLog() as log:
            for m in managers:
                m.meter.listen(True)  # every step timed
            check_outputs(model, reference, rank, device, steps=2)
            log.check(managers)
            for m in managers:
                samples = m.meter.listen(False)
                assert samples and all(t > 0 for _, _, t in samples), (m.layer_name, samples)
        layerwise.remove_layerwise_offload(model)
        same_weights(model, reference)


SCENARIOS = {"alltoall": scenario_alltoall, "remove_skew": scenario_remove_skew, "timed": scenario_timed}


def main(rank, world, port, tmp, scenario, device):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LAYERWISE_COLLECTIVE_TIMEOUT_S="60")
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    t0 = time.perf_counter()
    SCENARIOS[scenario](rank, dev)
    dist.barrier()
    print(f"rank {rank} ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    os._exit(0)  # as split_worker.py: no teardown of the groups to wait on


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
