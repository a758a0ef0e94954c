"""layerwise.tune and its pipeline model: placement chosen from
measurement, applied in place, checked against its prediction.

The model's own checks are pure (layerwise.planning.cost_model: numbers in, numbers out).
tune itself runs on the CPU backend with the simulated bus (csrc/sim_bus.h) in
a fresh interpreter (the bus is per process), on a stack where big, light
layers alternate irregularly with small, heavy ones: the right layers to keep
resident are the big ones whose copies the small ones cannot hide, which
neither fixed policy (`leading`, `strided`) picks."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import layerwise
from layerwise.planning import cost_model as pm

from helpers.tune import Stack, only_layer_hooks

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------ the model alone
def step_of(compute, copy, sizes=None, outside=0.0, pre=0.0, post=0.0, gbps=1.0):
    n = len(compute)
    sizes = sizes or [int(c * gbps * 1e9) for c in copy]
    g = pm.Group("g", n, sizes, sizes, 0)
    calls = [pm.Call(0, i, c, 0.0) for i, c in enumerate(compute)]
    return pm.Step([g], calls, [list(copy)], pre, post, outside, gbps)


def test_compute_bound_steps_cost_their_compute():
    st = step_of([5e-3] * 6, [1e-3] * 6, outside=2e-3, pre=1e-5, post=2e-5)
    p = pm.predict(st, pm.Placement(((),), (1,)))
    assert p.step_s == pytest.approx(2e-3 + 6 * (5e-3 + 3e-5))
    assert p.stall_s == 0.0
    assert p.bus_bytes == sum(st.groups[0].fetch_bytes)
    assert p.floor_s == pytest.approx(st.resident_s())


def test_transfer_bound_steps_cost_the_bus_and_residency_takes_bytes_off_it():
    st = step_of([1e-3] * 6, [4e-3] * 6)
    streamed = pm.predict(st, pm.Placement(((),), (1,)))
    assert streamed.step_s == pytest.approx(6 * 4e-3, rel=1e-6)  # the bus never idles: one copy after the other
    assert streamed.floor_s == pytest.approx(6 * 4e-3)
    two = pm.predict(st, pm.Placement(((1, 4),), (1,)))
    assert two.bus_bytes == streamed.bus_bytes * 4 // 6
    assert two.step_s < streamed.step_s
    everything = pm.predict(st, pm.Placement((tuple(range(6)),), (1,)))
    assert everything.bus_bytes == 0 and everything.step_s == pytest.approx(6e-3)


def test_depth_zero_loads_every_layer_when_it_is_called():
    st = step_of([2e-3] * 4, [1e-3] * 4)
    p = pm.predict(st, pm.Placement(((),), (0,)))
    assert p.step_s == pytest.approx(4 * 3e-3)
    assert p.stall_s == pytest.approx(4e-3)


def test_a_big_light_layer_is_the_one_to_keep():
    # compute hides every copy but layer 2's, which no neighbour can cover
    compute = [4e-3, 4e-3, 1e-4, 4e-3, 4e-3, 4e-3]
    copy = [1e-3, 1e-3, 9e-3, 1e-3, 1e-3, 1e-3]
    st = step_of(compute, copy)
    g = st.groups[0]

    def fits(p):
        return p.device_bytes(st) <= 3 * max(g.layer_bytes)

    chosen = pm.improve(st, pm.greedy(st, (1,), fits, by_bytes=False), fits)
    assert 2 in chosen.resident[0]
    leading = pm.candidates_by_policy(st, (1,), fits)[("leading", 1)]
    assert pm.predict(st, chosen).step_s < pm.predict(st, leading).step_s


def test_on_big_light_layers_among_small_heavy_ones_the_choice_beats_both_fixed_policies():
    """The irregular stack of the tune suite as the model sees it (fixed figures: what
    decides here is the choice, not the machine): the big light layers' copies are
    3 heavy layers' compute each; the budget holds a depth-1 ring and 3 big layers."""
    kinds = "HBHHBHBBHHHBHB"
    big, small = 4 << 20, 1 << 18
    sizes = [big if k == "B" else small for k in kinds]
    compute = [2e-3 if k == "H" else 1e-4 for k in kinds]
    copy = [6e-3 if k == "B" else 4e-4 for k in kinds]
    g = pm.Group("blocks", len(kinds), sizes, sizes, 0)
    st = pm.Step([g], [pm.Call(0, i, c, 0.0) for i, c in enumerate(compute)], [copy], 1e-5, 1e-5, 0.0, None)

    def fits(p):
        return p.device_bytes(st) <= 5 * big

    current = pm.Placement(((),), (1,))
    cands = pm.candidates(st, current, (1, 2), fits)
    best, preds = pm.choose(st, cands, fits)
    policies = min(v.step_s for k, v in preds.items() if k.startswith(("leading", "strided")))
    assert preds[best].step_s < 0.9 * policies, {k: v.step_s for k, v in preds.items()}
    assert fits(cands[best]) and set(cands[best].resident[0]) & {i for i, k in enumerate(kinds) if k == "B"}


def test_the_bus_fit_finds_latency_and_bandwidth():
    samples = [(b, 20e-6 + b / 2e9) for b in (1 << 16, 1 << 18, 1 << 20, 3 << 20)]
    lat, gbps = pm.fit_bus(samples)
    assert lat == pytest.approx(20e-6, rel=1e-6) and gbps == pytest.approx(2.0, rel=1e-6)
    assert pm.fit_bus([(1000, 1e-6)] * 3) == (0.0, pytest.approx(1.0))
    assert pm.fit_bus([]) is None


# ------------------------------------------------------------ tune, in process


def stack(seed=0):
    torch.manual_seed(seed)
    return Stack("HBHHBHBBHH", 64, 1024, 2).eval()


def test_tune_is_bitwise_within_its_budget_and_reported(device):
    ref = stack()
    x = torch.randn(64, 64)
    with torch.no_grad():
        want = ref(x)
    model = stack()
    delays = {"debug_copy_delay_us": 200} if device == "cpu" else {}  # (a CPU-backend mode)
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device=device, **delays)
    x = x.to(device)
    fixed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    budget = fixed + 6 * max(lp.nbytes for lp in m.plan.layers)
    plan = layerwise.tune(model, lambda mm: mm(x), device_budget=budget, repeats=2)
    st = m.stats()
    assert fixed + st["ring_bytes"] + st["resident_bytes"] <= budget
    assert plan.device_bytes == fixed + st["ring_bytes"] + st["resident_bytes"]
    assert (st["resident_layers"], st["prefetch_depth"]) == (plan.groups[0]["resident"], plan.groups[0]["prefetch_depth"])
    with torch.no_grad():
        assert torch.equal(model(x).cpu(), want)
    assert plan.applied and plan.measured_s > 0 and plan.floor_s <= plan.predicted_s * 1.02
    assert "in force" in plan.alternatives and any(k.startswith("strided") for k in plan.alternatives)
    text = str(plan)
    assert "predicted" in text and "measured" in text and "floor" in text and "blocks" in text
    assert "layerwise.tune" in str(layerwise.report(model))
    layerwise.remove_layerwise_offload(model)
    with torch.no_grad():
        assert torch.equal(model(x).cpu(), want)


def test_tune_with_compression_gets_bus_samples_and_stays_bitwise(device):
    """Compressed layers are fetched as a copy and a decode: tune's probe must time
    them from the copy's start to the decode's end (on CUDA the decode's event had no
    start: no bus samples, and tune predicted no transfer at all for them)."""
    ref = stack()
    x = torch.randn(64, 64)
    with torch.no_grad():
        want = ref(x)
    model = stack()
    options = {"debug_copy_delay_us": 200} if device == "cpu" else {"num_copy_streams": 2}
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device=device, compress="lossless", **options)
    assert len(m.stats()["compress"]["layers_raw"]) < m.num_layers  # (fp32 weights: their exponents shrink)
    x = x.to(device)
    fixed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    budget = fixed + 6 * max(lp.nbytes for lp in m.plan.layers)
    plan = layerwise.tune(model, lambda mm: mm(x), device_budget=budget, repeats=2)
    assert plan.bus_gbps is not None and plan.bus_gbps > 0, str(plan)
    assert m.meter.unstarted == 0
    st = m.stats()
    assert fixed + st["ring_bytes"] + st["resident_bytes"] <= budget
    with torch.no_grad():
        assert torch.equal(model(x).cpu(), want)
    layerwise.remove_layerwise_offload(model)
    with torch.no_grad():
        assert torch.equal(model(x).cpu(), want)


def test_tune_refuses_clearly_and_changes_nothing():
    model = stack()
    x = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="not offloaded"):
        layerwise.tune(model, lambda mm: mm(x))
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    with pytest.raises(ValueError, match="device_budget"):
        layerwise.tune(model, lambda mm: mm(x), device_budget="lots")
    with pytest.raises(RuntimeError, match="no placement fits"):
        layerwise.tune(model, lambda mm: mm(x), device_budget=1000)
    with pytest.raises(RuntimeError, match="representative step"):
        layerwise.tune(model, lambda mm: None)
    assert (m.resident, m.prefetch_depth) == ([], 1)
    fixed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    plan = layerwise.tune(model, lambda mm: mm(x), device_budget=fixed + 10 ** 7, repeats=1, apply=False)
    assert not plan.applied and plan.measured_s is None
    assert (m.resident, m.prefetch_depth) == ([], 1)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (a SIGINT in a weakref callback)
def test_real_sigints_during_tune_leave_one_placement_whole():
    ref = stack()
    x = torch.randn(32, 64)
    with torch.no_grad():
        want = ref(x)
    model = stack()
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", debug_copy_delay_us=100)
    fixed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    budget = fixed + 5 * max(lp.nbytes for lp in m.plan.layers)
    t0 = time.perf_counter()
    layerwise.tune(model, lambda mm: mm(x), device_budget=budget, repeats=1)
    span = time.perf_counter() - t0
    rng = random.Random(5)
    for n in range(12):
        m.set_residency([n % 10], 1)  # a placement tune will change
        old = (tuple(m.resident), m.prefetch_depth)
        timer = threading.Timer(rng.uniform(0, span), os.kill, (os.getpid(), signal.SIGINT))
        try:
            try:
                timer.start()
                layerwise.tune(model, lambda mm: mm(x), device_budget=budget, repeats=1)
                time.sleep(span)
            finally:
                timer.cancel()
                timer.join()
            time.sleep(0.005)
        except KeyboardInterrupt:
            pass
        assert only_layer_hooks(m)  # (the probe's hooks are gone)
        with torch.no_grad():
            assert torch.equal(model(x), want), n
        assert m.meter.copy_log is None
    # (how many of those landed is the machine's business; these land for sure: a real SIGINT
    # sent from inside the k-th call of run(), for every call a tune makes)
    calls = [0]

    def counting(mm):
        calls[0] += 1
        return mm(x)

    m.set_residency([3], 1)
    layerwise.tune(model, counting, device_budget=budget, repeats=1)
    total = calls[0]
    assert total >= 5  # warm-up, timed, probed; after the change: warm-up, timed
    # a tune whose prediction was off probes again after the change, so a later tune can
    # make fewer calls than `total` (the measured error decides): a call k it does not make
    # sends nothing, and that tune must finish; the first three calls (warm-up, timed,
    # probed) every tune makes, so their interrupts are always sent
    for k in range(total):
        m.set_residency([k % 10], 1)
        old = (tuple(m.resident), m.prefetch_depth)
        calls[0] = 0
        sent = [False]

        def kill_at_k(mm, _k=k):
            calls[0] += 1
            if calls[0] == _k + 1:
                sent[0] = True
                os.kill(os.getpid(), signal.SIGINT)
            return mm(x)

        try:
            layerwise.tune(model, kill_at_k, device_budget=budget, repeats=1)
            raised = False
        except KeyboardInterrupt:
            raised = True
        assert raised == sent[0], (k, raised, calls[0])
        assert sent[0] or k >= 3, (k, calls[0])
        if raised:
            assert (tuple(m.resident), m.prefetch_depth) == old, k  # (after the change: put back)
        assert only_layer_hooks(m) and m.meter.copy_log is None, k
        with torch.no_grad():
            assert torch.equal(model(x), want), k


# -------------------------------------------------------- tune on the simulated bus
TUNE = """
    import json, statistics, time, torch, layerwise
    torch.set_num_threads(1)
    from helpers import tune as T

    import os
    torch.manual_seed(0)
    kinds = "HBHHBHBBHHHBHB"
    make = lambda: T.Stack(kinds, 256, 4096, 4).eval()
    torch.manual_seed(0); ref = make()
    x = torch.randn(256, 256)
    with torch.no_grad():
        want = ref(x)
        heavy = ref.blocks[0]
        for _ in range(3):
            heavy(x)
        times = []
        for _ in range(9):
            t0 = time.perf_counter(); heavy(x); times.append(time.perf_counter() - t0)
    # The bus against the measured compute (each CPU engine reads it when it is created): a big
    # layer's copy takes 3 heavy layers' compute, so that the big ones' copies cannot all be hidden.
    big = sum(p.numel() * p.element_size() for p in ref.blocks[1].parameters())
    os.environ["LAYERWISE_SIM_BUS_GBPS"] = str(big / (3 * statistics.median(times)) / 1e9)
    torch.manual_seed(0); model = make()
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    fixed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    budget = fixed + 5 * max(lp.nbytes for lp in m.plan.layers)  # a ring of 2 and 3 big layers
    run = lambda mm: mm(x)
    plan = layerwise.tune(model, run, device_budget=budget)
    with torch.no_grad():
        same = torch.equal(model(x), want)
    st = m.stats()
    chosen = (list(m.resident), m.prefetch_depth)

    def timed(res, depth, k=5):
        m.set_residency(res, depth)
        with torch.no_grad():
            run(model)
            out = []
            for _ in range(k):
                t0 = time.perf_counter(); run(model); out.append(time.perf_counter() - t0)
        return statistics.median(out)

    measured = {"tune": [], "leading": [], "strided": []}
    policies = {}
    for policy in ("leading", "strided"):
        best = min(((k, v) for k, v in plan.alternatives.items() if k.startswith(policy) and "improved" not in k),
                   key=lambda kv: kv[1])  # (the policy's own placements: "<policy>, depth <d>")
        depth = int(best[0].rsplit(" ", 1)[1])
        res = layerwise.options.resolve_resident(T.largest_share(m, depth, policy, budget - fixed), m.num_layers, policy)
        policies[policy] = (res, depth)
    for _ in range(3):  # interleaved, so that a slow moment hits every placement alike
        measured["tune"].append(timed(*chosen))
        for policy, (res, depth) in policies.items():
            measured[policy].append(timed(res, depth))
    print(json.dumps({"same": same, "budget": budget, "used": fixed + st["ring_bytes"] + st["resident_bytes"],
                      "predicted": plan.predicted_s, "measured": plan.measured_s, "error": plan.error,
                      "note": plan.note, "alternatives": plan.alternatives, "table": str(plan),
                      "chosen": chosen, "policies": policies,
                      "timed": {k: min(v) for k, v in measured.items()}}))
"""


def test_tune_on_the_simulated_bus_is_bitwise_within_budget_and_predicts_honestly():
    import json

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           }
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(TUNE)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["same"]
    assert r["used"] <= r["budget"]
    # its choice: no slower, predicted, than either policy at any depth it compared (the policies
    # are among its candidates: by how much, and the measured comparison, depend on the machine's
    # load and are the bench's to report: the tune suite's targets)
    best_policy = min(v for k, v in r["alternatives"].items() if k.startswith(("leading", "strided")))
    assert r["predicted"] <= best_policy, r["table"]
    assert all(v > 0 for v in r["timed"].values()), r["timed"]
    # honest: within 10% of what it predicted, or the plan says why
    assert abs(r["error"]) <= 0.10 or "off the predicted" in r["note"], r["table"]


def test_tune_takes_an_offloaded_pipeline_and_keeps_its_image_bitwise():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from layerwise.bench.pipeline import SIZES, generate, tiny_flux_pipeline

    size = SIZES["tiny"]
    want = generate(tiny_flux_pipeline(size), size)
    pipe = tiny_flux_pipeline(size)
    managers = layerwise.offload_pipeline(pipe, device="cpu")
    plan = layerwise.tune(pipe, lambda p: generate(p, size), repeats=1)
    groups = [m for ms in managers.values() for m in ms if m.enabled]
    assert {g["group"] for g in plan.groups} == {m.layer_name for m in groups}
    assert len(plan.groups) == len(groups) >= 4  # every streamed group of every component
    assert torch.equal(generate(pipe, size), want)
    assert plan.device_bytes <= plan.budget
    layerwise.remove_pipeline_offload(pipe)
    assert torch.equal(generate(pipe, size), want)
