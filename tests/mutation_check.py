"""Plants each privacy wiring mistake in a scratch copy and shows which tests catch it.

    python tests/mutation_check.py            # every mutation; exits 1 if one goes uncaught
    python tests/mutation_check.py NAME ...   # only these (substring match)

Not collected by pytest (it runs pytest itself, once per mutation). Each run stops at the first
failing test (``-x``), the files most likely to catch the mutation first, so a caught mutation
costs seconds to a few minutes; every file run is part of the default suite. The test that fails is
then run on the real tree: one that fails there too caught nothing, and the mistake counts as uncaught. One mistake is
planted per class of privacy-at-the-edges mistake: the public item universe, per-user failures, the sampled PSD
bound, a statistic's bound applied to another kind, a release the calibration forgets, a refusal
after a release, resume bookkeeping, the sampling rate and the estimator's divisor; and one per
class an independent review found the suite missing (the per-user item cap, the sampled PSD bound
at large q, the calibration's full-resolution step-up, the shared Poisson sample, the budget
ledger's run key, the sampled estimator's divisor, a data value in a result, a seeded draw under secure noise).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALTMIN = "fedpers/protocols/altmin.py"
TESTS = [
    "tests/test_privacy_e2e.py",
    "tests/test_ledger_params.py",
    "tests/test_altmin.py",
    "tests/test_privacy_bookkeeping.py",
    "tests/test_psd_sampled.py",
    "tests/test_rating_files.py",
    "tests/test_long_format.py",
    "tests/test_npz_rows.py",
]
MECHANISMS = "fedpers/privacy/mechanisms.py"
RATINGS = "fedpers/data/rating_files.py"

MUTATIONS: dict[str, tuple[str, ...]] = {
    "A clip removed": (
        ALTMIN,
        "            log_v,\n            self.eta,\n",
        "            log_v,\n            math.inf,\n",
    ),
    "init label clip removed": (
        "fedpers/linalg.py",
        "        block = max(block, DEVICE_BLOCK)\n    coef = clip_scalar(y[:, 0::2], label_clip) * clip_scalar(y[:, 1::2], label_clip)",
        "        block = max(block, DEVICE_BLOCK)\n    coef = y[:, 0::2] * y[:, 1::2]",
    ),
    "init label clip removed on the nodes' batched path": (
        "fedpers/linalg.py",
        ':func:`sym`)."""\n    coef = clip_scalar(y[:, 0::2], label_clip) * clip_scalar(y[:, 1::2], label_clip)',
        ':func:`sym`)."""\n    coef = y[:, 0::2] * y[:, 1::2]',
        "tests/test_node_batched.py",
    ),
    "b label clip removed": (
        ALTMIN,
        "label=linalg.clip_scalar(y[:, q : 2 * q], self.zeta),",
        "label=y[:, q : 2 * q],",
    ),
    "A noised with b's bound": (
        ALTMIN,
        'summed.stats["A"],\n            per_unit_bound=a_bound,',
        'summed.stats["A"],\n            per_unit_bound=b_bound,',
    ),
    "disjoint cohort filter removed": (
        ALTMIN,
        "            keep = self.cohort_of(ids) == round\n",
        "            keep = None\n",
    ),
    # ----- the public item universe, per-user failures, sampled PSD tightening, bookkeeping -----
    "item universe read off the data": (
        RATINGS,
        "    frame, users, summary = clean(frame, universe, rating_min, rating_max)",
        "    universe = tuple(sorted(set(frame['item'].dropna().tolist())))\n    frame, users, summary = clean(frame, universe, rating_min, rating_max)",
        "tests/test_rating_files.py",
    ),
    "one user's bad rating refuses the file": (
        RATINGS,
        "        if count:\n            dropped[reason]",
        "        if count and reason != 'missing user id':\n            raise ValueError(f'{reason}: {count} rows')\n        if count:\n            dropped[reason]",
        "tests/test_rating_files.py",
    ),
    "one user's NaN feature refuses a long-format file": (
        "fedpers/data/long_format.py",
        '            reasons[f"{kind} {col!r} missing, NaN or infinite"] = bad',
        "            reasons[f\"{kind} {col!r} missing, NaN or infinite\"] = bad\n            if bad.any():\n                raise ValueError(f'{col}: NaN')",
        "tests/test_long_format.py",
    ),
    "string feature column silently left out": (
        "fedpers/data/long_format.py",
        "            feature_columns = tuple(c for c in names if c not in (user_column, label_column))",
        "            feature_columns = tuple(c for c in names if c not in (user_column, label_column) and _numeric(schema.field(c).type))",
        "tests/test_long_format.py",
    ),
    "PSD √2 tightening kept under Poisson sampling": (
        MECHANISMS,
        "        tighten = psd_units and sampling_probability >= 1.0",
        "        tighten = psd_units",
        "tests/test_psd_sampled.py",
    ),
    "PSD bound claimed for a non-PSD statistic": (
        MECHANISMS,
        "        if psd_units:\n            check_psd_sum(value, name)",
        "        pass",
        "tests/test_psd_sampled.py",
    ),
    "DPALS total entry left out of the sums' bound": (
        "fedpers/protocols/dpals.py",
        "        return math.sqrt(2.0) * self.rating_bound",
        "        return self.rating_bound",
        "tests/test_privacy_e2e.py",
    ),
    "calibration forgets DPALS's round 0": (
        "fedpers/experiments/dpals/protocol.py",
        "    return 2 * cfg.steps + 2 * int(prelude(cfg))",
        "    return 2 * cfg.steps",
        "tests/test_privacy_bookkeeping.py",
    ),
    "config refused after round 0 has released": (
        "fedpers/experiments/dpals/protocol.py",
        '        if not (math.isfinite(g) and math.isfinite(b)):\n            raise ValueError("clip_embedding and clip_rating must be finite for a finite epsilon")',
        "        pass",
        "tests/test_privacy_bookkeeping.py",
    ),
    "resume drops a recorded release that is not re-drawn": (
        "fedpers/privacy/ledger.py",
        "            self.settle()\n        self._releases.append(release)",
        "            self._recorded = []\n        self._releases.append(release)",
        "tests/test_privacy_bookkeeping.py",
    ),
    "sampler draws at another rate than the ledger records": (
        MECHANISMS,
        "        return torch.rand(n, generator=self.sampling_generator, dtype=torch.float64) < q",
        "        return torch.rand(n, generator=self.sampling_generator, dtype=torch.float64) < min(1.0, 1.5 * q)",
        "tests/test_privacy_bookkeeping.py",
    ),
    "FedRep divides by the realised cohort size": (
        "fedpers/protocols/fedrep.py",
        '        U = state["U"].to(G.dtype) - self.learning_rate * G / divisor',
        '        U = state["U"].to(G.dtype) - self.learning_rate * G / max(summed.count, 1)',
        "tests/test_privacy_bookkeeping.py",
    ),
    # ----- correlated noise (fedpers/privacy/correlated.py): the participation's sensitivity -----
    "single-participation sensitivity while users take part every K rounds": (
        "fedpers/privacy/correlated.py",
        "        S = p.nonzero().squeeze(1)\n",
        "        S = p.nonzero().squeeze(1)[:1]\n",
        "tests/test_correlated.py",
    ),
    "non-negative shortcut used for a C with negative entries": (
        "fedpers/privacy/correlated.py",
        "        elif bool((off >= -tol).all()):",
        "        elif True:",
        "tests/test_correlated.py",
    ),
    "BLT noise that is not C⁻¹z (the buffers never take the new noise)": (
        "fedpers/privacy/correlated.py",
        "            self.history = [theta * beta + w for theta, beta in zip(self.buf_decay, buffers, strict=True)]",
        "            self.history = [theta * beta for theta, beta in zip(self.buf_decay, buffers, strict=True)]",
        "tests/test_correlated.py",
    ),
    "optimiser not compared with independent noise (its result or the square root kept where C = I is better)": (
        "fedpers/privacy/correlated.py",
        "if bool(torch.isfinite(c).all())] + [identity]\n",
        "if bool(torch.isfinite(c).all())]\n",
        "tests/test_correlated.py",
    ),
    "amplified correlated noise without the max column norm (σ of one participation too small)": (
        "fedpers/privacy/correlated.py",
        "(s if self.amplified else s / math.sqrt(p))",
        "(1.0 if self.amplified else s / math.sqrt(p))",
        "tests/test_amplified.py",
    ),
    "add-remove noise at the replace-one scale (σ halved: the sensitivity read as 2·bound)": (
        MECHANISMS,
        "        noise_std = z * sensitivity / factor if z > 0 else 0.0\n",
        "        noise_std = z * sensitivity / 2 if z > 0 else 0.0\n",
        "tests/test_neighbours_relation.py",
    ),
}


# ----- the suite's own gaps found by an independent review: the item cap, the sampled PSD bound at
# large q, the calibration's full-resolution step-up, the shared Poisson sample, the budget ledger's
# run key, the sampled estimator's divisor -----
MUTATIONS.update(
    {
        "DPALS round 0 ignores the per-user item cap": (
            "fedpers/protocols/dpals.py",
            "    sel = selected(mask, items_per_user)\n    r_unit, log_rn = linalg.directions(ratings * sel",
            "    sel = mask\n    r_unit, log_rn = linalg.directions(ratings * sel",
            "tests/test_privacy_e2e.py",
        ),
        "PSD √2 tightening kept for sampling rates q >= 0.5": (
            MECHANISMS,
            "        tighten = psd_units and sampling_probability >= 1.0",
            "        tighten = psd_units and sampling_probability >= 0.5",
            "tests/test_psd_sampled.py",
        ),
        "coarse-grid calibration accepted without the full-resolution step-up": (
            "fedpers/privacy/accountant.py",
            "            while eps > target_epsilon:\n                z *= 1.0 + 1e-4\n                eps = eps_at(z)\n            return z",
            "            return z",
            "tests/test_privacy.py",
        ),
        "AltMin's b not tagged with the round's shared Poisson sample": (
            ALTMIN,
            "params={**b_params, **shared},",
            'params={**b_params, **{k: v for k, v in shared.items() if k != "poisson_sample"}},',
            "tests/test_poisson.py",
        ),
        "a new run in a reused out directory treated as already charged": (
            "fedpers/runtime/flower/policy.py",
            "key = f\"{Path(job.out).resolve() if job.out is not None else ''}|flwr-run-{run_id}\"",
            "key = f\"{Path(job.out).resolve() if job.out is not None else ''}\"",
            "tests/test_policy.py",
        ),
        "NoisyHead's Poisson estimator divides by N, not q·N": (
            "fedpers/protocols/noisyhead.py",
            "        return self.prompts * self.sampling_rate\n",
            "        return self.prompts\n",
            "tests/test_poisson.py",
        ),
        "dpattention writes the data's condition values into its result": (
            "fedpers/protocols/dpattention.py",
            '"conditions": {c.name: {"holds": c.holds, "text": c.text} for c in release.conditions},',
            '"conditions": {c.name: c.to_dict() for c in release.conditions},',
            "tests/test_dpattention.py",
        ),
        "private tuning draws its repetition count from the seeded generator under --secure-noise": (
            "fedpers/sweeps/tuning.py",
            'tuner = Privatizer(derived_seed(seed, "tuning"), secure=secure_noise)',
            'tuner = Privatizer(derived_seed(seed, "tuning"))',
            "tests/test_tuning.py",
        ),
        # ----- the nodes' noise (distributed and local DP), which the audit of those trust models scores -----
        "Skellam noise shares sized for all nodes while min_nodes < nodes are required": (
            "fedpers/runtime/distributed.py",
            "dist.noise_share(plan.encodings[s.name], plan.honest, generator)",
            "dist.noise_share(plan.encodings[s.name], plan.nodes, generator)",
            "tests/test_distributed.py",
            "tests/test_audit.py",
        ),
        "local DP noise at half its scale": (
            "fedpers/runtime/distributed.py",
            "clipped, plan.noise_multiplier * enc.bound, draws, privatizer.secure",
            "clipped, plan.noise_multiplier * enc.bound / 2, draws, privatizer.secure",
            "tests/test_distributed.py",
            "tests/test_audit.py",
        ),
        # ----- what a dishonest server controls: the state the releases give, the job's calibration, the schedule -----
        "local DP's units not re-clipped on their node": (
            "fedpers/runtime/distributed.py",
            "clipped = dist.clip_rows(rows[s.name], enc.bound)",
            "clipped = rows[s.name]",
            "tests/test_dishonest_broadcasts.py",
        ),
        "a local-DP node adds the job's calibrated z unchecked": (
            "fedpers/runtime/distributed.py",
            "        if calibrations.asked:  # the nodes' noise is the table's z itself",
            "        if False:  # the nodes' noise is the table's z itself",
            "tests/test_dishonest_broadcasts.py",
        ),
        "a node without a store computes a round twice": (
            "fedpers/runtime/flower/client.py",
            "        check_once(context, task.round)\n",
            "        pass\n",
            "tests/test_dishonest_broadcasts.py",
        ),
    }
)


def failing_tests(tree: Path, first: tuple[str, ...] = ()) -> list[str]:
    """The first failing test of the default-suite files (``first`` before the rest), or []."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    files = [*first, *(t for t in TESTS if t not in first)]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-rf", *files],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [line[len("FAILED ") :].split(" - ")[0] for line in out.splitlines() if line.startswith("FAILED ")]


def passes_unmutated(test: str) -> bool:
    """Whether ``test`` passes on the real tree: a test that fails without the planted mistake
    catches nothing, so a mutation it "catches" counts as uncaught."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return (
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", test],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        ).returncode
        == 0
    )


def main(only: list[str]) -> int:
    uncaught = []
    for name, (path, old, new, *first) in MUTATIONS.items():
        if only and not any(o in name for o in only):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "tree"
            shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", "*.egg-info"))
            source = (tree / path).read_text()
            if source.count(old) != 1:
                raise SystemExit(f"{name}: the code to mutate is not found once in {path}")
            (tree / path).write_text(source.replace(old, new))
            start = time.perf_counter()
            failed = failing_tests(tree, tuple(first))
        if failed and not passes_unmutated(failed[0]):
            print(f"| {name} | {path} | NOT CAUGHT: {failed[0]} fails without the mistake too | |", flush=True)
            uncaught.append(name)
            continue
        print(
            f"| {name} | {path} | {'caught by ' + failed[0] if failed else 'NOT CAUGHT'} | {time.perf_counter() - start:.0f} s |",
            flush=True,
        )
        if not failed:
            uncaught.append(name)
    if uncaught:
        print(f"NOT CAUGHT: {uncaught}")
    return 1 if uncaught else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
