"""``--attention-backend``: the denoiser's attention kernel, through diffusers' attention
dispatcher (``set_attention_backend``).

Diffusers' transformer processors (FLUX, Qwen-Image, Wan, Z-Image, Chroma...) call the dispatcher,
which runs the backend a model is set to; without a choice it runs torch's
``scaled_dot_product_attention`` and lets torch pick a kernel (``native``). The other names force
one kernel: torch's own (``math``, ``torch-flash``, ``efficient``, ``cudnn``) or a package's
(``flash``, ``flash3``, ``sage``, ``xformers``). UNets' processors (SD, SDXL) do not go through
the dispatcher: only ``native`` serves them.

A named backend that cannot run here (its package missing, no GPU, a GPU too old for it, a dtype
it does not take) stops the start with the flag and the reason. ``auto`` times every exact
candidate that can run here (``sage`` quantizes q and k, ``flex`` is unfused outside
torch.compile: neither is a candidate) on the model's own shapes, a native-size step each, and
keeps the fastest whose denoiser output stays within :data:`MATCH` of native's; the start-up check
then judges the chosen kernel like any other.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

from diffserve.config.flags import ConfigError

log = logging.getLogger(__name__)

# The flag's names -> diffusers' dispatcher names.
BACKENDS = {"native": "native", "math": "_native_math", "torch-flash": "_native_flash",
            "efficient": "_native_efficient", "cudnn": "_native_cudnn", "flash": "flash",
            "flash3": "_flash_3", "sage": "sage", "xformers": "xformers", "flex": "flex"}
# What each needs beyond what torch has everywhere: a CUDA device of at least this compute
# capability, and half-precision inputs.
NEEDS = {"efficient": ((5, 0), False), "cudnn": ((8, 0), False), "flash": ((8, 0), True),
         "flash3": ((9, 0), True), "sage": ((8, 0), True), "xformers": ((5, 0), False)}
HALF_ONLY_ON_CUDA = {"torch-flash"}  # torch's flash kernel takes float32 on the CPU only
AUTO = ("native", "cudnn", "torch-flash", "efficient", "flash3", "flash", "xformers", "math")
# Relative distance (L2) of a candidate's denoiser output from native's that auto accepts: a
# kernel's own rounding, by dtype (bfloat16 has 8 bits of mantissa); in float32 that is ~1e-6,
# but activations quantized per row (int8-dynamic) turn it into ~2e-4. A wrong kernel is O(1).
MATCH = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 2e-2}
TIMED_STEPS = 3  # per candidate, after one untimed
PROMPTS = ("a timing of attention", "a longer prompt, for a timing of attention kernels on this "
           "model's own shapes, with a mask where the family pads its prompts")


@dataclass
class AttentionChoice:
    backend: str = "native"
    step_ms: dict[str, float] = field(default_factory=dict)  # auto: each candidate's step
    refused: dict[str, str] = field(default_factory=dict)  # auto: candidates left out, with why

    def describe(self) -> dict:
        return {"backend": self.backend, "step_ms": self.step_ms, "left_out": self.refused}


def unavailable(name: str, device: str, dtype: str) -> str | None:
    """Why backend ``name`` cannot run on ``device`` in ``dtype``, or None."""
    from diffusers.models.attention_dispatch import (AttentionBackendName,
                                                     _check_attention_backend_requirements)

    from diffserve.device import of

    cuda = str(device).startswith("cuda")
    if name in NEEDS:
        capability, half = NEEDS[name]
        if not cuda:
            return f"it needs a CUDA GPU; this executor runs on {device}"
        card = of(device)
        have = card.capability(device)
        if have < capability:
            return (f"it needs compute capability {capability[0]}.{capability[1]} or later; "
                    f"{card.name(device)} has "
                    f"{have[0]}.{have[1]}")
        if half and dtype == "float32":
            return "it takes float16 or bfloat16 only; the model is served in float32"
    if name in HALF_ONLY_ON_CUDA and cuda and dtype == "float32":
        return "on CUDA it takes float16 or bfloat16 only; the model is served in float32"
    try:
        _check_attention_backend_requirements(AttentionBackendName(BACKENDS[name]))
    except RuntimeError as error:  # a package missing or too old: diffusers says which
        return str(error)
    return None


def dispatching(modules) -> list:
    """Those of ``modules`` whose attention goes through diffusers' dispatcher."""
    return [m for m in modules if any(hasattr(getattr(sub, "processor", None), "_attention_backend")
                                      for sub in m.modules())]


def apply(modules, name: str) -> None:
    """Every one of ``modules`` (denoisers, control models) on backend ``name``."""
    from diffusers.utils import logging as diffusers_logging

    model_log = diffusers_logging.get_logger("diffusers.models.modeling_utils")
    level = model_log.level
    model_log.setLevel(logging.ERROR)  # "an experimental feature": once per model, every start
    try:
        for module in modules:
            module.set_attention_backend(BACKENDS[name])
    finally:
        model_log.setLevel(level)
    # diffusers also makes it the process's default for every processor that names none (a
    # later model's, a control model loaded after): each served module names its own, and the
    # default stays native.
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def served_modules(rt) -> list:
    """``rt``'s denoisers and control models whose attention goes through the dispatcher."""
    controls = rt.controls.models.values() if rt.controls else ()
    return dispatching([*(rt.family.denoisers if rt.family else _denoisers(rt)),
                        *(m.module for m in controls)])


@contextmanager
def native_for(rt):
    """``rt``'s modules on the native kernel for the block, the chosen one again after: for the
    start-up check's float32 reference, which the half-only kernels (cuDNN, torch-flash, flash,
    flash3) refuse; native lets torch pick one that takes float32."""
    chosen = (getattr(rt, "speed", None) or {}).get("attention", {}).get("backend", "native")
    modules = served_modules(rt) if chosen != "native" else []
    if modules:
        apply(modules, "native")
    try:
        yield
    finally:
        if modules:
            apply(modules, chosen)


def choose(rt, requested: str) -> AttentionChoice:
    """Set ``rt``'s denoisers (and control models) on ``requested`` (``auto``: the fastest that
    matches native's output, timed here); raises naming the flag where it cannot run."""
    modules = served_modules(rt)
    device, dtype = rt.loaded.device, rt.loaded.dtype
    if requested not in ("auto", "native"):
        why = unavailable(requested, device, dtype)
        if why is None and not modules:
            why = (f"{type(_denoisers(rt)[0]).__name__}'s attention does not go through "
                   "diffusers' attention dispatcher (only native serves it)")
        if why is not None:
            raise ConfigError(f"--attention-backend {requested}: {why}")
    if requested != "auto" or not modules or rt.family is None:
        name = "native" if requested == "auto" else requested
        if modules:
            apply(modules, name)
        if name != "native" and rt.family is not None:
            try:  # a kernel may refuse what serving sends it (a mask, a head size): find out now
                _timed_step(rt, timed=0)
            except Exception as error:  # noqa: BLE001 - said at start, naming the flag
                apply(modules, "native")  # the model as it was (a process may load it again)
                raise ConfigError(f"--attention-backend {name}: a step of two requests with "
                                  f"prompts of different lengths failed: "
                                  f"{type(error).__name__}: {error}") from None
        return AttentionChoice(name)
    choice = AttentionChoice()
    runnable = []
    for name in AUTO:
        why = unavailable(name, device, dtype)
        if why is None:
            runnable.append(name)
        else:
            choice.refused[name] = why
    reference = None
    for name in runnable:
        apply(modules, name)
        try:
            ms, output = _timed_step(rt)
        except Exception as error:  # noqa: BLE001 - a kernel that refuses these shapes
            choice.refused[name] = f"{type(error).__name__}: {error}"[:200]
            continue
        if reference is None:
            reference = output  # native's, the first candidate
        elif _distance(output, reference) > MATCH.get(dtype, 2e-2):
            choice.refused[name] = (f"its output is {_distance(output, reference):.2e} from "
                                    "native's (relative)")
            continue
        choice.step_ms[name] = ms
    choice.backend = min(choice.step_ms, key=choice.step_ms.get, default="native")
    if rt.group is not None:  # every rank's forwards must meet in the same kernels' collectives
        choice.backend = rt.group.broadcast(choice.backend)
    apply(modules, choice.backend)
    log.info("--attention-backend auto: %s (a native-size step, ms: %s)", choice.backend,
             ", ".join(f"{n} {ms:.1f}" for n, ms in choice.step_ms.items()))
    return choice


def _denoisers(rt) -> list:
    from diffserve.executor.pipeline import denoisers

    return list(denoisers(rt.loaded.pipe).values())


def _timed_step(rt, timed: int = TIMED_STEPS) -> tuple[float, object]:
    """(median ms of ``timed`` native-size steps of two images after one untimed, nan when
    ``timed`` is 0; the first step's denoiser output). The two prompts differ in length: a
    family that pads its prompts masks the padding, which some kernels refuse (torch's flash
    kernel takes no mask), as serving would find out."""

    from diffserve.device.stats import synced_clock
    from diffserve.wire.request import ImageRequest, WorkItem

    info, outputs = rt.info, []
    denoiser = rt.family.denoisers[0]
    hook = denoiser.register_forward_hook(
        lambda module, args, out: outputs.append((out[0] if isinstance(out, tuple) else
                                                  getattr(out, "sample", out)).detach().float().cpu()))
    requests = [ImageRequest(f"attention-timing-{i}", info.name, info.width, info.height,
                             num_inference_steps=timed + 2, prompt=prompt,
                             guidance_scale=info.default_guidance_scale, seed=i,
                             num_frames=info.num_frames)
                for i, prompt in enumerate(PROMPTS)]
    engine, times = rt.step_engine(), []
    try:
        failed = [o.error for o in engine.admit([WorkItem(r, 0, 1) for r in requests], [[], []])]
        for i in range(timed + 1):  # the first untimed: the first call of a kernel
            start = synced_clock(rt.loaded.device)
            out = engine.step()
            times += [synced_clock(rt.loaded.device) - start] if i else []
            failed += [o.error for o in out.finished if o.error]
            if failed:  # the engine answers a failed forward's requests: raise it here
                raise RuntimeError(failed[0])
    finally:
        hook.remove()
        engine.abandon("timed")
        engine.close()
    return (1e3 * sorted(times)[len(times) // 2] if times else float("nan")), outputs[0]


def _distance(a, b) -> float:
    import torch

    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12))
