"""Without Flower: the three mechanisms give the local result when their units are split over
nodes that each build only their own slice (what the Flower runtime will do)."""
import pytest
import torch

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.base import derived_seed
from fedpers.privacy import Privatizer
from fedpers.runtime.driver import ClientReply, drive
from fedpers.runtime.local import run_local

CASES = {
    "expmech": {"n_users": 600, "net_width": 0.4, "epsilon": 50.0, "seed": 1},
    "noisygd": {"examples": 600, "feature_dim": 30, "steps": 3, "collapse": "random", "remedy": "pca", "dtype": "float64", "seed": 1},
    "dpattention": {"columns": 3000, "seed": 1},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_three_nodes_building_their_own_slices_match_local(name):
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, CASES[name])
    n = exp.num_units(cfg)
    proto = exp.protocol(cfg)
    parts = [ids for ids in torch.arange(n).chunk(3)]
    nodes = [exp.units(cfg, ids) for ids in parts]

    def gather(round, broadcast):
        return [ClientReply(f"node{i}", len(ids), proto.client_update(round, broadcast, units)) for i, (ids, units) in enumerate(zip(parts, nodes))]

    seed = derived_seed(cfg.seed, "dp-noise")
    split_state, _ = drive(proto, gather, Privatizer(seed), progress=False)
    local_state, _ = run_local(proto, exp.units(cfg, torch.arange(n)), Privatizer(seed), progress=False)
    split, local = exp.evaluator(cfg, proto).final(split_state), exp.evaluator(cfg, proto).final(local_state)
    key = exp.primary_metric
    assert split[key] == pytest.approx(local[key], rel=1e-6, abs=1e-9)
    for k, v in local_state.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert torch.allclose(split_state[k], v, rtol=1e-6, atol=1e-9), k
