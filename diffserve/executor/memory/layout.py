"""Where the pipeline's components live and how they use the device's memory (docs/memory.md):
offloading (``--offload``, ``--offload-components``), placement on other devices
(``--text-encoder-device``, ``--vae-device``) and tiled VAE decoding and encoding
(``--vae-tiling``, ``--vae-tile-size``). Applied once, as the model loads, before anything runs.

- **Offloading** is diffusers' group offloading. ``layer``: the denoiser's blocks stream onto the
  device one block ahead of use (block-level groups of one, on CUDA with a stream of their own
  and prefetch). ``model``: each offloaded component is brought whole for each use and sent
  back; for the denoisers and text encoders that is one block-level group per block list (and
  the rest with the module's forward), for the VAE, whose ``decode``/``encode`` are no
  ``forward``, leaf-level groups. On a CPU both ends are the host: the hooks run, nothing moves.
- **Placement** moves the text encoders or the VAE to another device and their inputs and
  outputs across: every tensor a text encoder's ``forward`` is given goes to its device, and what
  it returns comes back to the executor's; likewise the VAE's ``encode`` and ``decode``.
- **Tiling** uses each VAE's own tiles (spatial, and temporal for video VAEs). ``on`` tiles
  always; ``auto`` from :data:`AUTO_TILE_PIXELS` pixels times frames up, deciding per call.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from dataclasses import dataclass

from diffserve.executor.pipeline import is_denoiser, torch_modules
from diffserve.executor.tensors import moved

log = logging.getLogger(__name__)

AUTO_TILE_PIXELS = 2048 * 2048  # width x height (x frames) from which auto tiles


def kind_of(name: str) -> str | None:
    """The offload kind of a pipeline component (dit, text_encoder, vae), or None."""
    if is_denoiser(name):
        return "dit"
    if name.startswith("text_encoder"):
        return "text_encoder"
    return "vae" if name == "vae" else None


@dataclass(frozen=True)
class MemoryLayout:
    offload: str = "none"
    offloaded: tuple[str, ...] = ()
    text_encoder_device: str = ""
    vae_device: str = ""
    vae_tiling: str = "off"
    vae_tile_size: int = 0

    @classmethod
    def of(cls, config) -> "MemoryLayout":
        return cls(config.offload, config.offloaded, config.text_encoder_device, config.vae_device,
                   config.vae_tiling, config.vae_tile_size)

    @property
    def plain(self) -> bool:
        return self == MemoryLayout()

    def apply(self, pipe, device: str) -> None:
        """Put ``pipe``'s components where this layout says (``device``: the executor's)."""
        placed = {"text_encoder": self.text_encoder_device, "vae": self.vae_device}
        for name, module in torch_modules(pipe).items():
            kind = kind_of(name)
            if kind in self.offloaded:
                offload(module, device, self.offload, kind)
            elif placed.get(kind):
                module.to(placed[kind])
                if kind == "vae":
                    across(module, placed[kind], device)
                else:
                    module.register_forward_pre_hook(_inputs_to(placed[kind]), with_kwargs=True)
                    module.register_forward_hook(_outputs_to(device))
            else:
                module.to(device)
        vae = getattr(pipe, "vae", None)
        if vae is not None and self.vae_tiling != "off":
            tile(vae, self.vae_tiling, self.vae_tile_size)

    def describe(self) -> str:
        parts = []
        if self.offload != "none":
            parts.append(f"--offload {self.offload} ({', '.join(self.offloaded)})")
        for what, where in (("text encoders", self.text_encoder_device), ("VAE", self.vae_device)):
            if where:
                parts.append(f"{what} on {where}")
        if self.vae_tiling != "off":
            parts.append(f"VAE tiling {self.vae_tiling}"
                         + (f" ({self.vae_tile_size} px tiles)" if self.vae_tile_size else ""))
        return "; ".join(parts)


# -- offloading ------------------------------------------------------------------------------


def offload(module, device: str, mode: str, kind: str) -> None:
    """diffusers' group offloading of ``module`` onto ``device`` (from the host)."""
    import torch
    from diffusers.hooks import apply_group_offloading

    cuda = torch.device(device).type == "cuda"  # a stream needs an accelerator to onload to
    if kind == "vae":
        apply_group_offloading(module, device, offload_type="leaf_level", use_stream=cuda)
    elif mode == "layer":
        apply_group_offloading(module, device, offload_type="block_level", num_blocks_per_group=1,
                               use_stream=cuda, record_stream=cuda)
    else:  # each block list as one group: the component comes whole, in a few moves
        longest = max((len(m) for m in module.children()
                       if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))), default=1)
        apply_group_offloading(module, device, offload_type="block_level",
                               num_blocks_per_group=longest)


# -- placement -------------------------------------------------------------------------------


def _inputs_to(device):
    def hook(module, args, kwargs):
        return moved(tuple(args), device), moved(dict(kwargs), device)
    return hook


def _outputs_to(device):
    def hook(module, args, output):
        return moved(output, device)
    return hook


def across(vae, its_device: str, back: str) -> None:
    """The VAE's ``encode`` and ``decode`` take the executor's tensors and give theirs back."""
    for name in ("encode", "decode"):
        method = getattr(vae, name, None)
        if method is None:
            continue

        @functools.wraps(method)
        def call(*args, _method=method, **kwargs):
            return moved(_method(*moved(args, its_device), **moved(kwargs, its_device)), back)

        setattr(vae, name, call)


# -- tiling ----------------------------------------------------------------------------------


def tile(vae, mode: str, size: int) -> None:
    """Tiled ``encode``/``decode`` for ``vae``: always (``on``) or from AUTO_TILE_PIXELS up."""
    kwargs = {}
    if size:
        accepts = inspect.signature(vae.enable_tiling).parameters
        if "tile_sample_min_height" in accepts:  # the video VAEs: tiles and their strides
            stride = max(8, size * 3 // 4)
            kwargs = dict(tile_sample_min_height=size, tile_sample_min_width=size,
                          tile_sample_stride_height=stride, tile_sample_stride_width=stride)
    vae.enable_tiling(**kwargs)
    if size and not kwargs:  # AutoencoderKL: its tile sizes are attributes
        blocks = len(vae.config.block_out_channels)
        vae.tile_sample_min_size = size
        vae.tile_latent_min_size = size // 2 ** (blocks - 1)
    if mode == "auto":
        vae.use_tiling = False
        lock = threading.Lock()  # the encode and decode stages share the VAE
        scale = (getattr(vae, "spatial_compression_ratio", None)
                 or 2 ** (len(vae.config.block_out_channels) - 1))
        temporal = getattr(vae, "temporal_compression_ratio", None) or 1
        for name, latent in (("encode", False), ("decode", True)):
            method = getattr(vae, name)

            @functools.wraps(method)
            def call(x, *args, _method=method, _latent=latent, **kwargs):
                area = x.shape[-1] * x.shape[-2] * (scale * scale if _latent else 1)
                frames = (x.shape[2] * (temporal if _latent else 1)) if x.dim() == 5 else 1
                with lock:
                    vae.use_tiling = area * frames >= AUTO_TILE_PIXELS
                    return _method(x, *args, **kwargs)

            setattr(vae, name, call)
