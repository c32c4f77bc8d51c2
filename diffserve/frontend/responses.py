"""Answering an accepted image request: its images encoded, as one JSON body or as a stream of
Server-Sent Events (see :mod:`diffserve.frontend.streaming` for the events)."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import Executor
from typing import Awaitable, Callable

import orjson
from fastapi.responses import JSONResponse, StreamingResponse

from diffserve.errors import APIError
from diffserve.frontend import streaming
from diffserve.frontend.encode import encode_images
from diffserve.frontend.scheduler_client import DoneEvent, Submission
from diffserve.frontend.schemas import ImageOptions
from diffserve.frontend.usage import usage
from diffserve.wire.request import ImageRequest

# What the stream events say of quality: the server runs the request's own settings (steps,
# guidance) and has no quality levels, which the API calls "auto". JSON answers leave the field
# out (the API's images response admits no "auto" there).
STREAMED_QUALITY = "auto"


class OrjsonResponse(JSONResponse):
    """Large base64 payloads: orjson serialises them several times faster than json."""

    def render(self, content) -> bytes:
        return orjson.dumps(content)


class ImageAnswer:
    """One accepted request's answer; ``events`` names its stream events (see streaming)."""

    def __init__(self, request: ImageRequest, body: ImageOptions, events: str, created: float,
                 spatial_stride: int, pool: Executor,
                 keep: Callable[[bytes, str], str] | None = None) -> None:
        """``keep(data, format)``: for a url answer, keeps an image and gives its URL."""
        self.request, self.body, self.events, self.keep = request, body, events, keep
        self.created = int(created)
        self.stride, self.pool = spatial_stride, pool
        self.size = f"{request.width}x{request.height}"

    def _encode(self, frames: list) -> Awaitable[list[str]]:
        r, b = self.request, self.body
        return encode_images(self.pool, frames, r.width, r.height, b.output_format,
                             b.output_compression)

    def _usage(self, text_tokens: int, image_count: int, cached_steps: int | None = None) -> dict:
        return usage(self.request, self.stride, text_tokens, image_count, cached_steps)

    async def _images(self, encoded: list[str]) -> list[dict]:
        """Each image as the answer gives it: base64, or the URL it is kept under."""
        if self.keep is None:
            return [{"b64_json": b64} for b64 in encoded]
        fmt = self.body.output_format

        def keep_all() -> list[dict]:
            return [{"url": self.keep(base64.b64decode(b64), fmt)} for b64 in encoded]

        return await asyncio.get_running_loop().run_in_executor(self.pool, keep_all)

    async def json(self, done: DoneEvent) -> OrjsonResponse:
        return OrjsonResponse(await self.answer(done))

    async def answer(self, done: DoneEvent) -> dict:
        """The JSON answer's content."""
        images = await self._images(await self._encode(done.frames))
        return {
            "created": self.created,
            "data": [{**image, "seed": seed} for image, seed in zip(images, done.done.seeds)],
            "output_format": self.body.output_format, "size": self.size, "background": "opaque",
            "usage": self._usage(done.done.prompt_tokens, self.request.n,
                                 None if done.done.cached_steps is None
                                 else sum(done.done.cached_steps)),
            "weight_version": done.done.weight_version,
            **self._identifier(),
        }

    def _identifier(self) -> dict:
        """The caller's end-user identifier, echoed as the API does (``user`` if no other)."""
        given = self.body.safety_identifier or self.body.user
        return {"safety_identifier": given} if given else {}

    def stream(self, first, submission: Submission,
               next_event: Callable[[], Awaitable], finished: Callable[[str], None]) -> StreamingResponse:
        """The events from ``first`` on; ``next_event()`` awaits the next one or gives None if
        the client left. ``finished(outcome)`` is called once, when the stream ends."""
        common = {"created_at": self.created, "size": self.size, "quality": STREAMED_QUALITY,
                  "background": "opaque", "output_format": self.body.output_format}
        n = self.request.n

        async def events():
            outcome = "cancelled"
            try:
                event = first
                while True:
                    if isinstance(event, DoneEvent):
                        encoded = await self._encode(event.frames)
                        tokens, cached = event.done.prompt_tokens, event.done.cached_steps
                        for i, (b64, seed) in enumerate(zip(encoded, event.done.seeds)):
                            used = self._usage(tokens, 1, None if cached is None else cached[i])
                            yield streaming.completed(
                                self.events, {**common, "weight_version": event.done.weight_version},
                                b64, used, i, n, seed)
                        outcome = "success"
                        return
                    (b64,) = await self._encode([event.frame])
                    yield streaming.partial_image(self.events, common, b64,
                                                  event.partial.partial_index, event.partial.index, n)
                    event = await next_event()
                    if event is None:
                        return
            except APIError as error:
                outcome = error.outcome
                yield streaming.error(error.body())
            except asyncio.CancelledError:
                raise
            finally:
                submission.close()  # the client left: the engine drops the work
                finished(outcome)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=None)
