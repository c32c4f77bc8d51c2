"""Prompt encodings kept for the next request that asks for the same: RL groups (n samples of one
prompt sent as separate requests), a negative prompt every request repeats, retries.

An entry is one prompt's encoding (its positive row and, with classifier-free guidance, its
negative row), exactly as the family's encoder made it. Its key is everything that encoding
depends on: the prompt and the negative prompt (or none), whether guidance runs, the adapter
stack by version (a replaced adapter is a new key), and, where the text encoder also sees input
images (Qwen-Image-Edit's vision-language encoder), a hash of those images. The model and the
encoder's settings are the executor's own and never change under it: a weight update replaces the
denoiser's weights only, so the encodings stay the encoder's (a level-1 sleep drops them with the
rest of the device's memory).
Least recently used entries go first once the entries' tensors pass ``--prompt-cache-bytes``.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from diffserve.executor.families.conditioning import Encoded
from diffserve.executor.tensors import nbytes


def _copy(cond):
    import dataclasses

    if cond is None:
        return None
    return dataclasses.replace(cond, **{f.name: getattr(cond, f.name).clone()
                                        for f in dataclasses.fields(cond)
                                        if hasattr(getattr(cond, f.name), "clone")})


def image_hash(images) -> str | None:
    """A digest of the input images a vision-language text encoder sees (None: none)."""
    if images is None:
        return None
    h = hashlib.sha256()
    for image in images:
        h.update(str(image.shape).encode())
        h.update(image.tobytes())
    return h.hexdigest()


def prompt_key(request, cfg: bool, negative: bool, stack, images) -> tuple:
    """Everything one request's prompt encoding depends on (see the module's docstring)."""
    return (request.prompt, request.negative_prompt if negative else None, cfg, tuple(stack),
            image_hash(images))


class PromptCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.nbytes = 0
        self._kept: OrderedDict[tuple, tuple[Encoded, int]] = OrderedDict()
        # The encode stage looks up and keeps; the loop takes the counts.
        self._lock = threading.Lock()
        self._hits = self._misses = 0  # requests, since the last take_counts()

    def key(self, request, cfg: bool, negative: bool, stack, images) -> tuple:
        return prompt_key(request, cfg, negative, stack, images)

    def lookup(self, keys: list[tuple]) -> list[Encoded | None]:
        """Each key's kept encoding, or None. A request counts as a hit where its encoding was
        kept, or where an earlier request of the same call has its key (encoded once for both)."""
        with self._lock:
            found, asked = [], set()
            for key in keys:
                entry = self._kept.get(key)
                if entry is not None:
                    self._kept.move_to_end(key)
                hit = entry is not None or key in asked
                self._hits += hit
                self._misses += not hit
                asked.add(key)
                found.append(entry[0] if entry is not None else None)
            return found

    def put(self, key: tuple, encoded: Encoded) -> None:
        """Keep a copy of ``encoded`` (a row of a batch's encoding would keep the whole batch)."""
        encoded = Encoded(_copy(encoded.positive), _copy(encoded.negative))
        size = nbytes(encoded)
        if size > self.budget:
            return
        with self._lock:
            if key in self._kept:
                self.nbytes -= self._kept.pop(key)[1]
            self._kept[key] = (encoded, size)
            self.nbytes += size
            while self.nbytes > self.budget:
                self.nbytes -= self._kept.popitem(last=False)[1][1]

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self.nbytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def take_counts(self) -> tuple[int, int]:
        """(hits, misses) since the last call."""
        with self._lock:
            counts, self._hits, self._misses = (self._hits, self._misses), 0, 0
        return counts
