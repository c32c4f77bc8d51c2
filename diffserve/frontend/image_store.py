"""Where ``response_format: "url"`` images are kept until their URL expires: a local directory by
default, or an object store through fsspec where the operator names one (``--image-dir
s3://bucket/prefix``) and fsspec is installed (it is not a dependency). Each image is one object,
named by its id and format; past ``--max-image-store-bytes`` the oldest go first, and an image
older than ``--image-ttl-s`` is gone (404). Calls block: the frontend makes them off the loop."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


class LocalFiles:
    """The few calls of an fsspec filesystem the store makes, on a local directory."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def pipe(self, name: str, data: bytes) -> None:
        part = self.root / f".{name}.part"
        part.write_bytes(data)
        os.replace(part, self.root / name)  # a reader never sees half an image

    def cat(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def rm(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def listing(self) -> list[tuple[str, int, float]]:
        """(name, bytes, modified) of every image kept."""
        found = []
        for path in self.root.iterdir():
            if not path.name.startswith(".") and path.is_file():
                stat = path.stat()
                found.append((path.name, stat.st_size, stat.st_mtime))
        return found


class RemoteFiles:
    """An fsspec filesystem under a prefix (``s3://bucket/prefix``)."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError:
            raise RuntimeError(f"--image-dir {url!r} is an object store URL, which needs fsspec "
                               "(pip install fsspec and the store's driver, e.g. s3fs)") from None
        self.fs, self.prefix = fsspec.core.url_to_fs(url)

    def _path(self, name: str) -> str:
        return f"{self.prefix.rstrip('/')}/{name}"

    def pipe(self, name: str, data: bytes) -> None:
        self.fs.pipe(self._path(name), data)

    def cat(self, name: str) -> bytes:
        return self.fs.cat(self._path(name))

    def rm(self, name: str) -> None:
        try:
            self.fs.rm(self._path(name))
        except FileNotFoundError:
            pass

    def listing(self) -> list[tuple[str, int, float]]:
        try:
            entries = self.fs.ls(self.prefix, detail=True)
        except FileNotFoundError:
            return []
        return [(e["name"].rsplit("/", 1)[-1], int(e.get("size") or 0), time.time())
                for e in entries if e.get("type") == "file"]


class ImageStore:
    def __init__(self, where: str, ttl_s: float, max_bytes: int, clock=time.time) -> None:
        root = where or self._temporary()
        remote = "://" in root
        self.files = RemoteFiles(root) if remote else LocalFiles(os.path.join(root, "urls"))
        # Where the image jobs' table lives: a local directory (a temporary one beside an
        # object store).
        self.local_dir = self._temporary() if remote else root
        self.ttl_s, self.max_bytes, self.clock = ttl_s, max_bytes, clock
        self.lock = threading.Lock()
        # name -> (bytes, made at), oldest first: what a restart finds is kept until it expires.
        self.kept: OrderedDict[str, tuple[int, float]] = OrderedDict(
            (name, (size, made)) for name, size, made in
            sorted(self.files.listing(), key=lambda entry: entry[2]))
        self.bytes = sum(size for size, _ in self.kept.values())

    @staticmethod
    def _temporary() -> str:
        root = tempfile.mkdtemp(prefix="diffserve-images-")
        atexit.register(shutil.rmtree, root, True)
        return root

    def put(self, data: bytes, fmt: str) -> str:
        """Keep an image; its id."""
        image_id = f"img_{secrets.token_hex(16)}"
        name = f"{image_id}.{fmt}"
        self.files.pipe(name, data)
        with self.lock:
            self.kept[name] = (len(data), self.clock())
            self.bytes += len(data)
            gone = self._over()
        for old in gone:
            self.files.rm(old)
        return image_id

    def _over(self) -> list[str]:
        """The names to drop: expired, then the oldest while over the cap (lock held)."""
        gone, now = [], self.clock()
        while self.kept:
            name, (size, made) = next(iter(self.kept.items()))
            if now - made < self.ttl_s and (self.bytes <= self.max_bytes or len(self.kept) == 1):
                break
            self.kept.popitem(last=False)
            self.bytes -= size
            gone.append(name)
        return gone

    def get(self, image_id: str) -> tuple[bytes, str] | None:
        """The image and its media type; None if unknown or expired."""
        with self.lock:
            gone = self._over()
            name = next((n for n in (f"{image_id}.{fmt}" for fmt in MEDIA_TYPES)
                         if n in self.kept), None)
        for old in gone:
            self.files.rm(old)
        if name is None:
            return None
        try:
            return self.files.cat(name), MEDIA_TYPES[name.rsplit(".", 1)[1]]
        except FileNotFoundError:
            return None
