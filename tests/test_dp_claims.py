"""No run publishes a result whose DP claim fails: a paper's noise rule used outside its range (its noise
spends more than the target ε by the run's accountant) is refused before any work, naming the rule and the
way out; inside it the run spends at most its target."""

from __future__ import annotations

import pytest

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import execute

SMALL = {
    "altmin": {"n_users": 400, "baselines": "none"},
    "noisyhead": {"prompts": 400},
}


@pytest.mark.parametrize(
    ("algorithm", "values", "rule"),
    [
        ("altmin", {"epsilon": 64.0}, "Theorem 4.2's noise would spend ε = 67.38"),
        ("noisyhead", {"epsilon": 30.0, "steps": 1}, "classical Gaussian noise would spend ε = 44.82"),
    ],
)
def test_a_paper_rule_outside_its_range_is_refused_before_any_release(algorithm, values, rule):
    exp = EXPERIMENTS[algorithm]
    cfg = config.build(exp.config_type, {**SMALL[algorithm], **values, "calibration": "paper"})
    with pytest.raises(ValueError, match=rule):
        exp.protocol(cfg)


@pytest.mark.parametrize(("algorithm", "epsilon"), [("altmin", 8.0), ("noisyhead", 4.0)])
def test_a_paper_rule_inside_its_range_spends_at_most_its_target(algorithm, epsilon):
    exp = EXPERIMENTS[algorithm]
    cfg = config.build(exp.config_type, {**SMALL[algorithm], "epsilon": epsilon, "calibration": "paper"})
    result = execute(exp, cfg, write=False, progress=False)
    assert 0 < result["epsilon"] <= epsilon
