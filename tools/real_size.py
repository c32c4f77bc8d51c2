"""Released models' architectures at their published sizes, with random weights built in memory
on the device, for the GPU check (``benchmarks/gpu_check.py``): FLUX.1-dev, Qwen-Image and Wan 2.1
14B, or (``tiny``) the embedded tiny models of the same families. Nothing is downloaded and nothing
large touches the disk: a pipeline directory holds the index, tokenizers, scheduler and serving
defaults, and the loader is handed the modules built here.
"""

from __future__ import annotations

import inspect
import json
import tempfile
from pathlib import Path

from diffserve.executor.model.loading import load_model


def spec(family: str, tiny: bool, scratch: Path) -> tuple[str, dict, dict]:
    """(pipeline class, modules: name -> (class, build) or a built one, the other components):
    the real sizes, or the embedded tiny model's. Where diffusers' defaults are the released
    model's sizes (the transformers, the Qwen-Image and Wan VAEs), those."""
    import diffusers as d
    import transformers as t

    from diffserve.models.registry import resolve_model
    from diffserve.models.tiny import qwen_image
    from diffserve.models.tiny.common import seeded as s
    from diffserve.models.tokenizers import character_t5_tokenizer, qwen2_tokenizer, write_byte_clip_tokenizer

    def t5(cls, config, vocab):  # T5-XXL (FLUX.1) and UMT5-XXL (Wan)
        return cls, lambda: s(2, cls, config(vocab_size=vocab, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                             num_heads=64, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
                                             relative_attention_max_distance=128, tie_word_embeddings=False))
    if tiny:
        pipe = d.DiffusionPipeline.from_pretrained(resolve_model(f"tiny-{family}"))
        return type(pipe).__name__, {n: c for n, c in pipe.components.items() if c is not None}, {}
    if family == "flux":
        clip = t.CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu", bos_token_id=512,
                                eos_token_id=513, pad_token_id=513)  # the byte tokenizer's ids
        return "FluxPipeline", {
            "transformer": (d.FluxTransformer2DModel, lambda: s(0, d.FluxTransformer2DModel, guidance_embeds=True)),
            "vae": (d.AutoencoderKL, lambda: s(
                1, d.AutoencoderKL, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)),
            "text_encoder": (t.CLIPTextModel, lambda: s(3, t.CLIPTextModel, clip)),
            "text_encoder_2": t5(t.T5EncoderModel, t.T5Config, 32128)}, {
            "tokenizer": write_byte_clip_tokenizer(scratch), "tokenizer_2": character_t5_tokenizer(),
            "scheduler": d.FlowMatchEulerDiscreteScheduler(max_image_seq_len=4096, max_shift=1.15, shift=3.0,
                                                           use_dynamic_shifting=True)}
    if family == "qwen-image":
        tokenizer = qwen2_tokenizer([d.QwenImagePipeline(None, None, None, None, None).prompt_template_encode])
        ids = tokenizer.convert_tokens_to_ids
        vl = t.Qwen2_5_VLConfig(text_config=dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, rms_norm_eps=1e-6, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
            rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
            vision_config=dict(hidden_size=1280),  # else transformers' defaults, Qwen2.5-VL-7B's
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
        return "QwenImagePipeline", {
            "transformer": (d.QwenImageTransformer2DModel, lambda: s(0, d.QwenImageTransformer2DModel)),
            "vae": (d.AutoencoderKLQwenImage, lambda: s(1, d.AutoencoderKLQwenImage)),
            "text_encoder": (t.Qwen2_5_VLForConditionalGeneration,
                             lambda: s(2, t.Qwen2_5_VLForConditionalGeneration, vl))}, {
            "tokenizer": tokenizer, "scheduler": qwen_image.scheduler()}  # Qwen-Image's own settings
    return "WanPipeline", {
        "transformer": (d.WanTransformer3DModel, lambda: s(0, d.WanTransformer3DModel)),  # Wan 2.1 14B
        "vae": (d.AutoencoderKLWan, lambda: s(1, d.AutoencoderKLWan)),
        "text_encoder": t5(t.UMT5EncoderModel, t.UMT5Config, 256384)}, {
        "tokenizer": character_t5_tokenizer(), "scheduler": d.UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)}


def skeleton(family: str, tiny: bool, size: tuple, device: str, steps: int | None = None):
    """A pipeline directory without weights (index, tokenizers, scheduler, serving defaults), and
    ``made(dtype, quantization)``: its modules on ``device``, for the loader."""
    import diffusers
    import torch

    directory = Path(tempfile.mkdtemp(prefix=f"gpu-check-{family}-"))
    pipeline, parts, others = spec(family, tiny, directory / "_tok")
    modules = {n: m if isinstance(m, tuple) else (type(m), lambda m=m: m) for n, m in parts.items()
               if isinstance(m, (tuple, torch.nn.Module))}  # tiny: built already
    others.update({n: m for n, m in parts.items() if n not in modules})
    cls = getattr(diffusers, pipeline)  # what it has beyond these: None (a component), or its default
    index = {n: [None, None] if n in cls._optional_components else p.default
             for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}
    index.update(_class_name=pipeline, _diffusers_version=diffusers.__version__)
    for name, entry in [*((n, c) for n, (c, _) in modules.items()), *((n, type(o)) for n, o in others.items())]:
        if name not in cls._optional_components:  # a passed optional one is taken only where the index has none
            index[name] = [entry.__module__.split(".")[0], entry.__name__]
    for name, obj in others.items():
        obj.save_pretrained(directory / name)
    (directory / "model_index.json").write_text(json.dumps(index))
    w, h, frames = size  # the requests' defaults: this size and the run's steps
    defaults = {"width": w, "height": h, "spatial_stride": 16, "guidance_scale": {"flux": 3.5, "wan": 5}.get(family, 4),
                **({"num_frames": frames} if frames else {}), **({"num_inference_steps": steps} if steps else {})}
    if family != "qwen-image":  # whose text is as long as the prompt; the others pad it to this
        defaults["pipeline_kwargs"] = {"max_sequence_length": {"flux": 64, "wan": 32}[family] if tiny else 512}
    (directory / "diffserve.json").write_text(json.dumps(defaults))

    def made(dtype, quantization: str = "none", on: str | None = None) -> dict:
        built, default, where = {}, torch.get_default_dtype(), on or device
        for name, (_, build) in modules.items():
            torch.set_default_dtype(dtype)
            try:
                with torch.device(where):
                    built[name] = module = build().to(where, dtype).eval()
            finally:
                torch.set_default_dtype(default)
            # What the libraries keep in float32 as they load in half precision: diffusers its list,
            # transformers its strict one (the other in float16 only).
            strict, lax = ({*(getattr(module, f"_keep_in_fp32_modules{x}", None) or ())} for x in ("_strict", ""))
            keep = strict | (lax if isinstance(module, diffusers.ModelMixin) or dtype == torch.float16 else set())
            for key, tensor in [*module.named_parameters(), *module.named_buffers()]:
                if keep & {*key.split(".")}:
                    tensor.data = tensor.data.float()
        if quantization == "fp8-weight-only":
            from torchao.quantization import Float8WeightOnlyConfig, quantize_

            quantize_(built["transformer"], Float8WeightOnlyConfig())
        return built
    return str(directory), made


def loaded_family(family: str, tiny: bool, size: tuple, device: str, torch_threads: int):
    """A bench_parallel rank's model: ``family`` built in memory on ``device``."""
    model, made = skeleton(family, tiny, size, device)
    return load_model(model, device, "auto", torch_threads, components=lambda path, dtype: made(dtype))
