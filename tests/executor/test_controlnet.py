"""ControlNet in the step engine: requests with different control models, stacks, scales,
windows and union modes, and requests without control, share forwards (joining a running set
mid-way), and each image equals diffusers' own ControlNet pipeline for its family run alone with
the same inputs within 2/255; every control model runs once a step, on the rows that use it;
request mode calls the family's diffusers ControlNet pipeline; a control model made for another
family is refused at start, naming it."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.checks.reference import max_diff, sample_image, solo
from diffserve.executor.control.models import ControlModelError, load_controls
from diffserve.executor.runtime import build_runtime
from diffserve.wire.request import Control, ImageRequest, Work, WorkItem

EDGES = np.zeros((64, 64, 3), np.uint8)
EDGES[16:48, 16:48] = 255
EDGES[:, :6] = (255, 0, 0)
DEPTH = np.repeat(np.linspace(0, 255, 64, dtype=np.uint8)[None, :, None], 64, axis=0).repeat(3, 2)


def runtime(model: str, **controls: str):
    return build_runtime(ServerConfig(model=model, device="cpu", torch_threads=1,
                                      controlnet=tuple(f"{k}={v}" for k, v in controls.items()),
                                      skip_startup_check=True))


def request(rt, rid: str, controls=(), **fields) -> ImageRequest:
    fields = {"num_inference_steps": 4, "guidance_scale": rt.info.default_guidance_scale,
              "prompt": f"a cat {rid}", "seed": 7, **fields}
    return ImageRequest(rid, rt.info.name, 64, 64, controls=tuple(controls), **fields)


def images_of(r: ImageRequest) -> list[np.ndarray]:
    return [EDGES if i % 2 == 0 else DEPTH for i in range(len(r.controls))]


def frames_of(r: ImageRequest, inputs=()) -> list[np.ndarray]:
    return [*inputs, *images_of(r)]


def stepped(rt, joins: dict[int, list[tuple[ImageRequest, list]]]) -> dict:
    """Each request's outcome in one step engine, ``joins[s]`` admitted before step ``s``."""
    engine, outcomes, step = rt.step_engine(), [], 0
    while engine or step in joins:
        if step in joins:
            outcomes += engine.admit([WorkItem(r, 0, r.n) for r, _ in joins[step]],
                                     [frames for _, frames in joins[step]])
        outcomes += engine.step().finished
        step += 1
    return {o.item.request.request_id: o for o in outcomes}


def reference(rt, r: ImageRequest, image=None, mask=None) -> np.ndarray:
    controls = [(rt.controls[c.model].module, picture)
                for c, picture in zip(r.controls, images_of(r))]
    return solo(rt.loaded, rt.pipelines, r, image=image, mask=mask, controls=controls or None)


@pytest.fixture(scope="module")
def sd():
    return runtime("tiny-sd", edges="tiny-sd-control", depth="tiny-sd-control-b")


def test_sd_requests_with_different_controls_share_forwards_and_each_is_exact(sd):
    rs = [request(sd, "edges", [Control("edges", 0.8)], n=2),
          request(sd, "plain", negative_prompt="blurry"),
          request(sd, "window", [Control("depth", 1.2, 0.25, 0.75)], guidance_scale=3.0),
          request(sd, "stack", [Control("edges", 0.5), Control("depth", 0.7, 0.0, 0.5)],
                  num_inference_steps=6),
          request(sd, "twice", [Control("edges", 0.3), Control("edges", 0.6)])]
    got = stepped(sd, {0: [(r, frames_of(r)) for r in rs[:2]],
                       2: [(r, frames_of(r)) for r in rs[2:]]})  # these join mid-way
    for r in rs:
        assert got[r.request_id].error is None, got[r.request_id].error
        assert max_diff(got[r.request_id].images, reference(sd, r)) <= 2, r.request_id
    # Control visibly changes an image, and two models change it differently.
    plain = reference(sd, request(sd, "x"))
    assert np.abs(reference(sd, request(sd, "x", [Control("edges")])).astype(int) - plain).mean() > 3
    assert max_diff(reference(sd, request(sd, "x", [Control("edges")])),
                    reference(sd, request(sd, "x", [Control("depth")]))) > 10


@pytest.mark.parametrize("task", ["image-to-image", "inpaint"])
def test_sd_edits_with_controls_are_exact(sd, task):
    image, mask = sample_image(64)
    inputs = [image, mask] if task == "inpaint" else [image]
    rs = [request(sd, "one", [Control("edges", 0.9)], task=task, strength=0.7),
          request(sd, "stack", [Control("edges", 0.5), Control("depth", 0.8)], task=task,
                  strength=0.6, num_inference_steps=5)]
    got = stepped(sd, {0: [(rs[0], frames_of(rs[0], inputs))],
                       1: [(rs[1], frames_of(rs[1], inputs))]})
    for r in rs:
        assert got[r.request_id].error is None, got[r.request_id].error
        expected = reference(sd, r, image=image, mask=mask if task == "inpaint" else None)
        assert max_diff(got[r.request_id].images, expected) <= 2, r.request_id


def test_every_control_model_runs_once_a_step_on_the_rows_that_use_it(sd):
    calls = {name: [] for name in ("edges", "depth")}
    hooks = [sd.controls[name].module.register_forward_hook(
        lambda module, args, out, name=name: calls[name].append(len(args[0])))
        for name in calls]
    try:
        rs = [request(sd, "a", [Control("edges")]), request(sd, "b", [Control("edges"),
                                                                         Control("depth")]),
              request(sd, "c")]
        stepped(sd, {0: [(r, frames_of(r)) for r in rs]})
    finally:
        for hook in hooks:
            hook.remove()
    # Four steps; classifier-free guidance doubles each image's rows.
    assert calls == {"edges": [4] * 4, "depth": [2] * 4}


def test_request_mode_calls_the_familys_controlnet_pipeline(sd):
    rs = [request(sd, "a", [Control("edges", 0.7), Control("depth", 0.4)], n=2, seed=3),
          request(sd, "b", [Control("edges", 0.7), Control("depth", 0.4)], seed=9)]
    items = [WorkItem(r, 0, r.n) for r in rs]
    called = sd.request_runner().execute(Work(0, items), [frames_of(r) for r in rs])
    for o in called:
        assert o.error is None, o.error
        assert max_diff(o.images, reference(sd, o.item.request)) <= 2


def test_pipelines_built_over_a_bfloat16_model_leave_its_modules_as_they_are():
    """The image-to-image, inpainting and ControlNet pipelines share the loaded pipeline's modules
    (diffusers' ``from_pipe`` would cast them all to float32 in place, undoing bfloat16)."""
    import torch

    rt = build_runtime(ServerConfig(model="tiny-sd", dtype="bfloat16", torch_threads=1,
                                    controlnet=("edges=tiny-sd-control",), skip_startup_check=True))
    modules = {"unet": rt.family.denoiser, "vae": rt.loaded.pipe.vae,
               "text_encoder": rt.loaded.pipe.text_encoder, "edges": rt.controls.models["edges"].module}
    control = rt.family.control_pipeline("inpaint", ("edges",))
    assert control.unet is rt.family.denoiser and control.controlnet is modules["edges"]
    assert rt.pipelines["image-to-image"].unet is rt.pipelines["inpaint"].unet is rt.family.denoiser
    assert {name: {p.dtype for p in m.parameters()} for name, m in modules.items()} == dict.fromkeys(
        modules, {torch.bfloat16})


def test_a_control_model_of_another_family_is_refused_naming_it(sd):
    with pytest.raises(ControlModelError, match=r"--controlnet f=tiny-flux-control: a "
                                                r"FluxControlNetModel that is no control model "
                                                r"of this family \(it takes ControlNetModel\)"):
        load_controls({"f": "tiny-flux-control"}, sd.family, "cpu", sd.loaded.pipe.dtype)
    with pytest.raises(ControlModelError, match=r"was made for a UNet whose cross_attention_dim"):
        load_controls({"x": "tiny-sdxl-control"}, sd.family, "cpu", sd.loaded.pipe.dtype)


@pytest.mark.parametrize("model, controls, stack", [
    ("tiny-sdxl", {"edges": "tiny-sdxl-control"}, [Control("edges", 0.8, 0.0, 0.75)]),
    ("tiny-flux", {"edges": "tiny-flux-control", "union": "tiny-flux-control-union"},
     [Control("union", 0.9, mode=2), Control("edges", 0.5)]),
    ("tiny-qwen-image", {"edges": "tiny-qwen-image-control"}, [Control("edges", 0.8, 0.0, 0.75)]),
])
def test_each_family_is_exact_with_and_without_controls(model, controls, stack):
    rt = runtime(model, **controls)
    extra = {"negative_prompt": "blurry"} if model == "tiny-qwen-image" else {}  # true CFG
    rs = [request(rt, "plain", **extra), request(rt, "one", stack[:1], n=2, **extra),
          request(rt, "stack", stack, seed=11, **extra)]
    if rt.controls[stack[0].model].modes:
        rs.append(request(rt, "mode", [Control(stack[0].model, 1.0, mode=0)]))
    got = stepped(rt, {0: [(r, frames_of(r)) for r in rs[:2]],
                       1: [(r, frames_of(r)) for r in rs[2:]]})
    for r in rs:
        assert got[r.request_id].error is None, got[r.request_id].error
        assert max_diff(got[r.request_id].images, reference(rt, r)) <= 2, r.request_id


def test_with_the_step_cache_forwards_with_controls_compute_every_row():
    rt = build_runtime(ServerConfig(model="tiny-sd", device="cpu", torch_threads=1,
                                    controlnet=("edges=tiny-sd-control",), step_cache="first-block",
                                    skip_startup_check=True))
    controlled = request(rt, "controlled", [Control("edges", 0.8)], num_inference_steps=8,
                         cache_threshold=1.0)
    early = request(rt, "early", [Control("edges", 0.8, 0.0, 0.5)], num_inference_steps=8,
                    cache_threshold=1.0)
    plain = request(rt, "plain", num_inference_steps=8)
    got = stepped(rt, {0: [(r, frames_of(r)) for r in (controlled, plain)]})
    assert got["controlled"].cached_steps == [0]  # a control acted at every one of its steps
    for r in (controlled, plain):  # nothing was reused in their forwards: each is exact
        assert max_diff(got[r.request_id].images, reference(rt, r)) <= 2, r.request_id
    assert stepped(rt, {0: [(early, frames_of(early))]})["early"].cached_steps[0] > 0


@pytest.mark.parametrize("model, control", [("tiny-flux", "tiny-flux-control"),
                                            ("tiny-qwen-image", "tiny-qwen-image-control")])
def test_controls_on_rows_of_different_sizes_share_forwards(model, control):
    """Where sizes share a forward, the control model's does too: each row's own positions."""
    rt = runtime(model, edges=control)
    assert rt.describe().mixed_sizes["generate+controls"] == ""
    extra = {"negative_prompt": "blurry"} if model == "tiny-qwen-image" else {}  # true CFG
    sizes = [(64, 64), (96, 64), (48, 48)]
    rs = [ImageRequest(f"r{w}x{h}", rt.info.name, w, h, num_inference_steps=4, seed=i,
                       guidance_scale=rt.info.default_guidance_scale, prompt=f"a cat {i}",
                       controls=(Control("edges", 0.8),) if i != 1 else (), **extra)
          for i, (w, h) in enumerate(sizes)]
    pictures = {}
    for r in rs:
        picture = np.zeros((r.height, r.width, 3), np.uint8)
        picture[r.height // 4:3 * r.height // 4, r.width // 4:3 * r.width // 4] = 255
        pictures[r.request_id] = picture
    engine = rt.step_engine()
    assert not engine.admit([WorkItem(r, 0, 1) for r in rs],
                            [[pictures[r.request_id]] if r.controls else [] for r in rs])
    assert len(engine.running_sets()) == 1
    got = {}
    while engine:
        got.update({o.item.request.request_id: o for o in engine.step().finished})
    for r in rs:
        assert got[r.request_id].error is None, got[r.request_id].error
        controls = [(rt.controls["edges"].module, pictures[r.request_id])] if r.controls else None
        expected = solo(rt.loaded, rt.pipelines, r, controls=controls)
        assert max_diff(got[r.request_id].images, expected) <= 2, r.request_id
