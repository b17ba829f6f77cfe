"""Each mechanism runs under --runtime flower with the local runtime's result for one seed.

Skipped until the Flower runtime (branch ``flower``) is merged: it provides
``fedpers.runtime.flower.run_flower``, which ``runner.execute`` uses for Runtime.FLOWER.
"""
import pytest

pytest.importorskip("fedpers.runtime.flower")

from fedpers import config  # noqa: E402
from fedpers.experiments import EXPERIMENTS  # noqa: E402
from fedpers.runner import Runtime, RuntimeOptions, execute  # noqa: E402

CASES = {
    "expmech": ({"n_users": 600, "net_width": 0.4, "epsilon": 50.0, "seed": 1}, ["subspace_error", "excess_risk"]),
    "noisygd": ({"examples": 600, "feature_dim": 30, "steps": 3, "collapse": "offset", "remedy": "center", "dtype": "float64", "seed": 1}, ["accuracy"]),
    "dpattention": ({"columns": 3000, "seed": 1}, ["attention_error", "dp_claimed"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flower_matches_local(name):
    values, keys = CASES[name]
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, values)
    local = execute(exp, cfg, RuntimeOptions(), write=False, progress=False)
    flower = execute(exp, cfg, RuntimeOptions(runtime=Runtime.FLOWER, nodes=3), write=False, progress=False)
    for key in keys:
        assert flower[key] == pytest.approx(local[key], rel=1e-6, abs=1e-9), key
    assert flower["epsilon"] == pytest.approx(local["epsilon"])
