"""The video jobs' table (SQLite, write-ahead log) and the directory of their files.

One store belongs to one frontend at a time: it holds an exclusive lock on ``owner.lock`` for
its life (the OS drops it when the process dies), so a second server on the same directory is
refused rather than corrupting jobs. Opening a store fails every job that was queued or running
when its last owner stopped (``server_restarted``): a job is never lost, and never stays
``in_progress`` with nothing running it.
"""

from __future__ import annotations

import fcntl
import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
RESTARTED = "server_restarted"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,  -- sorts by creation time: the list's order and its cursors
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    seconds TEXT NOT NULL,
    size TEXT NOT NULL,
    params TEXT NOT NULL,  -- JSON: what else the job was asked (seed, frames, fps, steps...)
    error_code TEXT,
    error_message TEXT
)
"""


class StoreBusy(RuntimeError):
    """Another live server holds this video directory."""


@dataclass
class VideoJob:
    id: str
    status: str
    progress: int
    created_at: int
    model: str
    prompt: str
    seconds: str
    size: str
    params: dict[str, Any] = field(default_factory=dict)
    completed_at: int | None = None
    expires_at: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    seq: int = 0

    @property
    def finished(self) -> bool:
        return self.status in (COMPLETED, FAILED)


_COLUMNS = ("seq", "id", "status", "progress", "created_at", "completed_at", "expires_at", "model",
            "prompt", "seconds", "size", "params", "error_code", "error_message")


def _job(row) -> VideoJob:
    values = dict(zip(_COLUMNS, row))
    values["params"] = json.loads(values["params"])
    return VideoJob(**values)


class VideoStore:
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.files = self.directory / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.directory / "owner.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise StoreBusy(f"another server is using the video directory {self.directory}") from None
        self.db = sqlite3.connect(self.directory / "jobs.db", isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(_SCHEMA)
        self.interrupted = self._fail_interrupted()

    def _fail_interrupted(self) -> list[str]:
        """Jobs its last owner left queued or running: failed, their partial files removed."""
        ids = [row[0] for row in self.db.execute(
            "SELECT id FROM jobs WHERE status IN (?, ?)", (QUEUED, IN_PROGRESS))]
        now = int(time.time())
        self.db.execute(
            "UPDATE jobs SET status=?, completed_at=?, error_code=?, error_message=? WHERE status IN "
            "(?, ?)", (FAILED, now, RESTARTED, "The server stopped before this job finished; "
                       "create it again.", QUEUED, IN_PROGRESS))
        for job_id in ids:
            for partial in self.files.glob(f"{job_id}.*.part"):
                partial.unlink(missing_ok=True)
        return ids

    def stem(self, job_id: str) -> Path:
        return self.files / job_id

    def insert(self, job: VideoJob) -> VideoJob:
        cursor = self.db.execute(
            f"INSERT INTO jobs ({', '.join(_COLUMNS[1:])}) VALUES ({', '.join('?' * 13)})",
            (job.id, job.status, job.progress, job.created_at, job.completed_at, job.expires_at,
             job.model, job.prompt, job.seconds, job.size, json.dumps(job.params),
             job.error_code, job.error_message))
        job.seq = cursor.lastrowid
        return job

    def update(self, job_id: str, **values: Any) -> None:
        names = ", ".join(f"{name}=?" for name in values)
        self.db.execute(f"UPDATE jobs SET {names} WHERE id=?", (*values.values(), job_id))

    def get(self, job_id: str) -> VideoJob | None:
        row = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id=?",
                              (job_id,)).fetchone()
        return _job(row) if row else None

    def page(self, after: str | None, limit: int, descending: bool) -> tuple[list[VideoJob], bool]:
        """Up to ``limit`` jobs after the id ``after`` (ids sort by creation time: a cursor
        needs no row here, so pages merge across stores), newest first when ``descending``,
        and whether more follow."""
        where, args = "", []
        if after is not None:
            where, args = f"WHERE id {'<' if descending else '>'} ?", [after]
        rows = self.db.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM jobs {where} ORDER BY id "
            f"{'DESC' if descending else 'ASC'} LIMIT ?", (*args, limit + 1)).fetchall()
        return [_job(row) for row in rows[:limit]], len(rows) > limit

    def delete(self, job_id: str) -> None:
        self.db.execute("DELETE FROM jobs WHERE id=?", (job_id,))

    def expired(self, now: int) -> list[str]:
        return [row[0] for row in self.db.execute(
            "SELECT id FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))]

    def counts(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())

    def close(self) -> None:
        self.db.close()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()

