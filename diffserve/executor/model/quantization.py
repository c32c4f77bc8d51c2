"""Quantized denoiser weights (``--quantization``), through diffusers' own quantization config
and torchao.

The pipeline is loaded with a ``PipelineQuantizationConfig`` that maps each denoiser component
(``unet``, ``transformer``, Wan 2.2's ``transformer_2``) to a ``TorchAoConfig``: diffusers
quantizes their ``nn.Linear`` weights as it loads them; convolutions, norms, the text encoders
and the VAE keep the served dtype.

- ``int8-weight-only``: int8 weights with a scale per output channel, dequantized in the matmul;
  runs on CPU and GPU.
- ``fp8-weight-only``: float8 (e4m3) weights; needs a CUDA GPU (float8 matmuls).

LoRA adapters work on top: PEFT wraps the quantized layers, and each row's adapter deltas are
added in the served dtype (:mod:`diffserve.executor.lora.rows`).
"""

from __future__ import annotations

import logging

from diffserve.config import ConfigError
from diffserve.executor.pipeline import DENOISERS, declared_components, is_denoiser
from diffserve.executor.tensors import module_bytes

log = logging.getLogger(__name__)

NONE = "none"
SCHEMES = {"int8-weight-only": "Int8WeightOnlyConfig", "fp8-weight-only": "Float8WeightOnlyConfig"}


class QuantizationUnavailable(ConfigError):
    """The scheme cannot run here (torchao missing, no GPU for float8)."""


def pipeline_config(scheme: str, model_dir: str, device: str, text_encoders: str = NONE):
    """The ``quantization_config`` for ``from_pretrained`` (the denoisers by ``scheme``, the text
    encoders by ``text_encoders``), or None where both are ``none``."""
    if scheme == NONE and text_encoders == NONE:
        return None
    mapping = {}
    found = _components(model_dir)
    if scheme != NONE:
        schemes = _schemes(scheme, device, "--quantization")
        from diffusers import TorchAoConfig

        components = [name for name in DENOISERS if name in found]
        if not components:
            raise ValueError(f"--quantization: {model_dir} has no denoiser component to quantize "
                             f"(looked for {', '.join(DENOISERS)})")
        mapping.update({name: TorchAoConfig(getattr(schemes, SCHEMES[scheme])())
                        for name in components})
    if text_encoders != NONE:
        schemes = _schemes(text_encoders, device, "--text-encoder-quantization")
        from transformers import TorchAoConfig as TransformersTorchAoConfig

        encoders = sorted(name for name in found if name.startswith("text_encoder"))
        if not encoders:
            raise ValueError(f"--text-encoder-quantization: {model_dir} has no text encoder")
        mapping.update({name: TransformersTorchAoConfig(getattr(schemes, SCHEMES[text_encoders])())
                        for name in encoders})
    from diffusers import PipelineQuantizationConfig

    return PipelineQuantizationConfig(quant_mapping=mapping)


def _schemes(scheme: str, device: str, flag: str):
    """torchao's schemes, where ``scheme`` can run on ``device``."""
    if scheme not in SCHEMES:
        raise ValueError(f"{flag} {scheme!r} is not one of {NONE}, {', '.join(SCHEMES)}")
    try:
        import torchao.quantization as schemes
    except ImportError:
        raise QuantizationUnavailable(
            f"{flag} {scheme} needs torchao, which is not installed: "
            "pip install 'diffserve[quantization]'") from None
    if scheme == "fp8-weight-only" and not device.startswith("cuda"):
        raise QuantizationUnavailable(f"{flag} {scheme} needs a CUDA GPU (float8 "
                                      f"matmuls); this executor runs on {device}. On a CPU, "
                                      "int8-weight-only works")
    return schemes


def _components(model_dir: str) -> set[str]:
    declared = declared_components(model_dir)
    if declared is None:  # a hub id: diffusers reads its index itself
        return {*DENOISERS, "text_encoder"}
    return set(declared)


def quantize_built(scheme: str, text_encoders: str, built: dict, device: str) -> None:
    """Modules built in memory (a random-weight model's), quantized in place as the pipeline
    config would have them quantized as they load: the denoisers by ``scheme``, the text encoders
    by ``text_encoders``."""
    for flag, chosen, wanted in (("--quantization", scheme, is_denoiser),
                                 ("--text-encoder-quantization", text_encoders,
                                  lambda name: name.startswith("text_encoder"))):
        if chosen == NONE:
            continue
        schemes = _schemes(chosen, device, flag)
        for name in (n for n in built if wanted(n)):
            schemes.quantize_(built[name], getattr(schemes, SCHEMES[chosen])())


def log_weights(scheme: str, denoisers: list) -> None:
    logical = stored = 0
    for denoiser in denoisers:
        a, b = module_bytes(denoiser)
        logical, stored = logical + a, stored + b
    log.info("--quantization %s: denoiser weights %.1f MB, %.1f MB unquantized", scheme,
             stored / 1e6, logical / 1e6)
