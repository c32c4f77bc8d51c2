"""Chroma (Flux-style MM-DiT without pooled text or guidance inputs, T5): tiny-chroma."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import t5_encoder, vae
from diffserve.builders.tokenizers import character_t5_tokenizer


def build(directory: Path) -> None:
    """ChromaPipeline: one double and one single block (2 heads x 16) whose modulations come
    from a small approximator MLP, a T5 encoder, a 4-channel VAE (16 channels in per 2x2-packed
    token), FLUX.1's scheduler (shift by image token count); 64x64 native."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    t5_tokenizer = character_t5_tokenizer()
    transformer = seeded(
        0, ChromaTransformer2DModel, patch_size=1, in_channels=16, num_layers=1,
        num_single_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=1)
    pipe = ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096),
        vae=vae(latent_channels=4, use_quant_conv=False, use_post_quant_conv=False,
                scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=t5_encoder(len(t5_tokenizer)), tokenizer=t5_tokenizer, transformer=transformer)
    # The pipeline pads T5 prompts to 512 tokens by default; 128 still pads every prompt of the
    # tests (the padding is what its text mask is about) at a quarter of the cost.
    save(pipe, directory, spatial_stride=16, guidance_scale=5.0,
         pipeline_kwargs={"max_sequence_length": 128})


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-chroma": ("Chroma (Flux-style MM-DiT, flow matching, T5, classifier-free guidance) "
                    "with random weights, 64x64, 4 steps", build),
}
