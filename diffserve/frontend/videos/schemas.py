"""The Videos API's bodies: the create request (multipart as the SDK sends it, or JSON) with the
server's extensions, and the Video object as the SDK reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from diffserve.frontend.bounds import Guidance, Priority, Prompt, Seed, Steps, User
from diffserve.frontend.schemas import LoraRef, json_list

MAX_FPS = 120


class VideoCreate(BaseModel):
    """``POST /v1/videos``. The fields it shares with the images API have the same bounds
    (:mod:`diffserve.frontend.bounds`); :func:`diffserve.frontend.spec.video_spec` makes it
    the same typed spec an image request becomes."""

    model_config = ConfigDict(extra="forbid")

    prompt: Prompt = Field(description="What the video shows.")
    model: str | None = Field(None, description="The served model's name, or a served LoRA "
                              "adapter's (that adapter at scale 1), as the images API's.")
    seconds: str | None = Field(None, pattern=r"^\d+(\.\d+)?$", description="Duration: frames "
                                "are seconds x fps, rounded to the model's frame rule.")
    size: str | None = Field(None, description='"WIDTHxHEIGHT" (default: the model\'s native).')
    # Extensions (the openai client sends them through extra_body).
    seed: Seed | None = None
    num_frames: int | None = Field(None, ge=1, description="Frame count (wins over seconds).")
    fps: int | None = Field(None, ge=1, le=MAX_FPS, description="Frame rate of the MP4 (default: "
                            "the model's).")
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    guidance_scale_2: Guidance | None = Field(None, description="Two-expert models (Wan 2.2): "
                                              "the low-noise expert's guidance scale.")
    negative_prompt: str | None = None
    audio: bool | None = Field(None, description="Models that make sound (LTX-2): whether the "
                               "MP4 has the sound track (default: it has). A silent model takes "
                               "no true.")
    priority: Priority | None = Field(None, description="Its priority class, as the images "
                                      "API's.")
    loras: list[LoraRef] | None = Field(
        None, description="LoRA adapters to apply, in order, each with its scale, as the images "
        "API's (families whose diffusers pipeline takes LoRA: LTX-2, Wan). In a multipart form: "
        "a JSON list.")
    user: User | None = None

    @field_validator("seconds", mode="before")
    @classmethod
    def _number(cls, value):
        """JSON clients may send a number; the SDK sends a string."""
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    @field_validator("loras", mode="before")
    @classmethod
    def _json_form_field(cls, value):
        return json_list(value)


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
    audio: bool | None = None  # an extension: whether its MP4 has a sound track


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
