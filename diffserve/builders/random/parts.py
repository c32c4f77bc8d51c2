"""What a released model's architecture is made of, as configs: each module's class and its
published size, and what scales it down to run on a CPU (``:tiny``: the same structure with
fewer and narrower layers); and the modules several families share (CLIP, T5, FLUX.1's VAE).
Each family's own architecture is in its folder (``diffserve/executor/families/<family>/
architecture.py``). Tokenizers are built in memory (:mod:`diffserve.builders.tokenizers`): their
ids are all a random model needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

FULL, TINY = "full", "tiny"
SCALES = (FULL, TINY)


@dataclass(frozen=True)
class Module:
    """A torch module of the pipeline: its library, class, and config (``config`` at the
    published size, ``tiny`` what the tiny scale changes; ``derived(scale, others)`` what
    follows from the other components, a tokenizer's ids); ``config_class`` for a transformers
    model (its config object's class)."""

    library: str
    cls: str
    config: dict[str, Any]
    tiny: dict[str, Any] = field(default_factory=dict)
    config_class: str | None = None
    derived: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None

    def config_at(self, scale: str, others: dict[str, Any]) -> dict[str, Any]:
        config = {**self.config, **(self.tiny if scale == TINY else {})}
        return {**config, **(self.derived(scale, others) if self.derived else {})}


@dataclass(frozen=True)
class Architecture:
    pipeline: str
    description: str
    modules: dict[str, Module]
    # (scale, scratch directory) -> the other components (tokenizers, scheduler)
    others: Callable[[str, Path], dict[str, Any]]
    # scale -> serving defaults (diffserve.json)
    defaults: Callable[[str], dict[str, Any]]
    pipeline_config: dict[str, Any] = field(default_factory=dict)  # the index's extra settings


def clip(width: int, layers: int, heads: int, inner: int, act: str, tiny_width: int = 32,
          projection: bool = False) -> Module:
    """A CLIP text encoder over the byte CLIP tokenizer's ids (514 of them at the tiny scale)."""
    return Module("transformers", "CLIPTextModelWithProjection" if projection else "CLIPTextModel",
                  dict(vocab_size=49408, hidden_size=width, intermediate_size=inner,
                       num_hidden_layers=layers, num_attention_heads=heads, projection_dim=width,
                       hidden_act=act, bos_token_id=512, eos_token_id=513, pad_token_id=513,
                       max_position_embeddings=77),
                  dict(vocab_size=514, hidden_size=tiny_width, intermediate_size=2 * tiny_width,
                       num_hidden_layers=2, num_attention_heads=4, projection_dim=tiny_width),
                  config_class="CLIPTextConfig")


def t5(cls: str, config_class: str, vocab: int, tokenizer: str) -> Module:
    """T5-XXL's encoder (FLUX.1) or UMT5-XXL's (Wan); at the tiny scale over the character
    tokenizer's ids alone."""
    return Module("transformers", cls,
                  dict(vocab_size=vocab, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                       num_heads=64, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
                       relative_attention_max_distance=128, tie_word_embeddings=False),
                  dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                       relative_attention_num_buckets=8, feed_forward_proj="relu"),
                  config_class=config_class,
                  derived=lambda scale, others: ({"vocab_size": len(others[tokenizer])}
                                                 if scale == TINY else {}))


def flux_vae(scaling: float = 0.3611, shift: float = 0.1159) -> Module:
    return Module("diffusers", "AutoencoderKL",
                  dict(latent_channels=16, block_out_channels=(128, 256, 512, 512),
                       layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                       up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=scaling,
                       shift_factor=shift, use_quant_conv=False, use_post_quant_conv=False),
                  dict(block_out_channels=(16, 16, 32, 32), layers_per_block=1, norm_num_groups=8))


def size(scale: str, full: int, tiny: int = 64) -> dict[str, int]:
    side = full if scale == FULL else tiny
    return {"width": side, "height": side}
