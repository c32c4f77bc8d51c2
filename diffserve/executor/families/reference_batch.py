"""Instruction edits' input images through the VAE together: the encode stage admits several
edits at once, and their reference images (of one size) go through one VAE call instead of one
call each. A GPU runs a batch of encodes for little more than one; a CPU for about the sum.

The families that use it (Qwen-Image-Edit, Kontext) take the distribution's mode of each image
(diffusers' ``sample_mode="argmax"``): no generator is involved, so an image's latents do not
depend on its batch-mates. Families whose image-to-image and inpainting latents are sampled with
each image's generator inside diffusers' ``prepare_latents`` keep one call per request.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

from diffserve.wire.samples import group_by

# Images per VAE call: a VAE's activations at 1024x1024 are large, so a batch is bounded.
MAX_TOGETHER = 8

_local = threading.local()  # the latents made together, for the calls on this thread


def _key(image, width: int, height: int) -> tuple:
    """An input image by its buffer: each use makes a new array view of the request's frame."""
    return (image.__array_interface__["data"][0], image.shape, width, height)


class TogetherReferences:
    """A family mixin: ``reference_tensor`` is how the family preprocesses one reference image
    for its VAE; ``reference_latents`` is what its ``reference_conditioning`` calls."""

    def reference_tensor(self, reference, width: int, height: int, dtype) -> Any:
        raise NotImplementedError

    def _encode_references(self, tensors) -> Any:
        # A generator list would make diffusers loop over the rows; the mode needs none.
        return self.pipe._encode_vae_image(tensors, None)

    def reference_latents(self, reference, width: int, height: int, dtype) -> Any:
        """One reference image's VAE latents: made already where :meth:`references_together`
        encoded it with others, else encoded now."""
        made = getattr(_local, "made", None)
        found = made.get(_key(reference, width, height)) if made else None
        if found is not None:
            return found
        return self._encode_references(self.reference_tensor(reference, width, height, dtype))

    @contextmanager
    def references_together(self, requests: list[tuple[list, int, int]], dtype) -> Iterator[None]:
        """Within it, the reference images of ``requests`` ((images, width, height) each) are
        encoded already: those of one preprocessed shape in calls of up to MAX_TOGETHER."""
        wanted = [(image, width, height) for images, width, height in requests for image in images]
        if len(wanted) < 2:
            yield
            return
        tensors = {_key(image, w, h): self.reference_tensor(image, w, h, dtype)
                   for image, w, h in wanted}
        made = {}
        for same in group_by(list(tensors), lambda key: tuple(tensors[key].shape)).values():
            for at in range(0, len(same), MAX_TOGETHER):
                keys = same[at:at + MAX_TOGETHER]
                latents = self._encode_references(self.torch.cat([tensors[k] for k in keys]))
                made.update((k, latents[i:i + 1]) for i, k in enumerate(keys))
        _local.made = made
        try:
            yield
        finally:
            _local.made = None
