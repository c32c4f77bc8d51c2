"""What a request asks the engine to do, declared once.

A task says which diffusers pipeline runs it (the loaded one, or one built from its components by
a diffusers auto-pipeline), which input images travel with it (raw pixel frames after the
request's header, in this order), and how its denoising starts. Validation, loading, both engines
and the families read this table; a new task is an entry here plus what its family does
differently, never a chain of ``if task == ...`` across the code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Input:
    """An input image: the pipeline keyword it is passed as, its pixel channels (a frame is
    uint8, height x width x channels; a single channel is sent as height x width), and the API
    field it is uploaded in."""

    name: str
    channels: int
    param: str

    def shape(self, width: int, height: int) -> tuple[int, ...]:
        return (height, width, self.channels) if self.channels > 1 else (height, width)


IMAGE = Input("image", 3, "image")
FIRST_FRAME = Input("image", 3, "input_reference")  # image-to-video: the video's first frame
MASK = Input("mask_image", 1, "mask")
REFERENCE = Input("references", 3, "image")  # each of an instruction edit's images


@dataclass(frozen=True)
class Task:
    name: str
    inputs: tuple[Input, ...] = ()
    # The diffusers auto-pipeline that builds this task's pipeline from the loaded one's components
    # (no second copy of the weights); None: the loaded pipeline itself.
    auto_pipeline: str | None = None
    description: str = ""
    # Sampled as a stochastic process whose trajectory and per-step log-probabilities are
    # returned (reinforcement learning); only for families with a flow-matching scheduler.
    trajectory: bool = False
    # Conditioned on reference images (an instruction edit): its input images are references,
    # as many as the request carries (ImageRequest.references), after its fixed inputs. Their
    # tokens travel per row beside the generated ones; denoising starts from noise.
    references: bool = False
    needs: str = "a pipeline for it in diffusers"  # what a model lacks when it cannot do the task
    # Makes a video whose first frame is its input image; the pipeline takes one such image for
    # the whole call, so request mode calls it one request at a time.
    first_frame: bool = False

    @property
    def from_image(self) -> bool:
        """Denoising starts from the input image noised to ``strength``, not from pure noise."""
        return IMAGE in self.inputs

    @property
    def masked(self) -> bool:
        """Outside the mask, every step puts the input image back at the current noise level."""
        return MASK in self.inputs


GENERATE = Task("generate", description="text to image")
IMAGE_TO_IMAGE = Task("image-to-image", (IMAGE,), "AutoPipelineForImage2Image",
                      "an input image redrawn to the prompt")
INPAINT = Task("inpaint", (IMAGE, MASK), "AutoPipelineForInpainting",
               "the masked part of an input image redrawn to the prompt")

EDIT = Task("edit", description="the input images edited as the prompt instructs (the model "
            "conditions on them as references)", references=True,
            needs="a model whose pipeline conditions on reference images (FLUX.1 Kontext, "
            "Qwen-Image-Edit, FLUX.2)")

ROLLOUT = Task("rollout", description="a sampled denoising trajectory with per-step "
               "log-probabilities", trajectory=True,
               needs="a flow-matching model the step engine knows (SD3, Flux, Qwen-Image) with "
               "its flow-matching Euler scheduler")

IMAGE_TO_VIDEO = Task("image-to-video", (FIRST_FRAME,), description="a video that starts from "
                      "the input image", needs="an image-to-video pipeline (e.g. Wan "
                      "image-to-video)", first_frame=True)

TASKS: dict[str, Task] = {task.name: task for task in (GENERATE, IMAGE_TO_IMAGE, INPAINT, EDIT,
                                                       ROLLOUT, IMAGE_TO_VIDEO)}


def task_named(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}") from None
