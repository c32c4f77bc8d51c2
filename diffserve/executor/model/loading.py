"""Loading a pipeline once, and what both engines share about it: the device and dtype, the
serving defaults, and what the pipeline's ``__call__`` takes (the model info for the frontend is
:mod:`~diffserve.executor.model.info`; the pipeline of each task,
:mod:`~diffserve.executor.model.task_pipelines`)."""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any

from diffserve.device.choice import pick_device, use_device
from diffserve.executor.model.dtypes import auto_dtype
from diffserve.executor.pipeline import denoisers
from diffserve.builders import random as random_weights
from diffserve.builders.registry import resolve_model, serving_defaults

log = logging.getLogger(__name__)

# Keyword arguments the server always sets, whatever the model directory's defaults say:
# the server has validated the size, so a pipeline must not silently change it.
FORCED_KWARGS = {"use_resolution_binning": False}


def leave_out_unused_libraries(serves_adapters: bool, quantization: str,
                               text_encoder_quantization: str = "none") -> None:
    """Keep PEFT and torchao unimported in an executor that will not use them. diffusers (and
    transformers) import both at start wherever they are installed: about 1 CPU-s of the 6
    an executor takes to become ready, and torchao's warnings about kernels this machine lacks
    in every server log. A ``None`` entry in ``sys.modules`` is Python's own way to say a
    module is absent: the libraries then see the package as not installed. Call it only in a
    process of its own, before diffusers is imported (later it would change nothing, and it
    would hide the package from code in the same process that needs it)."""
    if "diffusers" in sys.modules:
        return
    if not serves_adapters:
        sys.modules.setdefault("peft", None)
    if quantization == "none" and text_encoder_quantization == "none":
        sys.modules.setdefault("torchao", None)


# What the libraries log while they import, at every start, that tells an operator nothing:
# torchao's kernels this machine lacks ("Failed to load ..._C_mxfp8"), torch's deprecation of how
# torchao registers its enums, and diffusers' "Unable to import `torchao` Tensor objects" where its
# list of torchao classes is older than the installed torchao. Where quantization cannot run,
# diffserve says so itself, once (diffserve.executor.model.quantization).
NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_imports() -> None:
    """Before torch and diffusers are imported: only errors from what they log as they import.
    diffusers and transformers take their level from the environment when they first log
    (an operator's own DIFFUSERS_VERBOSITY or TRANSFORMERS_VERBOSITY is kept)."""
    for name in NOISY_IMPORT_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    import os

    for variable in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):
        os.environ.setdefault(variable, "error")


def quiet_libraries() -> None:
    """Per-request warnings (prompt truncation) and progress bars would flood the server log."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # "Loading weights" bars at every start


@dataclass
class LoadedModel:
    """A pipeline on its device, with what the engines need to know about it."""

    pipe: Any
    device: str
    dtype: str
    defaults: dict[str, Any]
    accepts: frozenset[str]  # the parameters of the pipeline's __call__
    call_kwargs: dict[str, Any]  # passed to every call: the model dir's, then the forced ones
    random_weights: bool = False  # a released architecture built with random weights

    @property
    def pipeline_class(self) -> str:
        return type(self.pipe).__name__


def load_model(model: str, device: str = "auto", dtype: str = "auto", torch_threads: int = 0,
               index: int = 0, quantization: str = "none", components=None, layout=None,
               text_encoder_quantization: str = "none",
               published_dtype: str | None = None,
               quantization_scope: str = "auto") -> LoadedModel:
    """``quantization``: a scheme of :mod:`diffserve.executor.model.quantization` for the denoiser
    (``text_encoder_quantization`` for the text encoders; ``quantization_scope``: where its
    scope is ``blocks``, the denoiser is quantized once built, by the caller:
    :func:`~diffserve.executor.model.quantization.quantize_blocks`); ``components(path, dtype)``: pipeline
    components loaded beforehand (a tensor-parallel denoiser, sharded as it loads), by name;
    ``layout``: a :class:`~diffserve.executor.memory.layout.MemoryLayout` (offloading,
    placement, tiling), applied instead of moving everything to ``device``;
    ``published_dtype``: the dtype the model's family is published in (``--dtype auto``'s
    choice on a GPU, :func:`~diffserve.executor.model.dtypes.resolve_dtype`)."""
    quiet_imports()
    import torch
    from diffusers import DiffusionPipeline

    from diffserve.executor.model import quantization as quant
    from diffserve.builders.compat import allow_processors_without_torchvision

    quiet_libraries()
    if torch_threads:  # 0: torch's default (OMP_NUM_THREADS if set, else the cores)
        torch.set_num_threads(torch_threads)
    device = pick_device(device, index)
    use_device(device)
    path = resolve_model(model)
    dtype = auto_dtype(dtype, device, published_dtype)
    defaults = serving_defaults(path)
    allow_processors_without_torchvision()
    random = random_weights.marker(path)
    if random is not None:  # built where the layout would put them, quantized as they are
        quantized = None
        built = random_weights.build(path, device if layout is None or layout.plain else "cpu",
                                     getattr(torch, dtype))
        quant.quantize_built(quantization, text_encoder_quantization, built, device,
                             quantization_scope)
    else:
        quantized = quant.pipeline_config(quantization, path, device, text_encoder_quantization,
                                          quantization_scope)
        built = {}
    prebuilt = {**built, **(components(path, getattr(torch, dtype)) if components else {})}
    pipe = DiffusionPipeline.from_pretrained(path, dtype=getattr(torch, dtype), **prebuilt,
                                             **({"quantization_config": quantized} if quantized
                                                else {}))
    if layout is None or layout.plain:
        pipe.to(device)
    else:
        layout.apply(pipe, device)
        log.info("memory layout: %s", layout.describe())
    if quantization != "none" and quant.scope_of(quantization, quantization_scope) == "all":
        quant.log_weights(quantization, list(denoisers(pipe).values()))
    pipe.set_progress_bar_config(disable=True)
    accepts = frozenset(inspect.signature(pipe.__call__).parameters)
    # HunyuanVideo 1.5's image-to-video picks its size from the image (size_as_asked).
    sized = hasattr(getattr(pipe, "video_processor", None), "calculate_default_height_width")
    for required in ("prompt", "generator", "num_inference_steps") + (
            () if sized else ("height", "width")):
        if required not in accepts:
            raise ValueError(f"{type(pipe).__name__} is not a text-to-image pipeline this server "
                             f"can drive: its __call__ takes no {required!r}")
    kwargs = {k: v for k, v in defaults.get("pipeline_kwargs", {}).items() if k in accepts}
    kwargs.update({k: v for k, v in FORCED_KWARGS.items() if k in accepts})
    return LoadedModel(pipe, device, dtype, defaults, accepts, kwargs, random is not None)


