"""SecAgg+ over Flower Messages against central aggregation: one AltMin round in Flower's simulation.

For each number of nodes, three runs of the same tiny AltMin (2 users per node, d = 5, k = 2, every
user in each round, ε = 2) on Flower's Ray simulation, one after the other in this process:

- central: each node sends its clipped sums, the server adds them and the noise (``--dp-model central``);
- local: each node noises its units and sends its noisy sum (``--dp-model local``: node-side encoding,
  no secure aggregation);
- distributed: each node encodes, noises and masks its integer vector, in five Message stages per
  round (advertise keys, share keys, masked task, consistency, unmask; ``--dp-model distributed --bits 16``).

Timed: the steady round (the last of the run's rounds, from its record: the Ray start-up and the
nodes' first data loading fall in earlier ones), and the ratio of each to central's, measured side
by side in this run. The statistics here are small (W: 10, A: 55, b: 10 values), so the ratio is the
protocol's message and cryptography cost, not the arithmetic's.

    PYTHONPATH=$PWD python benchmarks/secagg_flower.py [--nodes 10,100] [--client-cpus 1] [--rounds 2]
        [--models central,local,distributed]

The floor (``--floor``): how much of SecAgg+'s cost is Flower's exchanges, not its work. For each number
of nodes, one simulation runs fedpers' central AltMin rounds, and after each steady round, on the same
Ray actors, two rounds of a bare ClientApp that computes nothing: one exchange with the central round's
bytes, and a *null SecAgg*, five exchanges with a SecAgg+ round's message types and sizes (keys, relayed
ciphertexts, the task with its relays, the survivor set, signatures, shares) and a node state of its
size kept in ``context.state``, no cryptography. ``--null-rounds`` chooses the null rounds: ``5`` is that one,
``3`` the fewest exchanges a round can have in steady state (the masked task; consistency, whose reply
carries the next round's advertised keys; unmask, whose message and reply carry the next round's share
stage, and a node state of two rounds), ``+crypto`` adds to each node's handler the library calls its stage
cannot avoid and to the server the rebuild of every self mask (``benchmarks/secagg_floor.py``, the same
calls). ``--null-rounds ''`` times fedpers' central round and the bare exchange alone. Medians of
``--steady-rounds`` rounds:

    PYTHONPATH=$PWD python benchmarks/secagg_flower.py --floor --nodes 1000 [--steady-rounds 3]
        [--null-rounds 5,3,3+crypto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedpers import config as config_lib
from fedpers.app import run_flower
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import secagg
from fedpers.privacy.accountant import Calibrations
from fedpers.runner import resolve

EXP = EXPERIMENTS["altmin"]
MODELS = ("central", "local", "distributed")


def one_run(nodes: int, model: str, args: argparse.Namespace) -> tuple[float, float, int]:
    """(seconds of the steady round, whole run's seconds, nodes that survived it) for one trust model."""
    cfg = config_lib.build(EXP.config_type, tiny_fields(nodes, args.rounds))
    opts: dict[str, Any] = {"runtime": "flower", "nodes": nodes, "dp_model": model, "round_timeout": 3600.0,
                            "client_cpus": args.client_cpus}  # fmt: skip
    if model == "distributed":
        opts["bits"] = 16
    p = resolve(EXP, cfg, config_lib.build(RuntimeOptions, opts))
    table = p.calibrations.table
    node_protocol = EXP.protocol(p.cfg, Calibrations(table)) if model != "central" else None
    start = time.perf_counter()
    _, records = run_flower(EXP, p.cfg, p.protocol, p.privatizer, p.options, progress=False, calibrations=table,
                            node_protocol=node_protocol)  # fmt: skip
    total = time.perf_counter() - start
    last = records[-1]
    return last.seconds, total, int(last.diagnostics.get("nodes_survived", nodes))


TAG = b"\x00" * 8
"""The round tag every call is bound to (its value changes no cost)."""


@dataclass
class Floor:
    """One SecAgg+ round's library calls for a node among ``nodes`` (``node_*``) and for the server
    (``server_*``), on keys and shares made once: the costs do not depend on the values. The null rounds with
    ``+crypto`` make them in Flower's processes; ``benchmarks/secagg_floor.py`` times them in one."""

    nodes: int
    length: int
    bits: int = 16
    degree: int = field(init=False)
    threshold: int = field(init=False)

    def __post_init__(self) -> None:
        # imported here: this script's functions travel to Flower's processes by value, and cloudpickle cannot
        # name cryptography's Rust classes by reference
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._new_x25519, self._new_ed25519 = X25519PrivateKey.generate, Ed25519PrivateKey.generate
        self.degree = min(secagg.plus_degree(self.nodes), self.nodes - 1)
        self.threshold = secagg.default_threshold(self.degree)
        d = self.degree
        self._peers = [X25519PrivateKey.generate().public_key().public_bytes_raw() for _ in range(d)]
        self._own = X25519PrivateKey.generate()
        self._channels = [AESGCM(os.urandom(32)) for _ in range(d)]
        self._plain = bytes(2 * secagg.SHARE_BYTES)
        self._sent = [(n := os.urandom(12)) + ch.encrypt(n, self._plain, TAG) for ch in self._channels]
        self._message = secagg.survivors_message(TAG, range(self.nodes))
        signer = Ed25519PrivateKey.generate()
        self._signer, self._verifier = signer, signer.public_key()
        self._signature = signer.sign(self._message)
        self._shares = secagg.split_secret(os.urandom(secagg.SEED_BYTES), self.threshold, d + 1)[: self.threshold]

    def node_keys(self) -> None:
        c, g = self._new_x25519(), self._new_ed25519()
        s = secagg.mask_key(os.urandom(secagg.SEED_BYTES), TAG)
        for key in (c, s, g):
            key.public_key().public_bytes_raw()

    def node_split(self) -> None:
        for _ in range(2):  # b_i and the seed of s_i^sk
            secagg.split_secret(os.urandom(secagg.SEED_BYTES), self.threshold, self.degree + 1)

    def node_channels(self) -> None:
        for pk in self._peers:
            secagg.agree(self._own, pk, b"channel" + TAG)

    def node_encrypt(self) -> None:
        for ch in self._channels:
            nonce = os.urandom(12)
            ch.encrypt(nonce, self._plain, TAG)

    def node_decrypt(self) -> None:
        for ch, blob in zip(self._channels, self._sent, strict=True):
            ch.decrypt(blob[:12], blob[12:], TAG)

    def node_pair_keys(self) -> None:
        for pk in self._peers:
            secagg.agree(self._own, pk, b"mask" + TAG)

    def node_masks(self) -> None:
        secagg._self_mask(os.urandom(secagg.SEED_BYTES), TAG, self.length, self.bits)
        for _ in range(self.degree):
            secagg.mask(os.urandom(32), self.length, self.bits)

    def node_sign(self) -> None:
        self._signer.sign(self._message)

    def node_verify(self) -> None:
        for _ in range(self.degree):
            self._verifier.verify(self._signature, self._message)

    def server_combine(self) -> None:
        secagg.combine_secret(self._shares)

    def server_self_mask(self) -> None:
        secagg._self_mask(os.urandom(secagg.SEED_BYTES), TAG, self.length, self.bits)

    def groups(self) -> dict[str, tuple[str, Callable[[], None]]]:
        """Name → (who, one call of it): the rows of the table, in a round's order."""
        return {
            "round keys (2 X25519, HKDF, Ed25519)": ("node", self.node_keys),
            "Shamir.split x 2": ("node", self.node_split),
            "channel keys (X25519 + HKDF) x degree": ("node", self.node_channels),
            "AES-GCM encrypt x degree": ("node", self.node_encrypt),
            "AES-GCM decrypt x degree": ("node", self.node_decrypt),
            "pair-mask keys (X25519 + HKDF) x degree": ("node", self.node_pair_keys),
            "mask expansion (AES-CTR) x (degree + 1)": ("node", self.node_masks),
            "Ed25519 sign": ("node", self.node_sign),
            "Ed25519 verify x degree": ("node", self.node_verify),
            "Shamir.combine (t shares)": ("server", self.server_combine),
            "self mask expansion (HKDF + AES-CTR)": ("server", self.server_self_mask),
        }


NULL = "bench.null"
"""Record of a null-SecAgg message: the stage, and the bytes its reply carries."""

NULL_STAGES = {
    "5": ("advertise", "share", "masked", "consistency", "unmask"),
    "3": ("masked", "consistency+advertise", "unmask+share"),
}
"""A null round's exchanges: SecAgg+'s five, or the three of a steady state that carries the next round's
advertise and share stages inside this round's consistency and unmask."""

STAGE_CALLS = {
    "advertise": ("node_keys",),
    "share": ("node_channels", "node_split", "node_encrypt"),
    "masked": ("node_decrypt", "node_pair_keys", "node_masks"),
    "consistency": ("node_sign",),
    "unmask": ("node_verify",),
    "consistency+advertise": ("node_sign", "node_keys"),
    "unmask+share": ("node_verify", "node_channels", "node_split", "node_encrypt"),
}
"""The library calls (``benchmarks/secagg_floor.py``'s ``Floor``) a node's handler makes at each stage."""


def null_sizes(nodes: int) -> dict[str, Any]:
    """A SecAgg+ round's message and state sizes at ``nodes`` nodes (degree and threshold as the protocol's)."""
    degree = min(secagg.plus_degree(nodes), nodes - 1)
    cipher = 12 + 2 * secagg.SHARE_BYTES + 16  # nonce, the two shares, the AES-GCM tag
    return {"degree": degree, "cipher": cipher, "key": secagg.KEY_BYTES}


def tiny_fields(nodes: int, rounds: int) -> dict[str, Any]:
    """The tiny AltMin of this benchmark at ``nodes`` nodes (2 users a node)."""
    return {"n_users": 2 * nodes, "dim": 5, "rank": 2, "samples_per_user": 16, "rounds": rounds,
            "cohorts": "all", "epsilon": 2.0, "seed": 0, "baselines": "none"}  # fmt: skip


def masked_length() -> int:
    """D: the length of a node's masked vector in the tiny AltMin (its padded statistics, concatenated)."""
    from fedpers.privacy.distributed import flat_dim, padded_dim

    protocol = EXP.protocol(config_lib.build(EXP.config_type, tiny_fields(1, 1)))
    return sum(padded_dim(flat_dim(s.shape, s.symmetric)) for s in protocol.stat_specs(1))


_FLOORS: dict[tuple[int, int], Floor] = {}


def _floor_calls(nodes: int, length: int) -> Floor:
    """This process's ``Floor`` for ``nodes`` nodes and a masked vector of ``length`` (its keys and shares made
    once a process: a handler makes only the calls of its stage)."""
    key = (nodes, length)
    if key not in _FLOORS:
        _FLOORS[key] = Floor(*key)
    return _FLOORS[key]


def floor(nodes: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of fedpers' central rounds, of one bare exchange with their bytes, and of each null SecAgg of
    ``args.null_rounds`` (bare exchanges with SecAgg+'s sizes), interleaved on one simulation's Ray actors."""
    from flwr.app import ConfigRecord, MessageType, RecordDict
    from flwr.app import Message as FlowerMessage
    from flwr.clientapp import ClientApp

    from fedpers.app import flower_job, simulate_objects
    from fedpers.app import make_client_app as fedpers_client
    from fedpers.privacy import Privatizer
    from fedpers.privacy.distributed import flat_dim
    from fedpers.runner import split_seed
    from fedpers.runtime.flower.server import exchange
    from fedpers.runtime.flower.simulation import run_flower as run_on_grid

    cfg, noise_seed = split_seed(config_lib.build(EXP.config_type, tiny_fields(nodes, args.steady_rounds + 1)))
    protocol = EXP.protocol(cfg)
    job = flower_job(EXP, cfg, protocol)
    opts = config_lib.build(
        RuntimeOptions, {"runtime": "flower", "nodes": nodes, "round_timeout": 3600.0, "client_cpus": args.client_cpus}
    )
    central_reply = 8 * sum(flat_dim(s.shape, s.symmetric) for s in protocol.stat_specs(1))
    length = masked_length()
    masked_reply = 8 * length
    task = len(job.config_json) + len(job.calibrations_json) + 8 * cfg.dim * cfg.rank
    z = null_sizes(nodes)
    d, key, cipher = z["degree"], z["key"], z["cipher"]
    variants = [v for v in args.null_rounds.split(",") if v]
    fedpers_app, client = fedpers_client(), ClientApp()

    def _answer(message: FlowerMessage, context: Any) -> FlowerMessage | None:
        rec = message.content.get(NULL)
        if not isinstance(rec, ConfigRecord):
            return None
        stage, n, rounds = str(rec["stage"]), int(str(rec["nodes"])), int(str(rec.get("states", 1)))
        if stage != "central":  # the node's round state(s), as SecAgg+ keeps it (its survivor set packed at unmask)
            context.state["bench.state"] = ConfigRecord(
                {
                    "keys": bytes(rounds * (3 * 32 + 3 * d * key)),
                    "held": bytes(rounds * 2 * (d + 1) * 20),
                    "signed": bytes(8 * n),
                }
            )
        spent: dict[str, float] = {}
        if bool(rec.get("crypto", False)):  # the calls' CPU time (this thread's) and wall time come back
            calls = _floor_calls(n, int(str(rec["length"])))
            cpu, wall = time.thread_time(), time.perf_counter()
            for name in STAGE_CALLS[stage]:
                getattr(calls, name)()
            spent = {"cpu": time.thread_time() - cpu, "wall": time.perf_counter() - wall}
        shares = {"ids": list(range(d + 1)), "kinds": "b" * (d + 1), "shares": [bytes(20)] * (d + 1)}
        blobs = {"ids": list(range(d)), "blobs": [bytes(cipher)] * d}
        keys = {"c-pk": bytes(key), "s-pk": bytes(key), "g-pk": bytes(key)}
        replies: dict[str, dict[str, Any]] = {
            "central": {"stats": bytes(central_reply)},
            "advertise": keys,
            "share": blobs,
            "masked": {"stats": bytes(masked_reply)},
            "consistency": {"signature": bytes(64)},
            "unmask": shares,
            "consistency+advertise": {"signature": bytes(64), **keys},
            "unmask+share": {**shares, "next-ids": blobs["ids"], "next-blobs": blobs["blobs"]},
        }
        return FlowerMessage(RecordDict({NULL: ConfigRecord({**replies[stage], **spent})}), reply_to=message)

    @client.train()
    def _train(message: FlowerMessage, context: Any) -> FlowerMessage:
        return _answer(message, context) or fedpers_app(message, context)

    @client.query()
    def _query(message: FlowerMessage, context: Any) -> FlowerMessage:
        return _answer(message, context) or fedpers_app(message, context)

    def server(grid: Any, context: Any) -> dict[str, list[float]]:  # in Flower's simulation process
        out: dict[str, list[float]] = defaultdict(list)
        ids: list[int] = []
        n = len(range(nodes))

        def one(stage: str, kind: str, body: dict[str, Any], extra: dict[str, Any]) -> tuple[float, float]:
            """One exchange; the summed CPU and wall seconds of the nodes' library calls (+crypto)."""
            rec = ConfigRecord({"stage": stage, "nodes": n, **extra, **body})
            replies = exchange(grid, [FlowerMessage(RecordDict({NULL: rec}), i, kind) for i in ids], 3600.0)
            assert len(replies) == len(ids) and not any(r.has_error() for r in replies)
            got = [r.content[NULL] for r in replies]
            return tuple(sum(float(str(g.get(k, 0.0))) for g in got) for k in ("cpu", "wall"))  # type: ignore[return-value]

        signed = {"ids": list(range(n)), "signers": list(range(d)), "signatures": [bytes(64)] * d}
        neighbour_keys = {"c-pk": [bytes(key)] * d, "s-pk": [bytes(key)] * d, "g-pk": [bytes(key)] * d}
        messages: dict[str, tuple[str, dict[str, Any]]] = {
            "advertise": (MessageType.QUERY, {"round": 1, "min-nodes": 1, "bits": 16}),
            "share": (MessageType.QUERY, {"ids": list(range(d)), **neighbour_keys}),
            "masked": (
                MessageType.TRAIN,
                {"task": bytes(task), "secagg-from": list(range(d)), "secagg-blobs": [bytes(cipher)] * d},
            ),
            "consistency": (MessageType.QUERY, {"ids": list(range(n))}),
            "unmask": (MessageType.QUERY, signed),
            "consistency+advertise": (MessageType.QUERY, {"ids": list(range(n)), "round": 2}),
            "unmask+share": (MessageType.QUERY, {**signed, "next-ids": list(range(d)), **neighbour_keys}),
        }

        def null_round(variant: str) -> float:
            exchanges, _, crypto = variant.partition("+")
            extra = {"states": 2 if exchanges == "3" else 1, "crypto": bool(crypto), "length": length}
            start = time.perf_counter()
            spent = [one(stage, *messages[stage], extra) for stage in NULL_STAGES[exchanges]]
            if crypto:  # the server rebuilds every survivor's self mask before the sum is released
                calls = _floor_calls(n, length)
                cpu, wall = time.thread_time(), time.perf_counter()
                for _ in range(n):
                    calls.server_combine()
                    calls.server_self_mask()
                spent.append((time.thread_time() - cpu, time.perf_counter() - wall))
                out[f"{variant}: server's calls, CPU"].append(spent[-1][0])
                out[f"{variant}: server's calls, wall"].append(spent[-1][1])
                out[f"{variant}: nodes' calls, CPU"].append(sum(c for c, _ in spent[:-1]))
                out[f"{variant}: nodes' calls, wall"].append(sum(w for _, w in spent[:-1]))
            return time.perf_counter() - start

        def central_round() -> float:
            start = time.perf_counter()
            one("central", MessageType.TRAIN, {"task": bytes(task)}, {})
            return time.perf_counter() - start

        def on_round(record: Any, state: Any) -> None:
            if record.round == 0:  # the first round loads every node's users and warms the actors
                central_round()
                for v in variants:
                    null_round(v)
                out.clear()
                return
            out["fedpers central"].append(record.seconds)
            out["bare central"].append(central_round())
            for v in variants:
                out[v].append(null_round(v))

        run_on_grid(job, 2 * nodes, protocol, Privatizer(noise_seed), opts, grid=grid, device=cfg.device,
                    progress=False, on_round=on_round, on_discovery=lambda f: ids.extend(f.nodes.values()))  # fmt: skip
        return dict(out)

    found: dict[str, list[float]] = simulate_objects(server, client, opts)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="10,100")
    p.add_argument("--rounds", type=int, default=2, help="AltMin rounds (the last one is timed)")
    p.add_argument("--client-cpus", type=float, default=1.0)
    p.add_argument("--models", default=",".join(MODELS), help="comma list of central, local, distributed")
    p.add_argument("--floor", action="store_true", help="the null-SecAgg floor against central (see the docstring)")
    p.add_argument("--steady-rounds", type=int, default=3, help="--floor: steady rounds (medians)")
    p.add_argument("--null-rounds", default="5", help="--floor: comma list of 5, 3, 5+crypto, 3+crypto ('': none)")
    a = p.parse_args()
    if a.floor:
        for v in [v for v in a.null_rounds.split(",") if v]:
            exchanges, _, crypto = v.partition("+")
            if exchanges not in NULL_STAGES or crypto not in ("", "crypto"):
                p.error(f"--null-rounds: {v!r} is not one of 5, 3, 5+crypto, 3+crypto")
        print(
            "seconds of a round on Flower's Ray simulation, interleaved on the same actors (medians of steady rounds)"
        )
        for n in [int(v) for v in a.nodes.split(",")]:
            med = {k: statistics.median(v) for k, v in floor(n, a).items()}
            c, b = med.pop("fedpers central"), med.pop("bare central")
            print(f"{n} nodes: fedpers central {c:.2f} s, bare central {b:.2f} s ({b / c:.2f} x central)", flush=True)
            for v, z in med.items():
                if ":" in v:  # the library calls' seconds summed over the nodes, or the server's
                    print(f"    {v:<36} {z:>8.2f} s", flush=True)
                else:
                    print(
                        f"  null SecAgg+ {v:<9} {z:>8.2f} s  {z / c:>6.2f} x central  {z / b:>6.2f} x bare", flush=True
                    )
        return
    models = [m for m in MODELS if m in a.models.split(",")]
    if "central" not in models or len(models) < 2:
        p.error("--models must hold central and at least one other (the ratios are to central)")
    print("seconds of one steady AltMin round on Flower's Ray simulation (whole run in brackets)")
    print(
        f"{'nodes':>6} {'central':>16} {'local':>16} {'distributed':>16} {'local/central':>14} {'SecAgg+/central':>16}"
    )
    for n in [int(v) for v in a.nodes.split(",")]:
        got: dict[str, tuple[float, float, int]] = {}
        for m in models:  # each printed as it finishes: a long run killed later keeps what it measured
            got[m] = one_run(n, m, a)
            print(f"  {n} nodes, {m}: steady round {got[m][0]:.2f} s (whole run {got[m][1]:.1f} s)", flush=True)
        if "distributed" in got:
            assert got["distributed"][2] == n, "every node should survive the timed round"
        cells = " ".join(f"{got[m][0]:>7.2f} ({got[m][1]:>6.1f})" if m in got else f"{'-':>16}" for m in MODELS)
        c = got["central"][0]
        ratios = " ".join(f"{got[m][0] / c:>14.1f}" if m in got else f"{'-':>14}" for m in ("local", "distributed"))
        print(f"{n:>6} {cells} {ratios}", flush=True)


if __name__ == "__main__":
    main()
