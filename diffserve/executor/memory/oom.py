"""Out of memory on the device: what counts as such, and what to do before trying again.

A batch that runs out of memory is run again in halves (:func:`diffserve.wire.samples.isolate`). For
the halves to fit, the failed attempt's memory must be free: its activations are held by the
frames of the error's traceback until those are cleared (``isolate`` leaves its ``except`` block
and clears them), and then the allocator's cache is emptied so that the memory is the device's
again, not a fragmented pool of the old batch's block sizes.
"""

from __future__ import annotations

# Allocation failures that CUDA libraries raise as a RuntimeError, not as torch.OutOfMemoryError.
OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                "CUDA error: out of memory", "HIP out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(m in str(error) for m in OOM_MESSAGES))


def release(error: BaseException) -> None:
    """Before a batch that failed with ``error`` runs again in parts: after an out-of-memory
    error, give the allocator's cached blocks back to the device."""
    if not is_out_of_memory(error):
        return
    import gc

    from diffserve.device import current

    gc.collect()  # tensors caught in reference cycles of the failed attempt
    current().empty_cache()
