"""Quantizing leaves the process's inductor options alone: torchao's configs would otherwise turn
on coordinate-descent tuning (and more) for every later compile (``set_inductor_config``)."""

from __future__ import annotations

import pytest
import torch

from diffserve.executor.model.quantization import quantize_built, scheme_config

# What torchao's recommended_inductor_config_setter flips.
OPTIONS = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions",
           "force_fuse_int_mm_with_mul", "fx_graph_cache", "triton.unique_kernel_names")


def _options() -> dict:
    import torch._inductor.config as inductor

    found = {}
    for name in OPTIONS:
        owner = inductor
        *path, last = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        found[name] = getattr(owner, last)
    return found


@pytest.mark.parametrize("scheme", ["int8-weight-only", "int8-dynamic"])
def test_quantizing_leaves_the_inductor_options_alone(scheme):
    pytest.importorskip("torchao")
    import torchao.quantization as schemes

    assert scheme_config(schemes, scheme).set_inductor_config is False
    before = _options()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    if scheme == "int8-dynamic":
        schemes.quantize_(model, scheme_config(schemes, scheme))
    else:
        quantize_built(scheme, "none", {"transformer": model}, "cpu")
    assert type(model[0].weight) is not torch.nn.Parameter or type(model[0].weight.data) is not torch.Tensor
    assert _options() == before


def test_every_scheme_config_refuses_the_inductor_setter():
    pytest.importorskip("torchao")
    import torchao.quantization as schemes

    from diffserve.executor.model.quantization import SCHEMES

    for scheme in SCHEMES:
        assert scheme_config(schemes, scheme).set_inductor_config is False, scheme
