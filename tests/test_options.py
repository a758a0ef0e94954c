"""OffloadOptions (layerwise/options.py): every streaming option validated once,
where a front door builds the options, before anything in the model changes; the
same error at every front door; frozen; a manager built from options behaves as
one built from keywords."""
import dataclasses
import inspect
import pathlib
import re

import pytest
import torch

import layerwise
from layerwise import OffloadOptions
from layerwise.configure import managers_of
from layerwise.options import OPTION_NAMES

from helpers.doors import Holder, front_door, save_checkpoint
from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]
INF, NAN = float("inf"), float("nan")
DOORS = ["LayerwiseOffloadManager", "configure_layerwise_offload", "load_offloaded", "offload_pipeline"]


def make():
    torch.manual_seed(0)
    return TwoGroupModel(n_a=4, n_b=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_checkpoint(make(), path)
    return path


def door_and_model(door, checkpoint):
    return front_door(door, make, GROUPS, checkpoint)


def state(model):
    """Every tensor of the state dict as (dtype, shape, device, bytes); meta tensors by shape."""
    out = {}
    for k, v in model.state_dict().items():
        data = None if v.is_meta else v.detach().cpu().contiguous().view(-1).view(torch.uint8).clone()
        out[k] = (v.dtype, tuple(v.shape), v.device.type, data)
    return out


def same_state(a, b):
    return a.keys() == b.keys() and all(
        a[k][:3] == b[k][:3] and (a[k][3] is None) == (b[k][3] is None)
        and (a[k][3] is None or torch.equal(a[k][3], b[k][3])) for k in a)


def hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


# (options, error, message): refused with that error and message at every front door
BAD = [
    (dict(device="tpu"), ValueError, "device 'tpu' is not a valid torch device"),
    (dict(device="meta"), ValueError, r"layerwise streams to 'cpu' or 'cuda\[:N\]', not 'meta'"),
    (dict(device=3.5), ValueError, "device 3.5 is not a valid torch device"),
    (dict(prefetch_depth=-1), ValueError, "prefetch_depth must be >= 0, got -1"),
    (dict(prefetch_depth=1.5), TypeError, "prefetch_depth must be an int >= 0, got 1.5"),
    (dict(prefetch_depth="1"), TypeError, "prefetch_depth must be an int >= 0"),
    (dict(resident_layers=-1), ValueError, "resident_layers must be >= 0, got -1"),
    (dict(resident_layers="1"), TypeError, "resident_layers must be an int"),
    (dict(resident_layers=NAN), ValueError, r"a fractional resident_layers must lie in \[0, 1\]"),
    (dict(resident_layers=-0.5), ValueError, r"a fractional resident_layers must lie in \[0, 1\]"),
    (dict(residency_policy="first"), ValueError, "residency_policy must be 'leading' or 'strided', got 'first'"),
    (dict(pin_memory="yes"), ValueError, "pin_memory must be True, False or 'auto', got 'yes'"),
    (dict(pin_memory=None), ValueError, "pin_memory must be True, False or 'auto', got None"),
    (dict(device_budget=-1), ValueError, "device_budget must be a finite number of bytes >= 0"),
    (dict(device_budget="lots"), ValueError, "device_budget must be a finite number of bytes >= 0"),
    (dict(budget_margin=INF), ValueError, "budget_margin must be a finite number of bytes >= 0"),
    (dict(device_budget=10 << 30, resident_layers=1), ValueError, "were both given: pass one of them"),
    (dict(num_copy_streams=0), ValueError, "num_copy_streams must be an int >= 1, got 0"),
    (dict(num_copy_streams="2"), TypeError, "num_copy_streams must be an int >= 1"),
    (dict(debug_copy_delay_us=-1), ValueError, r"debug_copy_delay_us must be an int >= 0 \(microseconds\)"),
    (dict(debug_copy_delay_us=1.5), TypeError, r"debug_copy_delay_us must be an int >= 0 \(microseconds\)"),
    (dict(debug_read_delay_us=-1), ValueError, r"debug_read_delay_us must be an int >= 0 \(microseconds\)"),
    # Ranges the native side takes (csrc/bindings.cpp), refused before packing rather than by pybind11 after it;
    # 10**5 streams would start that many threads per group.
    (dict(num_copy_streams=2**31), ValueError, (r"num_copy_streams must lie in \[1, 16\] \(copy streams per layer "
                                                r"group\), got 2147483648")),
    (dict(num_copy_streams=10**5), ValueError, r"num_copy_streams must lie in \[1, 16\].*got 100000"),
    (dict(num_copy_streams=17), ValueError, r"num_copy_streams must lie in \[1, 16\].*got 17"),
    (dict(debug_copy_delay_us=2**31), ValueError, (r"debug_copy_delay_us must lie in \[0, 1000000\] microseconds "
                                                   r"\(a random delay of up to that much per copy; None: none\)")),
    (dict(debug_copy_delay_us=10**6 + 1), ValueError, r"debug_copy_delay_us must lie in \[0, 1000000\]"),
    (dict(debug_read_delay_us=2**31), ValueError, (r"debug_read_delay_us must lie in \[0, 1000000\] microseconds "
                                                   r"\(a random delay of up to that much per read; None: none\)")),
    (dict(measure_stalls="yes"), TypeError, "measure_stalls must be True or False, got 'yes'"),
    (dict(compress="zstd"), ValueError, "compress must be None or 'lossless'"),
    (dict(compress=True), ValueError, "compress must be None or 'lossless'"),
    (dict(host_budget=-1), ValueError, "host_budget must be a finite number of bytes >= 0"),
    (dict(host_budget=True), ValueError, "host_budget must be a finite number of bytes >= 0"),
    (dict(spill_dir="."), ValueError, "give host_budget too"),
    (dict(host_budget=1 << 30, spill_dir="/nonexistent/layerwise"), ValueError, "is not a directory"),
    (dict(disk_prefetch_depth=0), ValueError, "disk_prefetch_depth must be an int >= 1 or None, got 0"),
    (dict(disk_prefetch_depth="2"), ValueError, "disk_prefetch_depth must be an int >= 1 or None"),
    (dict(split_fetch="world"), TypeError, "split_fetch must be a torch.distributed ProcessGroup"),
]
MANAGER_KEYWORDS = set(inspect.signature(layerwise.LayerwiseOffloadManager).parameters)


def _case_id(case):
    return ",".join(f"{k}={v!r}" for k, v in case[0].items())


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("case", BAD, ids=_case_id)
def test_a_bad_option_is_refused_at_every_front_door_before_the_model_changes(door, case, checkpoint):
    options, exc, match = case
    assert set(options) <= set(OPTION_NAMES)
    other = sorted(set(options) - MANAGER_KEYWORDS)
    if door == "LayerwiseOffloadManager" and other:  # the planners' options: not the manager's keywords
        exc, match = TypeError, f"unexpected keyword argument '{other[0]}'"
    call, model = door_and_model(door, checkpoint)
    before, hooks_before = state(model), hooks(model)
    with pytest.raises(exc, match=match):
        call(**options)
    assert not managers_of(model) and hooks(model) == hooks_before
    assert same_state(state(model), before)
    if door != "LayerwiseOffloadManager" or not other:  # the same error where the options are built
        with pytest.raises(exc, match=match):
            OffloadOptions.build(**{"device": "cpu", **options})


def test_the_engine_ranges_end_where_the_native_side_ends():
    opts = OffloadOptions.build(device="cpu", num_copy_streams=16, debug_copy_delay_us=10**6,
                                debug_read_delay_us=10**6)
    assert (opts.num_copy_streams, opts.debug_copy_delay_us, opts.debug_read_delay_us) == (16, 10**6, 10**6)
    engine = layerwise.CopyEngine("cpu", num_streams=opts.num_copy_streams, debug_delay_us=opts.debug_copy_delay_us)
    assert engine.num_streams == 16 and engine.debug_delay_us == 10**6
    with pytest.raises(ValueError, match=r"must lie in \[0, 1000000\]"):  # the engine's own limit, the same
        layerwise.CopyEngine("cpu", debug_delay_us=10**6 + 1)


@pytest.mark.parametrize("door", DOORS)
def test_a_copy_delay_on_a_cuda_device_is_refused_before_the_model_changes(door, monkeypatch, checkpoint):
    """debug_copy_delay_us is a CPU-backend mode: the CUDA engine refuses it when a
    group is finalised, after packing; the options refuse it first (the device simulated)."""
    import layerwise.options as options_mod

    monkeypatch.setattr(options_mod, "resolve_device", lambda device: torch.device("cuda", 0))
    call, model = door_and_model(door, checkpoint)
    before = state(model)
    with pytest.raises(ValueError, match=r"debug_copy_delay_us=300 delays the CPU backend's copies .* does not "
                                         r"apply on cuda:0; leave it None there"):
        call(device="cuda", debug_copy_delay_us=300)
    assert not managers_of(model) and same_state(state(model), before)
    assert OffloadOptions.build(device="cuda", debug_copy_delay_us=0).debug_copy_delay_us == 0


def _cuda_refused(match):
    with pytest.raises(RuntimeError, match=match) as info:
        OffloadOptions.build(device="cuda")
    return str(info.value)


def test_device_cuda_says_first_what_stops_it(monkeypatch):
    """device="cuda" names the first thing the user must fix: a CPU-only torch, then
    no GPU visible, and only then layerwise's own CPU-only build (torch and the
    extension simulated where this machine has them otherwise)."""
    import layerwise._native as native

    if torch.version.cuda is None:  # this machine as it is
        text = _cuda_refused(r"device 'cuda': this torch \(.*\) is a CPU-only build: it cannot use a GPU")
        assert "rebuild" not in text
    monkeypatch.setattr(torch.version, "cuda", None)
    text = _cuda_refused(rf"device 'cuda': this torch \({re.escape(torch.__version__)}\) is a CPU-only build: it "
                         "cannot use a GPU. Install a CUDA build of torch")
    assert text.endswith("or pass device='cpu'")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = _cuda_refused(r"device 'cuda': torch \(built with CUDA 12.8\) sees no GPU: torch.cuda.is_available\(\) "
                         "is False")
    assert "LAYERWISE_BUILD" not in text and "CUDA_VISIBLE_DEVICES" in text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native, "build_info", lambda: {"with_cuda": False})
    _cuda_refused(r"device 'cuda': torch can use the GPU, but this build of layerwise has no CUDA backend: rebuild it "
                  "with LAYERWISE_BUILD=cuda")
    monkeypatch.setattr(native, "build_info", lambda: {"with_cuda": True})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert options_device("cuda") == torch.device("cuda", 0)  # nothing in the way: the device itself
    with pytest.raises(RuntimeError, match=r"device 'cuda:1' does not exist: 1 CUDA device\(s\) visible"):
        options_device("cuda:1")


@pytest.mark.parametrize("door", DOORS)
def test_device_cuda_with_a_cpu_only_torch_is_refused_at_every_front_door(door, monkeypatch, checkpoint):
    monkeypatch.setattr(torch.version, "cuda", None)  # (this machine's torch; simulated on a CUDA one)
    call, model = door_and_model(door, checkpoint)
    before = state(model)
    with pytest.raises(RuntimeError, match="device 'cuda': this torch .* is a CPU-only build"):
        call(device="cuda")
    assert not managers_of(model) and same_state(state(model), before)


def options_device(device):
    from layerwise.options import resolve_device

    return resolve_device(device)


@pytest.mark.parametrize("door", DOORS)
def test_an_unknown_option_is_a_type_error_naming_it(door, checkpoint):
    call, model = door_and_model(door, checkpoint)
    before = state(model)
    with pytest.raises(TypeError, match="colour") as info:
        call(colour="red")
    if door in ("load_offloaded", "offload_pipeline"):  # **options: the message lists what is accepted
        assert f"{door} got unexpected option(s) ['colour']; it takes" in str(info.value)
        assert all(name in str(info.value) for name in OPTION_NAMES)
        assert ("'uses'" in str(info.value)) == (door == "offload_pipeline")
    assert not managers_of(model) and same_state(state(model), before)
    with pytest.raises(TypeError, match=r"OffloadOptions.build got unexpected option\(s\) \['colour'\]"):
        OffloadOptions.build(colour="red")


def test_options_are_frozen_and_replace_gives_a_changed_copy():
    opts = OffloadOptions.build(device="cpu", prefetch_depth=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.prefetch_depth = 3
    other = dataclasses.replace(opts, pin_memory=False)
    assert (other.pin_memory, opts.pin_memory) == (False, "auto") and other.prefetch_depth == 2
    assert opts == OffloadOptions.build(device="cpu", prefetch_depth=2) and opts != other
    # A ProcessGroup is neither hashable nor comparable: split_fetch takes no part in == and hash.
    unhashable = dataclasses.replace(opts, split_fetch=[])
    assert unhashable == opts and hash(unhashable) == hash(opts)


def test_values_are_normalised_once(tmp_path):
    np = pytest.importorskip("numpy")
    opts = OffloadOptions.build(device=None, resident_layers=np.int64(2), num_copy_streams=np.int64(2),
                                host_budget=torch.tensor(1 << 20), spill_dir=pathlib.Path(tmp_path),
                                disk_prefetch_depth=np.int64(3), pin_memory=1)
    assert opts.device == layerwise.options.default_device()
    assert (opts.resident_layers, opts.num_copy_streams, opts.host_budget, opts.disk_prefetch_depth,
            opts.pin_memory) == (2, 2, 1 << 20, 3, True)
    assert all(type(x) is int for x in (opts.resident_layers, opts.num_copy_streams, opts.host_budget,
                                        opts.disk_prefetch_depth))
    assert opts.spill_dir == str(tmp_path)
    budgeted = OffloadOptions.build(device="cpu", device_budget=np.float64(1e9), budget_margin=np.int64(5))
    assert (budgeted.device_budget, budgeted.budget_margin) == (10**9, 5)
    assert type(budgeted.device_budget) is int and type(budgeted.budget_margin) is int
    assert OffloadOptions.build(device="cpu", host_budget="auto", device_budget="auto").host_budget == "auto"


# Each front door's own parameters (not streaming options): every other keyword of a door is an option.
OWN = {
    "LayerwiseOffloadManager": {"model", "layer_name", "num_layers", "initialize", "options"},
    "configure_layerwise_offload": {"model", "layer_names"},
    "load_offloaded": {"model", "checkpoint", "layer_names", "strict", "dtype", "kwargs"},
    "offload_pipeline": {"pipe", "components", "pin_budget", "options"},
    "tune": {"model_or_pipe", "run", "depths", "repeats", "apply"},
}


def test_every_front_door_has_the_options_defaults():
    """Each option's default lives in OffloadOptions' field; a front door's signature
    repeats it (for inspect.signature, help() and an IDE), and must repeat it exactly
    (value and type); every keyword a door declares is an option or one of its own
    (OWN); configure takes every option by name, the doors with **options the rest."""
    defaults = {f.name: f.default for f in dataclasses.fields(OffloadOptions)}
    defaults["device"] = None  # (a required field: None at a door is the default device)
    assert layerwise.options.DEFAULTS == defaults
    for name, own in OWN.items():
        door = getattr(layerwise, name)
        params = inspect.signature(door).parameters
        named = {k: p.default for k, p in params.items() if k not in own}
        assert set(named) <= set(defaults), (name, set(named) - set(defaults))
        wrong = {k: v for k, v in named.items() if not (type(v) is type(defaults[k]) and v == defaults[k])}
        assert named and not wrong, (name, wrong)
        assert own <= set(params), (name, own - set(params))
    assert set(defaults) <= set(inspect.signature(layerwise.configure_layerwise_offload).parameters)
    for name in ("load_offloaded", "offload_pipeline"):
        assert any(p.kind is p.VAR_KEYWORD for p in inspect.signature(getattr(layerwise, name)).parameters.values())


class _Built(Exception):
    pass


@pytest.mark.parametrize("door", DOORS)
def test_every_option_keyword_reaches_the_options_unchanged(door, monkeypatch):
    """What a door is given for each option, declared or through **options, is what
    OffloadOptions.build gets (no keyword dropped, renamed or defaulted on the way),
    and build gets nothing else."""
    got = {}

    def spy(cls, *, caller, also=(), **kw):
        got.update(kw)
        raise _Built

    monkeypatch.setattr(OffloadOptions, "build", classmethod(spy))
    params = inspect.signature(getattr(layerwise, door)).parameters
    takes = [k for k in OPTION_NAMES if k in params or door in ("load_offloaded", "offload_pipeline")]
    given = {k: object() for k in takes}
    args = {"LayerwiseOffloadManager": (make(), GROUPS[0]), "configure_layerwise_offload": (make(), GROUPS),
            "load_offloaded": (make(), "unused.safetensors", GROUPS), "offload_pipeline": (Holder(make()),)}[door]
    with pytest.raises(_Built):
        getattr(layerwise, door)(*args, **given)
    assert got.keys() == given.keys() and all(got[k] is given[k] for k in given), door
    if door != "LayerwiseOffloadManager":
        assert set(takes) == set(OPTION_NAMES)


def _forwards(model, steps=3):
    torch.manual_seed(1)
    with torch.no_grad():
        return [model(torch.randn(2, 32)) for _ in range(steps)]


def test_a_manager_built_from_options_behaves_as_one_built_from_keywords():
    keywords = dict(device="cpu", prefetch_depth=2, resident_layers=1, residency_policy="strided",
                    pin_memory=False, num_copy_streams=2, measure_stalls=False)
    ref = _forwards(make())
    a, b = make(), make()
    ma = layerwise.LayerwiseOffloadManager(a, GROUPS[0], **keywords)
    mb = layerwise.LayerwiseOffloadManager(b, GROUPS[0], options=OffloadOptions.build(**keywords))
    assert ma.options == mb.options
    for name in ("prefetch_depth", "device", "compress", "pin_memory", "resident", "residency_policy",
                 "num_copy_streams", "measure_stalls", "disk_prefetch_depth", "split_fetch"):
        assert getattr(ma, name) == getattr(mb, name), name
    out_a, out_b = _forwards(a), _forwards(b)
    assert all(torch.equal(x, y) and torch.equal(x, r) for x, y, r in zip(out_a, out_b, ref))
    layerwise.remove_layerwise_offload(a)
    layerwise.remove_layerwise_offload(b)


def test_configure_hands_its_options_to_every_manager():
    model = make()
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=2, pin_memory=False)
    want = OffloadOptions.build(device="cpu", prefetch_depth=2, pin_memory=False)
    assert all(m.options == want for m in managers)
    layerwise.remove_layerwise_offload(model)


def test_options_and_keywords_together_are_refused():
    model = make()
    opts = OffloadOptions.build(device="cpu")
    with pytest.raises(TypeError, match=r"got options= and the option keyword\(s\) \['prefetch_depth'\] too"):
        layerwise.LayerwiseOffloadManager(model, GROUPS[0], prefetch_depth=2, options=opts)
    with pytest.raises(TypeError, match="options must be an OffloadOptions"):
        layerwise.LayerwiseOffloadManager(model, GROUPS[0], options={"device": "cpu"})
    # Budgets are planned by the front doors that plan them, not by one manager on its own.
    with pytest.raises(ValueError, match="plans no budget.*host_budget=1048576"):
        layerwise.LayerwiseOffloadManager(model, GROUPS[0], options=dataclasses.replace(opts, host_budget=1 << 20))
    assert not managers_of(model)
    m = layerwise.LayerwiseOffloadManager(model, GROUPS[0], device="cpu", options=None)  # keywords alone
    assert m.options == opts
    layerwise.remove_layerwise_offload(model)


def test_offload_pipeline_gives_each_group_its_own_pin_memory():
    holder = Holder(make())
    managers = layerwise.offload_pipeline(holder, device="cpu", pin_budget=0)["model"]
    assert all(m.options.pin_memory is False and m.pin_memory is False for m in managers)
    assert all(m.options == dataclasses.replace(OffloadOptions.build(device="cpu"), pin_memory=False)
               for m in managers)
    layerwise.remove_pipeline_offload(holder)


@pytest.mark.parametrize("door", ["configure_layerwise_offload", "load_offloaded", "offload_pipeline",
                                  "LayerwiseOffloadManager"])
def test_the_decode_path_is_checked_at_the_front_door(door, monkeypatch, checkpoint):
    """Compress="lossless" on a CUDA device whose decode path
    cannot run (here TRITON_INTERPRET=1 on a GPU host, the device simulated) is refused
    by the options validation, at every front door, before the model changes; not in
    the first forward's hook."""
    import layerwise.options as options_mod

    monkeypatch.setattr(options_mod, "resolve_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        OffloadOptions.build(device="cuda", compress="lossless")
    call, model = door_and_model(door, checkpoint)
    before = state(model)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET='1' is set"):
        call(device="cuda", compress="lossless")
    assert not managers_of(model) and same_state(state(model), before)
    OffloadOptions.build(device="cuda", compress=None)  # (without compress there is nothing to decode)


# ------------------------------------------------- one build per call, one place per default
def _count_builds(monkeypatch) -> list:
    """The `caller` of every OffloadOptions.build from now on."""
    build = OffloadOptions.build.__func__
    calls = []

    def spy(cls, **kw):
        calls.append(kw.get("caller"))
        return build(cls, **kw)

    monkeypatch.setattr(OffloadOptions, "build", classmethod(spy))
    return calls


def test_each_front_door_builds_its_options_once(monkeypatch, checkpoint):
    """A front door builds one OffloadOptions from its keywords and hands that object
    down (every group of the call gets it); nothing below builds the options again."""
    calls = _count_builds(monkeypatch)
    model = make()
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=2)
    assert calls == ["configure_layerwise_offload"]
    assert len({id(m.options) for m in managers}) == 1 and managers[0].options.prefetch_depth == 2
    layerwise.remove_layerwise_offload(model)

    calls.clear()
    with torch.device("meta"):
        model = make()
    managers = layerwise.load_offloaded(model, checkpoint, GROUPS, device="cpu", prefetch_depth=2)
    assert calls == ["load_offloaded"] and len({id(m.options) for m in managers}) == 1
    layerwise.remove_layerwise_offload(model)

    for uses in (None, lambda pipe: pipe.model(torch.randn(2, 32))):  # (a warm-up offloads twice: one build)
        calls.clear()
        holder = Holder(make())
        managers = layerwise.offload_pipeline(holder, device="cpu", prefetch_depth=2, uses=uses)["model"]
        assert calls == ["offload_pipeline"] and all(m.prefetch_depth == 2 for m in managers)
        layerwise.remove_pipeline_offload(holder)

    calls.clear()
    model = make()
    m = layerwise.LayerwiseOffloadManager(model, GROUPS[0], device="cpu", prefetch_depth=2)
    assert calls == ["LayerwiseOffloadManager"]
    layerwise.remove_layerwise_offload(model)
    opts = OffloadOptions.build(device="cpu")
    calls.clear()
    m = layerwise.LayerwiseOffloadManager(model, GROUPS[0], options=opts)
    assert calls == [] and m.options is opts
    layerwise.remove_layerwise_offload(model)


def test_the_derived_defaults_are_the_options_own():
    """A default that follows from other values is computed by options.py, once, and
    read from the object below: the disk stage's staging slots (disk_prefetch_depth
    None: one more than the ring reads ahead, at least 2), the device budget's margin
    (budget_margin None: DEFAULT_MARGIN_FRACTION of the device), the size of an
    expert_cache="auto" (a quarter of the streamed experts' bytes, at most a quarter
    of the room the device budget leaves)."""
    from layerwise.options import DEFAULT_MARGIN_FRACTION, auto_expert_cache_bytes, budget_margin_bytes

    opts = OffloadOptions.build(device="cpu")
    assert opts.disk_prefetch_depth is None and opts.disk_staging_slots == 2
    assert OffloadOptions.build(device="cpu", prefetch_depth=3).disk_staging_slots == 4
    assert OffloadOptions.build(device="cpu", prefetch_depth=0).disk_staging_slots == 2
    assert OffloadOptions.build(device="cpu", prefetch_depth=3, disk_prefetch_depth=1).disk_staging_slots == 1
    assert dataclasses.replace(opts, prefetch_depth=5).disk_staging_slots == 6  # the depth a planner chose
    assert budget_margin_bytes(None, 16 << 30) == int(DEFAULT_MARGIN_FRACTION * (16 << 30))
    assert budget_margin_bytes(1 << 30, 16 << 30) == 1 << 30
    assert auto_expert_cache_bytes(4000, None) == 1000 and auto_expert_cache_bytes(4000, 2000) == 500
    assert auto_expert_cache_bytes(4000, -8) == 0


def test_a_group_keeps_one_prefetch_depth_and_one_pin_memory():
    """The group's options are the one copy: prefetch_depth and pin_memory read them
    (read-only), and a placement change updates them."""
    model = make()
    m = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=2, pin_memory=False)[0]
    assert m.prefetch_depth == m.options.prefetch_depth == m.stats()["prefetch_depth"] == 2
    assert m.pin_memory is m.options.pin_memory is False
    with pytest.raises(AttributeError):
        m.prefetch_depth = 3
    with pytest.raises(AttributeError):
        m.pin_memory = True
    m.set_residency([0], prefetch_depth=1)
    assert m.prefetch_depth == m.options.prefetch_depth == m.stats()["prefetch_depth"] == 1
    assert [torch.equal(a, b) for a, b in zip(_forwards(model), _forwards(make()))] == [True] * 3
    layerwise.remove_layerwise_offload(model)
