"""``/v1/images/edits`` input: the multipart form, and the uploaded image and mask.

Rules (documented in docs/edits.md):
- The body is at most ``--max-upload-bytes``; the form has one or more ``image`` (or ``image[]``)
  files, at most one ``mask``, and text fields that appear once. How many images a model takes
  is its own (``max_edit_images`` in ``GET /v1/models``), checked in validation.
- Images must be PNG, JPEG or WebP. Their width x height is read from the file's header and
  checked against ``--max-input-pixels`` before any pixel is decoded, so a small file that
  expands to a huge image (a decompression bomb) is refused cheaply.
- Fitting: the image is scaled, keeping its aspect ratio, to cover the output size, then
  centre-cropped to it. Transparency is dropped (composited on black).
- The mask must have the image's dimensions. With an alpha channel, transparent pixels are the
  ones to edit (OpenAI's convention); without one, white pixels are (diffusers' convention).
  It is fitted like the image. A model that only inpaints (FLUX.1 Fill) takes an image without
  a mask where the image has transparency: its transparent pixels are the mask (OpenAI's rule).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from diffserve.errors import body_too_large, invalid_request
from diffserve.frontend.compat import check_form_fields
from diffserve.wire.tasks import IMAGE, MASK, REFERENCE, Task

FORMATS = {"PNG", "JPEG", "WEBP"}
IMAGE_FIELDS = ("image", "image[]")
FILE_FIELDS = (*IMAGE_FIELDS, "mask", "markup")


@dataclass
class EditForm:
    fields: dict[str, str]
    images: list[bytes]
    mask: bytes | None


async def read_limited(stream, limit: int, declared: str | None, flag: str) -> bytes:
    """The whole body, refused with 413 (naming ``flag``) as soon as it exceeds ``limit``."""
    if declared and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit, flag)
    chunks, size = [], 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit, flag)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_form(headers, body: bytes, limit: int) -> EditForm:
    """Split an edit's multipart body into its text fields, its images and its mask."""
    fields, files = await read_multipart(headers, body, limit, FILE_FIELDS)
    check_form_fields(fields, files)
    images = [data for name in IMAGE_FIELDS for data in files.get(name, [])]
    if not images:
        raise invalid_request("Missing required parameter: 'image' (a PNG, JPEG or WebP file).",
                              "image", "missing_required_parameter")
    masks = files.get("mask", [])
    if len(masks) > 1:
        raise invalid_request("'mask' is given more than once", "mask", "invalid_value")
    return EditForm(fields, images, masks[0] if masks else None)


async def read_multipart(headers, body: bytes, limit: int,
                         file_fields: tuple[str, ...]) -> tuple[dict[str, str], dict[str, list[bytes]]]:
    """A multipart body's text fields (each once) and its files (``file_fields`` only)."""
    from starlette.formparsers import MultiPartParser

    content_type = headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise invalid_request("The body must be multipart/form-data (an image file and form "
                              "fields), as the OpenAI SDK sends it.", None, "invalid_content_type")

    # The parser keeps what it read of a body that stops before its closing delimiter, so a
    # field cut off at the end would silently fall back to its default: refuse such a body.
    from python_multipart.multipart import parse_options_header

    boundary = parse_options_header(content_type)[1].get(b"boundary")
    if boundary and b"--" + boundary + b"--" not in body:
        raise invalid_request("The multipart body ends before its closing boundary "
                              f"('--{boundary.decode('latin-1')}--'): it was cut off.", None,
                              "invalid_multipart")

    async def one_chunk():
        yield body

    try:
        form = await MultiPartParser(headers, one_chunk(), max_files=4, max_fields=64,
                                     max_part_size=limit).parse()
    except Exception as error:  # noqa: BLE001 - any parser complaint is the body's fault
        raise invalid_request(f"The multipart body could not be parsed: {error}", None,
                              "invalid_multipart") from None
    try:
        fields: dict[str, str] = {}
        files: dict[str, list[bytes]] = {}
        for name, value in form.multi_items():
            if name in file_fields:
                data = await value.read() if hasattr(value, "read") else value.encode()
                files.setdefault(name, []).append(data)
            elif hasattr(value, "read"):
                raise invalid_request(f"{name!r} must be a text field, not a file", name,
                                      "invalid_value")
            elif name in fields:
                raise invalid_request(f"{name!r} is given more than once", name, "invalid_value")
            else:
                fields[name] = value
    finally:
        await form.close()
    return fields, files


def open_image(data: bytes, param: str, max_pixels: int, header_only: bool = False) -> Image.Image:
    """A decoded upload, checked: a known format, a sane size, pixels that decode (with
    ``header_only``, all but the last: the image is opened, not decoded)."""
    if not data:
        raise invalid_request(f"{param!r} is an empty file", param, "invalid_image")
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:  # Pillow's own ceiling, far above ours
        raise invalid_request(f"{param!r} has more pixels than this server decodes "
                              f"({max_pixels}, --max-input-pixels)", param,
                              "image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise invalid_request(f"{param!r} is not a PNG, JPEG or WebP image", param,
                              "invalid_image_format") from None
    if image.format not in FORMATS:
        raise invalid_request(f"{param!r} is a {image.format} image; send PNG, JPEG or WebP",
                              param, "invalid_image_format")
    width, height = image.size
    if width < 1 or height < 1 or width * height > max_pixels:
        raise invalid_request(f"{param!r} is {width}x{height} pixels; this server decodes at most "
                              f"{max_pixels} pixels (--max-input-pixels)", param,
                              "image_too_large")
    if header_only:
        return image
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except Exception:  # noqa: BLE001 - truncated or corrupt data, in whatever way
        raise invalid_request(f"{param!r} could not be decoded (truncated or corrupt)", param,
                              "invalid_image") from None
    return image


def fit(image: Image.Image, width: int, height: int, resample=Image.Resampling.LANCZOS) -> Image.Image:
    """Scale to cover ``width`` x ``height`` (aspect kept), then centre-crop to it."""
    return ImageOps.fit(image, (width, height), method=resample, centering=(0.5, 0.5))


def image_pixels(image: Image.Image, width: int, height: int) -> np.ndarray:
    """The input image as uint8 RGB (height, width, 3), fitted to the output size."""
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        image = flat
    return np.ascontiguousarray(np.asarray(fit(image.convert("RGB"), width, height), np.uint8))


def mask_pixels(mask: Image.Image, image: Image.Image, width: int, height: int) -> np.ndarray:
    """The mask as uint8 (height, width): 255 where the image is to be edited."""
    if mask.size != image.size:
        raise invalid_request(f"'mask' is {mask.size[0]}x{mask.size[1]} but 'image' is "
                              f"{image.size[0]}x{image.size[1]}; they must be the same size",
                              "mask", "invalid_mask")
    if mask.mode in ("RGBA", "LA") or (mask.mode == "P" and "transparency" in mask.info):
        edit = Image.eval(mask.convert("RGBA").getchannel("A"), lambda a: 255 - a)
    else:
        edit = mask.convert("L")
    return np.ascontiguousarray(np.asarray(fit(edit, width, height, Image.Resampling.NEAREST),
                                           np.uint8))


def image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """An upload's width and height, from its header (checked as :func:`open_image` does)."""
    return open_image(data, "image", max_pixels, header_only=True).size


def decode_inputs(form: EditForm, task: Task, width: int, height: int,
                  max_pixels: int) -> dict[str, list[Any]]:
    """The raw frames an edit carries to the engine, by their manifest role: its images (an
    instruction edit's references, or the one image it redraws) and its mask if any."""
    images = [open_image(data, "image", max_pixels) for data in form.images]
    role = REFERENCE.name if task.references else IMAGE.name
    frames = {role: [image_pixels(image, width, height) for image in images]}
    if form.mask is not None:
        frames[MASK.name] = [mask_pixels(open_image(form.mask, "mask", max_pixels), images[0],
                                         width, height)]
    elif task.masked:  # no mask for a model that only inpaints: the image's own transparency
        if not has_alpha(images[0]):
            raise invalid_request("this model only inpaints: give a 'mask', or an 'image' whose "
                                  "transparent pixels are the ones to redraw", "mask",
                                  "missing_required_parameter")
        frames[MASK.name] = [mask_pixels(images[0], images[0], width, height)]
    return frames


def has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info)

