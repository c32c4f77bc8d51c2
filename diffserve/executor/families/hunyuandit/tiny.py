"""HunyuanDiT (DiT, BERT + T5): tiny-hunyuandit."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import SCRATCH, save, seeded
from diffserve.builders.components import t5_encoder, vae
from diffserve.builders.tokenizers import character_t5_tokenizer, write_character_bert_tokenizer


def build(directory: Path) -> None:
    """HunyuanDiTPipeline: a four-block DiT (one long skip) with BERT and T5 text encoders.

    A regression fixture as much as a model: HunyuanDiTPipeline's ``use_resolution_binning``
    (on by default) replaces any size outside its ten standard ones by the nearest of them, so a
    64x64 request comes back 1024x1024 unless the call passes ``use_resolution_binning=False``."""
    from diffusers import DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline
    from transformers import BertConfig, BertModel

    bert_tokenizer = write_character_bert_tokenizer(directory / SCRATCH)
    t5_tokenizer = character_t5_tokenizer()
    # The pipeline always sends 77 BERT tokens and 256 T5 tokens (text_len, text_len_t5), and
    # pools the T5 tokens with 8 heads, so the T5 width must be a multiple of 8. The block count
    # must be even: the first half feeds long skips into the second (block 0 into block 3 here).
    transformer = seeded(
        0, HunyuanDiT2DModel, sample_size=8, patch_size=2, in_channels=4, num_layers=4,
        attention_head_dim=16, num_attention_heads=2, hidden_size=32, cross_attention_dim=32,
        cross_attention_dim_t5=32, pooled_projection_dim=16, text_len=77, text_len_t5=256)
    bert = seeded(0, BertModel, BertConfig(
        vocab_size=len(bert_tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=77))
    pipe = HunyuanDiTPipeline(
        vae=vae(scaling_factor=0.13025, force_upcast=False), text_encoder=bert,
        tokenizer=bert_tokenizer, transformer=transformer,
        scheduler=DDPMScheduler(beta_start=0.00085, beta_end=0.03, beta_schedule="scaled_linear",
                                prediction_type="v_prediction", clip_sample=False, steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        text_encoder_2=t5_encoder(len(t5_tokenizer)), tokenizer_2=t5_tokenizer)
    save(pipe, directory, spatial_stride=16, guidance_scale=5.0)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-hunyuandit": ("HunyuanDiT (DiT, BERT + T5) with random weights, 64x64, 4 steps; a regression "
                        "fixture: its pipeline turns a 64x64 request into 1024x1024 unless called "
                        "with use_resolution_binning=False", build),
}
