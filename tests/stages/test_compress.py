"""compress="lossless": layers kept encoded in host memory, copied encoded to a
staging buffer and decoded into their slot (layerwise/stages/decode.py), on the
CPU backend: outputs bitwise equal to the resident model, fewer bytes per step,
exact round trips of every bit pattern (and a raw fallback where encoding does
not pay), random copy delays, and the state contract for encoded layers."""
import copy

import pytest
import torch

import layerwise
from layerwise.configure import managers_of
from layerwise.runtime import group as manager_mod
from layerwise.stages import decode as decode_mod

from helpers.archs import ARCHS, SEEDS, assert_state_equal, build, clone_state
from helpers.compress import checksum_stack, linear_stack, random_bits, xs_for
from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def assert_bits_equal(model, sd):
    """state_dict() equals `sd` bit for bit (torch.equal says NaN != NaN)."""
    now = model.state_dict()
    assert set(now) == set(sd)
    for k, v in now.items():
        assert v.dtype == sd[k].dtype and v.shape == sd[k].shape, k
        assert torch.equal(v.contiguous().view(torch.uint8), sd[k].contiguous().view(torch.uint8)), k


def run(model, xs):
    with torch.no_grad():
        return [model(x) for x in xs]


def compress_stats(managers):
    return [m.stats(sync=True)["compress"] for m in managers]


# ------------------------------------------------- bitwise: real architectures
@pytest.mark.parametrize("depth,resident", [(0, 0), (1, 0), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["flux", "llama"])
def test_real_architectures_stream_compressed_bitwise(name, dtype, depth, resident):
    arch = ARCHS[name]
    model = build(arch).to(dtype)
    ref = copy.deepcopy(model)
    sd = clone_state(model)

    def call(m, seed):
        args, kwargs = arch.inputs(seed)
        kwargs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in kwargs.items()}
        with torch.no_grad():
            return arch.output(m(*args, **kwargs))

    refs = [call(ref, s) for s in SEEDS[:2]]
    assert not torch.equal(refs[0], refs[1])
    managers = layerwise.configure_layerwise_offload(model, arch.groups, device="cpu", prefetch_depth=depth,
                                                     resident_layers=resident, compress="lossless")
    for _ in range(2):
        for s, r in zip(SEEDS[:2], refs):
            assert torch.equal(call(model, s), r), (name, dtype, s)
    for m in managers:
        st = m.stats(sync=True)
        c = st["compress"]
        streamed = m.num_layers - len(st["resident_layers"])
        assert c["layers"] == streamed and c["layers_raw"] == [], c  # every streamed layer travels encoded
        # (a group whose streamed layers each have a slot of their own copies nothing after configure)
        assert st["bytes_copied"] < st["bytes_raw"] or st["bytes_raw"] == 0, st
    assert sum(m.stats()["bytes_copied"] for m in managers) > 0  # not vacuous: layers really streamed
    assert_state_equal(model, sd)  # state_dict() decodes the true weights
    layerwise.remove_layerwise_offload(model)
    assert not managers_of(model)
    assert_state_equal(model, sd)


# ------------------------------------------------ bytes per step, linear stacks
@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 0.80), (torch.float16, 0.95)])
def test_bytes_per_step_shrink_and_outputs_stay_bitwise(dtype, bound):
    xs = xs_for(256, dtype)
    ref = linear_stack(dtype)
    refs = run(ref, xs)
    per_step = {}
    for compress in (None, "lossless"):
        for depth, resident in [(1, 0), (2, 1)]:
            model = linear_stack(dtype)
            managers = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=depth,
                                                             resident_layers=resident, compress=compress)
            for _ in range(2):
                for out, r in zip(run(model, xs), refs):
                    assert torch.equal(out, r), (compress, depth, resident)
            last = managers[0].stats(sync=True)["last_step"]
            per_step[(compress, depth, resident)] = last["bytes_copied"]
            assert last["bytes_raw"] >= last["bytes_copied"] > 0
            if compress is None:
                assert last["bytes_raw"] == last["bytes_copied"]
            layerwise.remove_layerwise_offload(model)
    for depth, resident in [(1, 0), (2, 1)]:
        ratio = per_step[("lossless", depth, resident)] / per_step[(None, depth, resident)]
        assert ratio <= bound, (dtype, depth, resident, ratio)
        assert ratio > 0.3, ratio  # not vacuous: something still crosses the bus


def test_stats_and_report_show_the_codec():
    model = linear_stack(torch.bfloat16)
    managers = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", compress="lossless")
    run(model, xs_for(256, torch.bfloat16, 2))
    st = managers[0].stats(sync=True)
    c = st["compress"]
    assert c["codec"] == "lossless" and c["layers"] == 8 and c["layers_raw"] == []
    # (format version 2 codes fp32 too: the norms' exponents are far from random)
    assert c["per_dtype"]["bfloat16"]["ratio"] < 0.8 and c["per_dtype"]["float32"]["ratio"] < 0.97
    assert c["stored_bytes"] < c["raw_bytes"] and c["encode_gbps"] > 0
    assert c["decodes_timed"] > 0 and c["decode_s"] > 0
    assert st["arena_bytes"] >= c["stored_bytes"]  # the encoded blocks are this group's host memory
    row = layerwise.report(model)["groups"][0]
    assert row["compress_ratio"] == pytest.approx(c["ratio"])
    assert "lossless" in row["summary"]
    layerwise.remove_layerwise_offload(model)


# --------------------------------------------------- every bit pattern, fallback
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_bit_patterns_round_trip_and_travel_raw(dtype):
    kinds = ["random", "weights", "random", "weights", "weights", "random"]
    xs = xs_for(8, torch.float64)
    model = checksum_stack(kinds, dtype)
    ref = copy.deepcopy(model)
    sd = clone_state(model)
    refs = run(ref, xs)
    managers = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1,
                                                     compress="lossless", debug_copy_delay_us=200)
    for _ in range(2):
        for out, r in zip(run(model, xs), refs):
            assert torch.equal(out, r)
    c = compress_stats(managers)[0]
    # Decided per layer: the random ones travel raw, the weight-like ones encoded.
    assert c["layers_raw"] == [i for i, k in enumerate(kinds) if k == "random"], c
    assert_bits_equal(model, sd)
    layerwise.remove_layerwise_offload(model)
    assert_bits_equal(model, sd)


# ------------------------------------------------------- random copy delays
@pytest.mark.parametrize("streams", [1, 2])
def test_random_copy_delays_change_nothing(streams):
    # Two copy streams put a copy and its decode on different workers: only the
    # events order them (and a staging buffer's reuse after its decode).
    dtype = torch.bfloat16
    xs = xs_for(256, dtype, 4)
    refs = run(linear_stack(dtype), xs)
    for depth in (1, 3):
        model = linear_stack(dtype)
        layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=depth,
                                              compress="lossless", debug_copy_delay_us=400,
                                              num_copy_streams=streams)
        for _ in range(3):
            for out, r in zip(run(model, xs), refs):
                assert torch.equal(out, r), (streams, depth)
        layerwise.remove_layerwise_offload(model)


def test_layers_called_out_of_order_under_delays_are_exact():
    # Skipped and reversed layers: a prefetch into a slot may still be in flight when
    # another layer is loaded there; its decode must wait (`after`), on other workers too
    # (three: with two, round-robin puts every decode on one worker, ordered anyway).
    torch.manual_seed(0)
    model = TwoGroupModel(n_a=7, n_b=3)
    ref = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1, compress="lossless",
                                          debug_copy_delay_us=500, num_copy_streams=3)
    orders = [[0, 2, 4, 6], [6, 5, 4, 3, 2, 1, 0], [1, 3, 5], list(range(7)), [0, 0, 2, 2, 4]]
    with torch.no_grad():
        for _ in range(2):
            for order in orders:
                x = inputs(1, seed=len(order))[0]
                assert torch.equal(model(x, order_a=order), ref(x, order_a=order)), order
    layerwise.remove_layerwise_offload(model)


# ------------------------------------------------------------- state contract
def configured(delay=0, **kw):
    torch.manual_seed(0)
    model = TwoGroupModel()
    ref = copy.deepcopy(model)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", compress="lossless",
                                                     debug_copy_delay_us=delay, **kw)
    assert all(m.stats()["compress"]["layers"] > 0 for m in managers)
    return model, ref, managers


def inputs(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 32, generator=g) for _ in range(n)]


def test_load_state_dict_takes_effect_exactly_and_re_encodes():
    model, ref, managers = configured(delay=200)
    xs = inputs()
    run(model, xs)  # the ring holds the old weights
    torch.manual_seed(7)
    new = TwoGroupModel()
    result = model.load_state_dict(new.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for a, b in zip(run(model, xs), run(new, xs)):
        assert torch.equal(a, b)
    assert_state_equal(model, clone_state(new))
    layerwise.remove_layerwise_offload(model)
    for a, b in zip(run(model, xs), run(new, xs)):
        assert torch.equal(a, b)


def test_a_write_whose_encoding_grows_travels_raw_then_encoded_again():
    model, ref, managers = configured()
    xs = inputs()
    m = managers[0]
    assert m.stats()["compress"]["layers_raw"] == []
    g = torch.Generator().manual_seed(3)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for k in sd:
        if k.startswith("transformer_blocks.1.") and sd[k].dtype == torch.bfloat16:
            sd[k] = random_bits(sd[k].shape, torch.bfloat16, g)  # incompressible
    model.load_state_dict(sd)
    assert m.stats()["compress"]["layers_raw"] == [1]
    assert_bits_equal(model, sd)
    with torch.no_grad():
        ref.load_state_dict(sd)
    for a, b in zip(run(model, xs), run(ref, xs)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # (NaNs: compare bits)
    back = clone_state(TwoGroupModel())
    model.load_state_dict(back)
    assert m.stats()["compress"]["layers_raw"] == []
    assert_state_equal(model, back)


def test_a_failing_re_encode_changes_nothing_of_its_layer(monkeypatch):
    model, ref, managers = configured()
    xs = inputs()
    run(model, xs)
    before = clone_state(model)
    torch.manual_seed(9)
    new = clone_state(TwoGroupModel())
    calls = []
    orig = decode_mod.CodecTier.keep

    def failing(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected: no host memory for the new encoding")
        return orig(self, *a, **k)

    monkeypatch.setattr(decode_mod.CodecTier, "keep", failing)
    with pytest.raises(MemoryError, match="injected"):
        model.load_state_dict(new)
    monkeypatch.undo()
    now = clone_state(model)
    layer_keys = [k for k in now if "blocks." in k and not k.endswith("scale")]
    # load_state_dict writes each layer once, whole, at the end of the load: the two
    # layers written before the failure hold all of their new values, the failed one and
    # those after it all of their old ones.
    written = ("transformer_blocks.0.", "transformer_blocks.1.")
    assert any(not torch.equal(new[k], before[k]) for k in layer_keys if k.startswith(written))
    for k in layer_keys:
        assert torch.equal(now[k], new[k] if k.startswith(written) else before[k]), k
    # The model computes with exactly what state_dict() says.
    twin = copy.deepcopy(ref)
    twin.load_state_dict(now)
    for a, b in zip(run(model, xs), run(twin, xs)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_configure_failing_half_way_through_encoding_gives_exact_weights_back(monkeypatch, exc):
    torch.manual_seed(0)
    model = TwoGroupModel()
    sd = clone_state(model)
    calls = []
    orig = decode_mod.CodecTier.keep  # encodes each layer's payload as it is packed

    def failing(self, segments, block):
        calls.append(block.numel())
        if len(calls) == 3:
            raise exc("injected")
        return orig(self, segments, block)

    monkeypatch.setattr(decode_mod.CodecTier, "keep", failing)
    with pytest.raises(exc):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", compress="lossless")
    monkeypatch.undo()
    assert len(calls) == 3 and not managers_of(model)
    assert_state_equal(model, sd)


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 1)])
def test_backward_gives_exact_gradients_with_encoded_layers(depth, resident):
    model, ref, managers = configured(delay=100, prefetch_depth=depth, resident_layers=resident)
    for step in range(2):
        x = inputs(1, seed=step)[0]
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        model.zero_grad()
        ref.zero_grad()
        model(x1).square().sum().backward()
        ref(x2).square().sum().backward()
        assert torch.equal(x1.grad, x2.grad)
        grads = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            assert p.grad is not None and torch.equal(p.grad, grads[n].grad), n


def test_resident_layers_and_remove_are_exact():
    model, ref, managers = configured(resident_layers=2, prefetch_depth=1)
    xs = inputs()
    for a, b in zip(run(model, xs), run(ref, xs)):
        assert torch.equal(a, b)
    for m in managers:
        st = m.stats()
        assert st["compress"]["layers"] == m.num_layers - 2  # resident layers are not encoded
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model, clone_state(ref))


# ------------------------------------------------------------ entry points
@pytest.mark.parametrize("bad", ["zstd", True, "LOSSLESS", 1])
def test_a_bad_compress_value_is_refused_before_anything_changes(bad):
    torch.manual_seed(0)
    model = TwoGroupModel()
    sd = clone_state(model)
    with pytest.raises(ValueError, match="compress must be None or 'lossless'"):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", compress=bad)
    with pytest.raises(ValueError, match="compress must be None or 'lossless'"):
        layerwise.LayerwiseOffloadManager(model, "transformer_blocks", device="cpu", compress=bad)

    class Pipe:
        pass

    pipe = Pipe()
    pipe.transformer = model
    with pytest.raises(ValueError, match="compress must be None or 'lossless'"):
        layerwise.offload_pipeline(pipe, device="cpu", compress=bad)
    assert not managers_of(model)
    assert_state_equal(model, sd)


def test_load_offloaded_and_offload_pipeline_pass_compress_through(tmp_path):
    from safetensors.torch import save_file

    model = linear_stack(torch.bfloat16)
    xs = xs_for(256, torch.bfloat16, 2)
    refs = run(model, xs)
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with torch.device("meta"):
        empty = linear_stack(torch.bfloat16)
    managers = layerwise.load_offloaded(empty, str(path), "blocks", device="cpu", compress="lossless")
    assert managers[0].stats()["compress"]["layers"] == 8
    for out, r in zip(run(empty, xs), refs):
        assert torch.equal(out, r)
    layerwise.remove_layerwise_offload(empty)

    class Pipe:
        pass

    pipe = Pipe()
    pipe.transformer = model
    out = layerwise.offload_pipeline(pipe, device="cpu", components={"transformer": "blocks"}, compress="lossless")
    assert out["transformer"][0].stats()["compress"]["layers"] == 8
    for o, r in zip(run(model, xs), refs):
        assert torch.equal(o, r)
    layerwise.remove_pipeline_offload(pipe)


def test_manager_alone_streams_compressed():
    model = linear_stack(torch.float16)
    xs = xs_for(256, torch.float16, 2)
    refs = run(copy.deepcopy(model), xs)
    m = manager_mod.LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_depth=2, compress="lossless")
    for out, r in zip(run(model, xs), refs):
        assert torch.equal(out, r)
    assert m.stats()["compress"]["layers"] == 8
    layerwise.remove_layerwise_offload(model)


def _host_block(n):
    from layerwise import _native

    arena = _native.HostArena(max(n, 1), pinned=False)
    return arena.allocate(max(n, 1), alignment=4096)[:n], arena


def test_a_payload_block_that_changes_size_keeps_its_version_growing():
    """ArenaSource.version() (what the slot record compares) grows at every write, in
    place or into a block of another size: it was the block's own counter plus a count
    of replacements, so a replacement after two in-place writes went back to a version
    seen before, and a slot holding the older bytes would have counted as current."""
    from layerwise.stages.source import ArenaSource

    src = ArenaSource(*_host_block(64), alloc=_host_block)
    seen = [src.version()]
    for n in (64, 64, 64, 48, 48, 80, 80, 80, 80, 32):
        src.write(torch.full((n,), len(seen), dtype=torch.uint8))
        assert src.version() > max(seen), (n, src.version(), seen)
        seen.append(src.version())
        assert torch.equal(src.read(), torch.full((n,), len(seen) - 1, dtype=torch.uint8))


def test_an_undone_payload_write_puts_the_old_bytes_back_and_its_version_grows():
    """write(block, undo=True) (a split write that failed on another rank): the undo
    restores the old bytes, in place or into a block of another size, and the version
    never goes back (a slot holding the written bytes must not count as current)."""
    from layerwise.stages.source import ArenaSource

    src = ArenaSource(*_host_block(64), alloc=_host_block)
    src.block.copy_(torch.arange(64, dtype=torch.uint8))
    seen = [src.version()]
    for n in (64, 48, 64, 80):
        old = src.read().clone()
        undo = src.write(torch.full((n,), 200, dtype=torch.uint8), undo=True)
        assert src.version() > max(seen) and src.read().numel() == n
        seen.append(src.version())
        undo()
        assert src.version() > max(seen), (n, src.version(), seen)
        seen.append(src.version())
        assert torch.equal(src.read(), old), n
        src.write(torch.full((n,), len(seen), dtype=torch.uint8))  # the next size to undo from
        seen.append(src.version())
