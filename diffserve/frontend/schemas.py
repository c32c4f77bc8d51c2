"""The HTTP request and response bodies (OpenAI images API plus a few extensions)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diffserve.frontend.bounds import Guidance, Priority, Prompt, Seed, Steps, User
from diffserve.wire.rollouts import DEFAULT_RETURN, RETURNABLE

MAX_PARTIAL_IMAGES = 3
LORA_SCALE_LIMIT = 4.0
CONTROL_SCALE_LIMIT = 10.0


def json_list(value):
    """A form field is text: lists of objects (adapters, controls) come as JSON."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError("must be a JSON list of objects") from None
    return value


class LoraRef(BaseModel):
    """One adapter of a request's stack."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256, description="A served adapter's name.")
    scale: float = Field(1.0, ge=-LORA_SCALE_LIMIT, le=LORA_SCALE_LIMIT,
                         description="How strongly it applies (1: as trained).")

class ControlRef(BaseModel):
    """One control of a request's stack (ControlNet): a served control model and its image."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=256, description="A served control model's name "
                       "(GET /v1/models lists them).")
    image: str = Field(min_length=1, description="The control image (edges, depth, pose...): "
                       "base64 PNG, JPEG or WebP, or a data URL; resized to the request's size.")
    scale: float = Field(1.0, ge=-CONTROL_SCALE_LIMIT, le=CONTROL_SCALE_LIMIT,
                         description="How strongly it steers (its residuals' scale).")
    start: float = Field(0.0, ge=0, le=1, description="Where in the denoising it starts acting, "
                         "as a fraction of the request's steps.")
    end: float = Field(1.0, ge=0, le=1, description="Where it stops acting (after start).")
    mode: int | None = Field(None, ge=0, description="A union model's control type (GET "
                             "/v1/models says how many it has); null for other models.")


Quality = Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"]


class ImageOptions(BaseModel):
    """Fields both endpoints take. Bounds that depend on the server's configuration or on the
    loaded model are checked in :mod:`diffserve.frontend.validation`."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """The OpenAI SDK declares every optional parameter nullable: null means the default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    prompt: Prompt = Field(description="What to draw.")
    model: str | None = Field(None, description="Must be the served model's name if given.")
    n: int = Field(1, ge=1, description="Number of images.")
    size: str | None = Field(None, description='"WIDTHxHEIGHT" or "auto" (the model\'s native size).')
    response_format: Literal["b64_json", "url"] = "b64_json"
    # The API's whole set of values is declared, so a value the server cannot honour is refused
    # by name (diffserve.frontend.compat), not as an unknown literal.
    output_format: Literal["png", "jpeg", "webp", "gif", "svg"] = "png"
    output_compression: int | None = Field(None, ge=0, le=100,
                                           description="JPEG/WebP quality, PNG effort, 0-100.")
    user: User | None = None
    safety_identifier: User | None = Field(None, description="Echoed in the answer; the server "
                                           "runs no safety monitoring of its own.")
    quality: Quality = Field("auto", description="Accepted for compatibility; the server "
                                    "runs the request's own steps and guidance.")
    background: Literal["auto", "opaque", "transparent"] = Field(
        "auto", description="auto or opaque; images are always opaque.")
    moderation: Literal["auto", "low"] | None = Field(
        None, description="Accepted for compatibility: this server moderates nothing.")
    style: Literal["vivid", "natural"] | None = Field(
        None, description="Accepted for compatibility; describe the style in the prompt.")
    complexity: Literal["low", "medium", "high"] | None = Field(
        None, description="Accepted for compatibility; there is no planning stage.")
    frame_count: int | None = Field(None, description="GIF output only, which is not served.")
    frame_duration_ms: int | None = Field(None, description="GIF output only, which is not "
                                          "served.")
    svg: dict | None = Field(None, description="SVG output only, which is not served.")
    stream: bool = Field(False, description="Answer with Server-Sent Events.")
    partial_images: int = Field(0, ge=0, le=MAX_PARTIAL_IMAGES,
                                description="Streamed previews per image (stream only).")
    # Extensions (the openai client sends them through extra_body).
    seed: Seed | None = Field(None, description="Seed of image 0; image i uses seed+i, "
                              "modulo 2**32.")
    negative_prompt: str | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: Guidance | None = None
    priority: Priority | None = Field(None, description="Its priority class under "
                                      "--scheduling-policy priority: lower runs sooner (default "
                                      "0, or the API key's).")
    scheduler: str | None = Field(None, max_length=64, description="A sampler the model offers "
                                  "(GET /v1/models lists them); the model's own by default.")
    loras: list[LoraRef] | None = Field(
        None, description="LoRA adapters to apply, in order, each with its scale (see GET "
        "/v1/models for the served ones). model=NAME is the same as one adapter at scale 1.")
    cache_threshold: float | None = Field(
        None, ge=0, le=1, description="With --step-cache: how much an image's first-block "
        "signal may change since its last computed step for the step to reuse its cache (0: "
        "never reuse; default --cache-threshold).")
    controls: list[ControlRef] | None = Field(
        None, description="ControlNet controls, stacked (their residuals summed): each a "
        "served control model, its image, scale, window and union mode (docs/controlnet.md).")
    webhook: str | None = Field(None, max_length=2048, description="With Prefer: "
                                "respond-async: where the job's events are posted, signed "
                                "(docs/generations.md#asynchronous-jobs).")
    webhook_events_filter: list[Literal["start", "output", "completed"]] | None = Field(
        None, description="Which events are posted (default: all three); output: each "
        "partial image (partial_images).")


class ImageGenerationRequest(ImageOptions):
    """``POST /v1/images/generations`` (a JSON body)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ImageEditForm(ImageOptions):
    """``POST /v1/images/edits``: the multipart form's text fields (values arrive as strings).
    The files (``image`` or ``image[]``, and ``mask``) are read in
    :mod:`diffserve.frontend.uploads`."""

    model_config = ConfigDict(extra="forbid")

    input_fidelity: Literal["high", "low"] | None = Field(
        None, description="Accepted for compatibility: an edit always conditions on the whole "
        "input image (strength says how far it may move from it).")
    strength: float | None = Field(
        None, gt=0, le=1, description="Image-to-image and inpainting: how much of the input image "
        "is redrawn, from near 0 (stay close to it) to 1 (start from pure noise); 0.8 unless "
        "given. Refused for models that edit by instruction, which take none.")

    @field_validator("loras", "controls", "webhook_events_filter", mode="before")
    @classmethod
    def _json_form_field(cls, value):
        """A form field is text: the adapters and the controls come as JSON lists."""
        return json_list(value)


class ImageRef(BaseModel):
    """An image of a JSON edit: a data URL, or an http(s) URL the server may fetch."""

    model_config = ConfigDict(extra="forbid")

    image_url: str | None = Field(None, min_length=1, description="A data URL "
                                  "(data:image/png;base64,...), or an http(s) URL on a host "
                                  "the operator allows (--allowed-image-hosts).")
    file_id: str | None = Field(None, description="Not served (there is no files API).")


class ImageEditJSON(ImageEditForm):
    """``POST /v1/images/edits`` as a JSON body: the images and the mask named by URL."""

    model_config = ConfigDict(extra="forbid", strict=True)

    images: list[ImageRef] = Field(min_length=1, description="The input images.")
    mask: ImageRef | None = Field(None, description="Where to edit (OpenAI's convention: "
                                  "transparent pixels).")


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    total_tokens: int
    cached_steps: int | None = Field(None, description="Where the request ran with a step "
                                     "cache: its images' denoising steps that reused it.")


class ImageData(BaseModel):
    b64_json: str | None = Field(None, description="The image (response_format=b64_json).")
    url: str | None = Field(None, description="Where the image is kept until it expires "
                            "(response_format=url): GET it with the API key.")
    seed: int
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    """The answer of both endpoints when not streamed."""

    created: int
    data: list[ImageData]
    output_format: str
    size: str
    background: str
    usage: Usage
    weight_version: str = Field("0", description="The version of the weights that made the "
                                "images (POST /v1/update_weights; 0: --model's own).")
    safety_identifier: str | None = Field(None, description="The request's safety_identifier, "
                                          "or its user; absent where it gave neither.")


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "diffserve"
    parent: str | None = Field(None, description="For a LoRA adapter: the base model's id.")
    # Extensions: what the served pipeline is and does.
    pipeline: str
    dtype: str = Field("", description="The dtype the weights are served in.")
    batching_mode: str
    tasks: list[str] = Field(description="The tasks served (those whose start-up check passed).")
    task_modes: dict[str, str] = Field(default_factory=dict, description="Each task's batching "
                                       "mode: step, or request where the step engine does not "
                                       "run that task on this model.")
    mixed_sizes: dict[str, str] = Field(default_factory=dict, description="Each step-mode "
                                        "task and whether requests of different sizes share "
                                        "one denoiser forward: an empty string where they do, "
                                        "else why not (docs/batching.md).")
    unavailable_tasks: dict[str, str] = Field(default_factory=dict, description="Tasks the "
                                              "model has but cannot serve, with why.")
    partial_images: bool
    max_edit_images: int = Field(0, description="The most input images one edit takes.")
    schedulers: list[str] = Field(default_factory=list, description="Samplers a request may "
                                  "pick with its scheduler field.")
    num_frames: int = Field(0, description="A video model's native frame count (0: an image "
                            "model; videos are made through /v1/videos).")
    frame_stride: int = Field(1, description="A video's frame count is frame_stride x k + 1.")
    fps: int = Field(0, description="A video model's default frame rate.")
    audio_sample_rate: int = Field(0, description="A video model that makes sound (LTX-2): its "
                                   "sound track's sample rate (0: silent videos).")
    parallel: dict[str, int] = Field(default_factory=dict, description="Each executor's parallel "
                                     "group (ulysses, ring, cfg, tp degrees) and how many groups.")
    components: list[dict] = Field(default_factory=list, description="Where each pipeline "
                                   "component sits: name, device, rank, dtype, bytes.")
    weight_version: str = Field("0", description="The version of the weights serving now "
                                "(POST /v1/update_weights; 0: --model's own).")
    random_weights: bool = Field(False, description="A released architecture built with random "
                                 "weights (--model random:NAME): its images are noise.")
    controls: list[dict] = Field(default_factory=list, description="The served control models "
                                 "(ControlNet): name, kind (class), modes (a union model's "
                                 "control types; 0: none), cost (added to an image's per "
                                 "control).")
    max_controls: int = Field(0, description="The most controls one request may stack (0: the "
                              "model takes none).")
    speed: dict = Field(default_factory=dict, description="What makes a step faster, as chosen "
                        "and measured at start: attention (the backend; with auto, each "
                        "candidate's step in ms and those left out, with why), quantization "
                        "(scheme, scope, PSNR against the unquantized model), flops (the "
                        "model's FLOPs a step of one native-size image, the device's peak).")
    # A server of several models (--model NAME=PATH ...; docs/models.md#several-models).
    location: str | None = Field(None, description="Several models: device (awake), host "
                                 "(asleep in host memory), or failed (it could not load).")
    size_bytes: int | None = Field(None, description="Several models: its weights' bytes.")
    loaded_at: float | None = Field(None, description="Several models: when it loaded (Unix s).")
    swapped_at: float | None = Field(None, description="Several models: its last swap in or "
                                     "out (Unix s).")
    last_swap_s: float | None = Field(None, description="Several models: how long that swap took.")
    error: str | None = Field(None, description="A model that could not load: why.")


class LoadLoraAdapter(BaseModel):
    """``POST /v1/load_lora_adapter``: serve (or replace) an adapter."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256, pattern=r"^\S+$")
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapter(BaseModel):
    """``POST /v1/unload_lora_adapter``: stop serving an adapter."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)


class SharedTensors(BaseModel):
    """A trainer's tensors in shared memory: a safetensors file it wrote in the host's shared
    memory directory (/dev/shm), named here; the server takes the file over."""

    model_config = ConfigDict(extra="forbid")

    shared_memory: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._-]+\.safetensors$")


class UpdateWeights(BaseModel):
    """``POST /v1/update_weights``: new denoiser weights, from disk (``path``) or from a
    trainer's memory (``tensors``)."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, min_length=1, max_length=4096)
    tensors: SharedTensors | None = None
    mode: Literal["drain", "abort"] = "drain"
    weight_version: str | None = Field(None, min_length=1, max_length=128, pattern=r"^\S+$")


class SleepBody(BaseModel):
    """``POST /v1/sleep``: 1 moves the weights to host memory, 2 drops them."""

    model_config = ConfigDict(extra="forbid")

    level: Literal[1, 2] = 1


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class RolloutRequest(ImageGenerationRequest):
    """``POST /v1/rollouts``: a generations body, sampled by the stochastic sampler RL fine-tuning
    uses, answered with its trajectory (see diffserve.wire.rollouts)."""

    noise_level: float = Field(0.7, ge=0, le=10, description="The sampler's noise level a; 0 is "
                               "the deterministic sampler (no log-probabilities).")
    return_: list[Literal[RETURNABLE]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(DEFAULT_RETURN), alias="return",
        description="Which tensors come back.")

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=False)
