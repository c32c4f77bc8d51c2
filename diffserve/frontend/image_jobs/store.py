"""The image jobs' table: ``image_jobs`` in a ``jobs.db`` SQLite file (write-ahead log), the same
kind of store the video jobs keep (:mod:`diffserve.frontend.videos.store`), in the image
directory. A job's row holds what it takes to run it again (its route and its body, input images
as data URLs), so that a job a server left queued or running is resumed by the next server on the
same directory."""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = (
    "queued", "in_progress", "completed", "failed", "cancelled")
FINISHED = (COMPLETED, FAILED, CANCELLED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS image_jobs (
    id TEXT PRIMARY KEY,  -- sorts by creation time
    route TEXT NOT NULL,  -- generations or edits
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    body TEXT NOT NULL,  -- JSON: the request as a JSON body, to run it again after a restart
    key_priority INTEGER,  -- the priority class of the API key it came with
    result TEXT,  -- JSON: the images answer, once completed
    error TEXT  -- JSON: the OpenAI error body's error, once failed
)
"""
_COLUMNS = ("id", "route", "status", "created_at", "completed_at", "expires_at", "body",
            "key_priority", "result", "error")


@dataclass
class ImageJob:
    id: str
    route: str
    status: str
    created_at: int
    body: dict[str, Any]
    key_priority: int | None = None
    completed_at: int | None = None
    expires_at: int | None = None
    result: dict | None = None
    error: dict | None = None

    def view(self) -> dict:
        """The job as ``GET /v1/images/jobs/{id}`` answers it."""
        return {"id": self.id, "object": "image.job", "route": self.route, "status": self.status,
                "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "result": self.result, "error": self.error}


def _job(row) -> ImageJob:
    values = dict(zip(_COLUMNS, row))
    for name in ("body", "result", "error"):
        values[name] = None if values[name] is None else json.loads(values[name])
    return ImageJob(**values)


class ImageJobStore:
    def __init__(self, directory: Path | str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(Path(directory) / "jobs.db", isolation_level=None,
                                  check_same_thread=False)
        self.lock = threading.Lock()
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(_SCHEMA)

    def insert(self, job: ImageJob) -> None:
        with self.lock:
            self.db.execute(
                f"INSERT INTO image_jobs ({', '.join(_COLUMNS)}) VALUES "
                f"({', '.join('?' * len(_COLUMNS))})",
                (job.id, job.route, job.status, job.created_at, job.completed_at, job.expires_at,
                 json.dumps(job.body), job.key_priority, None, None))

    def update(self, job_id: str, **values: Any) -> None:
        values = {k: json.dumps(v) if k in ("result", "error") and v is not None else v
                  for k, v in values.items()}
        with self.lock:
            self.db.execute(f"UPDATE image_jobs SET {', '.join(f'{k}=?' for k in values)} "
                            "WHERE id=?", (*values.values(), job_id))

    def get(self, job_id: str) -> ImageJob | None:
        with self.lock:
            row = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM image_jobs WHERE id=?",
                                  (job_id,)).fetchone()
        return _job(row) if row else None

    def unfinished(self) -> list[ImageJob]:
        """Jobs queued or running, oldest first: what a restart resumes."""
        with self.lock:
            rows = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM image_jobs WHERE status "
                                   "IN (?, ?) ORDER BY id", (QUEUED, IN_PROGRESS)).fetchall()
        return [_job(row) for row in rows]

    def delete_expired(self, now: int) -> None:
        with self.lock:
            self.db.execute("DELETE FROM image_jobs WHERE expires_at IS NOT NULL AND "
                            "expires_at <= ?", (now,))
