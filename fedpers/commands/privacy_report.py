"""`fedpers privacy RUN_DIR`: the ledger of a run and the (ε, δ) an accountant gives for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedpers.commands.summary import LEDGER_COLUMNS, label, ledger_rows, text_table
from fedpers.configs.privacy import check_accountant
from fedpers.privacy import Ledger, ledger_epsilon
from fedpers.privacy.accountant import how_accounted, ledger_neighbours
from fedpers.privacy.ledger import SkellamDpEvent
from fedpers.results.rundir import read_run


def _accountant(given: str | None, cfg: dict[str, Any]) -> str:
    """The accountant asked for, else the run's own (pld when its config names none); must be registered."""
    name = str(given or cfg.get("accountant", "pld"))
    check_accountant(name)
    return name


def privacy_summary(run_dir: str | Path, accountant: str | None = None) -> dict[str, Any]:
    """The (ε, δ) of the releases a run actually made (complete or not) and its ledger."""
    run = read_run(run_dir)
    cfg = run["config"]
    ledger = Ledger.from_json(run["ledger_text"])
    delta = float(cfg.get("delta", 1e-5))
    acc = _accountant(accountant, cfg)
    relation = ledger_neighbours(ledger).value  # what the releases were accounted for, complete run or not
    neighbours = run.get("result", {}).get("privacy", {}).get("neighbouring", f"{relation} user")
    accounted = how_accounted(ledger, acc)
    return {
        "run_dir": str(run_dir),
        "algorithm": cfg.get("algorithm"),
        "complete": run["complete"],
        "releases": len(ledger),
        "epsilon": ledger_epsilon(ledger, delta, acc),
        "delta": delta,
        "accountant": accounted["accountant"],
        "accountant_asked": acc,
        "dp_model": accounted["dp_model"],
        "bits": accounted["bits"],
        "composition": accounted["composition"],
        "neighbouring": neighbours,
        "neighbours": relation,
        "groups": len(ledger.groups()),
        "paper_epsilon_same_noise": run.get("result", {}).get("privacy", {}).get("paper_epsilon_same_noise"),
        "error": run.get("error", {}).get("error"),
        "ledger": [r.to_dict() for r in ledger],
    }


def privacy_report(run_dir: str | Path, accountant: str | None = None, *, quiet: bool = False) -> str:
    """The run's ledger as a table and its (ε, δ); ``quiet``: the (ε, δ) line alone (for a script)."""
    run = read_run(run_dir)
    cfg = run["config"]
    ledger = Ledger.from_json(run["ledger_text"])
    delta = float(cfg.get("delta", 1e-5))
    acc = _accountant(accountant, cfg)
    status = "" if run["complete"] else "  INCOMPLETE: the run did not finish; these are the releases it made"
    lines = [f"run: {run_dir}  algorithm: {cfg.get('algorithm')}  releases: {len(ledger)}{status}", ""]
    header = [label(c) for c in LEDGER_COLUMNS]  # the report's ledger has the same columns and labels
    lines += text_table(header, ledger_rows(ledger), left=(1, 2, 3))
    eps = ledger_epsilon(ledger, delta, acc)
    neighbours = run.get("result", {}).get("privacy", {}).get("neighbouring", f"{ledger_neighbours(ledger).value} user")
    level = next((f"{unit}-level" for unit in ("prompt", "example", "column") if unit in neighbours), "user-level")
    accounted = how_accounted(ledger, acc)
    by = accounted["accountant"]
    spent = f"{level} (ε, δ) = ({eps:.4g}, {delta:g}) by the {by} accountant, {neighbours} neighbours"
    if quiet:
        return spent + ("" if run["complete"] else " (INCOMPLETE run: the releases it made)")
    lines += ["", spent]
    bits = f", {accounted['bits']}-bit sums" if accounted["bits"] is not None else ""
    lines.append(f"  trust model: {accounted['dp_model']}{bits}; {accounted['composition']}")
    if any(isinstance(r.event, SkellamDpEvent) for r in ledger) and acc != by:
        lines.append(
            f"  (asked for {acc}: a Skellam release has no {acc} bound, so the whole ledger is accounted in RDP)"
        )
    if len(ledger.groups()) > 1:
        lines.append(f"  (parallel composition over {len(ledger.groups())} disjoint groups; worst group reported)")
    priv = run.get("result", {}).get("privacy", {})
    if "paper_epsilon_same_noise" in priv:
        lines.append(
            f"the paper's calibration would claim ε = {float(priv['paper_epsilon_same_noise']):.4g} for the same noise"
        )
    if "error" in run:
        lines.append(
            f"note: the run failed after {run['error'].get('rounds_completed')} round(s): {run['error'].get('error')}"
        )
    return "\n".join(lines)
