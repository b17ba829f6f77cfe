"""docs/contributing.md's worked example runs: a toy algorithm (tests/toy_config.py, tests/toy_algorithm.py)
added through the documented extension points only — ``fedpers.experiments.register`` and its Experiment's
hooks — refuses a bad flag before torch is imported, runs on the local runtime, on Flower, under every trust
model it qualifies for, through ``fedpers audit`` and through a private sweep; an accountant registered by
one decorator is offered by the CLI and accounts a ledger."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import dp_accounting
import pytest
import torch

from fedpers import config as config_lib
from fedpers.commands import cli
from fedpers.experiments import ALGORITHMS, CONFIGS, config_type, experiment, register, unregister
from fedpers.privacy import Accountant, Ledger, Privatizer, Release, ledger_epsilon
from fedpers.privacy.accountant import PldAccountant, RdpAccountant, register_accountant, unregister_accountant
from fedpers.runner import RuntimeOptions, execute, split_seed
from fedpers.runtime.local import run_local
from fedpers.sweeps import tuning
from fedpers.sweeps.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "contributing.md"
TOY = ROOT / "tests" / "toy_algorithm.py"
TOY_CONFIG = ROOT / "tests" / "toy_config.py"
SMALL = {"n_users": 60, "dim": 4, "rounds": 2, "epsilon": 4.0, "seed": 3}


@pytest.fixture
def toy():
    """The toy algorithm, registered as docs/contributing.md says (and removed afterwards)."""
    register(
        "toymean",
        "tests.toy_algorithm",
        "ToyMeanExperiment",
        "A private mean of per-user vectors (docs/contributing.md)",
        config=("tests.toy_config", "ToyMeanConfig"),
    )
    try:
        yield experiment("toymean")
    finally:
        unregister("toymean")


def small(exp, **over):
    return config_lib.build(exp.config_type, {**SMALL, **over})


def test_the_docs_code_is_the_toy_that_runs():
    """Every code block of docs/contributing.md is a verbatim piece of tests/toy_config.py,
    tests/toy_algorithm.py or this file."""

    def solid(text: str) -> str:  # blank lines dropped: a block may leave out the ones around it
        return "\n".join(line for line in text.splitlines() if line.strip())

    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 10
    sources = "\n".join(solid(f.read_text()) for f in (TOY_CONFIG, TOY, Path(__file__)))
    for block in blocks:
        assert solid(block) in sources, block


def test_registration_is_one_call_and_refuses_a_clash(toy):
    assert ALGORITHMS["toymean"][:2] == ("tests.toy_algorithm", "ToyMeanExperiment")
    assert CONFIGS["toymean"] == ("tests.toy_config", "ToyMeanConfig") and config_type("toymean") is toy.config_type
    run = cli.build_parser()._subparsers._group_actions[0].choices["run"]
    assert "toymean" in [a for a in run._actions if a.dest == "algorithm"][0].choices
    register("toymean", "tests.toy_algorithm", "ToyMeanExperiment", ALGORITHMS["toymean"][2])  # the same entry: no-op
    with pytest.raises(ValueError, match="already registered"):
        register("toymean", "tests.other", "Other", "x")
    with pytest.raises(ValueError, match="already registered"):
        register("altmin", "tests.toy_algorithm", "ToyMeanExperiment", "x")


def test_a_bad_toy_flag_or_value_is_refused_before_torch_is_imported():
    """The toy's config lives in a light module (registered with ``config=``): ``fedpers run toymean``
    lists its flags and refuses a misspelt flag or a bad value with status 2, importing no torch."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom fedpers.experiments import register\nfrom fedpers.commands.cli import main\n"
        "register('toymean', 'tests.toy_algorithm', 'ToyMeanExperiment', 'toy', config=('tests.toy_config', 'ToyMeanConfig'))\n"
        "def status(*flags):\n    try:\n        return main(['run', 'toymean', *flags])\n    except SystemExit as e:\n        return e.code\n"
        "statuses = [status('--dim', '0'), status('--accountant', 'nope'), status('--dimm', '3')]\n"
        "print(statuses, 'torch' in sys.modules, 'dp_accounting' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[2, 2, 2] False False", out.stderr[-2000:]
    assert "dim must be >= 1" in out.stderr and "invalid choice: 'nope'" in out.stderr
    assert "unknown flag --dimm; did you mean --dim?" in out.stderr


def test_toy_runs_locally_with_the_expected_ledger(toy, tmp_path):
    """Two rounds: two Gaussian releases of the calibrated z, ε at the target, and better than the zero vector."""
    cfg = small(toy, n_users=400)
    result = execute(toy, cfg, out=tmp_path / "run", progress=False)
    ledger = Ledger.from_json((tmp_path / "run" / "ledger.json").read_text())
    z = result["privacy"]["noise_multiplier"]
    assert [(r.name, r.mechanism, r.units) for r in ledger] == [
        ("round0.sum", "gaussian", "all"),
        ("round1.sum", "gaussian", "all"),
    ]
    assert all(r.event == dp_accounting.GaussianDpEvent(z) and r.per_unit_bound == cfg.clip for r in ledger)
    assert 4.0 * (1 - 1e-3) <= result["epsilon"] <= 4.0
    assert result["mean_error"] < result["baselines"]["zero"]["mean_error"] and "warnings" not in result


def test_a_fresh_node_resolves_the_registered_toy_from_the_apps_entry(toy):
    """A Flower node process knows only the built-in registry: the ClientApp's entry lets it import the toy."""
    from fedpers.app import build_node
    from fedpers.runtime.flower.codec import Job

    cfg, _ = split_seed(small(toy))
    protocol = toy.protocol(cfg)
    job = Job.of("toymean", cfg, protocol)
    entry = {"toymean": ALGORITHMS["toymean"]}
    unregister("toymean")  # what a node process sees
    with pytest.raises(ValueError, match="unknown on this node"):
        build_node(job)
    node = build_node(job, entries=entry)
    assert node.protocol == protocol
    torch.testing.assert_close(node.units(torch.tensor([5, 7]))["x"], toy.units(cfg, torch.tensor([5, 7]))["x"])


def test_toy_on_an_in_process_flower_grid_equals_local(toy, tmp_path):
    from fedpers.app import make_client_app
    from tests.flower_support import InProcessGrid

    cfg = small(toy)
    local = execute(toy, cfg, out=tmp_path / "local", progress=False)
    grid = InProcessGrid(make_client_app({"toymean": ALGORITHMS["toymean"]}), 2)
    options = config_lib.build(RuntimeOptions, {"runtime": "flower", "nodes": 2})
    flower = execute(toy, cfg, options, out=tmp_path / "flower", progress=False, grid=grid)
    assert flower["runtime"] == "flower" and flower["mean_error"] == pytest.approx(local["mean_error"], rel=1e-9)
    assert (tmp_path / "flower" / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()


def test_toy_runs_under_distributed_and_local_dp_by_declaring_node_side(toy, tmp_path):
    """The toy declares ``node_side()`` (docs/contributing.md, Trust models) and nothing else: under
    distributed DP its sums are Skellam releases within its target, on Flower (SecAgg+, an in-process grid
    of two nodes seeded by the lab) equal to the local runtime's; under local DP each unit's own Gaussian."""
    from fedpers.app import make_client_app
    from fedpers.privacy.ledger import SkellamDpEvent
    from fedpers.runner import resolve
    from tests.flower_support import InProcessGrid

    cfg = small(toy)
    opts = {"nodes": 2, "dp_model": "distributed", "bits": 16}
    local = execute(toy, cfg, config_lib.build(RuntimeOptions, opts), out=tmp_path / "local", progress=False)
    grid = InProcessGrid(make_client_app({"toymean": ALGORITHMS["toymean"]}, noise_seed=split_seed(cfg)[1]), 2)
    options = config_lib.build(RuntimeOptions, {**opts, "runtime": "flower"})
    flower = execute(toy, cfg, options, out=tmp_path / "flower", progress=False, grid=grid)
    assert flower["mean_error"] == local["mean_error"]
    assert (tmp_path / "flower" / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()
    p = resolve(toy, cfg, config_lib.build(RuntimeOptions, opts))
    run_local(p.protocol, toy.units(p.cfg, torch.arange(cfg.n_users)), p.privatizer, progress=False)
    assert len(p.privatizer.ledger.releases) == cfg.rounds
    assert all(isinstance(r.event, SkellamDpEvent) for r in p.privatizer.ledger.releases)
    assert ledger_epsilon(p.privatizer.ledger, cfg.delta) <= cfg.epsilon * (1 + 1e-9)
    q = resolve(toy, cfg, config_lib.build(RuntimeOptions, {"nodes": 2, "dp_model": "local"}))
    run_local(q.protocol, toy.units(q.cfg, torch.arange(cfg.n_users)), q.privatizer, progress=False)
    assert {r.mechanism for r in q.privatizer.ledger.releases} == {"local_gaussian"}


@pytest.mark.parametrize("model", ["central", "distributed", "local"])
def test_toy_under_every_trust_model_it_qualifies_for(toy, tmp_path, model):
    """Each trust model runs the toy on the local runtime's nodes with the guarantee it was calibrated
    for, or (a protocol that does not declare it can be noised by the nodes) is refused before any
    release: no run directory holds a release it could not account."""
    cfg = small(toy, n_users=400)
    options = config_lib.build(RuntimeOptions, {"dp_model": model, "nodes": 4})
    try:
        result = execute(toy, cfg, options, out=tmp_path / model, progress=False)
    except ValueError as refused:
        assert model != "central" and "dp_model" in str(refused)
        assert isinstance(toy.protocol(cfg).node_side(), str) or "supports" in str(refused)
        ledger = tmp_path / model / "ledger.json"
        assert not ledger.exists() or len(Ledger.from_json(ledger.read_text())) == 0
        return
    assert 4.0 * (1 - 1e-2) <= result["epsilon"] <= 4.0
    assert result["mean_error"] < result["baselines"]["zero"]["mean_error"]
    assert len(Ledger.from_json((tmp_path / model / "ledger.json").read_text())) == cfg.rounds


@pytest.mark.slow  # a Ray head and two node actors: ~30 s
def test_toy_on_the_flower_simulation_equals_local(toy, tmp_path):
    """2 nodes in Flower's simulation engine (Ray actors: separate processes that import the toy themselves)."""
    import os

    from tests.flower_support import free_port, start_ray, stop_processes

    temp = Path("/tmp") / f"fedpers-ray-toy-{os.getpid()}"
    port = free_port()
    proc = start_ray(tmp_path / "head.log", temp, head_port=port)
    try:
        cfg, noise_seed = split_seed(small(toy))
        protocol = toy.protocol(cfg)
        local = Privatizer(noise_seed)
        state_local, _ = run_local(protocol, toy.units(cfg, torch.arange(cfg.n_users)), local, progress=False)
        options = config_lib.build(
            RuntimeOptions, {"runtime": "flower", "nodes": 2, "ray_address": f"127.0.0.1:{port}", "client_cpus": 1.0}
        )
        from fedpers.app import run_flower

        remote = Privatizer(noise_seed)
        state_flower, _ = run_flower(toy, cfg, protocol, remote, options, progress=False)
    finally:
        stop_processes([proc])
        shutil.rmtree(temp, ignore_errors=True)
    torch.testing.assert_close(state_flower["mean"], state_local["mean"], rtol=1e-12, atol=1e-12)
    assert remote.ledger.to_json() == local.ledger.to_json()


def test_toy_through_fedpers_audit(toy, capsys):
    """The canary_design hook: the empirical lower bounds never exceed the proven ε (here exactly the target)."""
    rc = cli.main(["audit", "toymean", "--canaries", "4", "--runs", "5", "--json", "--epsilon", "2.0"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["algorithm"] == "toymean" and result["canaries_per_run"] == 4 and result["runs"] == 5
    assert 2.0 * (1 - 1e-3) <= result["proven_epsilon"] <= 2.0
    assert result["canary_mu"] == pytest.approx(result["proven_mu"], rel=1e-9)  # canaries at the full sensitivity
    for bound in (
        result["epsilon_lower"],
        result["one_run_gdp"]["epsilon_lower"],
        result["independent_gdp"]["epsilon_lower"],
    ):
        assert 0.0 <= bound <= result["proven_epsilon"]
    assert cli.main(["audit", "toymean", "--canaries", "5"]) == 2
    assert "canaries must be in [2, 4]" in capsys.readouterr().err


def test_toy_through_a_private_sweep(toy, tmp_path):
    """The private_scores hook: each trial is the candidate's 2 releases and its score (3 Gaussians of z),
    the final run 2; the reported ε is RDP's for exactly that composition."""
    spec_file = tmp_path / "grid.toml"
    spec_file.write_text(
        'algorithm = "toymean"\nx = "clip"\nseries = "dim"\nmetrics = ["mean_error"]\n'
        "[base]\nn_users = 60\nepsilon = 4.0\n[grid]\nclip = [1.0, 2.0]\n"
    )
    spec = load_spec(spec_file)
    result = tuning.private_select(
        spec, "validation_mse", tuning.Goal.MIN, mean=2.0, validation_users=20, seed=1, out=tmp_path / "t"
    )
    z = toy.protocol(small(toy, n_users=60)).noise_multiplier  # the same z for every clip (it depends on ε, δ, rounds)
    gauss = dp_accounting.GaussianDpEvent(z)
    want = tuning.rdp_epsilon(
        tuning.tuning_event(
            [dp_accounting.ComposedDpEvent([gauss] * 3)], dp_accounting.ComposedDpEvent([gauss] * 2), 2.0, 1.0
        ),
        1e-5,
    )
    assert (
        result["epsilon_total"] == pytest.approx(want, rel=1e-9) and result["epsilon_total"] > result["epsilon_naive"]
    )
    assert result["selected"] in [{"clip": 1.0}, {"clip": 2.0}] and len(result["trials"]) == result["repetitions"]
    final = Ledger.from_json((Path(result["final_run"]) / "ledger.json").read_text())
    assert [r.name for r in final] == ["round0.sum", "round1.sum"]


# ----- an accountant added by one class and one registration -------------------------------------
class PldCopy(PldAccountant):
    """The PLD accountant under another name (docs/contributing.md's worked example)."""

    name = "pld_copy"


@pytest.fixture
def pld_copy():
    """PldCopy registered for one test (registering at import would change every test's choices)."""
    register_accountant(PldCopy)
    try:
        yield "pld_copy"
    finally:
        unregister_accountant("pld_copy")


def _choices(parser, flag: str) -> list[str]:
    return [list(a.choices) for a in parser._actions if flag in a.option_strings][0]


def test_a_registered_accountant_is_offered_and_accounts_a_ledger(pld_copy, tmp_path, capsys):
    privacy = cli.build_parser()._subparsers._group_actions[0].choices["privacy"]
    assert _choices(privacy, "--accountant") == ["pld", "rdp", "zcdp", "mmcc", "pld_copy"]
    assert _choices(cli.algorithm_parser("altmin"), "--accountant") == ["pld", "rdp", "zcdp", "mmcc", "pld_copy"]
    releases = [
        Release(r, f"round{r}", "gaussian", 1.0, 2.0, 3.0, "all", dp_accounting.GaussianDpEvent(3.0)) for r in range(4)
    ]
    ledger = Ledger(releases)
    assert ledger_epsilon(ledger, 1e-5, "pld_copy") == ledger_epsilon(ledger, 1e-5, Accountant.PLD) > 0
    (tmp_path / "config.json").write_text(json.dumps({"algorithm": "altmin", "delta": 1e-5, "accountant": "pld"}))
    (tmp_path / "ledger.json").write_text(ledger.to_json())
    assert cli.main(["privacy", str(tmp_path), "--accountant", "pld_copy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["accountant"] == "pld_copy" and out["epsilon"] == ledger_epsilon(ledger, 1e-5)
    altmin = experiment("altmin").config_type
    cfg = config_lib.build(altmin, {"accountant": "pld_copy", "cohorts": "poisson", "sampling_rate": 0.1})
    assert cfg.accountant == "pld_copy"  # it inherits PLD's Poisson sampling: accepted where pld is


def test_the_top_level_parser_lists_accountants_lazily():
    """``fedpers --help`` stays fast: building the parser imports no accountant (the choices are read when used)."""
    import subprocess
    import sys

    code = "import sys; from fedpers.commands.cli import build_parser; build_parser(); print('fedpers.privacy.accountant' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_config_validation_names_the_registered_accountants(pld_copy):
    altmin = experiment("altmin").config_type
    with pytest.raises(ValueError, match=r"accountant must be one of pld, rdp, zcdp, mmcc, pld_copy; got 'nope'"):
        config_lib.build(altmin, {"accountant": "nope"})


def test_an_accountant_without_poisson_sampling_is_refused_for_poisson_cohorts():
    @register_accountant
    class RdpCopy(RdpAccountant):
        name = "rdp_copy"

    try:
        with pytest.raises(ValueError, match="accountant must be pld with cohorts poisson"):
            config_lib.build(
                experiment("fedrep").config_type, {"accountant": "rdp_copy", "cohorts": "poisson", "sampling_rate": 0.1}
            )
        assert math.isfinite(
            ledger_epsilon(
                Ledger([Release(0, "s", "gaussian", 1.0, 2.0, 2.0, "all", dp_accounting.GaussianDpEvent(2.0))]),
                1e-5,
                "rdp_copy",
            )
        )
    finally:
        unregister_accountant("rdp_copy")
