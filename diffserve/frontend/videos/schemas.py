"""The Videos API's bodies: the create request (multipart as the SDK sends it, or JSON) with the
server's extensions, and the Video object as the SDK reads it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from diffserve.frontend.schemas import SEED_MAX

MAX_FPS = 120


class VideoCreate(BaseModel):
    """``POST /v1/videos``. Fields the images API has and a video does not (n, streaming, ...)
    are fixed here, so the one validation of requests applies to both."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, description="What the video shows.")
    model: str | None = Field(None, description="Must be the served model's name if given.")
    seconds: str | None = Field(None, pattern=r"^\d+(\.\d+)?$", description="Duration: frames "
                                "are seconds x fps, rounded to the model's frame rule.")
    size: str | None = Field(None, description='"WIDTHxHEIGHT" (default: the model\'s native).')
    # Extensions (the openai client sends them through extra_body).
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    num_frames: int | None = Field(None, ge=1, description="Frame count (wins over seconds).")
    fps: int | None = Field(None, ge=1, le=MAX_FPS, description="Frame rate of the MP4 (default: "
                            "the model's).")
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0, le=100)
    guidance_scale_2: float | None = Field(None, ge=0, le=100, description="Two-expert models "
                                           "(Wan 2.2): the low-noise expert's guidance scale.")
    negative_prompt: str | None = None
    priority: int | None = None
    user: str | None = Field(None, max_length=256)

    @field_validator("seconds", mode="before")
    @classmethod
    def _number(cls, value):
        """JSON clients may send a number; the SDK sends a string."""
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    # What the images API's validation reads, fixed for a video: one, unstreamed, no adapters,
    # the model's own sampler.
    n: ClassVar[int] = 1
    response_format: ClassVar[str] = "b64_json"
    stream: ClassVar[bool] = False
    partial_images: ClassVar[int] = 0
    scheduler: ClassVar[None] = None
    loras: ClassVar[None] = None


class VideoError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    prompt: str | None = None
    seconds: str
    size: str
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    weight_version: str | None = None  # an extension: the weights that made it, once completed


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True
