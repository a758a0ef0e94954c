"""The state contract of an offloaded model (layerwise/contract/): rollback at
every parameter index, state_dict / load_state_dict / in-place writes / casts /
backward / deepcopy while offloaded, nested block calls, two threads, and real
SIGINTs during configure and forward. CPU backend, often with random copy delays."""
import copy
import io
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

import layerwise
from layerwise.configure import managers_of, prepare_groups
from layerwise.runtime import group as manager_mod
from layerwise.runtime import host_store as packing_mod

from helpers.contract import assert_fingerprint, fingerprint, inputs, make, nested_model, no_trace_of_layerwise, run

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


# ------------------------------------------------------------- rollback
def _count_params(model):
    managers = prepare_groups(model, GROUPS, layerwise.OffloadOptions.build(device="cpu", pin_memory=True))
    return sum(len(lp.params) for m in managers for lp in m.plan.layers)


@pytest.mark.parametrize("where", ["before_copy", "after_copy"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failure_at_every_parameter_index_restores_the_model_bitwise(monkeypatch, where, exc):
    total = _count_params(make())
    assert total > 20
    for k in range(total):
        model = make()
        fp = fingerprint(model)
        calls = [0]
        target = "source" if where == "before_copy" else None  # (ParamEntry.source: what packing copies from)

        def boom(*a, **kw):
            calls[0] += 1
            if calls[0] == k + 1:
                raise exc(f"injected at parameter {k}")

        if target:
            from layerwise.planning.layout import ParamEntry

            orig = ParamEntry.source
            monkeypatch.setattr(ParamEntry, "source", lambda e: (boom(), orig(e))[1])
        else:
            orig_ph = packing_mod.HostLayers.placeholder
            monkeypatch.setattr(packing_mod.HostLayers, "placeholder",
                                lambda self, dt: (boom(), orig_ph(self, dt))[1])
        with pytest.raises(exc, match=f"injected at parameter {k}$"):
            layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
        monkeypatch.undo()
        assert_fingerprint(model, fp)
        assert no_trace_of_layerwise(model), k


def test_failure_after_packing_restores_resident_layers_and_non_layer_weights(monkeypatch):
    model = make()
    fp = fingerprint(model)
    orig = manager_mod.LayerwiseOffloadManager._finalize_initialization
    seen = []

    def fail_second(self):
        seen.append(self.layer_name)
        if len(seen) == 2:
            raise KeyboardInterrupt("injected in finalisation")
        return orig(self)

    monkeypatch.setattr(manager_mod.LayerwiseOffloadManager, "_finalize_initialization", fail_second)
    with pytest.raises(KeyboardInterrupt):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", resident_layers=2)
    assert_fingerprint(model, fp)
    assert no_trace_of_layerwise(model)


def test_a_meta_parameter_is_refused_before_anything_changes():
    model = make()
    model.transformer_blocks[2].up.weight = nn.Parameter(torch.empty(64, 32, device="meta", dtype=torch.bfloat16))
    fp = {k: v for k, v in fingerprint(model).items() if "transformer_blocks.2.up.weight" not in k}
    with pytest.raises(ValueError, match=r"transformer_blocks\.2\.up\.weight.*meta.*load_offloaded"):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    now = fingerprint(model)
    for k, v in fp.items():
        assert torch.equal(now[k][0], v[0]), k
    assert no_trace_of_layerwise(model)


def test_load_offloaded_failing_half_way_gives_real_weights_back(monkeypatch, tmp_path):
    from safetensors.torch import save_file

    from layerwise.formats import safetensors as loading

    src = make(seed=3)
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    n = sum(1 for k in src.state_dict() if "_blocks." in k and "scale" not in k)
    for k in range(0, n, 3):
        model = make(seed=0)  # real weights, different from the checkpoint's
        fp = fingerprint(model)
        calls = [0]
        orig = loading.read_into

        def failing(stored, out, orig=orig, k=k):
            calls[0] += 1
            if calls[0] == k + 1:
                raise OSError(f"injected read error {k}")
            return orig(stored, out)

        monkeypatch.setattr(loading, "read_into", failing)
        with pytest.raises(OSError, match="injected read error"):
            layerwise.load_offloaded(model, path, GROUPS, device="cpu")
        monkeypatch.undo()
        assert_fingerprint(model, fp)
        assert no_trace_of_layerwise(model)


# ---------------------------------------------------------- state_dict
def configured(seed=0, depth=1, resident=0, delay=None, **kw):
    model = make(seed, **kw)
    ref = copy.deepcopy(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=depth,
                                          resident_layers=resident, debug_copy_delay_us=delay)
    return model, ref, sd


@pytest.mark.parametrize("depth,resident", [(0, 0), (1, 0), (2, 1)])
def test_state_dict_gives_the_true_weights(depth, resident):
    model, ref, sd = configured(depth=depth, resident=resident)
    for _ in range(2):
        run(model, inputs(1))
        now = model.state_dict()
        assert set(now) == set(sd)
        for k, v in now.items():
            assert torch.equal(v, sd[k]) and v.stride() == sd[k].stride(), k
    # a sub-module's state_dict, and torch.save / torch.load of it
    blk = model.transformer_blocks[3].state_dict()
    assert torch.equal(blk["up.weight"], sd["transformer_blocks.3.up.weight"])
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    for k, v in loaded.items():
        assert torch.equal(v, sd[k]), k


def test_state_dict_saves_with_safetensors_without_shared_tensor_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    model, ref, sd = configured()
    run(model, inputs(1))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    back = load_file(str(tmp_path / "m.safetensors"))
    for k, v in back.items():
        assert torch.equal(v, sd[k]), k


def test_llama_save_pretrained_while_offloaded_round_trips(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    layerwise.configure_layerwise_offload(model, "model.layers", device="cpu")
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        model(ids)
    model.save_pretrained(tmp_path)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd[k]), k


# ------------------------------------------------------ load_state_dict
def test_load_state_dict_takes_effect_exactly():
    model, ref, sd = configured(delay=200)
    xs = inputs()
    run(model, xs)  # the ring is full of old weights
    new = make(seed=7)
    missing_unexpected = model.load_state_dict(new.state_dict())
    assert not missing_unexpected.missing_keys and not missing_unexpected.unexpected_keys
    for a, b in zip(run(model, xs), run(new, xs)):
        assert torch.equal(a, b)
    for k, v in model.state_dict().items():
        assert torch.equal(v, new.state_dict()[k]), k
    layerwise.remove_layerwise_offload(model)
    for a, b in zip(run(model, xs), run(new, xs)):
        assert torch.equal(a, b)


def test_load_state_dict_strict_and_assign_behave_as_in_pytorch():
    model, ref, sd = configured()
    new = make(seed=8)
    part = {k: v for k, v in new.state_dict().items() if k.startswith("transformer_blocks.1.")}
    res = model.load_state_dict(part, strict=False)
    assert "transformer_blocks.2.up.weight" in res.missing_keys and not res.unexpected_keys
    ref.load_state_dict(part, strict=False)
    xs = inputs()
    for a, b in zip(run(model, xs), run(ref, xs)):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(part)
    bad = dict(new.state_dict())
    bad["transformer_blocks.0.up.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="size mismatch for transformer_blocks.0.up.weight"):
        model.load_state_dict(bad)
    # assign=True with the same dtypes: the values are taken
    model2, ref2, _ = configured()
    model2.load_state_dict(make(seed=9).state_dict(), assign=True)
    ref2.load_state_dict(make(seed=9).state_dict(), assign=True)
    for a, b in zip(run(model2, xs), run(ref2, xs)):
        assert torch.equal(a, b)
    # assign=True that would change a streamed dtype: refused, named
    wrong = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in make(seed=9).state_dict().items()}
    with pytest.raises(RuntimeError, match="streamed dtypes are fixed while offloaded"):
        model2.load_state_dict(wrong, assign=True)


def test_writes_through_state_dict_views_reach_the_model_like_a_resident_one():
    model, ref, sd = configured()
    xs = inputs()
    run(model, xs)
    with torch.no_grad():
        model.state_dict()["transformer_blocks.4.up.weight"].mul_(2)
        ref.state_dict()["transformer_blocks.4.up.weight"].mul_(2)
    for a, b in zip(run(model, xs), run(ref, xs)):
        assert torch.equal(a, b)


def test_in_place_write_into_a_streamed_weight_is_refused_and_discarded():
    model, ref, sd = configured()
    xs = inputs()
    expect = run(ref, xs)
    run(model, xs)
    with torch.no_grad():
        model.transformer_blocks[1].up.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="in-place write to a streamed parameter.*load_state_dict"):
        run(model, xs)
    for _ in range(2):  # the old weights, exactly, from then on
        for a, b in zip(run(model, xs), expect):
            assert torch.equal(a, b)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k


# ------------------------------------------------------------------ casts
@pytest.mark.parametrize("cast", [lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.double(),
                                  lambda m: m.float(), lambda m: m.transformer_blocks[0].half(),
                                  lambda m: m.to("meta")])
def test_casts_of_streamed_weights_are_refused_with_the_model_unchanged(cast):
    model, ref, sd = configured()
    xs = inputs()
    expect = run(ref, xs)
    run(model, xs)
    with pytest.raises(RuntimeError, match="remove_layerwise_offload"):
        cast(model)
    for k, v in model.state_dict().items():
        assert v.dtype == sd[k].dtype and torch.equal(v, sd[k]), k
    for a, b in zip(run(model, xs), expect):
        assert torch.equal(a, b)


def test_moves_that_leave_streamed_weights_alone_are_allowed():
    model, ref, sd = configured()
    xs = inputs()
    model.to("cpu")
    model.cpu()
    model.requires_grad_(False)
    for a, b in zip(run(model, xs), run(ref, xs)):
        assert torch.equal(a, b)
    layerwise.remove_layerwise_offload(model)
    assert no_trace_of_layerwise(model)
    model.half()  # an ordinary model again
    assert all(p.dtype == torch.float16 for p in model.parameters())


# --------------------------------------------------------------- backward
@pytest.mark.parametrize("depth,resident", [(0, 0), (1, 0), (2, 1)])
def test_backward_gives_exact_gradients(depth, resident):
    model, ref, sd = configured(depth=depth, resident=resident, delay=100)
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


# ---------------------------------------------------------- deepcopy, pickle
def test_deepcopy_and_pickle_are_refused_with_the_remedy():
    model, ref, sd = configured()
    with pytest.raises(TypeError, match="remove_layerwise_offload"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="remove_layerwise_offload"):
        pickle.dumps(model)
    with pytest.raises(TypeError, match="remove_layerwise_offload"):
        torch.save(model, io.BytesIO())
    xs = inputs()
    for a, b in zip(run(model, xs), run(ref, xs)):
        assert torch.equal(a, b)


# --------------------------------------------------- nested calls, threads
def test_nested_block_calls_are_exact():
    model = nested_model([(0, 1), (3, 4)])
    x = torch.randn(4, 16)
    with torch.no_grad():
        expect = model(x)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1, debug_copy_delay_us=100)
    with torch.no_grad():
        for _ in range(5):
            assert torch.equal(model(x), expect)


def test_nested_call_into_a_shared_slot_raises_instead_of_computing_wrong():
    model = nested_model([(0, 2)], n=4)  # depth 1: slots 0,1,0,1: layers 0 and 2 share slot 0
    x = torch.randn(4, 16)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"blocks\[2\].*shares its ring slot"):
        model(x)
    model.blocks[0].callee = None  # the user fixes the model: exact again
    with torch.no_grad():
        out = model(x)
    layerwise.remove_layerwise_offload(model)
    with torch.no_grad():
        assert torch.equal(out, model(x))


def test_two_threads_get_exact_outputs():
    model, ref, sd = configured(depth=1, delay=50)
    xs = [inputs(4, seed=s) for s in (1, 2)]
    expect = [run(ref, x) for x in xs]
    wrong, errors = [0, 0], []

    def worker(t):
        try:
            with torch.no_grad():
                for k in range(150):
                    out = model(xs[t][k % 4])
                    wrong[t] += not torch.equal(out, expect[t][k % 4])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in (0, 1)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the threads inside forwards, not only between them
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert not errors and wrong == [0, 0]


# ------------------------------------------------------------ real SIGINTs
SIGINT_SCRIPT = textwrap.dedent(r"""
    import os, random, signal, statistics, sys, threading, time, copy
    import torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    import layerwise
    from layerwise.configure import managers_of, prepare_groups
    from helpers.models import TwoGroupModel
    GROUPS = ["transformer_blocks", "single_transformer_blocks"]
    mode, target = sys.argv[1], int(sys.argv[2])
    rng = random.Random(int(sys.argv[3]))
    pid = os.getpid()
    DEADLINE = time.monotonic() + float(sys.argv[5])
    durations = []  # of recent uninterrupted runs: the window follows the machine's load

    def window():
        return 1.2 * statistics.median(durations[-7:])

    # The SIGINT is sent from a SIGALRM handler: the kernel's timer fires on time
    # however loaded the machine is (a sleeping thread may wake too late for a short
    # operation), and the SIGINT is then the kernel's, delivered where Python is.
    signal.signal(signal.SIGALRM, lambda *a: os.kill(pid, signal.SIGINT))

    def interrupted_during(fn):
        # fn under a real SIGINT sent at a random moment within the window of its start
        delay = rng.uniform(0, window())
        finished = False
        t0 = time.perf_counter()
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-6))
                fn()
                finished = True
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt:
            return not finished  # (one that arrived just after fn returned did not land inside it)
        durations.append(time.perf_counter() - t0)
        return False

    def more(k):  # until enough interrupts landed inside the operation (or the time cap)
        return interrupted < target and k < 10 * target and time.monotonic() < DEADLINE

    def timed(fn):
        t0 = time.perf_counter(); fn(); durations.append(time.perf_counter() - t0)

    interrupted = bad = attempts = 0
    if mode == "configure":
        for _ in range(5):  # warm: the first configure imports and allocates for the first time
            m = TwoGroupModel()
            timed(lambda: layerwise.configure_layerwise_offload(m, GROUPS, device="cpu"))
            layerwise.remove_layerwise_offload(m)
        k = 0
        while more(k):
            torch.manual_seed(k)
            model = TwoGroupModel()
            sd = {{k2: (v.clone(), v.stride()) for k2, v in model.state_dict().items()}}
            interrupted += interrupted_during(
                lambda: layerwise.configure_layerwise_offload(model, GROUPS, device="cpu"))
            if managers_of(model):
                layerwise.remove_layerwise_offload(model)
            for k2, v in model.state_dict().items():
                if not torch.equal(v, sd[k2][0]) or v.stride() != sd[k2][1]:
                    bad += 1
                    print("WRONG", k, k2, flush=True)
            k += 1
        attempts = k
    else:
        torch.manual_seed(0)
        disk_mode = mode.startswith("disk") or mode == "remove-spill"
        d = 256 if disk_mode else 32
        model = TwoGroupModel(d=d, n_a=7, n_b=4)
        ref = copy.deepcopy(model)
        sd_ref = {{k: v.clone() for k, v in ref.state_dict().items()}}
        opts = dict(debug_copy_delay_us=300)
        depth = int(mode[-1]) if mode[-1].isdigit() else 1
        if disk_mode:  # the disk tier: most layers in spill files, reads delayed at random
            def fits(budget):
                try:
                    probe = copy.deepcopy(ref)
                    layerwise.configure_layerwise_offload(probe, GROUPS, device="cpu", prefetch_depth=depth,
                                                          host_budget=budget, spill_dir=sys.argv[4])
                except ValueError:
                    return False
                layerwise.remove_layerwise_offload(probe)
                return True

            hi = 1 << 14
            while not fits(hi):
                hi *= 2
            lo = hi // 2
            while hi - lo > 1024:  # about the smallest budget that works: nearly every layer on disk
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid) else (mid, hi)
            opts.update(host_budget=hi, spill_dir=sys.argv[4], debug_read_delay_us=300)
        if mode == "remove-compress":
            opts["compress"] = "lossless"

        def configure(m):
            layerwise.configure_layerwise_offload(m, GROUPS, device="cpu", prefetch_depth=depth, **opts)
            if disk_mode:
                assert sum(s.kind == "disk" for mg in managers_of(m) for s in mg.sources) >= 4

        xs = [torch.randn(2, d) for _ in range(4)]
        with torch.no_grad():
            expect = [ref(x) for x in xs]

        def check(m, x, want, k, what):
            global bad
            with torch.no_grad():
                out = m(x)
            if not torch.equal(out, want):
                bad += 1
                print("WRONG", what, k, flush=True)

        if mode.startswith("remove"):
            for _ in range(3):
                m = copy.deepcopy(ref)
                configure(m)
                timed(lambda: layerwise.remove_layerwise_offload(m))
            k = 0
            while more(k):
                m = copy.deepcopy(ref)
                configure(m)
                check(m, xs[k % 4], expect[k % 4], k, "before remove")
                interrupted += interrupted_during(lambda: layerwise.remove_layerwise_offload(m))
                if managers_of(m):  # interrupted: still offloaded, and exact
                    check(m, xs[(k + 1) % 4], expect[(k + 1) % 4], k, "after an interrupted remove")
                    layerwise.remove_layerwise_offload(m)  # the retry completes
                sd = m.state_dict()
                if managers_of(m) or any(not torch.equal(sd[key], v) for key, v in sd_ref.items()):
                    bad += 1
                    print("WRONG state after remove", k, flush=True)
                check(m, xs[(k + 2) % 4], expect[(k + 2) % 4], k, "after remove")
                k += 1
            attempts = k
        else:
            configure(model)
            for _ in range(5):
                timed(lambda: model(xs[0]))
            k = 0
            while more(k):
                def forward():
                    with torch.no_grad():
                        model(xs[k % 4])

                interrupted += interrupted_during(forward)
                check(model, xs[(k + 1) % 4], expect[(k + 1) % 4], k, "after an interrupted forward")
                k += 1
            attempts = k
    print("RESULT", interrupted, bad, attempts, flush=True)
""")


@pytest.mark.parametrize("mode,target", [("configure", 30), ("forward1", 75), ("forward2", 75), ("disk1", 50),
                                         ("disk2", 50), ("remove", 40), ("remove-spill", 30),
                                         ("remove-compress", 30)])
def test_real_sigints_never_leave_a_wrong_model(mode, target, tmp_path):
    """Real SIGINTs at random moments of an operation; it runs until `target` of them
    landed inside the operation (the window follows the operation's measured time, so
    a loaded machine changes how long this takes, not what it decides)."""
    import os

    script = tmp_path / "sigint.py"
    script.write_text(SIGINT_SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__))))
    cap = 240
    proc = subprocess.run([sys.executable, str(script), mode, str(target), "7", str(tmp_path), str(cap)],
                          capture_output=True, text=True, timeout=cap + 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    interrupted, bad, attempts = map(int, line.split()[1:])
    assert bad == 0, proc.stdout[-3000:]
    assert interrupted >= target, (
        f"only {interrupted} of {attempts} interrupts landed inside the operation within {cap} s")


# ------------------------------------------------------------------- LoRA
def _flux(seed=0):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(seed)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(4, 6, 6),
    ).eval()


def _flux_run(model, seed=5):
    g = torch.Generator().manual_seed(seed)
    kw = dict(hidden_states=torch.randn(1, 16, 8, generator=g), encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
              pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.rand(1, generator=g),
              img_ids=torch.randint(0, 8, (16, 3), generator=g).float(), txt_ids=torch.zeros(6, 3),
              return_dict=False)
    with torch.no_grad():
        return model(**kw)[0]


def _add_lora(model, seed=3):
    peft = pytest.importorskip("peft")
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "proj_out"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("when", ["before", "after"])
def test_lora_adapters_and_fusing_match_the_resident_model(when):
    pytest.importorskip("peft")
    from peft.tuners.tuners_utils import BaseTunerLayer

    ref = _flux()
    _add_lora(ref)
    model = _flux()
    if when == "before":
        _add_lora(model)
    layerwise.configure_layerwise_offload(model, ["transformer_blocks", "single_transformer_blocks"], device="cpu",
                                          debug_copy_delay_us=100)
    if when == "after":
        _add_lora(model)
    assert torch.equal(_flux_run(model), _flux_run(ref))
    for m in (model, ref):  # fuse, as diffusers' fuse_lora does
        for mod in m.modules():
            if isinstance(mod, BaseTunerLayer):
                mod.merge()
    assert torch.equal(_flux_run(model), _flux_run(ref))
    assert torch.equal(_flux_run(model, seed=6), _flux_run(ref, seed=6))
    for m in (model, ref):
        for mod in m.modules():
            if isinstance(mod, BaseTunerLayer):
                mod.unmerge()
    assert torch.equal(_flux_run(model), _flux_run(ref))
    sd_ref = ref.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd_ref[k]), k


# -------------------------------------------------------------- hook order
def _weight_normed_stack(n=6, d=16):
    import warnings

    torch.manual_seed(0)
    model = nn.Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.blocks = nn.ModuleList([torch.nn.utils.weight_norm(nn.Linear(d, d)) for _ in range(n)])

    def forward(x):
        for blk in model.blocks:
            x = torch.tanh(blk(x))
        return x

    model.forward = forward
    return model


@pytest.mark.parametrize("depth", [1, 2])
def test_weight_normed_blocks_are_exact_under_copy_delays(depth):
    # weight_norm computes `weight` in a forward pre-hook registered before configure:
    # it must run after our wait, so it reads this layer's weight_g / weight_v.
    model = _weight_normed_stack()
    xs = [torch.randn(3, 16) for _ in range(3)]
    with torch.no_grad():
        expect = [model(x) for x in xs]
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=depth,
                                          debug_copy_delay_us=2000)
    with torch.no_grad():
        for _ in range(3):
            for x, e in zip(xs, expect):
                assert torch.equal(model(x), e)


def test_user_hooks_before_and_after_configure_see_their_layers_weights():
    model, ref, sd = configured(depth=1, delay=2000)
    seen = {"pre": [], "post": []}
    truth = [sd[f"transformer_blocks.{i}.up.weight"].float().sum().item() for i in range(5)]

    def pre(i):
        return lambda m, a: seen["pre"].append((i, m.up.weight.float().sum().item()))

    def post(i):
        return lambda m, a, o: seen["post"].append((i, m.up.weight.float().sum().item()))

    layerwise.remove_layerwise_offload(model)
    for i, blk in enumerate(model.transformer_blocks):  # registered before configure
        blk.register_forward_pre_hook(pre(i))
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", debug_copy_delay_us=2000)
    for i, blk in enumerate(model.transformer_blocks):  # and after
        blk.register_forward_hook(post(i))
    run(model, inputs(4))
    assert len(seen["pre"]) == len(seen["post"]) == 20
    for kind in ("pre", "post"):
        for i, s in seen[kind]:
            assert s == truth[i], (kind, i)


def test_a_cuda_graph_capture_that_is_refused_leaves_the_model_streaming_exactly(monkeypatch):
    # A fake capture flag on a CPU model (the same code path as on CUDA), and a group
    # that cannot be captured (runtime/capture.py's refusal, here with grad enabled).
    model, ref, sd = configured()
    m = managers_of(model)[0]

    class FakeCudaEngine:
        is_cuda = True

    monkeypatch.setattr(m, "_engine", FakeCudaEngine())
    monkeypatch.setattr(layerwise.runtime.gpu_checks, "stream_capturing", lambda device: True)
    monkeypatch.setattr(layerwise.runtime.capture.CudaApi, "pinned", lambda self, t: True)
    with torch.enable_grad(), pytest.raises(RuntimeError, match="cannot be captured into a CUDA graph.*grad"):
        model(inputs(1)[0])
    monkeypatch.undo()
    for a, b in zip(run(model, inputs()), run(ref, inputs())):
        assert torch.equal(a, b)


@pytest.mark.parametrize("where", ["commit_configure", "_log_summary"])
@pytest.mark.parametrize("entry", ["configure", "load_offloaded"])
def test_ctrl_c_while_a_configure_completes_is_delivered_on_a_whole_model(monkeypatch, tmp_path, where, entry):
    # A real SIGINT that arrives once every group is packed and finalised (while the
    # configure records itself) is held back until the model is whole, then raised:
    # the model is configured, exact and removable, never half of one.
    import os
    import signal

    from layerwise import configure as configure_mod

    src = make(seed=3)
    ref = copy.deepcopy(src)
    xs = inputs()
    if where == "commit_configure":
        orig = manager_mod.LayerwiseOffloadManager.commit_configure

        def interrupted(self):
            os.kill(os.getpid(), signal.SIGINT)
            return orig(self)

        monkeypatch.setattr(manager_mod.LayerwiseOffloadManager, "commit_configure", interrupted)
    else:
        orig = configure_mod._log_summary
        monkeypatch.setattr(configure_mod, "_log_summary",
                            lambda *a: (os.kill(os.getpid(), signal.SIGINT), orig(*a))[1])
    if entry == "configure":
        model = src
        with pytest.raises(KeyboardInterrupt):
            layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "m.safetensors"))
        model = make(seed=0)  # real weights of its own: replaced by the checkpoint's
        with pytest.raises(KeyboardInterrupt):
            layerwise.load_offloaded(model, tmp_path / "m.safetensors", GROUPS, device="cpu")
    monkeypatch.undo()
    assert len(managers_of(model)) == 2
    for a, b in zip(run(model, xs), run(ref, xs)):
        assert torch.equal(a, b)
    layerwise.remove_layerwise_offload(model)
    assert no_trace_of_layerwise(model)
    for a, b in zip(run(model, xs), run(ref, xs)):
        assert torch.equal(a, b)


# ------------------------------------------ found by attacking the contract
def test_writes_through_state_dict_tensors_freed_at_once_still_reach_the_model():
    model, ref, sd = configured(depth=1)
    xs = inputs()
    run(model, xs)
    new = make(seed=5).state_dict()
    with torch.no_grad():
        for k, v in model.state_dict().items():  # the usual "copy new weights in" helper
            v.copy_(new[k])
        for k, v in ref.state_dict().items():
            v.copy_(new[k])
    for _ in range(2):
        for a, b in zip(run(model, xs), run(ref, xs)):
            assert torch.equal(a, b)


def test_load_state_dict_under_inference_mode_takes_effect():
    model, ref, sd = configured(depth=1)
    xs = inputs()
    run(model, xs)
    new = make(seed=5)
    with torch.inference_mode():
        model.load_state_dict(new.state_dict())
    for a, b in zip(run(model, xs), run(new, xs)):
        assert torch.equal(a, b)


def test_an_in_place_write_is_still_refused_after_an_unrelated_load_state_dict():
    model, ref, sd = configured(depth=1)
    xs = inputs()
    expect = run(ref, xs)
    run(model, xs)
    with torch.no_grad():
        model.transformer_blocks[2].up.weight.mul_(0)
    model.load_state_dict({"head.bias": sd["head.bias"]}, strict=False)
    with pytest.raises(RuntimeError, match="in-place write"):
        run(model, xs)
    for a, b in zip(run(model, xs), expect):
        assert torch.equal(a, b)


def test_writes_through_state_dict_between_forward_and_backward_are_refused():
    model, ref, sd = configured(depth=1)
    x = inputs(1)[0].requires_grad_()
    out = model(x)
    with torch.no_grad():
        model.state_dict()["transformer_blocks.0.up.weight"].mul_(2)
    run(model, inputs(1, seed=3))  # refills the slots
    with pytest.raises(RuntimeError, match="weights of transformer_blocks\\[0\\].*changed"):
        out.square().sum().backward()


@pytest.mark.parametrize("flag", ["set_overwrite_module_params_on_conversion", "set_swap_module_params_on_conversion"])
def test_parameter_replacing_conversion_flags_are_refused(flag):
    model, ref, sd = configured()
    setter = getattr(torch.__future__, flag)
    setter(True)
    try:
        with pytest.raises(RuntimeError, match="remove_layerwise_offload"):
            model.to("cpu")
    finally:
        setter(False)
    layerwise.remove_layerwise_offload(model)
    for a, b in zip(run(model, inputs()), run(ref, inputs())):
        assert torch.equal(a, b)


class _Tokens(nn.Module):
    """Learned query tokens, returned as they are (a view of the block's own weight)."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return self.tokens.unsqueeze(0) + 0 * x.sum() if x is not None else self.tokens.unsqueeze(0)


def test_a_block_output_that_is_a_view_of_its_weights_survives_the_next_copies():
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([_Tokens() for _ in range(4)])
    model.forward = lambda: [b(None) for b in model.blocks]
    expect = [t.clone() for t in model()]
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1, debug_copy_delay_us=500)
    with torch.no_grad():
        for _ in range(3):
            for a, b in zip(model(), expect):
                assert torch.equal(a, b)


def test_parameters_that_overlap_in_memory_stay_together():
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
    for blk in model.blocks:
        blk.alias = nn.Parameter(blk.weight.data[2:6])  # overlaps the weight

    def forward(x):
        for blk in model.blocks:
            x = blk(x) + blk.alias.sum()
        return x

    model.forward = forward
    ref = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    new = {k: v * 2 for k, v in ref.state_dict().items() if k.endswith("weight")}
    model.load_state_dict(new, strict=False)
    ref.load_state_dict(new, strict=False)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert torch.equal(model.blocks[1].alias, model.blocks[1].weight[2:6])


def test_configure_and_state_dict_under_inference_mode():
    model = make()
    ref = copy.deepcopy(model)
    with torch.inference_mode():
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
        sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k


@pytest.mark.parametrize("kind", [{"use_dora": True}, {"init_lora_weights": "pissa"}])
def test_adapters_whose_init_reads_base_weights_after_configure_are_refused_at_the_forward(kind):
    peft = pytest.importorskip("peft")
    model = _flux()
    layerwise.configure_layerwise_offload(model, ["transformer_blocks", "single_transformer_blocks"], device="cpu")
    _flux_run(model)  # the ring holds some layers' weights, not every layer's own
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k"], **kind))
    with pytest.raises(RuntimeError, match="initialisation.*base weight.*before|configure again"):
        _flux_run(model)


def test_remove_while_another_thread_runs_forwards_is_exact():
    model, ref, sd = configured(depth=1, delay=100)
    xs = inputs(4)
    expect = run(ref, xs)
    wrong, errors, done = [0], [], threading.Event()

    def worker():
        try:
            with torch.no_grad():
                k = 0
                while not done.is_set() and k < 400:
                    out = model(xs[k % 4])
                    wrong[0] += not torch.equal(out, expect[k % 4])
                    k += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for _ in range(3):
            t = threading.Thread(target=worker)
            t.start()
            import time

            time.sleep(0.05)
            layerwise.remove_layerwise_offload(model)  # waits for the forward under way, then removes
            time.sleep(0.02)  # the worker goes on, on the plain model
            done.set()
            t.join(60)
            done.clear()
            layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", debug_copy_delay_us=100)
    finally:
        sys.setswitchinterval(interval)
    assert not errors and wrong[0] == 0, (errors, wrong)
