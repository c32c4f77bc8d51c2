"""Never a black success: an image with NaN or infinite pixels fails its own request with a 500
``non_finite_output`` (counted in /metrics), its batch-mates are unharmed, and the next request
is served. The model (``nan_sd``) embeds '!' as NaN: a prompt with one makes NaN images, as a
half-precision model that overflows does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.request.runner import RequestRunner
from diffserve.wire.request import Work, WorkItem
from helpers import make_request
from server import Server, assert_openai_error, decode, metric

GENERATE = "/v1/images/generations"


@pytest.fixture(scope="module")
def server(nan_sd):
    with Server("--batching-mode", "step", model=str(nan_sd)) as srv:
        yield srv


def post(server, prompt: str, seed: int) -> httpx.Response:
    with server.client() as c:
        return c.post(GENERATE, json={"prompt": prompt, "seed": seed, "num_inference_steps": 3,
                                      "n": 2})


def test_step_mode_fails_only_the_request_whose_images_are_not_finite(server):
    before = metric(httpx.get(server.url + "/metrics").text, "diffserve_non_finite_outputs_total")
    with ThreadPoolExecutor(3) as pool:  # in one running set: they share forwards
        answers = list(pool.map(lambda job: post(server, *job),
                                [("a cat", 1), ("a cat!", 2), ("a dog", 3)]))
    good, bad, also_good = answers
    error = assert_openai_error(bad, 500, code="non_finite_output")
    assert "NaN or infinite pixels" in error["message"]
    for answer in (good, also_good):
        assert answer.status_code == 200, answer.text
        assert all(decode(d["b64_json"]).max() > 0 for d in answer.json()["data"])
    after = metric(httpx.get(server.url + "/metrics").text, "diffserve_non_finite_outputs_total")
    assert after - before == 1
    assert post(server, "a bird", 4).status_code == 200  # the next request is served


def test_request_mode_fails_only_the_item_whose_images_are_not_finite(nan_sd):
    """One batched pipeline call of three requests: the one with '!' fails with the code, the
    others get their images; no pipeline call is repeated to find it."""
    loaded = load_model(str(nan_sd), torch_threads=1)
    runner = RequestRunner(loaded, task_pipelines(loaded.pipe), None)
    calls = []
    pipe_call = type(loaded.pipe).__call__
    type(loaded.pipe).__call__ = lambda self, **kw: calls.append(1) or pipe_call(self, **kw)
    try:
        items = [WorkItem(make_request(2, request_id=rid, prompt=prompt, steps=3), 0, 2)
                 for rid, prompt in (("a", "a cat"), ("b", "a cat!"), ("c", "a dog"))]
        outcomes = runner.execute(Work(1, items), [[], [], []])
    finally:
        type(loaded.pipe).__call__ = pipe_call
    assert len(calls) == 1
    assert [o.status for o in outcomes] == ["finished", "failed", "finished"]
    assert outcomes[1].code == "non_finite_output" and "NaN" in outcomes[1].error
    assert all(np.asarray(o.images).max() > 0 for o in (outcomes[0], outcomes[2]))
