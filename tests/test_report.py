"""layerwise.report: a dict, a table within 120 columns, and one plain line per
group whose figures are those of the managers' stats()."""
import pytest
import torch
from torch import nn

import layerwise
from layerwise.planning.device_budget import fmt_bytes

from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]
X = torch.randn(2, 32)


def streamed_model(steps=2, **kw):
    torch.manual_seed(0)
    model = TwoGroupModel(n_a=8, n_b=4)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", **kw)
    with torch.no_grad():
        for _ in range(steps):
            model(X)
    return model, managers


def layer_bytes(m):
    return m.plan.layers[0].nbytes


def line_of(report, group):
    """The plain line of `group`, its wrapped pieces joined back."""
    text = "\n".join(report.lines()).replace("\n    ", " ")
    (line,) = [ln for ln in text.split("\n") if ln.startswith(group + ":")]
    return line


def check_widths(report):
    assert report.table() in str(report) and "\n".join(report.lines()) in str(report)
    for ln in str(report).split("\n"):
        assert len(ln) <= 120, ln


def test_report_is_a_dict_and_a_table():
    model, managers = streamed_model(steps=3, prefetch_depth=1)
    r = layerwise.report(model)
    a, b = r["groups"]
    lb = layer_bytes(managers[0])
    assert a["group"] == GROUPS[0] and a["copies_per_step"] == 8 and a["bytes_per_step"] == 8 * lb
    assert r["total"]["bytes_per_step"] == a["bytes_per_step"] + b["bytes_per_step"]
    assert r["total"]["ring_bytes"] == a["ring_bytes"] + b["ring_bytes"] > 0
    assert r["total"]["sync_loads"] == 0
    for key in ("layers", "resident", "slots", "steps", "mib_per_step", "stall_ms_per_step", "gbps",
                "bytes_copied", "copies", "stall_s", "arena_bytes", "arena_mib", "arena_pinned", "ring_mib",
                "resident_bytes", "resident_mib"):
        assert key in a and key in r["total"]
    text = str(r)
    table = r.table().split("\n")
    assert table[0].split()[:2] == ["group", "resident"] and "GB/s" in table[0]
    assert table[2].split()[0] == GROUPS[0] and table[-1].split()[0] == "total"
    assert fmt_bytes(a["bytes_per_step"]) in table[2]
    assert text.startswith(r.table()) and text.endswith("\n".join(r.lines()))
    check_widths(r)
    plain = layerwise.report(TwoGroupModel())  # says so rather than raising (tests/test_public_api.py)
    assert plain["offloaded"] is False and "not offloaded" in str(plain)


@pytest.mark.parametrize("resident", [0, 3])
def test_plain_lines_say_what_stats_say(resident):
    model, managers = streamed_model(resident_layers=resident)
    r = layerwise.report(model)
    for m, g in zip(managers, r["groups"]):
        s = m.stats()
        last = s["last_step"]
        assert last is not None  # two complete forwards
        n_res = len(s["resident_layers"])
        assert n_res == min(resident, m.num_layers)
        streamed = s["layers"] - n_res
        assert g["bytes_per_step"] == last["bytes_copied"] and g["copies_per_step"] == last["copies"]
        if streamed > s["slots"]:  # the ring cannot hold them all: layers are copied every step
            assert 0 < last["bytes_copied"] <= streamed * layer_bytes(m)
        line = line_of(r, s["group"])
        assert f"{streamed} of {s['layers']} layers streamed ({n_res} resident)" in line
        slots = f"{s['slots']} slot{'' if s['slots'] == 1 else 's'}"
        assert f"{slots}, prefetch depth {s['prefetch_depth']}" in line
        assert f"{fmt_bytes(last['bytes_copied'])} per step in {last['copies']} copies" in line
        if last.get("stall_s") is not None:
            assert f"compute waited {last['stall_s'] * 1e3:.2f} ms per step on copies" in line
        assert "(sync loads: 0)" in line and "synchronous loads" not in line
        assert f"ring {fmt_bytes(s['ring_bytes'])}, resident layers {fmt_bytes(s['resident_bytes'])}" in line
        pin = "pinned" if s["arena_pinned"] else "NOT pinned"
        assert f"arena {fmt_bytes(s['arena_bytes'])} {pin}" in line
    assert r["total"]["resident"] == sum(len(m.resident) for m in managers)
    assert r["total"]["resident_of"] == f"{r['total']['resident']} of 12"
    check_widths(r)


def test_synchronous_loads_are_said_plainly():
    model, managers = streamed_model(prefetch_depth=0)
    line = line_of(layerwise.report(model), GROUPS[0])
    n = managers[0].stats()["sync_loads"]
    assert n > 0
    assert f"{n} synchronous loads" in line and "prefetch_depth is 0" in line and "1 slot, " in line

    torch.manual_seed(0)
    model = TwoGroupModel(n_a=8, n_b=4)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1)
    with torch.no_grad():
        for _ in range(2):
            model(X, order_a=[0, 1, 2, 5, 3, 4, 6, 7])  # called out of order: some loads cannot be prefetched
    s = managers[0].stats()
    assert s["sync_loads"] > 0
    r = layerwise.report(model)
    line = line_of(r, GROUPS[0])
    assert f"{s['sync_loads']} synchronous loads" in line and "out of order" in line
    assert r["groups"][0]["sync_loads"] == s["sync_loads"]
    check_widths(r)


def test_no_complete_step_yet():
    model, _ = streamed_model(steps=0)
    r = layerwise.report(model)
    assert r["groups"][0]["bytes_per_step"] is None and r["total"]["bytes_per_step"] is None
    assert "no complete step yet" in line_of(r, GROUPS[0])
    assert r.table().split("\n")[2].split()[4] == "-"  # per step (after "0 of 8")
    check_widths(r)


def test_unpinned_arena_is_said_with_its_reason(monkeypatch):
    model, managers = streamed_model(pin_memory=False)
    r = layerwise.report(model)
    assert "NOT pinned: pin_memory=False" in line_of(r, GROUPS[0])
    assert r["total"]["arena_pinned"] is False

    model, managers = streamed_model()
    orig = managers[1].stats

    def failed_pin(**kw):
        s = orig(**kw)
        s.update(arena_pinned=False, arena_pin_error="mlock: Cannot allocate memory (RLIMIT_MEMLOCK 8 MiB)")
        return s

    monkeypatch.setattr(managers[1], "stats", failed_pin)
    r = layerwise.report(model)
    line = line_of(r, GROUPS[1])
    assert "NOT pinned: mlock: Cannot allocate memory (RLIMIT_MEMLOCK 8 MiB)" in line
    assert "NOT pinned" not in line_of(r, GROUPS[0]) or not managers[0].stats()["arena_pinned"]
    assert r["groups"][1]["pin_error"].startswith("mlock")
    check_widths(r)


def test_gbps_is_over_copy_time_never_wall_time(monkeypatch):
    model, managers = streamed_model()
    r = layerwise.report(model)
    for m, g in zip(managers, r["groups"]):
        last = m.stats()["last_step"]
        if last.get("copy_s"):
            assert g["gbps"] == pytest.approx(last["bytes_copied"] / last["copy_s"] / 1e9)
        else:  # the engine does not say how long copies were in flight: no GB/s at all
            assert g["gbps"] is None and "GB/s" not in line_of(r, g["group"])

    origs = [m.stats for m in managers]
    for m, orig, copy_s in zip(managers, origs, (0.002, 0.001)):
        def with_copy_time(orig=orig, copy_s=copy_s, **kw):
            s = orig(**kw)
            s["last_step"] = dict(s["last_step"], copy_s=copy_s, wall_s=1000.0)
            return s

        monkeypatch.setattr(m, "stats", with_copy_time)
    r = layerwise.report(model)
    a, b = r["groups"]
    assert a["gbps"] == pytest.approx(a["bytes_per_step"] / 0.002 / 1e9)
    assert b["gbps"] == pytest.approx(b["bytes_per_step"] / 0.001 / 1e9)
    assert r["total"]["gbps"] == pytest.approx((a["bytes_per_step"] + b["bytes_per_step"]) / 0.003 / 1e9)
    assert f"at {a['gbps']:.2f} GB/s while copies were in flight" in line_of(r, GROUPS[0])
    assert f"{a['gbps']:.2f}" in r.table().split("\n")[2]


def test_table_fits_120_columns_with_long_group_names():
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.a_rather_long_component_name = nn.Module()
            self.a_rather_long_component_name.with_a_long_submodule_name = TwoGroupModel(n_a=3, n_b=2)

        def forward(self, x):
            return self.a_rather_long_component_name.with_a_long_submodule_name(x)

    model = Deep()
    prefix = "a_rather_long_component_name.with_a_long_submodule_name."
    layerwise.configure_layerwise_offload(model, [prefix + g for g in GROUPS], device="cpu")
    with torch.no_grad():
        model(X)
        model(X)
    r = layerwise.report(model)
    check_widths(r)
    rows = r.table().split("\n")
    a, b = rows[2].split()[0], rows[3].split()[0]
    assert a.endswith("transformer_blocks") and b.endswith("single_transformer_blocks")
    assert b.startswith("...") and len(b) < len(prefix + GROUPS[1])  # it had to elide the start
    assert any(ln.startswith(prefix + GROUPS[1] + ":") for ln in r.lines())  # plain lines keep full names


# ------------------------------------------------- Friction in report()
def test_step_time_and_averages_over_the_last_steps():
    from layerwise.runtime.meter import RECENT_STEPS

    model, managers = streamed_model(steps=5)
    r = layerwise.report(model)
    for m, g in zip(managers, r["groups"]):
        s = m.stats()
        recent = s["recent_steps"]
        assert len(recent) == 5 and recent[-1]["step"] == s["last_step"]["step"]
        assert g["step_ms"] == pytest.approx(s["last_step"]["wall_s"] * 1e3)
        walls = [st["wall_s"] * 1e3 for st in recent]
        rec = g["recent"]
        assert rec["steps"] == 5 and rec["step_ms_mean"] == pytest.approx(sum(walls) / 5)
        assert rec["step_ms_min"] == pytest.approx(min(walls)) and rec["step_ms_max"] == pytest.approx(max(walls))
        stalls = [st["stall_s"] * 1e3 for st in recent if st["stall_s"] is not None]
        assert rec["stall_steps"] == len(stalls) > 0 and rec["stall_ms_max"] == pytest.approx(max(stalls))
        assert "over the last 5 steps: step mean" in line_of(r, g["group"])
    assert r["total"]["step_ms"] == max(g["step_ms"] for g in r["groups"])
    assert "step" in r.table().split("\n")[0].split()
    check_widths(r)
    with torch.no_grad():
        for _ in range(RECENT_STEPS + 3):
            model(X)
    assert len(managers[0].stats()["recent_steps"]) == RECENT_STEPS
    assert layerwise.report(model)["groups"][0]["recent"]["steps"] == RECENT_STEPS


def _smallest_working_budget(tmp_path, start):
    budget = start
    while True:
        torch.manual_seed(0)
        model = TwoGroupModel(n_a=8, n_b=4)
        try:
            managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", host_budget=budget,
                                                             spill_dir=tmp_path)
            return model, managers, budget
        except ValueError as e:
            assert "too small" in str(e)
            budget += budget // 16


def test_host_budget_in_force_and_its_use(tmp_path):
    model, managers = streamed_model()
    assert layerwise.report(model)["host_budget"] is None  # no budget given: none reported
    layerwise.remove_layerwise_offload(model)
    torch.manual_seed(0)
    model = TwoGroupModel(n_a=8, n_b=4)
    ref = model(X).detach()
    everything = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", host_budget=everything,
                                                     spill_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(X), ref)
    r = layerwise.report(model)
    hb = r["host_budget"]
    stats = [m.stats() for m in managers]
    from layerwise.planning.device_budget import non_layer_bytes

    want = (sum(s["arena_bytes"] + (s["disk"]["staging_bytes"] if s["disk"] else 0) for s in stats)
            + non_layer_bytes(model, managers) + sum(s["ring_bytes"] + s["resident_bytes"] for s in stats))
    assert hb["bytes"] == everything and hb["source"] == "given" and hb["used_bytes"] == want <= everything
    assert r.lines()[0].startswith(f"host budget {fmt_bytes(everything)} (given): {fmt_bytes(want)} used")
    check_widths(r)


def test_a_group_held_entirely_on_disk_is_said_plainly(tmp_path):
    model, managers, budget = _smallest_working_budget(tmp_path, 1 << 12)
    with torch.no_grad():
        model(X)
        model(X)
    r = layerwise.report(model)
    on_disk = [g for g in r["groups"] if g["disk"] and g["disk"]["layers"] == g["layers"]]
    assert on_disk, [(g["group"], g["arena_bytes"], g["disk"]) for g in r["groups"]]
    for g in on_disk:
        line = line_of(r, g["group"])
        assert g["arena_bytes"] == 0 and "no host arena: all" in line and "stay on disk" in line
        assert "arena 0 B" not in line
    assert r["host_budget"]["used_bytes"] <= budget
    check_widths(r)


def test_streaming_that_saves_nothing_warns_and_the_report_says_so(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="layerwise"):
        model, managers = streamed_model(prefetch_depth=3)  # single_transformer_blocks: 4 layers, 4 slots
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(GROUPS[1] in w and "saves no device memory" in w for w in warned), warned
    assert not any(f"'{GROUPS[0]}'" in w for w in warned), warned  # 8 layers at depth 3: 4 slots, it saves
    r = layerwise.report(model)
    assert "WARNING: streaming saves no device memory" in line_of(r, GROUPS[1])
    assert "WARNING" not in line_of(r, GROUPS[0])
    check_widths(r)


def test_resident_layers_count_and_fraction_are_treated_alike(caplog):
    import logging

    for every in (4, 1.0, 5, 1.5):  # the group size and 1.0 mean every layer; more than it holds too, said so
        torch.manual_seed(0)
        model = TwoGroupModel(n_a=8, n_b=4)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="layerwise"):
            managers = layerwise.configure_layerwise_offload(model, GROUPS[1], device="cpu", resident_layers=every)
        assert managers[0].resident == [0, 1, 2, 3]
        warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert "streaming saves no device memory: every one of its 4 layers is resident" in warned, warned
        over = every in (5, 1.5)
        assert (f"resident_layers={every!r} is more than layer group 'single_transformer_blocks' holds (4 layers)"
                in warned) == over, warned
        layerwise.remove_layerwise_offload(model)


# ------------------------------------------------ errors that name what is wrong
def test_in_place_write_error_names_the_parameter():
    model, managers = streamed_model(prefetch_depth=1)  # 8 layers, 2 slots: layer 0 waits in slot 0
    managers[0].stats(sync=True)  # every queued copy done
    with torch.no_grad():
        model.transformer_blocks[0].up.weight.mul_(2.0)  # bound to its slot view: the write lands in the slot
    with pytest.raises(RuntimeError, match=r"in-place write to a streamed parameter \('transformer_blocks\.0\.up"
                                           r"\.weight', in ring slot 0\).*load_state_dict"):
        with torch.no_grad():
            model(X)
    # A write into a slot that the next layer's copy overwrites before the check: the candidates.
    with torch.no_grad():
        model.transformer_blocks[5].up.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"in-place write to a streamed parameter \(one bound to ring slot 1: "
                                           r".*up\.weight.* of transformer_blocks\.<i> for i in \[1, 3, 5, 7\]\)"):
        with torch.no_grad():
            model(X)


@pytest.mark.parametrize("wrong,suggested", [("layers", "model.layers"), ("model.layer", "model.layers"),
                                              ("model.norm", "model.layers")])
def test_a_wrong_layer_name_says_did_you_mean(wrong, suggested):
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3))
            self.norm = nn.LayerNorm(4)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

    with pytest.raises((ValueError, TypeError), match=rf"did you mean '{suggested}'\?|its block lists are "
                                                       rf"'{suggested}'$"):
        layerwise.configure_layerwise_offload(Outer(), wrong, device="cpu")


def test_a_missing_checkpoint_file_is_a_file_not_found_error(tmp_path):
    with torch.device("meta"):
        model = TwoGroupModel()
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match="no such file") as info:
        layerwise.load_offloaded(model, missing, GROUPS, device="cpu")
    assert info.value.filename == str(missing) and isinstance(info.value, ValueError)  # (refused like the rest)
    with pytest.raises(FileNotFoundError):
        layerwise.load_offloaded(model, [missing], GROUPS, device="cpu")


def test_cpu_device_recommends_one_torch_thread_fewer(monkeypatch, caplog):
    import logging
    import os

    from layerwise import options

    monkeypatch.setattr(options, "_THREADS_NOTED", [])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)  # 4 cores
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with caplog.at_level(logging.INFO, logger="layerwise"):
            streamed_model(steps=1)
            streamed_model(steps=1)  # said once per process
    finally:
        torch.set_num_threads(threads)
    said = [r.getMessage() for r in caplog.records if "intra-op threads" in r.getMessage()]
    assert len(said) == 1 and "torch.set_num_threads(3)" in said[0], said
    assert torch.get_num_threads() == threads  # never changed behind the caller's back
