"""A video's downloadable files from its frames (uint8, frames x height x width x 3), made with
PyAV (FFmpeg): an H.264 MP4 (yuv420p, moov atom first, so a browser plays it while it loads; with
the model's sound track as an AAC stream where it makes one), a thumbnail (WebP of the first frame) and a sprite sheet (JPEG grid of evenly spaced frames).
Runs in a worker thread of the frontend, never on an executor's step loop."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

VIDEO, THUMBNAIL, SPRITESHEET = "video", "thumbnail", "spritesheet"
# variant -> (file suffix, media type)
VARIANTS = {VIDEO: (".mp4", "video/mp4"), THUMBNAIL: (".thumbnail.webp", "image/webp"),
            SPRITESHEET: (".spritesheet.jpg", "image/jpeg")}
SPRITES = 16  # most frames a sprite sheet shows
CRF = 12  # near-lossless: tiny and random-looking videos lose little
X264_THREADS = 2  # FFmpeg's encoder threads: a bound on what one encode takes from the host
AAC_BITRATE = 128_000  # the sound track's, any sample rate
LAYOUTS = {1: "mono", 2: "stereo"}


@dataclass(frozen=True)
class Sound:
    """A video's sound track: float32 samples in [-1, 1], (channels, samples)."""

    samples: np.ndarray
    sample_rate: int


def encode_mp4(frames: np.ndarray, fps: int, path: Path, sound: Sound | None = None) -> None:
    import av

    count, height, width, _ = frames.shape
    with av.open(str(path), "w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(CRF), "preset": "medium", "threads": str(X264_THREADS)}
        audio = None
        if sound is not None:
            audio = container.add_stream("aac", rate=sound.sample_rate)
            audio.layout, audio.bit_rate = LAYOUTS[len(sound.samples)], AAC_BITRATE
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if audio is not None:  # one planar frame; the encoder cuts it into AAC's frames
            track = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(np.clip(sound.samples, -1.0, 1.0), np.float32),
                format="fltp", layout=LAYOUTS[len(sound.samples)])
            track.sample_rate, track.pts = sound.sample_rate, 0
            container.mux(audio.encode(track))
            container.mux(audio.encode(None))


def decode_mp4(path: Path) -> np.ndarray:
    """An MP4's frames as uint8 RGB (what a player shows)."""
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def decode_sound(path: Path) -> Sound | None:
    """An MP4's sound track as a player hears it (the encoder's padding included); None where
    it has none."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        samples = [f.to_ndarray() for f in container.decode(stream)]
        return Sound(np.concatenate(samples, axis=1), stream.rate)


def sprite_sheet(frames: np.ndarray) -> np.ndarray:
    """Up to :data:`SPRITES` evenly spaced frames in a grid, row after row."""
    picked = frames[np.unique(np.linspace(0, len(frames) - 1, min(SPRITES, len(frames))).round()
                              .astype(int))]
    columns = math.ceil(math.sqrt(len(picked)))
    rows = math.ceil(len(picked) / columns)
    _, height, width, channels = picked.shape
    sheet = np.zeros((rows * height, columns * width, channels), np.uint8)
    for i, frame in enumerate(picked):
        r, c = divmod(i, columns)
        sheet[r * height:(r + 1) * height, c * width:(c + 1) * width] = frame
    return sheet


def write_files(frames: np.ndarray, fps: int, stem: Path, sound: Sound | None = None) -> int:
    """Every variant's file beside ``stem`` (each written to a temporary name, then renamed:
    a reader never sees half a file); ``sound``: the MP4's sound track. Returns the bytes
    written. On any error (a full disk), nothing of this video is left."""
    from PIL import Image

    written = []
    try:
        for variant, (suffix, _) in VARIANTS.items():
            final = stem.with_name(stem.name + suffix)
            partial = final.with_name(final.name + ".part")
            written.append(partial)
            if variant == VIDEO:
                encode_mp4(frames, fps, partial, *([sound] if sound is not None else []))
            elif variant == THUMBNAIL:
                Image.fromarray(frames[0]).save(partial, format="WEBP", quality=90)
            else:
                Image.fromarray(sprite_sheet(frames)).save(partial, format="JPEG", quality=90)
        size = 0
        for partial in written:
            size += partial.stat().st_size
            os.replace(partial, partial.with_name(partial.name.removesuffix(".part")))
        return size
    except BaseException:
        remove_files(stem)
        for partial in written:
            partial.unlink(missing_ok=True)
        raise


def remove_files(stem: Path) -> None:
    for suffix, _ in VARIANTS.values():
        stem.with_name(stem.name + suffix).unlink(missing_ok=True)
