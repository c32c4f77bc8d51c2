"""The request lifecycle's order, in place: a server that is stopping or not ready refuses a
request before it reads the body (an upload is never decoded for nothing), and the refusal is
counted once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from diffserve.errors import APIError
from diffserve.frontend.serving import Serving
from diffserve.metrics import FrontendMetrics


@pytest.mark.parametrize("draining, ready, code", [(True, True, "shutting_down"),
                                                   (False, False, "engine_not_ready")])
def test_a_server_that_does_not_serve_refuses_before_reading_the_body(draining, ready, code):
    counts = FrontendMetrics()
    serving = Serving(config=None, scheduler=SimpleNamespace(draining=draining, ready=ready),
                      counts=counts, pool=None)
    read = []

    async def accept():
        read.append(True)
        raise AssertionError("the body was read")

    with pytest.raises(APIError) as error:
        asyncio.run(serving.serve(None, accept, "image_generation"))
    assert (error.value.status, error.value.code, read) == (503, code, [])
    assert counts.requests_total.labels(status="failed")._value.get() == 1
