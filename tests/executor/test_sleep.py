"""Sleep's pinned host copies (diffserve/executor/rl/sleep.py) on the device layer's fake GPU:
torch's pinned allocator rounds each block up to a power of two and keeps it once freed, so the
weights are packed into power-of-two chunks (not one buffer a dtype: 23.8 GB would take 32 GiB)
and the chunks go back to the host at the wake."""

from __future__ import annotations

import torch

from diffserve.device import installed
from diffserve.device.fake import FakeCuda
from diffserve.executor.rl.sleep import CHUNK_BYTES, HostCopy, pack

MiB = 1 << 20


def pinned(sizes: list[int], chunk: int) -> int:
    """Bytes the pinned allocator takes for ``pack``'s chunks (each rounded to a power of two)."""
    return sum(1 << (sum(sizes[i] for i in c) - 1).bit_length() for c in pack(sizes, chunk))


def test_packing_wastes_little_where_one_buffer_would_round_up_to_a_power_of_two():
    # A Flux-like denoiser in bfloat16 (a 1 GiB embedding, larger than a chunk; double and single
    # blocks of 3072-wide attention and MLP weights, small norms and biases): ~23.8 GB in all.
    d, m, b = 3072 * 3072 * 2, 3072 * 12288 * 2, 3072 * 2
    double = [d] * 8 + [m] * 4 + [2 * d] * 2 + [b] * 30
    single = [d] * 4 + [m] + [3072 * 15360 * 2] + [b] * 10
    sizes = [1040 * MiB] + double * 22 + single * 44
    total = sum(sizes)
    assert 23.5e9 < total < 24e9 and 1 << (total - 1).bit_length() == 32 << 30  # one buffer
    assert pinned(sizes, CHUNK_BYTES) < 1.03 * total
    # Uniform weights that do not divide a chunk waste the most: 38 MiB ones, 13 a chunk.
    uniform = [38 * MiB] * 600
    assert pinned(uniform, CHUNK_BYTES) < 1.05 * sum(uniform)
    chunks = pack(sizes, CHUNK_BYTES)
    assert sorted(i for c in chunks for i in c) == list(range(len(sizes)))  # each tensor once
    assert chunks[0][0] == 0  # the largest first, in a chunk of its own power of two (2 GiB)


def test_a_host_copy_pins_in_chunks_and_gives_them_back_at_the_wake():
    module = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])  # 16 KiB weights
    before = {name: t.detach().clone() for name, t in module.state_dict().items()}
    params = list(module.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    with installed(FakeCuda()) as fake:
        copy = HostCopy(module, chunk=32 << 10)
        one_buffer = 1 << (weights - 1).bit_length()
        assert fake.pinned_live == sum(fake.pinned_sizes) < 1.02 * weights < one_buffer
        assert len(copy.buffers[torch.float32]) == 4  # three chunks of two weights, the biases
        assert fake.asked[-1][0] == "synchronize"  # the copies are done before the weights go
        copy.restore()
        assert fake.pinned_live == 0 and fake.pinned_cached == 0  # freed, and not kept cached
    assert list(module.parameters()) == params
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
