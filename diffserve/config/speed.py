"""The flags of what makes a step faster: the step cache, compilation, quantization and the
attention kernels, declared as :mod:`diffserve.config.flags` declares the rest (``ServerConfig``
takes them as a base)."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.config.fields import option


@dataclass(frozen=True)
class SpeedOptions:
    step_cache: str = option(
        "off", "Step mode: first-block runs every row through the denoiser's first block and, per "
        "image, reuses its cached output of the remaining blocks when that block's signal changed "
        "less than the request's cache_threshold since its last computed step; those rows skip "
        "the remaining blocks. Each image decides alone; the first and last steps always "
        "compute.", choices=("off", "first-block"))
    cache_threshold: float = option(
        0.0, "--step-cache: the threshold of requests that set no cache_threshold (0: never "
        "reuse).", ge=0, le=1)
    compile: bool = option(
        False, "torch.compile the denoiser's repeated blocks (each block class once); the native "
        "size compiles at start, other sizes when first needed. See --compile-rows and "
        "--cuda-graphs.")
    compile_rows: str = option(
        "exact", "--compile: exact compiles the rows (and a transformer's token count) as dynamic "
        "sizes, so a forward computes only its own rows and a new text length does not "
        "recompile; buckets pads rows to powers of two with static shapes (1, 2, 4, 8...), each "
        "bucket a graph of its own, as CUDA graphs need.", choices=("exact", "buckets"))
    cuda_graphs: str = option(
        "off", "--compile on CUDA: on captures a CUDA graph per bucket (mode reduce-overhead; "
        "implies --compile-rows buckets), which pays where launches dominate (small sizes, few "
        "rows) and costs a copy of every block's output; off runs the compiled kernels without "
        "graphs.", choices=("off", "on"))
    quantization: str = option(
        "none", "Quantize the denoiser's linear layers through torchao: int8-weight-only (CPU and "
        "GPU) and fp8-weight-only (GPU) store the weights quantized and compute in the served "
        "dtype (memory); int8-dynamic (CPU and GPU) and fp8 (GPUs with float8 tensor cores: "
        "compute capability 8.9 or later) quantize each row's activations too and run the "
        "matmuls in int8 or float8 (speed). Needs the quantization extra (torchao).",
        choices=("none", "int8-weight-only", "fp8-weight-only", "int8-dynamic", "fp8"))
    quantization_scope: str = option(
        "auto", "--quantization: which linear layers. blocks: those of the denoiser's repeated "
        "blocks (the embedders, the first and the last layers stay in the served dtype); all: "
        "every one. auto: blocks for int8-dynamic and fp8, all for the weight-only schemes.",
        choices=("auto", "blocks", "all"))
    text_encoder_quantization: str = option(
        "none", "Quantize the text encoders' linear weights through transformers' torchao config "
        "(the denoiser's schemes): int8-weight-only (CPU and GPU), fp8-weight-only (GPU).",
        choices=("none", "int8-weight-only", "fp8-weight-only"))
    attention_backend: str = option(
        "native", "The denoiser's attention kernel, through diffusers' attention dispatcher: "
        "native (torch's scaled_dot_product_attention, which picks its own kernel), math, "
        "torch-flash, efficient, cudnn (torch's kernels, each forced), flash, flash3, sage, "
        "xformers (their packages), flex. auto times the available exact kernels on the model's "
        "own shapes at start and keeps the fastest whose output matches native's. A kernel that "
        "is not installed or does not run on the device stops the start, naming what is missing.",
        choices=("native", "auto", "math", "torch-flash", "efficient", "cudnn", "flash", "flash3",
                 "sage", "xformers", "flex"))
    device_peak_tflops: float = option(
        0.0, "The device's peak dense TFLOP/s in the served dtype, for "
        "diffserve_model_flops_utilization. 0: from diffserve's table of GPUs by name and dtype "
        "(no utilisation where the device is not in it).", ge=0, le=1e6)
