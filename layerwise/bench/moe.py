"""moe: routed experts (layerwise/planning/experts.py, docs/moe.md).
Tiny Mixtral and Qwen3-MoE from small configs (random weights, fp32),
streamed with experts="all" (whole layers), "routed", routed with the device
expert cache (expert_cache="auto": a quarter of the experts) and routed with
speculative prefetch, beside the resident model.

Workloads: decode at batch 1 and 8 (one new token per sequence per step, a KV
cache, greedy) and prefill (one forward of a 64-token prompt). Rows per
workload and method:
  bytes/token   bytes that crossed the bus in a step (stats()["last_step"]
                ["bytes_copied"]) per token of the step, beside the ideal: the
                non-expert bytes of the streamed layers plus the experts the
                step's forwards used (each (layer, expert) once), measured on
                the same step. Targets (docs/design.md): decode at batch 1, routed
                <= 1.1x the ideal; routed with the cache below it (< 1.0x).
  step          the step's median time against the resident model's.

On the CPU the copies cross the CPU backend's simulated bus
(bus.simulated_bus), its speed chosen in the run so that whole layers are
transfer-bound at decode: one decode step's layer bytes take BUS_CT_INVERSE
times the resident decode step (with LAYERWISE_SIM_BUS_GBPS set, that bus).
Steps after the first WARM ones are measured (the cache warm). Every streamed
step's logits are checked bitwise against the resident model's; a mismatch
fails the suite.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

import layerwise
from layerwise.bench import bus
from layerwise.bench.common import Context, MiB, Row, Skip, SuiteResult, Target, clone_module

NAME = "moe"
TARGET_ROUTED = 1.1
BUS_CT_INVERSE = 10
SIZES = {"full": (512, 1024, 16, 8, 24), "quick": (256, 512, 8, 8, 8), "tiny": (64, 128, 8, 4, 4)}
# hidden, expert intermediate, experts, layers, decode steps
WARM = {"full": 6, "quick": 4, "tiny": 1}
PROMPT = 64
METHODS = {"all": dict(experts="all"), "routed": dict(experts="routed"),
           "routed+cache": dict(experts="routed", expert_cache="auto"),
           "routed+prefetch": dict(experts="routed", expert_prefetch=True)}


def _models(hidden, inter, experts, layers):
    import transformers

    common = dict(vocab_size=512, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256)
    return {
        "Mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=inter, num_local_experts=experts, **common)).eval(),
        "Qwen3-MoE": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=inter, moe_intermediate_size=inter, num_experts=experts, head_dim=hidden // 4,
            **common)).eval(),
    }


class _Used:
    """The (layer, module, expert) triples the forwards of a step used, and the ideal bytes."""

    def __init__(self, manager):
        from layerwise.runtime.expert_hooks import chosen_experts

        self.m, self.seen, self.handles = manager, set(), []
        expert_ids = set()
        for i, mods in manager.experts.layers.items():
            for xm in mods:
                expert_ids.update(id(e) for e in xm.entries)

                def rec(mod, args, kwargs, i=i, xm=xm):
                    self.seen.update((i, xm.name, x, xm.unit_bytes)
                                     for x in chosen_experts(xm.routed(args, kwargs), xm.num_experts))
                self.handles.append(xm.module.register_forward_pre_hook(rec, with_kwargs=True))
        streamed = set(manager.ring.streamed)
        self.base = sum(e.numel * e.dtype.itemsize for lp in manager.plan.layers if lp.index in streamed
                        for e in lp.params if id(e) not in expert_ids)

    def ideal(self) -> int:
        out, self.seen = self.base + sum(u[3] for u in self.seen), set()
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def _decode(model, ids, steps: int, manager=None, used=None):
    """Greedy decode: per step (logits, seconds, bytes, ideal bytes)."""
    out = []
    with torch.no_grad():
        o = model(ids, use_cache=True)
        past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        if used is not None:
            used.ideal()
        for _ in range(steps):
            t0 = time.perf_counter()
            o = model(nxt, past_key_values=past, use_cache=True)
            dt = time.perf_counter() - t0
            past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            nbytes = manager.stats(sync=True)["last_step"]["bytes_copied"] if manager is not None else 0
            out.append((o.logits, dt, nbytes, used.ideal() if used is not None else None))
    return out


def _prefill(model, ids, steps: int, manager=None, used=None):
    out = []
    with torch.no_grad():
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = model(ids, use_cache=False).logits
            dt = time.perf_counter() - t0
            nbytes = manager.stats(sync=True)["last_step"]["bytes_copied"] if manager is not None else 0
            out.append((logits, dt, nbytes, used.ideal() if used is not None else None))
    return out


def run(ctx: Context) -> SuiteResult:
    if ctx.is_cuda:
        raise Skip("the moe suite runs on the CPU backend with the simulated bus (no CUDA rows yet)")
    try:
        import transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001
        raise Skip(f"transformers is not importable ({type(e).__name__}: {e})") from None
    hidden, inter, n_exp, layers, steps = ctx.pick(SIZES)
    warm = ctx.pick(WARM)
    result = SuiteResult(NAME, data={"config": {"hidden": hidden, "expert_intermediate": inter, "experts": n_exp,
                                                "top_k": 2, "layers": layers, "decode_steps": steps, "warm": warm,
                                                "prompt": PROMPT, "dtype": "float32"}, "models": {}})
    given = bool(os.environ.get(bus.ENV))
    gen = torch.Generator().manual_seed(1)
    workloads = {"decode, batch 1": (_decode, torch.randint(3, 512, (1, 8), generator=gen)),
                 "decode, batch 8": (_decode, torch.randint(3, 512, (8, 8), generator=gen)),
                 "prefill": (_prefill, torch.randint(3, 512, (1, PROMPT), generator=gen))}
    with ctx.progress(2 * len(workloads) * (len(METHODS) + 1), NAME) as bar:
        for mname, make in _models(hidden, inter, n_exp, layers).items():
            torch.manual_seed(0)
            base = make()
            layer_bytes = sum(p.numel() * p.element_size() for p in base.model.layers.parameters())
            data = result.data["models"][mname] = {"layer_bytes": layer_bytes, "workloads": {}}
            gbps = None
            if not given:  # whole layers transfer-bound at decode (batch 1)
                ref = _decode(base, workloads["decode, batch 1"][1], 3)
                resident_s = statistics.median(t for _, t, _, _ in ref)
                gbps = layer_bytes / (BUS_CT_INVERSE * resident_s) / 1e9
            with bus.simulated_bus(gbps) as cfg:
                data["bus"] = {**cfg, "source": "given" if given else f"chosen: whole layers at C/T "
                                                                        f"1/{BUS_CT_INVERSE} at decode"}
                for wname, (fn, ids) in workloads.items():
                    n = steps if fn is _decode else warm + 3
                    ref = fn(base, ids, n)
                    bar.update(1)
                    tokens = ids.shape[0] * (1 if fn is _decode else ids.shape[1])
                    res_ms = statistics.median(t for _, t, _, _ in ref[warm:]) * 1e3
                    wd = data["workloads"][wname] = {"tokens_per_step": tokens, "resident_ms": res_ms}
                    for label, opts in METHODS.items():
                        model = clone_module(base)
                        (m,) = layerwise.configure_layerwise_offload(model, "model.layers", device=ctx.device,
                                                                     prefetch_depth=1, **opts)
                        used = _Used(m) if m.experts is not None else None
                        got = fn(model, ids, n, m, used)
                        for k, ((a, *_), (b, *_)) in enumerate(zip(ref, got)):
                            if not torch.equal(a, b):
                                raise AssertionError(f"moe: {mname}, {wname}, {label}, step {k}: logits differ "
                                                     "from the resident model's")
                        st = m.stats(sync=True)
                        if used is not None:
                            used.remove()
                        layerwise.remove_layerwise_offload(model)
                        bar.update(1)
                        meas = got[warm:]
                        nbytes = statistics.median(b for _, _, b, _ in meas)
                        ideal = statistics.median(i for _, _, _, i in meas) if used is not None else None
                        ms = statistics.median(t for _, t, _, _ in meas) * 1e3
                        wd[label] = {"bytes_per_step": nbytes, "ideal_bytes_per_step": ideal, "step_ms": ms,
                                     "per_step": [(b, i) for _, _, b, i in got], "experts": st["experts"]}
                        result.rows += _rows(mname, wname, label, wd, tokens, nbytes, ideal, ms, res_ms, st)
    return result


def _rows(mname, wname, label, wd, tokens, nbytes, ideal, ms, res_ms, st) -> list:
    rows = []
    ratios, base, targets = {}, {}, []
    if ideal:
        base["ideal"] = ideal / tokens / MiB
        ratios["/ideal"] = nbytes / ideal
        if wname == "decode, batch 1" and label == "routed":
            targets.append(Target.at_most(ratios["/ideal"], TARGET_ROUTED, "ideal"))
        if wname == "decode, batch 1" and label == "routed+cache":
            targets.append(Target("< 1x ideal", bool(ratios["/ideal"] < 1.0)))
    if "all" in wd and label != "all":
        base["all"] = wd["all"]["bytes_per_step"] / tokens / MiB
        ratios["/all"] = nbytes / wd["all"]["bytes_per_step"]
    ex = st.get("experts") or {}
    note = ""
    if ex:
        note = (f"hits {ex['hits']} (cache {ex['cache_hits']}), misses {ex['misses']}"
                + (f", speculative {ex['speculative_bytes'] / MiB:.2f} MiB of which wasted "
                   f"{ex['speculative_wasted_bytes'] / MiB:.2f} MiB" if ex["speculative_bytes"] else "")
                + " (whole run)")
    rows.append(Row(NAME, f"bytes/token, {mname}, {wname}, {label}", "MiB", nbytes / tokens / MiB, base, ratios,
                    targets, note=note, short=f"bytes/token, {mname}, {wname}, {label}"))
    rows.append(Row(NAME, f"step, {mname}, {wname}, {label}", "ms", ms, {"resident": res_ms},
                    {"/resident": ms / res_ms}, [], short=f"step, {mname}, {wname}, {label}"))
    return rows
