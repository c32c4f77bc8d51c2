"""The HTTP request and response bodies (OpenAI images API plus a few extensions)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MAX = 2**32 - 1


class ImageGenerationRequest(BaseModel):
    """``POST /v1/images/generations``. Field bounds that depend on the server's configuration
    or on the loaded model are checked in :mod:`diffserve.frontend.validation`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, description="What to draw.")
    model: str | None = Field(None, description="Must be the served model's name if given.")
    n: int = Field(1, ge=1, description="Number of images.")
    size: str | None = Field(None, description='"WIDTHxHEIGHT" or "auto" (the model\'s native size).')
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(None, ge=0, le=100,
                                           description="JPEG/WebP quality, 0-100.")
    user: str | None = Field(None, max_length=256)
    # Extensions (the openai client sends them through extra_body).
    seed: int | None = Field(None, ge=0, le=SEED_MAX,
                             description="Seed of image 0; image i uses seed+i.")
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0, le=100)


class ImageData(BaseModel):
    b64_json: str
    seed: int
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "diffserve"


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
