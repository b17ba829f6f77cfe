"""NoisyHead under the Flower runtime (in-process Grid, no Ray): same Γ̂ and ledger as the local runtime."""

from __future__ import annotations

import pytest
import torch

from fedpers import config as config_lib
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import Privatizer
from fedpers.runner import RuntimeOptions, split_seed
from fedpers.runtime.local import run_local

pytest.importorskip("flwr")
from fedpers import app as flower
from tests.flower_support import InProcessGrid, faulty_client_app

EXP = EXPERIMENTS["noisyhead"]


def runs(values: dict, grid) -> tuple:
    cfg, noise_seed = split_seed(config_lib.build(EXP.config_type, values))
    protocol = EXP.protocol(cfg)
    units = EXP.units(cfg, torch.arange(EXP.num_units(cfg)))
    local = Privatizer(noise_seed)
    state_local, _ = run_local(protocol, units, local, progress=False)
    remote = Privatizer(noise_seed)
    options = config_lib.build(RuntimeOptions, {"runtime": "flower"})
    state, records = flower.run_flower(EXP, cfg, protocol, remote, options, grid=grid, progress=False)
    return state_local, local.ledger, state, remote.ledger, records


@pytest.mark.parametrize("mode", ["statistics", "rounds"])
@pytest.mark.parametrize("unit", [{}, {"unit": "user", "prompts_per_user": 3, "user_clip": 0.1}])
def test_flower_equals_local(mode, unit):
    values = dict(prompts=150, dim=3, steps=4, epsilon=2.0, mode=mode, seed=2, **unit)
    state_local, ledger_local, state, ledger, records = runs(values, InProcessGrid(flower.make_client_app(), 4))
    torch.testing.assert_close(state["gamma"], state_local["gamma"], rtol=0, atol=1e-10)
    assert ledger == ledger_local
    assert all(r.accepted == 4 and not r.dropped for r in records)


def test_a_client_sending_an_oversized_gradient_is_dropped():
    values = dict(prompts=150, dim=3, steps=3, epsilon=2.0, mode="rounds", seed=2)
    grid = InProcessGrid(faulty_client_app({1: "huge"}), 4)
    cfg, noise_seed = split_seed(config_lib.build(EXP.config_type, values))
    options = config_lib.build(RuntimeOptions, {"runtime": "flower", "min_fraction": 0.5})
    _, records = flower.run_flower(
        EXP, cfg, EXP.protocol(cfg), Privatizer(noise_seed), options, grid=grid, progress=False
    )
    assert all(r.accepted == 3 and len(r.dropped) == 1 for r in records)
    assert any("norm" in why for r in records for why in r.dropped.values())
