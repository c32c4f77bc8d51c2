"""The executor: loads a model once and runs it, in request mode (one batched pipeline call per
batch) or in the step engine (requests join and leave a running batch between denoising steps).

The house is a set of rooms, one per concern, each a package whose docstring says what it owns.
The modules at the top are the process around them (``entry``: the entry functions of an
executor and of a parallel group's other ranks; ``loops``: the loops of the two modes;
``sockets``: the sockets; ``runtime``: a model built ready to serve) and four small facts every
room may use (``results``: what an engine hands back; ``rows``: rows of a batched forward;
``tensors``: tensors inside values, their bytes, moving them; ``pipeline``: the denoiser
component names, a pipeline's modules, a model directory's index).

Imports flow one way, down :data:`LAYERS`: a module imports only modules of its own layer or of
the layers before it (``tests/test_imports.py`` holds the package to it). Below them all is the
device layer, :mod:`diffserve.device`: every room asks it, never ``torch``'s CUDA module.
"""

# Lowest first. Within a layer, modules may import each other (never in a circle).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("results", "rows", "tensors", "pipeline"),
    ("model",),      # loading a pipeline, its device and dtype, what it serves, its samplers
    ("memory",),     # out of memory, placement and offloading, the budget, parking a request
    ("families",),   # what each pipeline family gives the step engine
    ("lora",),       # adapters served and applied per row
    ("control",),    # ControlNet models served and applied per row
    ("accel",),      # the step cache and compiled blocks
    ("parallel",),   # parallel groups: topology, the model spread over ranks, ranks in step
    ("step",),       # the step engine
    ("request",),    # request mode
    ("checks",),     # the start-up checks and their verdicts
    ("rl",),         # weight updates and sleep
    ("sockets", "loops", "runtime", "entry"),
)
