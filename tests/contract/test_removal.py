"""The way out: remove_layerwise_offload / remove_pipeline_offload are one
transaction. A failure or Ctrl-C at any point of a removal leaves the model
streaming exactly (outputs and state_dict bitwise), a retry completes, and a
state_dict() or load_state_dict() on another thread sees the model wholly
before or wholly after the removal."""
import copy
import os
import threading

import pytest
import torch

import layerwise
from layerwise.configure import managers_of
from layerwise.runtime import host_store as packing_mod
from layerwise.stages import disk as disk_mod

from helpers.contract import assert_fingerprint, fingerprint, inputs, make, no_trace_of_layerwise, run

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def _configure(model, mode, tmp_path, **kw):
    if mode == "compress":
        kw["compress"] = "lossless"
    elif mode == "spill":  # nearly every layer in a spill file
        kw.update(host_budget=_smallest_budget(model, tmp_path), spill_dir=str(tmp_path))
    elif mode == "resident":
        kw["resident_layers"] = 2
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", debug_copy_delay_us=50, **kw)
    if mode == "spill":
        assert sum(s.kind == "disk" for m in managers_of(model) for s in m.sources) >= 4
    return model


_BUDGETS = {}


def _smallest_budget(model, tmp_path):
    key = tuple((n, p.shape) for n, p in model.named_parameters())
    if key in _BUDGETS:
        return _BUDGETS[key]
    ref = copy.deepcopy(model)

    def fits(budget):
        probe = copy.deepcopy(ref)
        try:
            layerwise.configure_layerwise_offload(probe, GROUPS, device="cpu", host_budget=budget,
                                                  spill_dir=str(tmp_path))
        except ValueError:
            return False
        layerwise.remove_layerwise_offload(probe)
        return True

    hi = 1 << 14
    while not fits(hi):
        hi *= 2
    lo = hi // 2
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    _BUDGETS[key] = hi
    return hi


def _still_streaming_exactly(model, expect, sd_ref):
    assert managers_of(model), "the model is no longer offloaded after a removal that failed"
    assert all(m.streaming for m in managers_of(model))
    for out, want in zip(run(model, inputs()), expect):
        assert torch.equal(out, want)
    sd = model.state_dict()
    assert sd.keys() == sd_ref.keys()
    for k, v in sd_ref.items():
        assert torch.equal(sd[k], v), k


def _fail_materialize_at(monkeypatch, k, exc=RuntimeError) -> list:
    """The (k+1)-th parameter a removal builds raises exc (k None: none does); the
    list returned counts the calls."""
    orig = packing_mod.materialize
    calls = [0]

    def failing(e, block, device):
        calls[0] += 1
        if calls[0] == (-1 if k is None else k + 1):
            raise exc(f"injected at parameter {k}")
        return orig(e, block, device)

    monkeypatch.setattr(packing_mod, "materialize", failing)
    return calls


def _count_materialized(monkeypatch, mode, tmp_path):
    probe = _configure(make(), mode, tmp_path)
    calls = _fail_materialize_at(monkeypatch, None)
    layerwise.remove_layerwise_offload(probe)
    monkeypatch.undo()
    return calls[0]


@pytest.mark.parametrize("mode", ["plain", "resident", "compress", "spill"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failure_at_every_parameter_of_a_removal_leaves_the_model_streaming(monkeypatch, tmp_path, mode, exc):
    total = _count_materialized(monkeypatch, mode, tmp_path)
    assert total > 10
    ref = make()
    expect = run(ref, inputs())
    sd_ref = {k: v.clone() for k, v in ref.state_dict().items()}
    for k in range(total):
        model = _configure(make(), mode, tmp_path)
        _fail_materialize_at(monkeypatch, k, exc)
        with pytest.raises(exc, match=f"injected at parameter {k}$"):
            layerwise.remove_layerwise_offload(model)
        monkeypatch.undo()
        _still_streaming_exactly(model, expect, sd_ref)
        assert layerwise.remove_layerwise_offload(model) is model  # the retry completes
        assert no_trace_of_layerwise(model)
        assert_fingerprint(model, fingerprint(ref))
        for out, want in zip(run(model, inputs()), expect):
            assert torch.equal(out, want)
    if mode == "spill":
        assert not os.listdir(tmp_path), "spill files left behind"


def test_a_layer_that_cannot_be_read_fails_the_removal_and_the_model_keeps_streaming(monkeypatch, tmp_path):
    """A source that fails on the way out (a spill file's read, at every disk layer)."""
    ref = make()
    expect = run(ref, inputs())
    sd_ref = {k: v.clone() for k, v in ref.state_dict().items()}
    model = _configure(make(), "spill", tmp_path)
    n_disk = sum(s.kind == "disk" for m in managers_of(model) for s in m.sources)
    layerwise.remove_layerwise_offload(model)
    orig = disk_mod.DiskSource.read
    for k in range(n_disk):
        model = _configure(make(), "spill", tmp_path)
        calls = [0]

        def failing(self):
            calls[0] += 1
            if calls[0] == k + 1:
                raise OSError(5, f"injected read failure at disk layer {k}")
            return orig(self)

        monkeypatch.setattr(disk_mod.DiskSource, "read", failing)
        with pytest.raises(OSError, match=f"injected read failure at disk layer {k}$"):
            layerwise.remove_layerwise_offload(model)
        monkeypatch.undo()
        _still_streaming_exactly(model, expect, sd_ref)
        layerwise.remove_layerwise_offload(model)
        assert_fingerprint(model, fingerprint(ref))
    assert not os.listdir(tmp_path)


def test_a_checkpoint_cut_short_fails_the_removal_clearly_and_a_retry_after_restoring_it_completes(tmp_path):
    from helpers.disk import budget, meta_model, save_checkpoint
    from helpers.disk import inputs as disk_inputs
    from helpers.disk import make as disk_make

    ref = disk_make()
    path = save_checkpoint(ref, str(tmp_path / "model.safetensors"))
    xs = disk_inputs()
    expect = [ref(x) for x in xs]
    model = meta_model()
    layerwise.load_offloaded(model, path, "blocks", device="cpu", host_budget=budget(ref, 1))
    assert sum(s.kind == "disk" for m in managers_of(model) for s in m.sources) >= 3
    assert all(torch.equal(model(x), e) for x, e in zip(xs, expect))
    original = open(path, "rb").read()
    with open(path, "r+b") as f:  # its layers' bytes are gone
        f.truncate(len(original) // 3)
    with pytest.raises(OSError, match="model.safetensors"):
        layerwise.remove_layerwise_offload(model)
    assert managers_of(model) and all(m.streaming for m in managers_of(model))
    with open(path, "wb") as f:
        f.write(original)
    assert all(torch.equal(model(x), e) for x, e in zip(xs, expect))  # the file is back: exact again
    layerwise.remove_layerwise_offload(model)
    assert no_trace_of_layerwise(model)
    sd = ref.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert all(torch.equal(model(x), e) for x, e in zip(xs, expect))


@pytest.mark.parametrize("mode", ["plain", "spill"])
def test_state_dict_on_another_thread_during_a_removal_is_always_true(tmp_path, mode):
    ref = make()
    sd_ref = {k: v.clone() for k, v in ref.state_dict().items()}
    wrong, calls, errors = [], [0], []
    for _ in range(12):
        model = _configure(make(), mode, tmp_path)
        stop = threading.Event()
        started = threading.Event()

        def reader():
            try:
                while not stop.is_set():
                    sd = model.state_dict()
                    calls[0] += 1
                    started.set()
                    for k, v in sd_ref.items():
                        if not torch.equal(sd[k], v):
                            wrong.append(k)
            except Exception as err:  # noqa: BLE001 - an error here is a failure of the test
                errors.append(repr(err))
                started.set()

        t = threading.Thread(target=reader)
        t.start()
        started.wait(30)
        layerwise.remove_layerwise_offload(model)
        for _ in range(3):  # a few more after the removal
            sd = model.state_dict()
            assert all(torch.equal(sd[k], v) for k, v in sd_ref.items())
        stop.set()
        t.join(60)
        assert not errors, errors[:3]
        assert not wrong, wrong[:5]
    assert calls[0] >= 12


def test_load_state_dict_on_another_thread_during_a_removal_takes_effect(tmp_path):
    """Each load is applied to the streamed model or to the plain one, never lost."""
    for trial in range(8):
        model = _configure(make(), "plain", tmp_path)
        key = "transformer_blocks.1.up.weight"
        values = [torch.full_like(model.state_dict()[key], float(j)) for j in range(1, 40)]
        done = []

        def loader():
            for v in values:
                model.load_state_dict({key: v}, strict=False)
                done.append(v)

        t = threading.Thread(target=loader)
        t.start()
        layerwise.remove_layerwise_offload(model)
        t.join(60)
        assert len(done) == len(values)
        assert torch.equal(model.state_dict()[key], values[-1])
        assert torch.equal(model.transformer_blocks[1].up.weight, values[-1])


# ---------------------------------------------------------------- pipelines
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failure_during_remove_pipeline_offload_leaves_every_component_streaming(monkeypatch, exc):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from layerwise import pipelines
    from layerwise.bench.pipeline import SIZES, generate, tiny_flux_pipeline

    size = SIZES["tiny"]
    reference = generate(tiny_flux_pipeline(size), size)
    names = ("vae", "text_encoder", "text_encoder_2", "transformer")
    before = {n: {k: v.clone() for k, v in getattr(tiny_flux_pipeline(size), n).state_dict().items()} for n in names}
    pipe = tiny_flux_pipeline(size)
    layerwise.offload_pipeline(pipe, device="cpu", resident_layers=1)
    calls = _fail_materialize_at(monkeypatch, None)
    layerwise.remove_pipeline_offload(pipe)
    monkeypatch.undo()
    total = calls[0]
    assert total > 40
    # The first and last parameters of the removal and points spread between them
    # (every index would take minutes: each trial builds a pipeline).
    for k in sorted({0, 1, total - 1, *range(2, total - 1, max(1, total // 9))}):
        pipe = tiny_flux_pipeline(size)
        layerwise.offload_pipeline(pipe, device="cpu", resident_layers=1)
        _fail_materialize_at(monkeypatch, k, exc)
        with pytest.raises(exc, match=f"injected at parameter {k}$"):
            layerwise.remove_pipeline_offload(pipe)
        monkeypatch.undo()
        assert pipelines.is_offloaded_pipeline(pipe)
        assert all(managers_of(getattr(pipe, n)) for n in names)
        assert torch.equal(generate(pipe, size), reference), k
        layerwise.remove_pipeline_offload(pipe)  # the retry completes
        assert not pipelines.is_offloaded_pipeline(pipe)
        for n in names:
            module = getattr(pipe, n)
            assert not managers_of(module)
            sd = module.state_dict()
            for key, v in before[n].items():
                assert torch.equal(sd[key], v), (k, n, key)
        assert torch.equal(generate(pipe, size), reference), k


# ------------------------------------------- forwards an interrupt abandoned
def _interrupt_inside_a_layer(model, x, exc=KeyboardInterrupt):
    """A forward that leaves a layer by a BaseException that is not an Exception:
    torch then runs no always_call hook, so layerwise's post-hook never runs."""
    def boom(*a):
        raise exc()

    h = model.transformer_blocks[2].up.register_forward_hook(boom)
    try:
        with torch.no_grad():
            model(x)
    except exc:
        pass
    finally:
        h.remove()


def _in_thread(fn, timeout=60):
    out, errors = [], []

    def run_():
        try:
            out.append(fn())
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    t = threading.Thread(target=run_, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} still running after {timeout} s: it hangs"
    assert not errors, errors
    return out[0]


def _interrupted_model(tmp_path):
    """(reference, input, its output, a streamed model whose last forward a
    KeyboardInterrupt abandoned inside a layer)."""
    ref = make()
    x = inputs(1)[0]
    with torch.no_grad():
        want = ref(x)
    model = _configure(make(), "plain", tmp_path)
    _interrupt_inside_a_layer(model, x)
    return ref, x, want, model


def test_a_removal_on_another_thread_after_a_forward_interrupted_inside_a_layer(tmp_path):
    ref, x, want, model = _interrupted_model(tmp_path)
    _in_thread(lambda: layerwise.remove_layerwise_offload(model))  # the abandoned hold is taken over
    assert no_trace_of_layerwise(model)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert_fingerprint(model, fingerprint(ref))


def test_a_forward_waiting_on_another_thread_after_an_interrupted_one_runs(tmp_path):
    _, x, want, model = _interrupted_model(tmp_path)
    with torch.no_grad():
        assert torch.equal(_in_thread(lambda: model(x)), want)  # still offloaded, exact
        assert torch.equal(model(x), want)  # and the interrupted thread goes on too
    layerwise.remove_layerwise_offload(model)


def test_a_thread_that_died_inside_a_layer_does_not_block_the_removal(tmp_path):
    ref = make()
    x = inputs(1)[0]
    model = _configure(make(), "plain", tmp_path)
    t = threading.Thread(target=_interrupt_inside_a_layer, args=(model, x, SystemExit))
    t.start()
    t.join(60)
    _in_thread(lambda: layerwise.remove_layerwise_offload(model))
    assert_fingerprint(model, fingerprint(ref))


def test_blocks_called_directly_on_another_thread_during_a_removal_are_exact(tmp_path):
    """A pipeline calls sub-blocks outside the model's forward (vae.decode): the
    removal cannot wait for forwards it never saw; the block runs streamed or plain."""
    ref = make()
    h = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = [blk(h) for blk in ref.transformer_blocks]
    for trial in range(10):
        model = _configure(make(), "plain", tmp_path)
        wrong, errors, stop = [], [], threading.Event()

        def caller():
            try:
                while not stop.is_set():
                    for i, blk in enumerate(model.transformer_blocks):
                        with torch.no_grad():
                            if not torch.equal(blk(h), want[i]):
                                wrong.append(i)
            except Exception as err:  # noqa: BLE001
                errors.append(repr(err))

        t = threading.Thread(target=caller)
        t.start()
        layerwise.remove_layerwise_offload(model)
        stop.set()
        t.join(60)
        assert not errors, errors[:3]
        assert not wrong, wrong[:5]


def test_manager_remove_alone_leaves_the_model_plain_and_configurable(tmp_path):
    ref = make()
    x = inputs(1)[0]
    with torch.no_grad():
        want = ref(x)
    model = make()
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    managers[0].remove()
    assert managers_of(model) == [managers[1]]  # the other group still streams
    with torch.no_grad():
        assert torch.equal(model(x), want)
    managers[1].remove()
    assert no_trace_of_layerwise(model)
    copy.deepcopy(model)  # an ordinary module again
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(x), want)


SIG_DFL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import layerwise
from layerwise.runtime import group as mm
from helpers.models import TwoGroupModel
signal.signal(signal.SIGINT, signal.SIG_DFL)  # a program that lets Ctrl-C end it
model = TwoGroupModel()
layerwise.configure_layerwise_offload(model, ["transformer_blocks", "single_transformer_blocks"], device="cpu")
orig = mm.LayerwiseOffloadManager.commit_removal
def commit(self, prepared):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C lands while the removal commits
    return orig(self, prepared)
mm.LayerwiseOffloadManager.commit_removal = commit
layerwise.remove_layerwise_offload(model)
print("still running: the Ctrl-C was dropped", flush=True)
"""


def test_ctrl_c_held_back_during_the_commit_is_delivered_to_sig_dfl():
    import signal
    import subprocess
    import sys

    code = SIG_DFL_SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stdout, proc.stderr[-2000:])
