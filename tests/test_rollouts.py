"""Rollouts through the real server (tiny-flux without guidance, tiny-sd3 with it, tiny-qwen-image
with its true classifier-free guidance from a negative prompt): the tensors and
their layouts; every returned log-probability recomputed from the returned latents with the model
run alone, as a trainer does (the on-policy property); the deterministic sampler equals the
generations endpoint; one request of n equals n single requests; the client; and the errors."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.numpy import load

from diffserve.client import Client, RolloutError
from diffserve.builders.registry import resolve_model, serving_defaults
from helpers import sde_log_prob
from server import LAUNCHES, assert_openai_error, decode, serves, spec

ROLLOUTS = "/v1/rollouts"


# Qwen-Image guides only with a negative prompt: every request of its server carries one.
NEGATIVE = {"tiny-qwen-image": "blurry"}


@pytest.fixture(scope="module", params=["tiny-flux", "tiny-sd3", "tiny-qwen-image"])
@serves(lambda model: spec("--model", model, "--max-n", "16", "--dynamic-batch-max-size", "8",
                           "--batching-mode", "step"))
def served(request):
    launched = LAUNCHES.take(request)
    try:
        pipe = DiffusionPipeline.from_pretrained(resolve_model(request.param))  # while it starts
    except BaseException:
        launched.stop()
        raise
    with launched as srv:
        srv.model_name, srv.pipe = request.param, pipe
        srv.negative = NEGATIVE.get(request.param, "")
        # The pipelines' own default where the model's serving defaults set none (Qwen-Image).
        srv.max_sequence_length = serving_defaults(resolve_model(request.param)).get(
            "pipeline_kwargs", {}).get("max_sequence_length", 512)
        yield srv


def rollout(server, **body):
    with server.client(timeout=300) as c:
        response = c.post(ROLLOUTS, json={"prompt": "a red circle", "num_inference_steps": 4,
                                          **_negative(server), **body})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    return load(response.content), _metadata(response.content)


def _negative(server) -> dict:
    return {"negative_prompt": server.negative} if server.negative else {}


def _metadata(body: bytes) -> dict:
    length = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + length])["__metadata__"]


def test_every_tensor_has_its_shape_and_dtype(served):
    t, meta = rollout(served, n=3, seed=5, **{"return": ["latents", "log_probs", "timesteps",
                                                          "images", "prompt_embeds"]})
    assert t["latents"].shape == (3, 5, *t["latents"].shape[2:]) and t["latents"].dtype == np.float32
    assert t["latents"].shape[3:] == (8, 8)  # unpacked: [n, T+1, C, h, w] at 64x64 / 8
    assert t["log_probs"].shape == (3, 4) and t["log_probs"].dtype == np.float32
    assert t["timesteps"].shape == (4,) and t["sigmas"].shape == (5,) and t["sigmas"][-1] == 0
    assert t["images"].shape == (3, 64, 64, 3) and t["images"].dtype == np.uint8
    assert t["prompt_embeds"].ndim == 2
    assert json.loads(meta["seeds"]) == [5, 6, 7] and meta["model"] == served.model_name
    request = json.loads(meta["request"])
    assert request["noise_level"] == 0.7 and request["n"] == 3
    only, _ = rollout(served, seed=5, **{"return": ["log_probs"]})
    assert set(only) == {"log_probs"}


def transformer_velocity(server, latents: torch.Tensor, t: float, guidance: float) -> torch.Tensor:
    """The model alone on one sample (unpacked latents [C, h, w]): its guided velocity, in the
    same layout. Written from the pipeline's own components, not the server's code."""
    pipe, x = server.pipe, latents[None]
    with torch.inference_mode():
        if server.model_name == "tiny-flux":
            embeds, pooled, text_ids = pipe.encode_prompt(
                "a red circle", None, max_sequence_length=server.max_sequence_length)
            c, h, w = x.shape[1:]
            packed = pipe._pack_latents(x, 1, c, h, w)
            ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
            out = pipe.transformer(
                hidden_states=packed, timestep=torch.tensor([t / 1000]),
                guidance=torch.tensor([guidance]) if pipe.transformer.config.guidance_embeds else None,
                pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=text_ids,
                img_ids=ids, return_dict=False)[0]
            return pipe._unpack_latents(out, 8 * h, 8 * w, pipe.vae_scale_factor)[0]
        if server.model_name == "tiny-qwen-image":
            c, h, w = x.shape[1:]
            packed = pipe._pack_latents(x, 1, c, h, w)

            def velocity(prompt):
                embeds, mask = pipe.encode_prompt(prompt, max_sequence_length=server.max_sequence_length)
                return pipe.transformer(
                    hidden_states=packed, timestep=torch.tensor([t / 1000]), guidance=None,
                    encoder_hidden_states_mask=mask, encoder_hidden_states=embeds,
                    img_shapes=[[(1, h // 2, w // 2)]], return_dict=False)[0]

            cond, uncond = velocity("a red circle"), velocity(server.negative)
            guided = uncond + guidance * (cond - uncond)
            guided = guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
            return pipe._unpack_latents(guided, 8 * h, 8 * w, pipe.vae_scale_factor)[0, :, 0]
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            "a red circle", None, None, do_classifier_free_guidance=True,
            max_sequence_length=server.max_sequence_length)
        out = pipe.transformer(hidden_states=torch.cat([x, x]), timestep=torch.tensor([t, t]),
                               encoder_hidden_states=torch.cat([negative, embeds]),
                               pooled_projections=torch.cat([negative_pooled, pooled]),
                               return_dict=False)[0]
        uncond, cond = out.chunk(2)
        return (uncond + guidance * (cond - uncond))[0]


def test_log_probs_recomputed_from_the_trajectory_with_the_model_alone_agree(served):
    t, meta = rollout(served, n=2, seed=11, noise_level=0.9)
    guidance = json.loads(meta["request"])["guidance_scale"]
    sigmas, a = t["sigmas"].astype(np.float64), 0.9
    for i in range(2):
        for step in range(4):
            x = torch.from_numpy(t["latents"][i, step].copy())
            v = transformer_velocity(served, x, float(t["timesteps"][step]), guidance).double()
            nxt = torch.from_numpy(t["latents"][i, step + 1].copy()).double()
            lp = sde_log_prob(x, v, nxt, sigmas, step, a)
            assert abs(lp - float(t["log_probs"][i, step])) <= 1e-3, (i, step, lp)


def test_without_noise_the_rollout_is_the_generations_endpoints_image(served):
    t, _ = rollout(served, n=2, seed=3, noise_level=0.0)
    assert "log_probs" not in t
    with served.client() as c:
        made = c.post("/v1/images/generations", json={"prompt": "a red circle", "n": 2, "seed": 3,
                                                       "num_inference_steps": 4,
                                                       **_negative(served)}).json()["data"]
    for i in range(2):
        assert np.abs(decode(made[i]["b64_json"]).astype(int) - t["images"][i].astype(int)).max() <= 2


def test_sixteen_in_one_request_equal_sixteen_single_requests(served):
    together, _ = rollout(served, n=16, seed=100)
    with ThreadPoolExecutor(8) as pool:  # the singles share forwards with each other too
        alone = list(pool.map(lambda i: rollout(served, n=1, seed=100 + i)[0], range(16)))
    for i, single in enumerate(alone):
        assert np.abs(together["images"][i].astype(int) - single["images"][0].astype(int)).max() <= 2
        assert np.abs(together["log_probs"][i] - single["log_probs"][0]).max() <= 1e-3
        assert np.abs(together["latents"][i] - single["latents"][0]).max() <= 1e-3


@pytest.mark.parametrize("body, param", [
    ({"noise_level": -1}, "noise_level"), ({"noise_level": "high"}, "noise_level"),
    ({"return": ["everything"]}, "return[0]"), ({"stream": True}, "stream"),
    ({"n": 17}, "n"), ({"unknown": 1}, "unknown"), ({"prompt": ""}, "prompt"),
])
def test_malformed_bodies_are_400_naming_the_field(served, body, param):
    with served.client() as c:
        response = c.post(ROLLOUTS, json={"prompt": "x", **body})
    assert_openai_error(response, 400, param=param)


def test_the_client_returns_torch_tensors_concurrently_and_retries_when_overloaded(served):
    with Client(served.url) as client:
        groups = client.rollout(["a red circle", "a blue square", "a green triangle"], n=4,
                                seed=40, num_inference_steps=4)
    assert [g.request["prompt"] for g in groups] == ["a red circle", "a blue square",
                                                      "a green triangle"]
    assert [g.seeds for g in groups] == [[40, 41, 42, 43], [44, 45, 46, 47], [48, 49, 50, 51]]
    assert isinstance(groups[0].log_probs, torch.Tensor) and groups[0].log_probs.shape == (4, 4)
    assert groups[1].latents.shape[:2] == (4, 5)


@pytest.mark.server("--model", "tiny-sd")
def test_a_family_without_flow_matching_answers_400(own_server):
    with own_server as srv, srv.client() as c:
        response = c.post(ROLLOUTS, json={"prompt": "x"})
        error = assert_openai_error(response, 400, code="unsupported_task")
        assert "flow-matching" in error["message"]
        assert "rollout" not in c.get("/v1/models").json()["data"][0]["tasks"]


@pytest.mark.server("--model", "tiny-flux", "--max-queue-size", "1", "--dynamic-batch-max-size",
                    "1", "--max-n", "16")
def test_the_client_honours_retry_after_on_a_full_queue(own_server):
    with own_server as srv:
        with Client(srv.url, backoff_s=0.05) as client:
            groups = client.rollout([f"prompt {i}" for i in range(6)], n=2, seed=1,
                                    num_inference_steps=6)
        assert len(groups) == 6 and all(g.log_probs.shape == (2, 6) for g in groups)
        with Client(srv.url, max_retries=0) as impatient, pytest.raises(RolloutError) as error:
            with ThreadPoolExecutor(6) as pool:
                list(pool.map(lambda i: impatient.rollout_one({"prompt": f"p{i}", "n": 2,
                                                               "num_inference_steps": 30}),
                              range(6)))
        assert error.value.status == 429


