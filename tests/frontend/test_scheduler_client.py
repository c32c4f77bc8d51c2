"""The frontend's end of the engine link, with real ZMQ sockets: images come from the executors
and answers from the scheduler, in either order; a lost image is a 500, not a hang; and a reader
that fails answers everyone 503 and says so, instead of dying silently."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq

from diffserve.errors import APIError
from diffserve.frontend import scheduler_client as module
from diffserve.frontend.scheduler_client import DoneEvent, SchedulerClient, PartialEvent
from diffserve.wire.protocol import (
    BackendStatus,
    ExecutorState,
    ItemImages,
    Kind,
    Partial,
    RequestDone,
    RequestFailed,
    encode,
)
from helpers import make_request


class Engine:
    """Plays the scheduler and an executor: PUSH sockets into the client's PULL socket, and a PULL
    on its PUSH socket to see what it sends."""

    def __init__(self, tmp_path) -> None:
        self.ctx = zmq.Context()
        self.client = SchedulerClient(self.ctx, str(tmp_path))
        self.scheduler = self.ctx.socket(zmq.PUSH)
        self.scheduler.connect(self.client.result_addr)
        self.executor = self.ctx.socket(zmq.PUSH)
        self.executor.connect(self.client.result_addr)
        self.requests = self.ctx.socket(zmq.PULL)
        self.requests.connect(self.client.request_addr)
        self.failures: list[str] = []

    async def start(self) -> None:
        await self.client.start(self.failures.append)
        self.scheduler.send_multipart(encode(Kind.BACKEND_STATUS, BackendStatus(
            [ExecutorState(0, "ready", "cpu")])))
        while not self.client.ready:
            await asyncio.sleep(0.001)  # the reader takes it from the socket

    def images(self, request_id: str, start: int, stop: int, value: int = 0) -> None:
        pixels = [np.full((2, 2, 3), value + i, np.uint8) for i in range(start, stop)]
        self.executor.send_multipart(encode(Kind.IMAGES, ItemImages(request_id, start, stop, 2, 2),
                                            pixels))

    def done(self, request_id: str, n: int) -> None:
        self.scheduler.send_multipart(encode(Kind.REQUEST_DONE, RequestDone(request_id, list(range(n)))))

    async def close(self) -> None:
        await self.client.close()
        self.ctx.destroy(linger=0)


def run(tmp_path, scenario) -> None:
    async def main():
        engine = Engine(tmp_path)
        await engine.start()
        try:
            await asyncio.wait_for(scenario(engine), 10)
        finally:
            await engine.close()

    asyncio.run(main())


@pytest.mark.parametrize("header_first", [True, False])
def test_images_from_executors_and_the_answer_from_the_scheduler_meet_in_either_order(tmp_path, header_first):
    async def scenario(engine: Engine):
        request = make_request(request_id="r", n=3, width=2, height=2)
        submission = await engine.client.submit(request)
        if header_first:
            engine.done("r", 3)
        engine.images("r", 2, 3, value=10)  # parts of a split request come in any order
        engine.images("r", 0, 2, value=10)
        if not header_first:
            engine.done("r", 3)
        event = await submission.next()
        assert isinstance(event, DoneEvent) and event.done.seeds == [0, 1, 2]
        assert [bytes(f)[0] for f in event.frames] == [10, 11, 12]

    run(tmp_path, scenario)


def test_previews_come_before_the_answer_and_late_messages_are_dropped(tmp_path):
    async def scenario(engine: Engine):
        submission = await engine.client.submit(make_request(request_id="p", width=2, height=2))
        engine.executor.send_multipart(encode(Kind.PARTIAL, Partial("p", 0, 0, 2, 2),
                                              [np.zeros((2, 2, 3), np.uint8)]))
        engine.images("p", 0, 1)
        engine.done("p", 1)
        assert isinstance(await submission.next(), PartialEvent)
        assert isinstance(await submission.next(), DoneEvent)
        engine.images("p", 0, 1)  # a duplicate, for nobody: dropped
        engine.done("p", 1)
        submission.close()
        other = await engine.client.submit(make_request(request_id="q", width=2, height=2))
        engine.images("q", 0, 1)
        engine.done("q", 1)
        assert isinstance(await other.next(), DoneEvent)  # the reader is still there
        assert engine.failures == []

    run(tmp_path, scenario)


def test_images_that_never_follow_their_answer_are_a_500_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(module, "IMAGES_GRACE_S", 0.05)

    async def scenario(engine: Engine):
        submission = await engine.client.submit(make_request(request_id="lost", n=2, width=2, height=2))
        engine.images("lost", 0, 1)
        engine.done("lost", 2)  # image 1 was lost with its executor
        with pytest.raises(APIError) as error:
            await submission.next()
        assert error.value.status == 500

    run(tmp_path, scenario)


def test_a_malformed_message_is_dropped_and_reading_goes_on(tmp_path):
    async def scenario(engine: Engine):
        submission = await engine.client.submit(make_request(request_id="m", width=2, height=2))
        engine.executor.send_multipart([b"\x63garbage"])
        engine.executor.send_multipart(encode(Kind.IMAGES, ItemImages("m", 0, 2, 2, 2),
                                              [b"\x00" * 12]))  # says 2 images, carries 1
        engine.scheduler.send_multipart(encode(Kind.REQUEST_FAILED, RequestFailed("m", 500, "boom")))
        with pytest.raises(APIError, match="boom"):
            await submission.next()
        assert engine.failures == [] and engine.client.ready

    run(tmp_path, scenario)


def test_a_reader_that_fails_answers_every_waiter_503_and_reports_it(tmp_path, monkeypatch):
    def broken(self, kind, msg, buffers):
        raise RuntimeError("a bug in routing")

    async def scenario(engine: Engine):
        waiting = [await engine.client.submit(make_request(request_id=f"w{i}", width=2, height=2))
                   for i in range(3)]
        monkeypatch.setattr(SchedulerClient, "_dispatch", broken)
        engine.done("w0", 1)
        for submission in waiting:
            with pytest.raises(APIError) as error:
                await submission.next()
            assert error.value.status == 503
        assert not engine.client.ready  # /health turns 503
        assert len(engine.failures) == 1 and "a bug in routing" in engine.failures[0]
        with pytest.raises(APIError) as error:
            await engine.client.submit(make_request(request_id="after"))
        assert error.value.status == 503

    run(tmp_path, scenario)
