"""An image request's life in the frontend, whatever route it came by: check that the server
serves, read and validate it, hand it to the engine, answer (JSON, a stream, or a route's own
answer), and count its outcome once."""

from __future__ import annotations

import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from diffserve.config.flags import ServerConfig
from diffserve.errors import APIError, unavailable
from diffserve.frontend.bodies import until_disconnected
from diffserve.frontend.image_store import ImageStore
from diffserve.frontend.scheduler_client import SchedulerClient
from diffserve.frontend.responses import ImageAnswer
from diffserve.frontend.schemas import ImageOptions
from diffserve.metrics import FrontendMetrics
from diffserve.wire.request import ImageRequest

# What a route's ``accept`` gives: the request for the engine, its input frames and the body.
Accepted = tuple[ImageRequest, list, ImageOptions]


@dataclass
class Serving:
    config: ServerConfig
    scheduler: SchedulerClient
    counts: FrontendMetrics
    pool: Executor  # encodes and decodes images off the event loop
    images: ImageStore | None = None  # where response_format=url images are kept

    def check_serving(self) -> None:
        if self.scheduler.draining:
            raise unavailable("The server is shutting down.", "shutting_down")
        if not self.scheduler.ready:
            raise unavailable("The model is not ready (no executor is serving: starting or "
                              "restarting); retry shortly.", "engine_not_ready")

    def url_keeper(self, base_url: str, body: ImageOptions):
        """For a url answer: keeps an encoded image and gives its URL on this server (whose
        address is ``base_url``)."""
        if body.response_format != "url" or self.images is None:
            return None
        base = base_url.rstrip("/")

        def keep(data: bytes, fmt: str) -> str:
            return f"{base}/v1/images/{self.images.put(data, fmt)}/content"

        return keep

    async def serve(self, http_request: Request, accept: Callable[[], Awaitable[Accepted]],
                     events: str, respond=None) -> Response:
        """Check that the server serves, read and validate the request (``accept``), run it
        and answer (as JSON or a stream; ``respond(request, done)`` makes any other answer).
        Its outcome is counted once, when the answer is complete (a stream's at its end)."""
        arrival, start = time.time(), time.perf_counter()
        request = None

        def finished(outcome: str) -> None:
            self.counts.finished(outcome, time.perf_counter() - start,
                                 None if request is None else request.priority)

        outcome, streamed = "cancelled", False
        try:
            self.check_serving()  # before the body is read: a stopping server reads nothing
            request, frames, body = await accept()
            self.counts.adapters_used(name for name, _ in request.loras)
            answer = ImageAnswer(request, body, events, arrival,
                                 self.scheduler.route(request.model)[0].spatial_stride, self.pool,
                                 self.url_keeper(str(http_request.base_url), body))
            if body.stream:
                response = await self._stream(http_request, answer, request, frames, finished)
                streamed = response is not None
            else:
                done = await until_disconnected(http_request, self.scheduler.generate(request, frames))
                response = (None if done is None else respond(request, done) if respond
                            else await answer.json(done))
            if response is None:
                return Response(status_code=499)  # the client left; its work was dropped
            outcome = "success"
            return response
        except APIError as error:
            outcome = error.outcome
            raise
        except Exception:
            outcome = "failed"
            raise
        finally:
            if not streamed:
                finished(outcome)

    async def _stream(self, http_request: Request, answer: ImageAnswer, request: ImageRequest,
                      frames: list, finished: Callable[[str], None]):
        """A streamed answer, or None if the client left before the first event. The first
        event decides the status: a request that fails before anything was streamed gets an
        ordinary error response."""
        submission = await self.scheduler.submit(request, frames)
        try:
            first = await until_disconnected(http_request, submission.next())
        except BaseException:
            submission.close()
            raise
        if first is None:
            submission.close()
            return None
        # Watch the client while waiting: the server may notice a departure only when it next
        # writes, which can be a whole image later.
        return answer.stream(first, submission,
                             lambda: until_disconnected(http_request, submission.next()), finished)
