"""FLUX.2 (MM-DiT over 2x2-patchified, batch-normalised latents; guidance embedding, Mistral 3
text encoder): tiny-flux2; FLUX.2 [klein] (no guidance embedding, real classifier-free guidance,
Qwen3 text encoder): tiny-flux2-klein."""

from __future__ import annotations

import re
from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.tokenizers import byte_characters, learn_merges, qwen2_tokenizer

# Both text encoders are 16 wide: the pipelines stack three of their hidden-state layers
# (dev: 10, 20, 30; klein: 9, 18, 27), so they need that many (tiny) layers.
TEXT_WIDTH = 16

# The real models' scheduler: dynamic shifting by the mu the pipelines compute from the token
# and step counts, exponential time shift.
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                 max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
                 time_shift_type="exponential")

# Mistral Small 3's chat template, reduced to what Flux2Pipeline sends (a system message and a
# user message, each a string or a list of text blocks).
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}"
    "{{- '[SYSTEM_PROMPT]' + system + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST]' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)
# Mistral's special tokens at their real ids; the other ids below 20 are placeholders.
MISTRAL_SPECIALS = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 10: "[IMG]",
                    11: "<pad>", 12: "[IMG_BREAK]", 13: "[IMG_END]", 17: "[SYSTEM_PROMPT]",
                    18: "[/SYSTEM_PROMPT]"}

# Qwen3's chat template as it renders one user message with a generation prompt and thinking
# off (the empty think block), which is all Flux2KleinPipeline sends.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def mistral_tokenizer(texts):
    """A byte-level BPE tokenizer with Mistral's special tokens and chat template, merges making
    each word of ``texts`` one token. FLUX.2 [dev]'s own ``tokenizer`` is a PixtralProcessor,
    which cannot be imported without torchvision; the pipeline only calls
    ``apply_chat_template`` on text, which a plain fast tokenizer serves the same way."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [MISTRAL_SPECIALS.get(i, f"<SPECIAL_{i}>") for i in range(20)]
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    special = re.compile("|".join(re.escape(t) for t in specials))
    merges = learn_merges(piece for text in texts for part in special.split(text)
                          for piece, _ in pre.pre_tokenize_str(part))
    vocab = {t: i for i, t in enumerate(specials)}
    for token in byte_characters() + [left + right for left, right in merges]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre, decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
    return tokenizer


def flux2_vae():
    """AutoencoderKLFlux2 (8x, 4 latent channels). Its latents are normalised with the running
    stats of its affine-free BatchNorm, which random init leaves at mean 0 / variance 1: they
    get seeded other values, so a missing (de)normalisation shows in the images."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = seeded(0, AutoencoderKLFlux2, in_channels=3, out_channels=3,
                 down_block_types=("DownEncoderBlock2D",) * 4,
                 up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(16, 16, 32, 32),
                 layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=64,
                 batch_norm_eps=1e-4)
    generator = torch.Generator().manual_seed(0)
    n = vae.bn.running_mean.numel()
    vae.bn.running_mean.copy_(0.1 * torch.randn(n, generator=generator))
    vae.bn.running_var.copy_(0.5 + torch.rand(n, generator=generator))
    return vae


def _build(directory: Path, pipeline_cls, text_encoder, tokenizer, guidance_embeds: bool,
           **extra) -> None:
    """The parts both variants share: a one-double-block, one-single-block transformer (2 heads
    x 16, RoPE over (t, h, w, l)) on 16 channels (4 latent channels x 2x2), the VAE, the
    scheduler; 64x64 native, the pipelines' guidance 4.0."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    transformer = seeded(
        0, Flux2Transformer2DModel, patch_size=1, in_channels=16, num_layers=1,
        num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, guidance_embeds=guidance_embeds)
    pipe = pipeline_cls(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=flux2_vae(),
                        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                        **extra)
    save(pipe, directory, spatial_stride=16, guidance_scale=4.0)


def build(directory: Path) -> None:
    """Flux2Pipeline (FLUX.2 [dev]): guidance as an embedding; text encoder a Mistral 3 (30
    layers; its one-block Pixtral vision tower is never fed an image)."""
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    # Every prompt follows the system message: learning its words keeps it about as many tokens
    # as with Mistral's vocabulary.
    tokenizer = mistral_tokenizer([SYSTEM_MESSAGE])
    text_encoder = seeded(0, Mistral3ForConditionalGeneration, Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH,
                         intermediate_size=2 * TEXT_WIDTH, num_hidden_layers=30,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=4096, sliding_window=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e9},
                         bos_token_id=1, eos_token_id=2, pad_token_id=11),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=64,
                           patch_size=16, head_dim=8),
        image_token_index=10, spatial_merge_size=2, projector_hidden_act="gelu",
        multimodal_projector_bias=False, vision_feature_layer=-1))
    _build(directory, Flux2Pipeline, text_encoder, tokenizer, guidance_embeds=True)


def build_klein(directory: Path) -> None:
    """Flux2KleinPipeline (FLUX.2 [klein] base, not step-distilled: a guidance scale above 1
    runs classifier-free guidance against the empty prompt); text encoder a Qwen3 (27 layers)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Learning the template's words keeps it about as many tokens as with Qwen3's vocabulary.
    template = "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    tokenizer = qwen2_tokenizer([template])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    text_encoder = seeded(0, Qwen3ForCausalLM, Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
        num_hidden_layers=27, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True))
    _build(directory, Flux2KleinPipeline, text_encoder, tokenizer, guidance_embeds=False,
           is_distilled=False)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-flux2": ("FLUX.2 [dev] (MM-DiT, flow matching, guidance embedding, Mistral 3 text "
                   "encoder; edits with reference images) with random weights, 64x64, 4 steps",
                   build),
    "tiny-flux2-klein": ("FLUX.2 [klein] (FLUX.2 with classifier-free guidance, Qwen3 text "
                         "encoder; edits with reference images) with random weights, 64x64, "
                         "4 steps", build_klein),
}
