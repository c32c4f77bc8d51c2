"""Which pipeline runs each task: a family's strength tasks are diffusers' auto-pipelines' picks."""

import inspect

from diffserve.executor.families.known import FAMILIES


def test_each_familys_strength_pipelines_are_those_diffusers_auto_pipelines_pick():
    """The classes a family names for image-to-image and inpainting are the ones diffusers'
    auto-pipelines build from its text-to-image pipeline, where they redraw by strength; an
    instruction-editing family names none; a pipeline that inpaints itself (FLUX.1 Fill) is its
    own (the executor names them so that a start does not import every pipeline diffusers
    knows)."""
    import diffusers
    from diffusers.pipelines import auto_pipeline as auto

    kinds = {name: cls.__name__ for name, cls in auto.AUTO_TEXT2IMAGE_PIPELINES_MAPPING.items()}
    for family in FAMILIES:
        for pipeline in family.pipelines:
            picked = {}
            kind = next((k for k, name in kinds.items() if name == pipeline), None)
            for task, mapping in (("image-to-image", auto.AUTO_IMAGE2IMAGE_PIPELINES_MAPPING),
                                  ("inpaint", auto.AUTO_INPAINT_PIPELINES_MAPPING)):
                cls = mapping.get(kind)
                if cls is not None and "strength" in inspect.signature(cls.__call__).parameters:
                    picked[task] = cls.__name__
            own = inspect.signature(getattr(diffusers, pipeline).__call__).parameters
            if kind is None and {"mask_image", "strength"} <= set(own):
                picked["inpaint"] = pipeline  # it inpaints itself (FLUX.1 Fill: it only inpaints)
            expected = {} if family.max_references else picked
            assert family.strength_pipelines == expected, (family.__name__, pipeline)
    assert sum(bool(f.strength_pipelines) for f in FAMILIES) >= 6  # SD, SDXL, SD3, Flux, Qwen, Z
