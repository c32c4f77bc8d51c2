"""The Videos API routes: create (multipart as the SDK sends it, or JSON), retrieve, list,
delete and download. Only a server whose model makes videos has them."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse

from diffserve.errors import APIError, invalid_request
from diffserve.frontend.bodies import validate
from diffserve.frontend.serving import Serving
from diffserve.frontend.spec import video_spec
from diffserve.frontend.image_routes import key_priority
from diffserve.frontend.uploads import image_pixels, open_image, read_limited, read_multipart
from diffserve.frontend.validation import to_engine_request
from diffserve.frontend.videos.encode import VARIANTS, VIDEO
from diffserve.frontend.videos.jobs import VideoJobs, new_id
from diffserve.frontend.videos.peers import Peers
from diffserve.frontend.videos.schemas import Video, VideoCreate, VideoDeleted, VideoError, VideoList
from diffserve.frontend.videos.store import COMPLETED, VideoJob
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.tasks import FIRST_FRAME, GENERATE, IMAGE_TO_VIDEO
from diffserve.wire.request import in_manifest_order

REFERENCE_FIELD = "input_reference"
POLL_AFTER_MS = "500"  # how soon the SDK's poll helper asks again
VIDEO_ID = re.compile(r"^video_[0-9a-f]{28}(_r\d+)?$")


def not_found(job_id: str) -> APIError:
    return APIError(f"No video found with id {job_id!r}.", "video_id", "not_found", 404,
                    "invalid_request_error")


def video_object(job: VideoJob) -> Video:
    error = VideoError(code=job.error_code, message=job.error_message or "") if job.error_code else None
    return Video(id=job.id, status=job.status, progress=job.progress, created_at=job.created_at,
                 completed_at=job.completed_at, expires_at=job.expires_at, model=job.model,
                 prompt=job.prompt, seconds=job.seconds, size=job.size, error=error,
                 weight_version=job.params.get("weight_version"),
                 audio=bool(job.params.get("audio")))


def frame_count(body: VideoCreate, info: ModelInfo, fps: int, limit: int) -> int:
    """The frames asked for: ``num_frames`` (which must keep the model's rule), else ``seconds``
    x ``fps`` rounded to the nearest count the rule allows, else the model's native count."""
    stride = info.frame_stride
    rule = (f"this model makes {stride}k+1 frames (e.g. {stride + 1}, {2 * stride + 1}, "
            f"{4 * stride + 1})") if stride > 1 else "any count"
    if body.num_frames is not None:
        frames, param = body.num_frames, "num_frames"
        if (frames - 1) % stride:
            raise invalid_request(f"num_frames={frames} breaks the frame rule: {rule}", param,
                                  "invalid_value")
    elif body.seconds is not None:
        frames, param = max(0, round((float(body.seconds) * fps - 1) / stride)) * stride + 1, "seconds"
    else:
        frames, param = info.num_frames, "num_frames"
    if frames > limit:
        raise invalid_request(f"{frames} frames is above this server's limit of {limit} "
                              "(--max-video-frames)", param, "invalid_value")
    return frames


def with_sound(body: VideoCreate, info: ModelInfo) -> bool:
    """Whether the MP4 gets the model's sound track. A model that makes sound makes it for its
    own frame rate: another ``fps`` would play the frames against a track of another length."""
    if not info.audio_sample_rate:
        if body.audio:
            raise invalid_request(f"model {info.name!r} ({info.pipeline_class}) makes no sound",
                                  "audio", "unsupported_parameter")
        return False
    if body.fps is not None and body.fps != info.fps and body.audio is not False:
        raise invalid_request(f"model {info.name!r} makes its sound for {info.fps} fps: ask for "
                              f"fps={info.fps}, or for audio=false", "fps", "invalid_value")
    return body.audio is not False


def seconds_text(frames: int, fps: int) -> str:
    return format(round(frames / fps, 3), "g")


async def read_body(http_request: Request, limit: int) -> tuple[dict, bytes | None]:
    """The create request's fields and its input reference image, if any: a multipart form (as
    the SDK sends it) or JSON, where the image is a base64 data URL (``{"image_url": ...}``)."""
    raw = await read_limited(http_request.stream(), limit,
                             http_request.headers.get("content-length"), "--max-upload-bytes")
    if http_request.headers.get("content-type", "").lower().startswith("multipart/"):
        fields, files = await read_multipart(http_request.headers, raw, limit, (REFERENCE_FIELD,))
        images = files.get(REFERENCE_FIELD, [])
        if len(images) > 1:
            raise invalid_request("one input_reference per video", REFERENCE_FIELD, "invalid_value")
        return fields, images[0] if images else None
    try:
        fields = json.loads(raw or b"{}")
    except ValueError:
        raise invalid_request("The body is neither JSON nor multipart/form-data.", None,
                              "invalid_json") from None
    if not isinstance(fields, dict):
        raise invalid_request("The body must be a JSON object.", None, "invalid_json")
    reference = fields.pop(REFERENCE_FIELD, None)
    if reference is None:
        return fields, None
    url = reference.get("image_url", "") if isinstance(reference, dict) else ""
    header, _, data = url.partition(",")
    if not (header.startswith("data:image/") and header.endswith(";base64")):
        raise invalid_request("input_reference must be an uploaded file, or {\"image_url\": a "
                              "base64 data URL} (this server fetches nothing)", REFERENCE_FIELD,
                              "invalid_value")
    try:
        return fields, base64.b64decode(data, validate=True)
    except binascii.Error:
        raise invalid_request("input_reference's data URL is not valid base64", REFERENCE_FIELD,
                              "invalid_value") from None


def video_routes(serving: Serving, jobs: VideoJobs, peers: Peers | None = None) -> APIRouter:
    """``peers``: the other replicas (Ray Serve), where a request about their jobs goes."""
    router = APIRouter()
    config, scheduler = serving.config, serving.scheduler

    async def elsewhere(video_id: str, http_request: Request):
        """The holding replica's answer where another replica holds the job, else None."""
        rank = peers.holder(video_id, http_request) if peers else None
        if rank is None:
            return None
        answer = await peers.pass_on(http_request, rank)
        if answer is None:
            raise not_found(video_id)
        return answer

    @router.post("/v1/videos", response_model=Video)
    async def create_video(http_request: Request):
        serving.check_serving()
        fields, reference = await read_body(http_request, config.max_upload_bytes)
        body = validate(VideoCreate, fields)
        info = scheduler.model_info
        task = IMAGE_TO_VIDEO if reference is not None else GENERATE
        if task.name not in info.tasks and task.name not in info.unavailable_tasks:
            raise invalid_request(
                f"model {info.name!r} ({info.pipeline_class}) makes videos from " +
                ("text only: it takes no input_reference" if task is IMAGE_TO_VIDEO else
                 "an image: send its first frame as input_reference"), REFERENCE_FIELD,
                "unsupported_task")
        if body.guidance_scale_2 is not None and not info.guidance_scale_2:
            raise invalid_request(f"model {info.name!r} has one expert and takes no "
                                  "guidance_scale_2", "guidance_scale_2", "unsupported_parameter")
        sound = with_sound(body, info)
        fps = body.fps or info.fps
        frames = frame_count(body, info, fps, config.max_video_frames)
        request = to_engine_request(video_spec(body, frames), new_id(peers.tag if peers else ""),
                                    info, config, task, scheduler.adapters,
                                    key_priority=key_priority(http_request))
        inputs = []
        if reference is not None:
            picture = open_image(reference, REFERENCE_FIELD, config.max_input_pixels)
            first = await asyncio.get_running_loop().run_in_executor(
                serving.pool, image_pixels, picture, request.width, request.height)
            inputs = in_manifest_order(request.manifest, {FIRST_FRAME.name: [first]})
        params = {"seed": request.seed, "num_frames": frames, "fps": fps,
                  "num_inference_steps": request.num_inference_steps,
                  "guidance_scale": request.guidance_scale, "task": task.name, "audio": sound,
                  "loras": [list(pair) for pair in request.loras]}
        seconds = body.seconds if body.seconds is not None and body.num_frames is None \
            else seconds_text(frames, fps)
        return video_object(jobs.create(request, inputs, params, seconds))

    @router.get("/v1/videos", response_model=VideoList)
    async def list_videos(http_request: Request, after: str | None = None,
                          limit: int = Query(20, ge=1, le=100),
                          order: str = Query("desc", pattern="^(asc|desc)$")):
        if after is not None and not VIDEO_ID.match(after):
            raise invalid_request(f"after={after!r} is not a video id", "after", "invalid_value")
        descending = order == "desc"
        page, more = jobs.store.page(after, limit, descending)
        data = [video_object(job).model_dump(mode="json") for job in page]
        if peers is not None and not peers.local(http_request):  # every replica's page, merged
            for body in await peers.pages(http_request):
                data += body["data"]
                more = more or body["has_more"]
            data.sort(key=lambda video: video["id"], reverse=descending)
            more, data = more or len(data) > limit, data[:limit]
        return VideoList(data=data, first_id=data[0]["id"] if data else None,
                         last_id=data[-1]["id"] if data else None, has_more=more)

    @router.get("/v1/videos/{video_id}", response_model=Video)
    async def retrieve_video(video_id: str, http_request: Request):
        if (answer := await elsewhere(video_id, http_request)) is not None:
            return answer
        job = jobs.store.get(video_id)
        if job is None:
            raise not_found(video_id)
        headers = {} if job.finished else {"openai-poll-after-ms": POLL_AFTER_MS}
        return JSONResponse(video_object(job).model_dump(mode="json"), headers=headers)

    @router.delete("/v1/videos/{video_id}", response_model=VideoDeleted)
    async def delete_video(video_id: str, http_request: Request):
        if (answer := await elsewhere(video_id, http_request)) is not None:
            return answer
        if not await jobs.delete(video_id):
            raise not_found(video_id)
        return VideoDeleted(id=video_id)

    @router.get("/v1/videos/{video_id}/content")
    async def download_video(video_id: str, http_request: Request,
                             variant: str = Query(VIDEO, pattern="^(video|thumbnail|spritesheet)$")):
        if (answer := await elsewhere(video_id, http_request)) is not None:
            return answer
        job = jobs.store.get(video_id)
        if job is None:
            raise not_found(video_id)
        if job.status != COMPLETED:
            raise invalid_request(f"video {video_id!r} is {job.status}: its content exists once "
                                  "it is completed", "video_id", "video_not_ready")
        suffix, media_type = VARIANTS[variant]
        path = jobs.store.stem(video_id).with_name(video_id + suffix)
        if not path.is_file():
            raise not_found(video_id)
        return FileResponse(path, media_type=media_type)

    return router
