"""Where a deployment round's time goes: per-exchange segments read off the timestamped logs of a kept run.

Run ``benchmarks/deployment_round.py`` with ``--keep DIR --flower-debug`` (``FLWR_LOG_LEVEL=DEBUG``:
every Flower process logs with millisecond timestamps), then

    python benchmarks/deployment_trace.py DIR/poll-central DIR/poll-distributed

For each kept deployment it prints, per message type (``train``: the round's task; ``query.secagg``:
a SecAgg+ stage), the median of each segment of one exchange as the SuperNodes log it, and, from the
SuperLink's log, how long the ServerApp took from the last node's reply of an exchange to its next push
(its reply polling, pulling the replies' objects, its own work, building the next stage) and the calls
the exchange cost at the SuperLink (the ServerApp's and the nodes'). Round 0's exchanges and the discovery
query are left out (round 0 fills the node cache); a run ends with the ServerApp's last push.

Segments of one exchange at a node, in the order they happen:

- ``pull msg``: the SuperNode received a message's header until it had pulled its objects (it may wait for
  the ServerApp, which pushes the objects after the header);
- ``to fork``: the message's objects pulled until the ClientApp's fork first called the node (negative: the
  SuperExec acquired the task and forked while the node was still pulling the objects);
- ``fork: task input``: the fork's first call until it loaded the ClientApp (its task input with the FAB,
  the message and its objects);
- ``app: handler``: ClientApp loading and the handler (the stage's work), until its reply was pushed;
- ``reply to link``: the fork's task ended until the SuperNode had pushed the reply to the SuperLink;
- ``wait next``: the reply sent until the next message reached this node (the other nodes, the ServerApp,
  this node's poll).
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
from datetime import datetime
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+):\s+(.*)")
NODE_EVENTS = (
    ("Receiving:", "received"),
    ("Received successfully", "pulled"),
    ("Runtime.SendTaskHeartbeat", "forked"),
    ("Loading ClientApp", "loading"),
    ("Runtime.PushMessages", "replied"),
    ("Finished task", "finished"),
    ("Sent successfully", "sent"),
)
SEGMENTS = (
    ("pull msg", "received", "pulled"),
    ("to fork", "pulled", "forked"),
    ("fork: task input", "forked", "loading"),
    ("app: handler", "loading", "replied"),
    ("reply to link", "finished", "sent"),
    ("wait next", "sent", "next"),
)
LINK_CALLS = (
    "Runtime.PushMessages",
    "Runtime.PushObject",
    "Runtime.PullMessages",
    "Runtime.PullObject",
    "[Fleet.PushMessages]",
    "[Fleet.PushObject]",
    "[Fleet.PullObject]",
    "[Fleet.ConfirmMessageReceived]",
)
ROUND = re.compile(r"\[RUN \d+, ROUND (\d+)\]")


def lines(path: Path) -> list[tuple[float, str]]:
    """The timestamped lines of one process's log, as (seconds since the epoch, message)."""
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        m = STAMP.match(ANSI.sub("", raw))
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((stamp, m.group(2)))
    return out


def node_exchanges(path: Path) -> list[dict[str, float | str]]:
    """One SuperNode's messages, each with the first time of each event of :data:`NODE_EVENTS` after it arrived."""
    messages: list[dict[str, float | str]] = []
    round = -1
    for stamp, text in lines(path):
        if m := ROUND.match(text):
            round = int(m.group(1))
        for prefix, event in NODE_EVENTS:
            if not text.startswith(prefix):
                continue
            if event == "received":
                if messages:
                    messages[-1]["next"] = stamp
                messages.append({"kind": text.split()[1], "received": stamp, "round": float(round)})
            elif messages and event not in messages[-1]:
                messages[-1][event] = stamp
    return messages


def trace(run: Path) -> None:
    """Print the medians of one kept deployment's exchanges (its SuperNodes' and SuperLink's logs)."""
    segments: dict[tuple[str, str], list[float]] = {}
    first = float("inf")  # when the first message of round 1 reached a node
    for log in sorted(run.glob("supernode*.log")):
        for message in node_exchanges(log):
            if float(message["round"]) < 1:
                continue
            first = min(first, float(message["received"]))
            for name, start, end in SEGMENTS:
                a, b = message.get(start), message.get(end)
                if isinstance(a, float) and isinstance(b, float):
                    segments.setdefault((str(message["kind"]), name), []).append(b - a)
    link = lines(run / "superlink.log")
    pushes = [t for t, text in link if text.startswith("Runtime.PushMessages")]
    pushes = pushes[max(sum(1 for t in pushes if t < first) - 1, 0) :]  # from round 1's first push on
    replies = [t for t, text in link if text.startswith("[Fleet.PushMessages]")]
    server: list[float] = []
    calls = dict.fromkeys(LINK_CALLS, 0)
    for a, b in itertools.pairwise(pushes):
        last = [t for t in replies if a < t < b]
        if last:
            server.append(b - max(last))
    since = pushes[0] if pushes else float("inf")
    for stamp, text in link:
        for call in LINK_CALLS:
            if stamp >= since and text.startswith(call):
                calls[call] += 1
    exchanges = max(len(pushes), 1)
    print(f"{run.name}: {exchanges} exchanges after round 0 (medians in ms, n = samples)")
    for (kind, name), values in sorted(segments.items()):
        print(f"  {kind:14s} {name:18s} {1000 * statistics.median(values):7.0f}   n={len(values)}")
    if server:
        print(f"  ServerApp: last reply -> next push {1000 * statistics.median(server):7.0f}   n={len(server)}")
    print("  calls at the SuperLink per exchange: " + ", ".join(f"{c} {n / exchanges:.1f}" for c, n in calls.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="deployment directories kept by deployment_round.py --keep")
    for run in p.parse_args().runs:
        trace(run)


if __name__ == "__main__":
    main()
