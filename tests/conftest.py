import gc
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# The tests' helpers, and the repository's tools (the shapes model's dataset and evaluation).
sys.path.insert(0, str(TESTS))
sys.path.insert(1, str(TESTS.parent))

# Embedded models are built once per test session into a private cache, never the user's.
os.environ.setdefault("DIFFSERVE_CACHE_DIR", str(TESTS.parent / ".cache"))
# One intra-op thread for torch in this process and the ones it starts (set before torch is
# imported): the servers, the references and the tools share a few cores, and OpenMP threads
# that outnumber the free cores slow every one of them down many times over.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# -- servers launched ahead (tests/server.py, Launches) ------------------------------------------

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "server(*args, **kwargs): the test's own `diffserve serve`, taken with the "
        "own_server fixture and launched ahead of the test (tests/server.py, Launches)")
    config.addinivalue_line(
        "markers", "early(*names): the test takes these background runs' results "
        "(tests/background.py), which start when collection finishes")


def pytest_collection_finish(session):
    import background
    import workers
    from server import LAUNCHES

    mine = workers.mine(session.items)  # under xdist, this worker's share (tests/workers.py)
    background.start(mine)
    LAUNCHES.make_plan(mine)
    # What collection imported (torch, diffusers, the test modules) lives to the end: out of the
    # collector's full passes, which otherwise walk it again and again (about 20 s a session).
    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    import workers

    return workers.scheduler(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    from server import LAUNCHES

    LAUNCHES.top_up(item.nodeid)


def pytest_sessionfinish(session):
    import background
    from server import LAUNCHES, STOPPING

    background.close()
    LAUNCHES.close()
    failures = STOPPING.check()
    if failures:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for failure in failures:
            if reporter is not None:
                reporter.write_line(f"SERVER FAILED TO STOP: {failure}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def own_server(request):
    """The server ``@pytest.mark.server(...)`` declares for this test: launched (maybe not yet
    ready; ``start()`` or ``with`` waits), stopped after the test if it still runs."""
    from server import LAUNCHES, STOPPING

    srv = LAUNCHES.take_own(request.node)
    yield srv
    if srv.proc.poll() is None:
        STOPPING.stop(srv)


@pytest.fixture(scope="session")
def sd3_four_channels():
    """SD3's architecture with 4-channel latents: every task runs but inpainting, which diffusers'
    SD3 inpainting pipeline refuses ("should have 16 input channels or 33 input channels").
    Built once per session beside the embedded models."""
    from diffserve.executor.families.sd3 import tiny as sd3

    return _session_model("sd3-four-channels", lambda d: sd3.build(d, latent_channels=4))


@pytest.fixture(scope="session")
def nan_sd():
    """The tiny SD whose text encoder embeds '!' as NaN: every image of a prompt with a '!' comes
    out NaN (as a half-precision model's that overflows), every other image is finite."""
    return _session_model("sd-nan-bang", _build_nan_sd)


def _build_nan_sd(directory):
    import shutil

    import torch
    from diffusers import DiffusionPipeline

    from diffserve.builders.registry import resolve_model
    from diffserve.builders.common import SERVING_DEFAULTS_FILE

    source = resolve_model("tiny-sd")
    pipe = DiffusionPipeline.from_pretrained(source)
    vocab = pipe.tokenizer.get_vocab()
    with torch.no_grad():
        pipe.text_encoder.get_input_embeddings().weight[[vocab["!"], vocab["!</w>"]]] = float("nan")
    pipe.save_pretrained(directory)
    shutil.copy(os.path.join(source, SERVING_DEFAULTS_FILE), directory)


def _session_model(name: str, build):
    """A test model built once (its directory beside the embedded models), ``build(directory)``."""
    from diffserve.builders.embedded import cache_root

    directory = cache_root() / "test-models" / name
    if not (directory / "model_index.json").exists():
        staging = directory.with_name(f"{directory.name}.{os.getpid()}")
        build(staging)
        try:
            staging.rename(directory)
        except OSError:  # the other worker built it meanwhile
            import shutil

            shutil.rmtree(staging)
    return directory
