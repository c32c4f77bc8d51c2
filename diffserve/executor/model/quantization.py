"""Quantized denoiser weights (``--quantization``), through diffusers' own quantization config
and torchao.

The pipeline is loaded with a ``PipelineQuantizationConfig`` that maps each denoiser component
(``unet``, ``transformer``, Wan 2.2's ``transformer_2``) to a ``TorchAoConfig``: diffusers
quantizes their ``nn.Linear`` weights as it loads them; convolutions, norms, the text encoders
and the VAE keep the served dtype.

- ``int8-weight-only``: int8 weights with a scale per output channel, dequantized in the matmul;
  runs on CPU and GPU.
- ``fp8-weight-only``: float8 (e4m3) weights, dequantized to the served dtype for the matmul;
  needs a CUDA GPU. Both save memory, not time.
- ``int8-dynamic``: int8 weights and activations, the matmul in int8 (CPU and GPU).
- ``fp8``: float8 weights and activations, the matmul on float8 tensor cores (compute capability
  8.9 or later: Ada, Hopper, Blackwell).

The two dynamic schemes scale each row of the activations on its own (per token), so a row's
values never depend on the other rows in the batch: batching stays exact under quantization.

``--quantization-scope``: ``all`` quantizes every linear layer of the denoisers as they load
(the weight-only schemes' default); ``blocks`` only those of the repeated blocks, once loaded,
leaving the embedders and the first and last layers in the served dtype (the dynamic schemes'
default: those layers are small, and where quantizing costs the most accuracy).

LoRA adapters work on top: PEFT wraps the quantized layers, and each row's adapter deltas are
added in the served dtype (:mod:`diffserve.executor.lora.row_adapters`).
"""

from __future__ import annotations

import logging

from diffserve.config.flags import ConfigError
from diffserve.executor.pipeline import DENOISERS, declared_components, is_denoiser
from diffserve.executor.tensors import module_bytes

log = logging.getLogger(__name__)

NONE = "none"
SCHEMES = {"int8-weight-only": "Int8WeightOnlyConfig", "fp8-weight-only": "Float8WeightOnlyConfig",
           "int8-dynamic": "Int8DynamicActivationInt8WeightConfig",
           "fp8": "Float8DynamicActivationFloat8WeightConfig"}
DYNAMIC = ("int8-dynamic", "fp8")  # activations quantized too: the matmul in int8 or float8
FLOAT8_MATMUL = (8, 9)  # compute capability of the first float8 tensor cores (Ada)


def scope_of(scheme: str, scope: str) -> str:
    """``--quantization-scope`` with ``auto`` resolved for ``scheme``."""
    if scope != "auto":
        return scope
    return "blocks" if scheme in DYNAMIC else "all"


def scheme_config(schemes, scheme: str):
    """torchao's config of ``scheme`` (``schemes``: torchao.quantization). Never with torchao's
    ``set_inductor_config``: it turns on coordinate-descent tuning (and more) for every later
    compile in the process, quantized or not; ``--compile`` sets what it wants itself."""
    if scheme == "fp8":  # a scale per row (token) of the activations, as per output channel
        return schemes.Float8DynamicActivationFloat8WeightConfig(granularity=schemes.PerRow(),
                                                                 set_inductor_config=False)
    return getattr(schemes, SCHEMES[scheme])(set_inductor_config=False)


class QuantizationUnavailable(ConfigError):
    """The scheme cannot run here (torchao missing, no GPU for float8)."""


def pipeline_config(scheme: str, model_dir: str, device: str, text_encoders: str = NONE,
                    scope: str = "auto"):
    """The ``quantization_config`` for ``from_pretrained`` (the denoisers by ``scheme`` where
    its scope is ``all``, the text encoders by ``text_encoders``), or None where neither is
    quantized as it loads (a ``blocks`` scope quantizes once loaded: :func:`quantize_blocks`)."""
    if scheme != NONE and scope_of(scheme, scope) != "all":
        _schemes(scheme, device, "--quantization")  # refused now, before the weights load
        scheme = NONE
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
        mapping.update({name: TorchAoConfig(scheme_config(schemes, scheme))
                        for name in components})
    if text_encoders != NONE:
        schemes = _schemes(text_encoders, device, "--text-encoder-quantization")
        from transformers import TorchAoConfig as TransformersTorchAoConfig

        encoders = sorted(name for name in found if name.startswith("text_encoder"))
        if not encoders:
            raise ValueError(f"--text-encoder-quantization: {model_dir} has no text encoder")
        mapping.update({name: TransformersTorchAoConfig(getattr(schemes, SCHEMES[text_encoders])(
                             set_inductor_config=False))
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
    if scheme.startswith("fp8") and not device.startswith("cuda"):
        raise QuantizationUnavailable(f"{flag} {scheme} needs a CUDA GPU (float8 "
                                      f"matmuls); this executor runs on {device}. On a CPU, "
                                      "int8-weight-only and int8-dynamic work")
    if scheme == "fp8":
        from diffserve.device import of

        card = of(device)
        have = card.capability(device)
        if have < FLOAT8_MATMUL:
            raise QuantizationUnavailable(
                f"{flag} fp8 needs float8 tensor cores (compute capability 8.9 or later: Ada, "
                f"Hopper, Blackwell); {card.name(device)} has "
                f"{have[0]}.{have[1]}. fp8-weight-only or int8-dynamic run there")
    return schemes


def _components(model_dir: str) -> set[str]:
    declared = declared_components(model_dir)
    if declared is None:  # a hub id: diffusers reads its index itself
        return {*DENOISERS, "text_encoder"}
    return set(declared)


def quantize_built(scheme: str, text_encoders: str, built: dict, device: str,
                   scope: str = "auto") -> None:
    """Modules built in memory (a random-weight model's), quantized in place as the pipeline
    config would have them quantized as they load: the denoisers by ``scheme`` (where its scope
    is ``all``), the text encoders by ``text_encoders``."""
    if scheme != NONE and scope_of(scheme, scope) != "all":
        _schemes(scheme, device, "--quantization")
        scheme = NONE
    for flag, chosen, wanted in (("--quantization", scheme, is_denoiser),
                                 ("--text-encoder-quantization", text_encoders,
                                  lambda name: name.startswith("text_encoder"))):
        if chosen == NONE:
            continue
        schemes = _schemes(chosen, device, flag)
        for name in (n for n in built if wanted(n)):
            schemes.quantize_(built[name], scheme_config(schemes, chosen))


def quantize_blocks(scheme: str, denoisers: list, device: str) -> int:
    """The linear layers of ``denoisers``' repeated blocks quantized by ``scheme`` in place (the
    ``blocks`` scope); how many."""
    import torch

    schemes = _schemes(scheme, device, "--quantization")
    inside: list[str] = []
    for denoiser in denoisers:
        repeated = set(getattr(type(denoiser), "_repeated_blocks", None) or ())
        blocks = [name + "." for name, m in denoiser.named_modules() if type(m).__name__ in repeated]
        if not blocks:
            raise QuantizationUnavailable(
                f"--quantization-scope blocks: {type(denoiser).__name__} names no repeated "
                "blocks; give --quantization-scope all")
        chosen = [name for name, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)
                  and any(name.startswith(prefix) for prefix in blocks)]
        wanted = set(chosen)
        schemes.quantize_(denoiser, scheme_config(schemes, scheme),
                          filter_fn=lambda module, fqn, wanted=wanted: fqn in wanted)
        inside += chosen
    return len(inside)


def log_weights(scheme: str, denoisers: list) -> None:
    logical = stored = 0
    for denoiser in denoisers:
        a, b = module_bytes(denoiser)
        logical, stored = logical + a, stored + b
    log.info("--quantization %s: denoiser weights %.1f MB, %.1f MB unquantized", scheme,
             stored / 1e6, logical / 1e6)
