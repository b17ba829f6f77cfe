"""Each mechanism under the Flower runtime gives the local runtime's result, ledger and state for one seed.

Default: Flower's ClientApp/ServerApp logic on an in-process Grid of 3 nodes, each building
only its own units (no Ray). Slow: ``--runtime flower`` proper, Flower's simulation engine
on a Ray head.
"""

import pytest
import torch

from fedpers import config
from fedpers.app import make_client_app
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import Runtime, RuntimeOptions, execute
from tests.flower_support import InProcessGrid
from tests.test_flower_simulation import options, ray_address  # noqa: F401 - the module's Ray head fixture

CASES = {
    "expmech": ({"n_users": 600, "net_width": 0.4, "epsilon": 50.0, "seed": 1}, ["subspace_error", "excess_risk"]),
    "noisygd": (
        {
            "examples": 600,
            "feature_dim": 30,
            "steps": 3,
            "collapse": "offset",
            "remedy": "center",
            "dtype": "float64",
            "seed": 1,
        },
        ["accuracy"],
    ),
    "noisygd-pca": (
        {
            "examples": 600,
            "feature_dim": 30,
            "steps": 3,
            "collapse": "random",
            "remedy": "pca",
            "dtype": "float64",
            "seed": 1,
        },
        ["accuracy"],
    ),
    "dpattention": ({"columns": 3000, "seed": 1}, ["attention_error", "relative_error"]),
    "dpals": (
        {"n_users": 300, "n_items": 40, "min_count": 2, "max_count": 30, "steps": 2, "epsilon": 5.0, "seed": 1},
        ["test_rmse"],
    ),
    "dpals-head": (
        {
            "n_users": 300,
            "n_items": 40,
            "min_count": 2,
            "max_count": 30,
            "steps": 2,
            "epsilon": 5.0,
            "seed": 1,
            "head_items": 25,
        },
        ["test_rmse", "private_mean"],
    ),
}


def assert_same(local: dict, flower: dict, keys: list[str], tmp_path) -> None:
    assert flower["runtime"] == "flower"
    for key in keys:
        assert flower[key] == pytest.approx(local[key], rel=1e-6, abs=1e-9), key
    assert (tmp_path / "flower" / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()
    for k, v in local["_state"].items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            torch.testing.assert_close(flower["_state"][k], v, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("case", sorted(CASES))
def test_flower_grid_matches_local(case, tmp_path):
    values, keys = CASES[case]
    exp = EXPERIMENTS[case.split("-")[0]]
    cfg = config.build(exp.config_type, values)
    local = execute(exp, cfg, out=tmp_path / "local", progress=False)
    grid = InProcessGrid(make_client_app(), 3)
    flower = execute(
        exp, cfg, RuntimeOptions(runtime=Runtime.FLOWER, nodes=3), out=tmp_path / "flower", progress=False, grid=grid
    )
    assert_same(local, flower, keys, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dpattention", "expmech", "noisygd"])
def test_flower_simulation_matches_local(case, ray_address, tmp_path):  # noqa: F811
    values, keys = CASES[case]
    exp = EXPERIMENTS[case]
    cfg = config.build(exp.config_type, values)
    local = execute(exp, cfg, out=tmp_path / "local", progress=False)
    flower = execute(exp, cfg, options(ray_address, nodes=3), out=tmp_path / "flower", progress=False)
    assert_same(local, flower, keys, tmp_path)
