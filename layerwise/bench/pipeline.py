"""pipeline: a whole diffusers pipeline per image, streamed by
``layerwise.offload_pipeline`` against diffusers' own offloading.

Pipeline: a Flux-architecture ``FluxPipeline`` built from small configs with
random weights (CLIP text model + T5 encoder + Flux transformer + VAE; no
tokenizer files: the prompt is fixed token ids that the pipeline's own text
encoders turn into ``prompt_embeds`` / ``pooled_prompt_embeds``, so one image
runs every component). fp32 on the CPU, bf16 on CUDA.

Methods, each in a fresh interpreter (so that host-memory figures are its own):
  resident                       ``pipe.to(device)``: the reference image;
  layerwise                      ``offload_pipeline(pipe, device)`` (pin_budget="auto");
  layerwise pageable             (CUDA) the same with ``pin_budget=0``;
  diffusers model offload        (CUDA) ``enable_model_cpu_offload``;
  diffusers sequential offload   (CUDA) ``enable_sequential_cpu_offload``;
  diffusers group offload        (CUDA) ``enable_group_offload(block_level, 1 block, use_stream=True)``.
diffusers' offloading moves weights to an accelerator: on a CPU run those rows
say "not measured".

Per method: set-up time, wall time per image (median over the timed images,
after one untimed image), peak host RSS growth during set-up and over set-up +
images (above the RSS of the built pipeline's process before set-up), peak
device memory (CUDA), and whether the image is bitwise equal to the resident
pipeline's. The methods run one after another, not interleaved: the price of
host-memory figures that are each method's own.

Targets: layerwise's image is bitwise equal to resident's; its set-up grows the
host RSS by at most the largest layer + 5% of the pipeline (+ the rings on a
CPU device, which live in host memory there): never two copies; on CUDA it is
faster per image than every diffusers offload that ran.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from layerwise.bench.common import Context, MiB, Row, Stat, SuiteResult, Target, ratio
from layerwise.stages.disk.reader import held_interrupts

NAME = "pipeline"
RESIDENT, LAYERWISE, PAGEABLE = "resident", "layerwise", "layerwise pageable"
MODEL_OFFLOAD, SEQUENTIAL, GROUP = "diffusers model offload", "diffusers sequential offload", "diffusers group offload"
METHODS = (RESIDENT, LAYERWISE, PAGEABLE, MODEL_OFFLOAD, SEQUENTIAL, GROUP)
CUDA_ONLY = {
    PAGEABLE: "pinned and pageable memory differ only for copies to an accelerator",
    MODEL_OFFLOAD: "diffusers' enable_model_cpu_offload moves components to an accelerator",
    SEQUENTIAL: "diffusers' enable_sequential_cpu_offload moves weights to an accelerator",
    GROUP: "diffusers' enable_group_offload(use_stream=True) needs CUDA streams",
}


@dataclass(frozen=True)
class PipelineSize:
    hidden: int  # transformer width = heads x head_dim; also the text encoders' width
    heads: int
    double: int  # Flux double-stream blocks
    single: int  # Flux single-stream blocks
    text_layers: int  # CLIP layers; T5 has as many
    text_tokens: int
    vae_channels: tuple
    image: int  # height = width, pixels
    steps: int  # num_inference_steps
    images: int  # timed images per method (after one untimed)


SIZES = {
    ("full", "cuda"): PipelineSize(1536, 12, 8, 16, 12, 128, (128, 256), 512, 8, 5),
    ("quick", "cuda"): PipelineSize(1024, 8, 4, 8, 6, 64, (64, 128), 256, 4, 3),
    ("tiny", "cuda"): PipelineSize(64, 2, 2, 2, 2, 8, (8, 16), 32, 2, 1),
    "full": PipelineSize(512, 8, 4, 8, 8, 64, (32, 64), 128, 4, 3),
    "quick": PipelineSize(256, 4, 4, 8, 6, 32, (32, 64), 64, 4, 3),
    "tiny": PipelineSize(32, 2, 2, 4, 2, 8, (8, 16), 32, 2, 1),
}


# ---------------------------------------------------------- the pipeline
def tiny_flux_pipeline(size: PipelineSize, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A FluxPipeline of the given size with random weights (seeded), on the host;
    tokenizers are None."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    h, latent = size.hidden, 4
    head_dim = h // size.heads
    rope = (head_dim - 2 * (3 * head_dim // 8), 3 * head_dim // 8, 3 * head_dim // 8)  # sums to head_dim
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent, num_layers=size.double, num_single_layers=size.single,
        attention_head_dim=head_dim, num_attention_heads=size.heads, joint_attention_dim=h,
        pooled_projection_dim=h, axes_dims_rope=rope)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        hidden_size=h, intermediate_size=4 * h, num_hidden_layers=size.text_layers, num_attention_heads=size.heads,
        vocab_size=1000, max_position_embeddings=max(77, size.text_tokens), projection_dim=h,
        bos_token_id=0, eos_token_id=2, pad_token_id=1))
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=1000, d_model=h, d_ff=4 * h, d_kv=head_dim, num_layers=size.text_layers, num_heads=size.heads,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(size.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(size.vae_channels), block_out_channels=size.vae_channels,
        layers_per_block=1, latent_channels=latent, norm_num_groups=min(8, size.vae_channels[0]),
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                        tokenizer=None, text_encoder_2=text_encoder_2, tokenizer_2=None, transformer=transformer)
    for module in (transformer, text_encoder, text_encoder_2, vae):
        if dtype != torch.float32:
            module.to(dtype)
        module.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, size: PipelineSize, seed: int = 0, output_type: str = "pt") -> torch.Tensor:
    """One image: fixed token ids through both text encoders, then the pipeline
    with those embeddings and a seeded generator. Returned on the host."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (1, size.text_tokens), generator=g)
    ids[0, -1] = 2  # CLIP pools at the end-of-text token
    device = pipe._execution_device  # noqa: SLF001 - diffusers' own: where the pipeline runs its modules
    with torch.inference_mode():
        pooled = pipe.text_encoder(ids.to(device)).pooler_output
        embeds = pipe.text_encoder_2(ids.to(device))[0]
        out = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, height=size.image, width=size.image,
                   num_inference_steps=size.steps, guidance_scale=3.5, generator=torch.Generator().manual_seed(seed),
                   output_type=output_type).images
    return out.cpu() if isinstance(out, torch.Tensor) else out


def pipeline_bytes(pipe) -> tuple[int, int]:
    """(parameter bytes of every component, bytes of the largest block of any block list)."""
    import layerwise

    total, largest = 0, 0
    for module in pipe.components.values():
        if not isinstance(module, torch.nn.Module):
            continue
        total += sum(p.numel() * p.element_size() for p in module.parameters())
        try:
            groups = layerwise.detect_layer_groups(module)
        except ValueError:
            continue
        for g in groups:
            for block in module.get_submodule(g):
                largest = max(largest, sum(p.numel() * p.element_size() for p in block.parameters()))
    return total, largest


# ---------------------------------------------------------- one method
def _set_up(pipe, method: str, device: torch.device) -> dict:
    import layerwise

    info = {}
    if method == RESIDENT:
        pipe.to(device)
    elif method in (LAYERWISE, PAGEABLE):
        managers = layerwise.offload_pipeline(pipe, device, pin_budget=0 if method == PAGEABLE else "auto")
        stats = [m.stats() for ms in managers.values() for m in ms]
        info["arena_bytes"] = sum(s["arena_bytes"] for s in stats)
        info["pinned_bytes"] = sum(s["arena_bytes"] for s in stats if s["arena_pinned"])
        info["ring_bytes"] = sum(s["ring_bytes"] for s in stats)
        info["pin_budget"] = layerwise.report_pipeline(pipe)["pin_budget"]["bytes"]
        info["streamed"] = sorted(managers)
    elif method == MODEL_OFFLOAD:
        pipe.enable_model_cpu_offload(device=device)
    elif method == SEQUENTIAL:
        pipe.enable_sequential_cpu_offload(device=device)
    elif method == GROUP:
        pipe.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                  offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    else:
        raise ValueError(f"unknown method {method!r}")
    return info


def _warm_up(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Pay the one-time costs of a process (lazy imports, the first copy engine and
    its threads, allocator pools, first kernels) on a throwaway test-size
    pipeline, so that the figures are those of the method itself."""
    import gc

    import layerwise

    small = SIZES["tiny"]
    pipe = tiny_flux_pipeline(small, dtype=dtype)
    if method in (LAYERWISE, PAGEABLE):
        layerwise.offload_pipeline(pipe, device, pin_budget=0 if method == PAGEABLE else "auto")
        generate(pipe, small)
        layerwise.remove_pipeline_offload(pipe)
    else:
        generate(pipe.to(device), small)
    del pipe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure_method(method: str, device: torch.device, size: PipelineSize) -> dict:
    """Build the pipeline, set it up by `method`, run 1 + size.images images; figures."""
    from layerwise.bench.startup import PeakRSS

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _warm_up(method, device, dtype)
    pipe = tiny_flux_pipeline(size, dtype=dtype)
    total, largest = pipeline_bytes(pipe)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        device_base = torch.cuda.memory_allocated(device)
    with PeakRSS() as whole:
        with PeakRSS() as setup:
            t0 = time.perf_counter()
            info = _set_up(pipe, method, device)
            if cuda:
                torch.cuda.synchronize(device)
            setup_s = time.perf_counter() - t0
        image = generate(pipe, size)  # untimed: first-call costs
        times = []
        for _ in range(size.images):
            t0 = time.perf_counter()
            generate(pipe, size)  # the image comes back to the host: the device is drained
            times.append(time.perf_counter() - t0)
    out = {"method": method, "setup_s": setup_s, "image_s": times, "setup_rss_growth": setup.growth,
           "rss_growth": max(setup.growth, whole.peak - setup.start), "pipeline_bytes": total,
           "largest_layer_bytes": largest, "image": image, **info}
    if cuda:
        out["device_peak_bytes"] = torch.cuda.max_memory_allocated(device) - device_base
    return out


def _child() -> None:
    from layerwise.bench.startup import unmap_freed_memory

    unmap = unmap_freed_memory()
    method, device, scale, threads, out = sys.argv[1:]
    torch.set_num_threads(int(threads))
    ctx = Context(torch.device(device), scale)
    result = measure_method(method, ctx.device, ctx.pick(SIZES))
    result["unmap_on_free"] = unmap
    with open(out, "wb") as f:
        pickle.dump(result, f)


def _run_method(ctx: Context, method: str) -> dict:
    with held_interrupts():  # made with the finalizer that removes it (at exit at the latest) as one step
        made = tempfile.TemporaryDirectory()
    with made as tmp:
        out = os.path.join(tmp, "result.pkl")
        args = [method, str(ctx.device), ctx.scale, str(torch.get_num_threads()), out]
        proc = subprocess.run([sys.executable, "-c", f"from {__name__} import _child; _child()", *args])
        if proc.returncode != 0:
            raise RuntimeError(f"the pipeline suite's process for {method!r} exited with status {proc.returncode} "
                               "(traceback above)")
        with open(out, "rb") as f:
            return pickle.load(f)


# ------------------------------------------------------------------ suite
def run(ctx: Context) -> SuiteResult:
    try:
        import diffusers  # noqa: F401
        import transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001
        from layerwise.bench.common import Skip

        raise Skip(f"diffusers and transformers are needed ({type(e).__name__}: {e})") from None
    size = ctx.pick(SIZES)
    runs, skipped = {}, {}
    with ctx.progress(len(METHODS), NAME) as bar:
        for method in METHODS:
            if method in CUDA_ONLY and not ctx.is_cuda:
                skipped[method] = f"{CUDA_ONLY[method]} (this run: {ctx.device})"
            else:
                try:
                    runs[method] = _run_method(ctx, method)
                except RuntimeError as e:
                    if method in (RESIDENT, LAYERWISE):
                        raise
                    skipped[method] = str(e)  # a baseline that fails to run is not our failure
            bar.update(1)
    reference = runs[RESIDENT]["image"]
    for r in runs.values():
        r["equal"] = bool(torch.equal(r["image"], reference))
        r["max_abs_diff"] = float((r["image"].float() - reference.float()).abs().max())
    data = {"size": asdict(size), "skipped": skipped,
            "runs": {m: {k: v for k, v in r.items() if k != "image"} for m, r in runs.items()}}
    result = SuiteResult(NAME, data=data)
    result.rows = _rows(ctx, runs, skipped)
    return result


def _rows(ctx: Context, runs: dict, skipped: dict) -> list[Row]:
    ours = runs[LAYERWISE]
    others = [m for m in runs if m != LAYERWISE]
    diffusers = [m for m in runs if m.startswith("diffusers")]
    ms = {m: Stat.of([t * 1e3 for t in r["image_s"]]) for m, r in runs.items()}
    rows = []

    ratios = {"/resident": ratio(ms[LAYERWISE], ms[RESIDENT])}
    targets = []
    if diffusers:
        best = min(diffusers, key=lambda m: ms[m].median)
        ratios[f"/{best.removeprefix('diffusers ')}"] = ratio(ms[LAYERWISE], ms[best])
        targets.append(Target("< every diffusers offload", all(ms[LAYERWISE].median < ms[m].median
                                                               for m in diffusers)))
    rows.append(Row(NAME, "wall time per image", "ms", ms[LAYERWISE], {m: ms[m] for m in others}, ratios, targets))

    rows.append(Row(NAME, "set-up time", "ms", ours["setup_s"] * 1e3,
                    {m: runs[m]["setup_s"] * 1e3 for m in others}))

    # docs/design.md: peak host memory during set-up <= the pipeline + its largest layer + 5%: never two copies.
    # On a CPU device the rings are host memory too.
    total, largest = ours["pipeline_bytes"], ours["largest_layer_bytes"]
    allowed = largest + 0.05 * total + (0 if ctx.is_cuda else ours["ring_bytes"])
    judged = ours.get("unmap_on_free", False)
    rows.append(Row(NAME, "peak host RSS growth during set-up", "MiB", ours["setup_rss_growth"] / MiB,
                    {"pipeline": total / MiB, "largest layer": largest / MiB,
                     **{m: runs[m]["setup_rss_growth"] / MiB for m in others}},
                    {"/pipeline": ours["setup_rss_growth"] / total},
                    [Target("<= largest layer + 5%" + ("" if ctx.is_cuda else " + ring"),
                            ours["setup_rss_growth"] <= allowed)] if judged else [],
                    note="" if judged else "freed memory stays resident here: no target"))
    rows.append(Row(NAME, "peak host RSS growth, set-up + images", "MiB", ours["rss_growth"] / MiB,
                    {m: runs[m]["rss_growth"] / MiB for m in others},
                    {"/resident": ratio(ours["rss_growth"], runs[RESIDENT]["rss_growth"])}))
    rows.append(Row(NAME, "host arena pinned", "MiB", ours["pinned_bytes"] / MiB,
                    {"arena": ours["arena_bytes"] / MiB, "pin budget": ours["pin_budget"] / MiB},
                    note="pinned = mlock'ed on a CPU device"))
    if ctx.is_cuda:
        rows.append(Row(NAME, "peak device memory", "MiB", ours["device_peak_bytes"] / MiB,
                        {m: runs[m]["device_peak_bytes"] / MiB for m in others},
                        {"/resident": ratio(ours["device_peak_bytes"], runs[RESIDENT]["device_peak_bytes"])}))
    else:
        rows.append(Row(NAME, "peak device memory", "MiB", None, note="not measured: the device is host memory"))
    rows.append(Row(NAME, "image bitwise equal to resident", "1=yes", float(ours["equal"]),
                    {m: float(runs[m]["equal"]) for m in others if m != RESIDENT},
                    targets=[Target("= resident image", ours["equal"])]))
    for method, why in skipped.items():
        rows.append(Row(NAME, f"{method}: not measured", "", None, note=why))
    return rows
