"""benchmarks/sizes_model.py: the server's own scheduler core and choice of set on a fake clock."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sm = pytest.importorskip("sizes_model")

SIZES = ["32x32", "48x48"]


def calibration(tmp_path: Path, per_step: dict[str, dict[int, float]]) -> Path:
    """A ``diffserve calibrate --json`` report with the given seconds per step."""
    cost = {"32x32": 2.0, "48x48": 4.5}  # rows x pixels over the native 32x32, with guidance
    samples = [{"width": int(s.split("x")[0]), "height": int(s.split("x")[1]), "image_count": n,
                "seconds": sec, "cost": cost[s] * n} for s, curve in per_step.items()
               for n, sec in curve.items()]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"samples": samples, "facts": {"native_image_cost": 2.0}}))
    return path


def test_every_request_is_answered_and_forwards_respect_the_bounds(tmp_path):
    flat = {1: 0.01, 8: 0.012}
    model = sm.load_model(calibration(tmp_path, {s: flat for s in SIZES}), SIZES, steps=4,
                          max_batch_size=8, max_batch_cost=0, max_running_cost=0)
    assert model.max_batch_cost == 16 and model.max_running_cost == 32  # the server's defaults
    arrivals = sm.poisson(200.0, 60, seed=1, sizes=SIZES)
    for mode in (sm.REQUEST_MODE, sm.STEP_MODE):
        run = sm.simulate(model, mode, arrivals)
        assert sum(len(v) for v in run.latency.values()) == 60 == run.completed
        assert max(run.forwards) <= 8
        # No request is faster than its own steps alone.
        assert min(x for v in run.latency.values() for x in v) >= 4 * 0.01 - 1e-9


def test_on_a_flat_curve_step_mode_keeps_its_forwards_full_with_two_sizes(tmp_path):
    flat = {1: 0.01, 8: 0.011}  # a forward costs about the same at any batch: the GPU regime
    model = sm.load_model(calibration(tmp_path, {s: flat for s in SIZES}), SIZES, steps=10,
                          max_batch_size=8, max_batch_cost=0, max_running_cost=0)
    f = sm.figures(model, SIZES, load=60, requests=120, seeds=2, clients=16)
    assert f["saturated img/s mixed, step / request"] >= 0.95
    assert f["images per forward, mixed / uniform"] >= 0.8  # sets fill while the other steps


def test_a_size_missing_from_the_calibration_is_named(tmp_path):
    path = calibration(tmp_path, {"32x32": {1: 0.01}})
    with pytest.raises(SystemExit, match="48x48"):
        sm.load_model(path, SIZES, 4, 8, 0, 0)
