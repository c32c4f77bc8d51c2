"""The gathered method of per-row adapters (:mod:`~diffserve.executor.lora.row_adapters`): each distinct
stack's A matrices concatenated along the rank (its B's, scales folded in, likewise), zero-padded
to the largest, so that every row's update comes from two batched matrix products whatever the
number of adapters; and the byte-bounded cache of those weights."""

from __future__ import annotations

import threading

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear

from diffserve.executor.lora.row_plan import unit_scale
from diffserve.executor.tensors import nbytes

# The gathered method's adapter weights, kept per layer and set of distinct stacks (whatever the
# rows' order, so running sets with the same adapters share them) within this many bytes, the
# least recently used dropped first.
GATHERED_BYTES = 256 << 20


class GatheredWeights:
    """An LRU of gathered (A, B) weights with a byte budget."""

    def __init__(self, budget: int = GATHERED_BYTES) -> None:
        self.budget = budget
        self.nbytes = 0
        self._kept: dict = {}  # key -> (A_all, B_all) or None; insertion order is use order
        self._sizes: dict = {}
        self._lock = threading.Lock()  # the step loop and an encode stage share it

    def get(self, key, make):
        with self._lock:
            if key in self._kept:
                value = self._kept[key] = self._kept.pop(key)  # now the most recently used
                self._evict()
                return value
        value = make()
        with self._lock:
            if key not in self._kept:
                self._kept[key], self._sizes[key] = value, nbytes(value)
                self.nbytes += self._sizes[key]
            self._evict()
        return value

    def _evict(self) -> None:
        while self.nbytes > self.budget and len(self._kept) > 1:
            gone = next(iter(self._kept))
            del self._kept[gone]
            self.nbytes -= self._sizes.pop(gone)

    def clear(self) -> None:
        with self._lock:
            self._kept, self._sizes, self.nbytes = {}, {}, 0


def gather(layer: LoraLayer, distinct: list, x: torch.Tensor):
    """One (rank, in) A and (out, rank) B per distinct stack (B scaled by the stack's scales),
    zero-padded to the largest rank; None where no stack adapts ``layer``."""
    pieces = [[(layer.lora_A[a].weight, layer.lora_B[a].weight * (s * unit_scale(layer, a)))
               for a, s in stack if a in layer.lora_A] for stack in distinct]
    rank = max(sum(A.shape[0] for A, _ in p) for p in pieces)
    if rank == 0:
        return None
    dtype = next(A.dtype for p in pieces for A, _ in p)
    A_all = x.new_zeros((len(distinct), rank, layer.in_features), dtype=dtype)
    B_all = x.new_zeros((len(distinct), layer.out_features, rank), dtype=dtype)
    for u, p in enumerate(pieces):
        at = 0
        for A, B in p:
            A_all[u, at:at + A.shape[0]] = A
            B_all[u, :, at:at + A.shape[0]] = B
            at += A.shape[0]
    return A_all, B_all


def gatherable(layer: LoraLayer) -> bool:
    return isinstance(layer, LoraLinear) and all(b.bias is None for b in layer.lora_B.values())
