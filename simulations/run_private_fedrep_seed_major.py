"""The private_fedrep.toml grid with seeds as the outer loop (every ε gets its k-th seed before any
gets its (k+1)-th), one JSON line per run, so a time-boxed run still has every ε covered.

    PYTHONPATH=$PWD python simulations/run_private_fedrep_seed_major.py OUT.jsonl [SEEDS]
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import execute

spec = tomllib.loads((Path(__file__).parent / "private_fedrep.toml").read_text())
exp = EXPERIMENTS["fedrep"]
out = Path(sys.argv[1])
seeds = int(sys.argv[2]) if len(sys.argv) > 2 else spec["repetitions"]
for seed in range(seeds):
    for eps in spec["grid"]["epsilon"]:
        cfg = config.build(exp.config_type, {**spec["base"], "rounds": 5, "epsilon": eps, "seed": seed})
        r = execute(exp, cfg, write=False, progress=False)
        row = {
            "seed": seed,
            "epsilon": eps,
            "fedrep": r["population_mse"],
            "fedrep_subspace": r["subspace_error"],
            "fedrep_eps": r["epsilon"],
            "priv_altmin": r["baselines"]["priv_altmin"]["population_mse"],
            "priv_altmin_subspace": r["baselines"]["priv_altmin"]["subspace_error"],
            "priv_altmin_eps": r["baselines"]["priv_altmin"]["epsilon"],
            "init_only": r["baselines"]["private_init_only"]["population_mse"],
            "oracle": r["baselines"]["oracle"]["population_mse"],
        }
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
