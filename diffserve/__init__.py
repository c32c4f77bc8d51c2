"""diffserve: an async diffusion inference server with a dynamic-batching scheduler.

The package is layered; a module imports only modules of its own layer or of the layers before it,
at any depth (``tests/test_imports.py`` holds it to :data:`LAYERS`; the executor layers its own
rooms the same way, ``diffserve.executor.LAYERS``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("diffserve")  # the one version: the package's own metadata
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# Lowest first: the top-level packages and modules of ``diffserve``.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "policies", "wire", "ports"),  # the vocabulary every process shares, torch-free
    ("device",),                # the device layer: CUDA, the CPU, a fake for tests
    ("builders",),              # building model directories offline (tiny, random, packaged)
    ("config",),                # the flags, declared once, and the executors' layout
    ("metrics", "processes"),   # what the processes count, and how they start and stop
    ("executor",),              # loading a model and running it
    ("scheduler",),             # the queue and the batches (it starts the executors)
    ("frontend",),              # HTTP: validation, the routes, the scheduler's client
    ("serving",),               # ``diffserve serve``'s processes, and the launcher
    ("calibrate", "cli", "client", "ray", "__main__"),  # commands and entry points
)
