"""The Videos API of a frontend whose model makes videos: its store (``--video-dir``, or a
temporary directory removed at exit), its jobs and its routes."""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile

from diffserve.frontend.serving import Serving
from diffserve.frontend.videos.jobs import VideoJobs
from diffserve.frontend.videos.routes import video_routes
from diffserve.frontend.videos.store import VideoStore
from diffserve.metrics import FrontendMetrics

log = logging.getLogger("diffserve")


def video_api(serving: Serving, counts: FrontendMetrics, peers=None):
    """(the router, the jobs) for ``serving``'s engine; ``peers``: the other replicas, past
    one server (:mod:`diffserve.frontend.videos.peers`)."""
    config = serving.config
    directory = config.video_dir
    if not directory:
        directory = tempfile.mkdtemp(prefix="diffserve-videos-")
        atexit.register(shutil.rmtree, directory, True)
        log.warning("video jobs are kept in %s until the server stops: set --video-dir to keep "
                    "them across restarts", directory)
    store = VideoStore(directory)
    if store.interrupted:
        log.warning("%d video jobs were queued or running when the server last stopped: they "
                    "are failed (server_restarted)", len(store.interrupted))
    jobs = VideoJobs(store, serving.scheduler, counts.video, config.video_ttl_s,
                     config.max_video_jobs)
    return video_routes(serving, jobs, peers), jobs
