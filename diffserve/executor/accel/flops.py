"""The model's FLOPs, counted as the denoiser runs: ``diffserve_model_flops_total`` and, where the
device's peak is known, ``diffserve_model_flops_utilization`` (model FLOPs utilisation, MFU).

A denoiser forward's FLOPs per row are a quadratic in the row's tokens x (its latent elements per
channel: a transformer's image tokens, a UNet's latent pixels, a video's frames x pixels):
the linear layers and convolutions grow with x, self-attention with x², and what the text adds
is fixed for a given prompt length. So each model's count is *fitted* at start, not written by
hand per family: one-step generations at three small sizes run under torch's FLOP counter
(attention on torch's math kernel, which the counter sees), and the three counts give the
quadratic's three coefficients exactly; ``tests/executor/test_flops.py`` checks the fit against
a fourth size's count, and docs/accelerators.md checks it against FLUX.1-dev's own shapes. What
it counts: every matmul, convolution and attention product of the denoiser (the FLOPs the model
defines); not elementwise work, the text encoder, the VAE or control models; a step cache's
skipped blocks still count (the model's FLOPs, not the executed ones). A prompt longer or
shorter than the fit's (Qwen-Image's text is as long as its prompt) counts at the fit's length.

In a parallel group a rank counts its own share of each forward (the split is inside the
denoiser): the utilisation is a device's, the total is multiplied by the group's size.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

# Dense peak TFLOP/s by GPU (the device layer's name, lower case, first match) and dtype, from
# the vendors' datasheets (without sparsity). 8-bit: float8 and int8 tensor cores.
PEAKS = (("h200", {"bfloat16": 989.4, "float16": 989.4, "8bit": 1978.9, "float32": 66.9}),
         ("h100 nvl", {"bfloat16": 835.5, "float16": 835.5, "8bit": 1671.0, "float32": 60.0}),
         ("h100 pcie", {"bfloat16": 756.5, "float16": 756.5, "8bit": 1513.0, "float32": 51.2}),
         ("h100", {"bfloat16": 989.4, "float16": 989.4, "8bit": 1978.9, "float32": 66.9}),
         ("b200", {"bfloat16": 2250.0, "float16": 2250.0, "8bit": 4500.0}),
         ("a100", {"bfloat16": 312.0, "float16": 312.0, "8bit": 624.0, "float32": 19.5}),
         ("l40s", {"bfloat16": 362.1, "float16": 362.1, "8bit": 733.0}),
         ("l4", {"bfloat16": 121.0, "float16": 121.0, "8bit": 242.5}),
         ("rtx 4090", {"bfloat16": 165.2, "float16": 165.2, "8bit": 330.3}))
FIT_SIDES = (1, 2, 3)  # the fit's sizes: this many times 8 latent pixels a side
WINDOW_S = 10.0  # the utilisation's window of busy time


@dataclass(frozen=True)
class FlopModel:
    """FLOPs of one row of a denoiser forward: ``a + b*x + c*x*x`` for a row of x tokens."""

    a: float
    b: float
    c: float
    per_pixel: float = 0.0  # tokens per pixel of one latent frame

    def per_row(self, tokens: float) -> float:
        return self.a + self.b * tokens + self.c * tokens * tokens


def tokens_and_rows(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(tokens per row, rows) of a denoiser call, from its latent input: [rows, tokens, C]
    (packed transformers), [rows, C, (frames,) h, w] (UNets, DiTs on latents, videos), or a
    list of [C, (frames,) h, w] (one per row)."""
    latents = next((kwargs[k] for k in ("hidden_states", "sample", "x") if k in kwargs),
                   args[0] if args else None)
    if isinstance(latents, (list, tuple)) and latents and hasattr(latents[0], "shape"):
        return int(np.prod(latents[0].shape[1:])), len(latents)
    if not hasattr(latents, "shape") or latents.dim() < 3:
        return None
    shape = latents.shape
    return (int(shape[1]) if latents.dim() == 3 else int(np.prod(shape[2:]))), int(shape[0])


class FlopCounter:
    """Counts the model FLOPs of every forward of ``denoisers`` (a hook on each, no device work),
    for :meth:`take`; ``scale``: the group's size (each rank counts its share)."""

    def __init__(self, model: FlopModel, denoisers: list, scale: int = 1) -> None:
        self.model, self.scale = model, scale
        self._flops, self._lock = 0.0, threading.Lock()
        self._hooks = [d.register_forward_pre_hook(self._count, with_kwargs=True)
                       for d in denoisers]

    def _count(self, module, args, kwargs) -> None:
        found = tokens_and_rows(args, kwargs)
        if found is not None:
            tokens, rows = found
            with self._lock:
                self._flops += rows * self.model.per_row(tokens)

    def take(self) -> float:
        """This rank's model FLOPs since the last call."""
        with self._lock:
            flops, self._flops = self._flops, 0.0
        return flops

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


class Utilization:
    """Model FLOPs utilisation while busy: the FLOPs of the steps (or calls) that fill the last
    ``window_s`` seconds of device time, over those seconds, against ``peak`` FLOP/s."""

    def __init__(self, peak: float, window_s: float = WINDOW_S) -> None:
        self.peak, self.window_s = peak, window_s
        self._recent: deque = deque()  # (flops, seconds)

    def add(self, flops: float, seconds: float) -> float | None:
        """Count a step's FLOPs and seconds; the utilisation now (None: nothing timed yet)."""
        self._recent.append((flops, seconds))
        while len(self._recent) > 1 and self._busy() - self._recent[0][1] >= self.window_s:
            self._recent.popleft()
        busy = self._busy()
        return sum(f for f, _ in self._recent) / busy / self.peak if busy > 0 else None

    def _busy(self) -> float:
        return sum(s for _, s in self._recent)


def peak_flops(device: str, dtype: str, quantization: str, configured_tflops: float) -> float:
    """The device's peak FLOP/s for the model as served (0: unknown): ``--device-peak-tflops``,
    else :data:`PEAKS` by the GPU's name (the 8-bit peak where the matmuls run in int8 or
    float8)."""
    if configured_tflops:
        return configured_tflops * 1e12
    if not str(device).startswith("cuda"):
        return 0.0
    from diffserve.device import of

    name = of(device).name(device).lower()
    kind = "8bit" if quantization in ("fp8", "int8-dynamic") else dtype
    for key, peaks in PEAKS:
        if key in name:
            return peaks.get(kind, 0.0) * 1e12
    return 0.0


def fit(rt) -> FlopModel | None:
    """``rt``'s FLOP model, fitted from generations at three sizes (see the module's
    docstring); None where a count failed."""
    info = rt.info
    # Pixels: a UNet's latent halves three times evenly, and a transformer that pads its tokens to
    # a multiple of 32 (Z-Image) gets 64, 256 and 576 tokens, none padded.
    unit = 8 * info.spatial_stride
    frames = info.frame_stride + 1 if info.num_frames else 0  # two latent frames
    seen = []
    for side in FIT_SIDES:
        try:
            seen.append(count_forward(rt, side * unit, side * unit, frames))
        except RuntimeError as error:
            log.warning("model FLOPs not counted: %s", error)
            return None
    x = np.array([tokens for tokens, _, _ in seen], dtype=float)
    y = np.array([flops / rows for _, rows, flops in seen], dtype=float)
    a, b, c = np.linalg.solve(np.stack([np.ones_like(x), x, x * x], axis=1), y)
    # Tokens per pixel of one latent frame, from the fit's own readings (a packed transformer's
    # token is 16x16 pixels, a UNet's latent pixel 8x8): what a request's size comes to.
    per_pixel = x[0] / (FIT_SIDES[0] * unit) ** 2 / (2 if frames else 1)
    return FlopModel(float(a), float(b), float(c), float(per_pixel))


def count_forward(rt, width: int, height: int, frames: int = 0) -> tuple[int, int, int]:
    """(tokens per row, rows, FLOPs) of the first denoiser forward of a generation of one image
    at ``width`` x ``height`` (``frames``: a video's), counted by torch's FLOP counter with
    attention on the math kernel. Raises RuntimeError where the generation fails."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from diffserve.executor.pipeline import denoisers
    from diffserve.wire.request import ImageRequest, Work, WorkItem
    from diffserve.wire.tasks import GENERATE, INPAINT

    count_int8()
    info, counting, seen = rt.info, {}, []

    def enter(module, args, kwargs):
        if not counting:  # the first forward only
            counting.update(mode=FlopCounterMode(display=False), found=tokens_and_rows(args, kwargs))
            counting["mode"].__enter__()

    def leave(module, args, kwargs, output):
        if counting.get("found") is not None:
            counting["mode"].__exit__(None, None, None)
            seen.append((*counting.pop("found"), counting["mode"].get_total_flops()))

    hooks = [h for m in denoisers(rt.loaded.pipe).values()
             for h in (m.register_forward_pre_hook(enter, with_kwargs=True),
                       m.register_forward_hook(leave, with_kwargs=True))]
    # Two steps: some schedulers' single step divides by zero (FlowMatch's shift at one step).
    # A model that only inpaints (FLUX.1 Fill) is counted on an inpainting of a grey image.
    task = GENERATE if GENERATE.name in info.tasks or INPAINT.name not in info.tasks else INPAINT
    request = ImageRequest(f"flop-count-{width}x{height}", info.name, width, height,
                           num_inference_steps=2, prompt="a count of the model's flops",
                           guidance_scale=info.default_guidance_scale, seed=0, num_frames=frames,
                           task=task.name)
    inputs = [np.full(i.shape(width, height), 128, np.uint8) for i in task.inputs]
    try:
        with sdpa_kernel(SDPBackend.MATH), torch.inference_mode():
            (outcome,) = rt.request_runner().execute(Work(0, [WorkItem(request, 0, 1)]), [inputs])
    finally:
        if counting.get("found") is not None:  # a forward that raised
            counting["mode"].__exit__(None, None, None)
        for hook in hooks:
            hook.remove()
    if outcome.error or not seen:
        raise RuntimeError(f"a {width}x{height} generation "
                           f"{outcome.error or 'ran no denoiser forward'}")
    return seen[0]


def count_int8() -> None:
    """torch's FLOP counter taught ``_int_mm`` (int8-dynamic's matmul), which it does not count
    on its own: an int8 model's fit would otherwise leave out every quantized linear layer."""
    import torch
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    if torch.ops.aten._int_mm not in flop_registry:
        register_flop_formula(torch.ops.aten._int_mm)(_int_mm_flop)


def _int_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """An [m, k] x [k, n] matmul: 2mkn, as torch counts a float one."""
    (m, k), (_, n) = a_shape, b_shape
    return 2 * m * k * n


def tokens_of(model: FlopModel, info, width: int, height: int, frames: int = 0) -> float:
    """The tokens of one row of a ``width`` x ``height`` request (``frames``: a video's)."""
    latent_frames = (frames - 1) // info.frame_stride + 1 if frames else 1
    return model.per_pixel * width * height * latent_frames


def row_cost(model: FlopModel | None, info) -> tuple[float, ...]:
    """One row's cost against its size relative to the native size's, p: (a, b, c) of
    a + b*p + c*p*p with a + b + c = 1 (diffserve.wire.costs.RowCost), from the FLOP model;
    () without one, or where the fit is not a cost that grows with the size."""
    if model is None:
        return ()
    native = tokens_of(model, info, info.width, info.height, info.num_frames)
    whole = model.per_row(native)
    if whole <= 0 or native <= 0:
        return ()
    a, b, c = model.a / whole, model.b * native / whole, model.c * native * native / whole
    if min(b, c) < 0 or a < -0.5:  # a fit the size does not explain: price by the tokens
        return ()
    return (a, b, c)


def rows_per_image(info, guidance_scale: float | None = None, negative_prompt: str = "") -> int:
    """The denoiser rows one image takes a step: two under classifier-free guidance, which a
    model with true CFG (Qwen-Image's rule) runs only with a negative prompt."""
    from diffserve.wire.costs import uses_cfg

    guidance = info.default_guidance_scale if guidance_scale is None else guidance_scale
    return 2 if uses_cfg(info.guidance_rule, guidance, negative_prompt) else 1


def step_flops(model: FlopModel, info, images: int, width: int, height: int, frames: int = 0,
               guidance_scale: float | None = None, negative_prompt: str = "") -> float:
    """The model FLOPs of one step of ``images`` images of this size and guidance."""
    rows = images * rows_per_image(info, guidance_scale, negative_prompt)
    return rows * model.per_row(tokens_of(model, info, width, height, frames))


def describe(rt, config) -> dict:
    """What /v1/models shows of the count: the FLOPs of a step of one native-size image at the
    default guidance (its rows; with a negative prompt, where that turns true CFG on), and the
    device's peak."""
    model, info = rt.flops, rt.info
    if model is None:
        return {}
    rows, with_negative = rows_per_image(info), rows_per_image(info, negative_prompt=" ")
    per_row = model.per_row(tokens_of(model, info, info.width, info.height, info.num_frames))
    ranks, peak = _ranks_and_peak(rt, config)
    return {"per_step_native": rows * per_row * ranks, "rows_per_image": rows,
            **({"rows_per_image_with_negative_prompt": with_negative}
               if with_negative != rows else {}),
            "device_peak_tflops": peak / 1e12 or None}


def counter_for(rt, config):
    """The executor's FLOP counter and its device's peak FLOP/s, or (None, 0.0) where the model
    was not fitted."""
    from diffserve.executor.pipeline import denoisers

    if rt.flops is None:
        return None, 0.0
    ranks, peak = _ranks_and_peak(rt, config)
    return FlopCounter(rt.flops, list(denoisers(rt.loaded.pipe).values()), ranks), peak


def _ranks_and_peak(rt, config) -> tuple[int, float]:
    """The group's size (each rank counts its share) and one device's peak FLOP/s."""
    return (rt.group.degrees.size if rt.group else 1,
            peak_flops(rt.loaded.device, rt.loaded.dtype, config.quantization,
                       config.device_peak_tflops))
