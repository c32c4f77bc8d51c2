"""Which device an executor runs on. ``auto`` and a bare ``cuda`` spread executors over the
visible GPUs (executor i on GPU i modulo their count); ``auto`` takes the CPU where there is none.
Every CUDA executor makes its GPU the current one, so that whatever allocates on "the" GPU
without naming one (a library's workspace, an event) uses its own.

Torch-free at import: the frontend and scheduler count GPUs with :func:`visible_gpus`.
"""

from __future__ import annotations


def visible_gpus() -> int:
    """The NVIDIA GPUs this process may use, counted without importing torch:
    ``CUDA_VISIBLE_DEVICES`` where set, else the driver's list of GPUs."""
    import os
    from pathlib import Path

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip() and d.strip() != "-1"])
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else 0


def gpu_count() -> int:
    """The GPUs torch sees in this process."""
    from diffserve.device import of

    return of("cuda").count()


def pick_device(requested: str, index: int = 0, gpus: int | None = None) -> str:
    """Executor ``index``'s device: ``auto`` and ``cuda`` spread executors over the ``gpus``
    visible GPUs (default: counted here); ``auto`` is the CPU without one."""
    if requested not in ("auto", "cuda"):
        return requested
    gpus = gpu_count() if gpus is None else gpus
    if gpus:
        return f"cuda:{index % gpus}"
    if requested == "cuda":
        raise ValueError("--device cuda: no CUDA GPU is visible to this process")
    return "cpu"


def use_device(device: str) -> None:
    """Make ``device`` the process's current device of its kind (nothing to do on the CPU)."""
    from diffserve.device import of

    of(device).set_current(device)
