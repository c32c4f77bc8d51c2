"""How an engine's executors are laid out: their number, each one's device or its parallel group's
devices (one per rank), and the threads each process gets. Torch-free: the frontend and the
scheduler decide this before any executor starts, from the configuration alone."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.device.choice import visible_gpus


@dataclass(frozen=True)
class Degrees:
    """A parallel group's shape (every degree 1: one process, no group)."""

    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    tp: int = 1

    @classmethod
    def of(cls, config) -> "Degrees":
        return cls(config.ulysses_degree, config.ring_degree, config.cfg_parallel_size,
                   config.tensor_parallel_size)

    @property
    def model_ranks(self) -> int:
        """Ranks one copy of the model is spread over (one CFG branch)."""
        return self.tp if self.tp > 1 else self.ulysses * self.ring

    @property
    def size(self) -> int:
        """Ranks per executor: 1, or a parallel group's size."""
        return self.cfg * self.model_ranks

    @property
    def context(self) -> bool:
        return self.ulysses * self.ring > 1

    def describe(self, groups: int) -> dict[str, int]:
        return {"ulysses": self.ulysses, "ring": self.ring, "cfg": self.cfg, "tp": self.tp,
                "groups": groups}


def device_list(config) -> list[str]:
    """--devices, split."""
    return [d.strip() for d in config.devices.split(",")] if config.devices else []


def num_executors(config) -> int:
    """Executors fed by the queue: single devices, or parallel groups."""
    size = config.degrees.size
    if config.data_parallel_size:
        return config.data_parallel_size
    if config.devices:
        return len(device_list(config)) // size
    if size > 1 and config.device in ("auto", "cuda"):
        return max(1, visible_gpus() // size)
    return 1


def executor_devices(config) -> list[str]:
    """Each executor's device (``auto`` is resolved by each executor from its index), or a group's
    devices, comma-separated, one per rank."""
    size = config.degrees.size
    listed = device_list(config)
    if not listed:
        if size == 1:
            return [config.device] * num_executors(config)
        listed = group_devices(config.device, num_executors(config) * size)
    return [",".join(listed[g * size:(g + 1) * size]) for g in range(len(listed) // size)]


def executor_threads(config, cpu_count: int) -> int:
    """Intra-op threads per executor process (each rank of a group is one): the flag, else the
    cores shared out between them (0 keeps torch's own default where there is one)."""
    processes = num_executors(config) * config.degrees.size
    if config.torch_threads or processes == 1:
        return config.torch_threads
    return max(1, cpu_count // processes)


class TopologyError(ValueError):
    """Devices that cannot hold the groups asked for."""


def group_devices(device: str, count: int) -> list[str]:
    """``count`` ranks' devices from --device: one visible GPU each (``auto``, ``cuda``), else
    ``device`` for all of them (the CPU)."""
    if device in ("auto", "cuda"):
        gpus = visible_gpus()
        if gpus:
            if gpus < count:
                raise TopologyError(f"{count} ranks need {count} GPUs; {gpus} are visible")
            return [f"cuda:{i}" for i in range(count)]
        if device == "cuda":
            raise TopologyError("--device cuda: no CUDA GPU is visible")
        return ["cpu"] * count
    return [device] * count
