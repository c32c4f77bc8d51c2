"""Token usage of an image request, reported as OpenAI reports it.

``input_tokens``: the prompt's tokens (the model's first tokenizer) plus, for edits, the input
image's latent cells; ``output_tokens``: the latent cells of the images, (width / stride) x
(height / stride) each. ``cached_steps`` (an extension, where the request ran with a step
cache): the denoising steps of those images that reused their cache.
"""

from __future__ import annotations

from diffserve.wire.request import ImageRequest


def latent_cells(request: ImageRequest, spatial_stride: int) -> int:
    return (request.width // spatial_stride) * (request.height // spatial_stride)


def usage(request: ImageRequest, spatial_stride: int, text_tokens: int, image_count: int,
          cached_steps: int | None = None) -> dict:
    cells = latent_cells(request, spatial_stride)
    image_tokens = cells if request.task_spec.from_image else 0
    inputs = text_tokens + image_tokens
    counted = {"input_tokens": inputs, "output_tokens": image_count * cells,
               "total_tokens": inputs + image_count * cells,
               "input_tokens_details": {"image_tokens": image_tokens, "text_tokens": text_tokens}}
    if cached_steps is not None:
        counted["cached_steps"] = cached_steps
    return counted
