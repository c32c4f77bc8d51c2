"""Z-Image (single-stream DiT, flow matching, Qwen3 text encoder): tiny-z-image."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import vae
from diffserve.builders.tokenizers import qwen2_tokenizer

# What Qwen3's chat template renders for the one user message the pipeline sends, with the
# generation prompt (its thinking switch on: no empty think block).
CHAT_TEMPLATE = ("{%- for message in messages %}"
                 "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
                 "{{- '<|im_end|>\\n' }}"
                 "{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def build(directory: Path) -> None:
    """ZImagePipeline: one refiner layer each for image and caption tokens and one main layer
    (2 heads x 16), a two-layer Qwen3 text encoder (the pipeline reads its second-to-last
    hidden states), a 16-channel Flux-style VAE, Z-Image-Turbo's scheduler; 64x64 native."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    # Qwen3 checkpoints use the Qwen2 tokenizer class; learning the template's words keeps the
    # template about as many tokens as with Qwen's vocabulary.
    tokenizer = qwen2_tokenizer(["<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"])
    tokenizer.chat_template = CHAT_TEMPLATE
    hidden = 32
    text_encoder = seeded(0, Qwen3Model, Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    # The RoPE axes (caption/frame, height, width) add up to the head width.
    transformer = seeded(
        0, ZImageTransformer2DModel, all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16,
        dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, qk_norm=True,
        cap_feat_dim=hidden, axes_dims=[4, 6, 6], axes_lens=[1024, 512, 512])
    pipe = ZImagePipeline(
        # Z-Image-Turbo's: a static shift of 3.
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
        vae=vae(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    # Turbo is distilled to run without guidance (a scale of 0: no negative pass).
    save(pipe, directory, spatial_stride=16, guidance_scale=0.0)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-z-image": ("Z-Image-Turbo (single-stream DiT, flow matching, Qwen3 text encoder) with "
                     "random weights, 64x64, 4 steps", build),
}
