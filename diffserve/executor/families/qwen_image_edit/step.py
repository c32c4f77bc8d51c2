"""Qwen-Image-Edit and Qwen-Image-Edit-Plus: Qwen-Image edited by instruction. Each input image
conditions twice: through the Qwen2.5-VL, whose prompt encoding holds the image's tokens (so a
request's prompt is encoded with its own images), and through the VAE, whose latents travel
beside the generated tokens on frames of their own (1, 2, ... for Edit-Plus's several images).

The pipelines size each image themselves, by area at the input's aspect ratio: about 1024x1024
for the VAE, and for the VL encoder the same (Edit) or about 384x384 (Edit-Plus). The server fits
every input to the output size first, so all of a request's images, and every row of a forward,
share one aspect ratio and so one geometry. A request equals the pipeline called alone with its
fitted image (Edit: one image, as a single image; Edit-Plus: the list), its prompt, height and
width. Neither generates without an image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.base import IMAGE_LIST, ONE_IMAGE
from diffserve.executor.families.conditioning import Encoded, padded
from diffserve.executor.families.row_sizes import RowSizes, joined_rows
from diffserve.executor.families.qwen_image.step import QwenImage, QwenImageConditioning
from diffserve.executor.families.reference_batch import TogetherReferences

VAE_AREA = 1024 * 1024  # the pixels the pipelines encode each input image at


@dataclass
class QwenEditConditioning(QwenImageConditioning):
    # The input images' VAE latents, packed: one row per image (padded to the longest where
    # rows of several sizes share a forward).
    image_latents: Any = padded(None, rounded=False)


class QwenImageEdit(TogetherReferences, QwenImage):
    name = "qwen-image-edit"
    mixes_references = True  # each row's reference tokens after its own, padded per row
    pipelines = ("QwenImageEditPipeline",)
    max_references = 1
    reference_call = ONE_IMAGE
    encodes_references = True
    generates = False
    strength_pipelines = {}  # its edits are by instruction
    # Its call with one image (not a list of one) is the one whose VL encoder sees the image at
    # the pipeline's own size: request mode calls it so, one request a call.
    references_per_row = False
    vl_area: int | None = VAE_AREA  # the VL encoder's image size (None: as given)

    def _size(self, area: int, width: int, height: int) -> tuple[int, int]:
        """(width, height) of ``area`` pixels at this aspect ratio, as the pipelines compute it."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        return calculate_dimensions(area, width / height)[:2]

    def _resized(self, image, area: int):
        from PIL import Image

        pil = Image.fromarray(image)
        width, height = self._size(area, *pil.size)
        return self.pipe.image_processor.resize(pil, height, width)

    def _vl_images(self, references):
        """What the pipeline hands its VL encoder for these images."""
        return self._resized(references[0], self.vl_area)

    def encode(self, prompts, negatives, cfg, references=None):
        return Encoded(self._encode_each(prompts, references),
                       self._encode_each(negatives, references) if cfg else None)

    def _encode_each(self, prompts: list[str], references) -> QwenEditConditioning:
        """Each prompt with its own images: one VL forward each, rows padded to the longest."""
        rows = []
        for prompt, images in zip(prompts, references):
            embeds, mask = self.pipe.encode_prompt(
                prompt=[prompt], image=self._vl_images(images), device=self.device)
            if mask is None:
                mask = self.torch.ones(embeds.shape[:2], dtype=self.torch.long, device=embeds.device)
            rows.append(QwenEditConditioning(embeds, mask))
        return QwenEditConditioning.cat(rows)

    def noise_latents(self, k, width, height, dtype, generators):
        return self.pipe.prepare_latents(None, k, self._channels, height, width, dtype,
                                         self.device, generators)[0]

    def reference_tensor(self, reference, width, height, dtype):
        image = self._resized(reference, VAE_AREA)
        tensor = self.pipe.image_processor.preprocess(image, image.height, image.width)
        return tensor.unsqueeze(2).to(self.device, dtype)

    def reference_conditioning(self, references, width, height, k, dtype, generators):
        pipe, packed = self.pipe, []
        for reference in references:
            latents = self.reference_latents(reference, width, height, dtype)
            *_, h, w = latents.shape
            packed.append(pipe._pack_latents(latents, 1, self._channels, h, w))
        return {"image_latents": self.torch.cat(packed, dim=1).repeat(k, 1, 1)}

    def forward(self, latents, timesteps, cond, guidance, width, height, sizes=None):
        if sizes is not None:
            return self._forward_rows(latents, timesteps, cond, sizes)
        # The inputs have the output's aspect ratio, so each has the grid of the VAE's size.
        reference = self.grid(*self._size(VAE_AREA, width, height))
        count = cond.image_latents.shape[1] // (reference[1] * reference[2])
        out = self.transform(self.torch.cat([latents, cond.image_latents], dim=1), timesteps,
                             cond, [self.grid(width, height), *[reference] * count])
        return out[:, :latents.shape[1]]

    def _reference_tokens(self, width: int, height: int) -> int:
        _, h, w = self.grid(*self._size(VAE_AREA, width, height))
        return h * w

    def _forward_rows(self, latents, timesteps, cond, sizes):
        """Rows of several sizes: each row's own tokens, then its references', then padding."""
        # Every row of a set has as many references (the batch key); the longest row's fill
        # the padded field.
        count = cond.image_latents.shape[1] // max(self._reference_tokens(*s) for s in sizes.sizes)
        references = [count * self._reference_tokens(*size) for size in sizes.sizes]
        joined = [t + r for t, r in zip(sizes.tokens, references)]
        rows = RowSizes(sizes.sizes, tuple(joined), max(joined))
        hidden = joined_rows([(latents, sizes.tokens), (cond.image_latents, references)],
                             rows.length)

        def grids(width: int, height: int) -> list:
            return [self.grid(width, height),
                    *[self.grid(*self._size(VAE_AREA, width, height))] * count]

        with self._rows_attention(rows, cond, grids, f"edit-{count}"):
            out = self.transform(hidden, timesteps, cond, grids(*self._longest(sizes)))
        return out[:, :latents.shape[1]]

    def request_kwargs(self, task, width, height, references=None):
        return {"image": references[0][0]} if references else {}


class QwenImageEditPlus(QwenImageEdit):
    """Edit-Plus (Qwen-Image-Edit-2509): several images, each labelled in the prompt ("Picture
    1: ..."), the VL encoder seeing each at about 384x384. Its pipeline takes one prompt a call."""

    name = "qwen-image-edit-plus"
    pipelines = ("QwenImageEditPlusPipeline",)
    max_references = 3  # the model's documented range is one to three images
    reference_call = IMAGE_LIST
    vl_area = 384 * 384

    def _vl_images(self, references):
        return [self._resized(image, self.vl_area) for image in references]

    def request_kwargs(self, task, width, height, references=None):
        return {"image": references[0]} if references else {}


FAMILIES = (QwenImageEdit, QwenImageEditPlus)
