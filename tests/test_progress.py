"""Every phase of a run that has no round bar says so on stderr before its work: the evaluation
with its baselines, and on Flower the wait for the nodes (start-up and discovery)."""

from __future__ import annotations

import sys

from fedpers import config
from fedpers.app import make_client_app
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.dpals import baselines as rating_baselines
from fedpers.runner import Runtime, RuntimeOptions, execute
from tests.flower_support import InProcessGrid

DPALS = {"n_users": 300, "n_items": 20, "steps": 1}


def test_the_evaluation_and_its_baselines_are_announced_before_their_work(monkeypatch, capfd):
    """The non-private reference (a biased ALS fitted 5 times) runs after the round bar has
    ended: the line naming it must already be on stderr when it starts."""
    tuned = rating_baselines.tuned

    def marked(*args, **kwargs):
        print("<<reference starts>>", file=sys.stderr, flush=True)
        return tuned(*args, **kwargs)

    monkeypatch.setattr(rating_baselines, "tuned", marked)
    exp = EXPERIMENTS["dpals"]
    execute(exp, config.build(exp.config_type, DPALS), write=False, progress=True)
    err = capfd.readouterr().err
    announced = err.find("dpals: evaluating the private result and its baselines (the non-private reference")
    assert 0 <= announced < err.index("<<reference starts>>"), err


def test_a_quiet_run_prints_no_phase(capfd):
    exp = EXPERIMENTS["dpals"]
    execute(exp, config.build(exp.config_type, DPALS), write=False, progress=False)
    assert "evaluating" not in capfd.readouterr().err


def test_the_wait_for_flower_nodes_is_announced(capfd):
    exp = EXPERIMENTS["altmin"]
    cfg = config.build(exp.config_type, {"n_users": 300, "dim": 10, "rank": 2, "rounds": 1, "baselines": "none"})
    execute(
        exp,
        cfg,
        RuntimeOptions(runtime=Runtime.FLOWER, nodes=2),
        write=False,
        progress=True,
        grid=InProcessGrid(make_client_app(), 2),
    )
    err = capfd.readouterr().err
    assert 0 <= err.find("flower: waiting for 2 nodes to join") < err.find("altmin: evaluating"), err
