"""``--quantization`` with the ``blocks`` scope: the denoisers' repeated blocks quantized once
the model is built (:func:`~diffserve.executor.model.quantization.quantize_blocks`), with what it
costs in accuracy measured on the way: one small generation before and after, their PSNR
(``/v1/models`` shows it under ``speed.quantization``). The ``all`` scope quantizes as the
weights load, so no unquantized image exists to compare with; its PSNR is not measured.

The start-up check then judges the quantized model as it judges half precision: the step engine
against the plain pipeline on the same (quantized) weights."""

from __future__ import annotations

import logging
import math

import numpy as np

from diffserve.executor.model import quantization as quant

log = logging.getLogger(__name__)

SIDE = 256  # pixels of the compared image, rounded to the model's stride, at most its native size
STEPS = 4


def quantize(rt, config) -> dict:
    """Quantize ``rt``'s denoisers where ``config`` asks for the blocks scope; what was done (for
    ``rt.speed``), empty without quantization."""
    scheme = config.quantization
    if scheme == quant.NONE:
        return {}
    scope = quant.scope_of(scheme, config.quantization_scope)
    done = {"scheme": scheme, "scope": scope, "psnr_db": None}
    denoisers = rt.family.denoisers if rt.family else _denoisers(rt)
    if scope == "all":
        done["padded_layers"] = pad_int8_rows(scheme, denoisers, rt.loaded.device)
        return {**done, "psnr_note": "quantized as it loaded: no unquantized image to compare"}
    before = None if config.skip_startup_check else _image(rt)
    layers = quant.quantize_blocks(scheme, denoisers, rt.loaded.device)
    quant.log_weights(scheme, denoisers)
    done["layers"] = layers
    done["padded_layers"] = pad_int8_rows(scheme, denoisers, rt.loaded.device)
    if before is not None:
        psnr = _psnr(_image(rt), before)
        done["psnr_db"] = None if math.isinf(psnr) else round(psnr, 2)
        done["identical"] = math.isinf(psnr)
        log.info("--quantization %s: %d linear layers of the repeated blocks; a %d-step image "
                 "is %.1f dB from the unquantized one", scheme, layers, STEPS, psnr)
    return done


def pad_int8_rows(scheme: str, denoisers: list, device: str, force: bool = False) -> int:
    """int8-dynamic's quantized linear layers on CUDA given at least :data:`INT8_ROWS` rows
    (``force``: wherever they run, as the tests do); how many layers. cuBLAS's int8 matmul
    (``torch._int_mm``) refuses 16 rows or fewer, and torchao then computes the matmul in
    float32 instead: every step, in the modulation layers (a row per image). The padding rows
    copy the last one; activations are scaled per row, so the real rows' values do not change.
    A compiled block's matmul is inductor's, which takes any rows: it is left alone."""
    import torch

    from diffserve.executor.accel.wrapping import wrap_forward

    if scheme != "int8-dynamic" or not (force or str(device).startswith("cuda")):
        return 0
    layers = [m for d in denoisers for m in d.modules() if isinstance(m, torch.nn.Linear)
              and type(m.weight) is not torch.nn.Parameter and getattr(m, "_int8_rows", None) is None]
    for layer in layers:
        layer._int8_rows = wrap_forward(layer, _padded_linear)
    return len(layers)


INT8_ROWS = 17  # the fewest rows cuBLAS's int8 matmul takes


def _padded_linear(original, args, kwargs):
    import torch

    x = args[0] if args else kwargs.pop("input")
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if not 0 < rows < INT8_ROWS or torch.compiler.is_compiling():
        return original(x, *args[1:], **kwargs)
    flat = x.reshape(rows, x.shape[-1])
    out = original(torch.cat([flat, flat[-1:].expand(INT8_ROWS - rows, -1)]), *args[1:], **kwargs)
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def _denoisers(rt) -> list:
    from diffserve.executor.pipeline import denoisers

    return list(denoisers(rt.loaded.pipe).values())


def _image(rt) -> np.ndarray:
    """One small generation's pixels through the plain pipeline (a fixed seed and prompt)."""
    from diffserve.wire.request import ImageRequest, Work, WorkItem

    info = rt.info
    stride = info.spatial_stride
    side = lambda native: max(stride, min(native, SIDE) // stride * stride)  # noqa: E731
    request = ImageRequest("quantization-psnr", info.name, side(info.width), side(info.height),
                           num_inference_steps=STEPS, guidance_scale=info.default_guidance_scale,
                           prompt="a red fox in the snow, photograph", seed=0,
                           num_frames=info.frame_stride + 1 if info.num_frames else 0)
    (outcome,) = rt.request_runner().execute(Work(0, [WorkItem(request, 0, 1)]), [[]])
    if outcome.error:
        raise RuntimeError(f"--quantization: the comparison image failed: {outcome.error}")
    return np.asarray(outcome.images)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)
