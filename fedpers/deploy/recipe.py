"""`fedpers deploy certs DIR`: the keys, secrets, policy and commands of a lab's Flower deployment.

One directory per machine, each holding only what that machine needs (copy each to its machine,
into a directory of that machine's choosing, and nowhere else; every directory is 0700, every
private file 0600). Every path in the recipe is relative: each machine runs its commands from the
directory that holds its copy, so the recipe names no path of the machine that wrote it:

- ``ca/``: ``ca.key``, ``ca.crt`` — the lab's certificate authority (EC P-384). Needed only to
  issue certificates: keep it offline. No machine of the deployment reads it.
- ``superlink/``: ``superlink.crt``/``.key`` (TLS, for the hosts given), ``ca.crt``,
  ``superexec.secret`` (the SuperExec shared secret), ``policy.toml`` (the lab's privacy policy),
  ``supernode-I.pub`` (to register), ``configs/`` (empty: the only place a run's ``config-file`` is
  read from). ``flwr/config.toml`` (the ``flwr`` connection, loopback) is written on the SuperLink
  machine by the recipe's ``fedpers deploy connection superlink``: Flower requires its CA path absolute.
- ``supernode-I/``: ``supernode-I.key`` (its OpenSSH EC P-384 key, Flower's SuperNode
  authentication), ``ca.crt``, ``policy.toml``.
- ``commands.txt``: the recipe, one command per line group, in order; the README's recipe.

Flower 1.41 serves its Fleet, Control and Runtime APIs on one address, so the SuperLink listens
on 127.0.0.1 only and ``fedpers deploy fleet-proxy`` puts its Fleet API alone on the network
(:mod:`fedpers.deploy.fleetproxy`). See docs/flower.md (Security) for what each layer stops.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedpers.results.securefs import private_dir, write_private

if TYPE_CHECKING:
    from cryptography import x509

FLEET_PORT = 9092
"""The network port: ``fedpers deploy fleet-proxy`` (the Fleet API only)."""
LINK_PORT = 9093
"""The SuperLink's own port, on 127.0.0.1 (Fleet, Control and Runtime APIs)."""
NODE_PORT = 9094
"""SuperNode I's local Runtime API port is NODE_PORT + I (distinct, so nodes may share a host)."""
CHECKOUT = "/path/to/the/lab/checkout"
"""Where the recipe names the lab's checkout (the Flower app the job sends): each machine's own path."""
CONNECTION = "deployment"
"""The ``flwr`` connection name in ``superlink/flwr/config.toml``."""


@dataclass(frozen=True)
class Layout:
    """What ``fedpers deploy certs`` writes and the commands refer to."""

    out: Path
    hosts: tuple[str, ...]
    supernodes: int
    port: int = FLEET_PORT
    link_port: int = LINK_PORT
    node_port: int = NODE_PORT
    data_file: str = "/data/users.npz"
    listen: str = "0.0.0.0"
    app_hash: str = ""
    n_users: int = 300
    """The example job's declared shapes (the nodes' data files; the SuperLink machine reads none)."""
    dim: int = 10
    samples_per_user: int = 20

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError(
                "host: give at least one --host (the SuperLink's name or IP address as the SuperNodes reach it)"
            )
        for host in self.hosts:  # the first is the certificate's common name: 1-64 characters
            if not 1 <= len(host) <= 64 or any(c.isspace() for c in host):
                raise ValueError(f"host must be a name or IP address of 1 to 64 characters, no spaces; got {host!r}")
        if self.supernodes < 1:
            raise ValueError(f"supernodes must be an integer >= 1; got {self.supernodes}")
        for name in ("n_users", "dim", "samples_per_user"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {getattr(self, name)}")
        for name, port in (("port", self.port), ("link_port", self.link_port), ("node_port", self.node_port)):
            if not 1 <= port <= 65535 - (self.supernodes if name == "node_port" else 0):
                raise ValueError(f"{name} must be in 1..65535 (node_port + supernodes too); got {port}")
        ports = {self.port, self.link_port, *range(self.node_port, self.node_port + self.supernodes)}
        if len(ports) != 2 + self.supernodes:
            raise ValueError(
                f"port={self.port}, link_port={self.link_port} and node ports {self.node_port}..{self.node_port + self.supernodes - 1} must all differ"
            )

    def node(self, i: int) -> str:
        """SuperNode I's directory, as the recipe names it (relative to where its machine runs it)."""
        return f"supernode-{i}"

    @property
    def link(self) -> str:
        """The SuperLink machine's directory, as the recipe names it."""
        return "superlink"


DEFAULT_POLICY = """# The lab's privacy policy (fedpers/runtime/flower/policy.py): the same file on the SuperLink and every SuperNode.
federation = "{federation}"         # names the budget ledger ({federation}-budget.json beside this file)
trust-model = "{trust_model}"     # the weakest trust model the nodes' users accept (central < distributed < local)
max-epsilon = {max_epsilon}               # per user, summed over every run of this federation
max-delta = {max_delta}                 # per user, summed over every run of this federation
require-secure-noise = {secure}     # the ServerApp refuses secure-noise=false (noise reproducible from a seed)
min-units = {min_units}                   # no node computes a message over fewer users
algorithms = [{algorithms}]
max-rounds = 1000                 # no run has more rounds
max-seconds = 86400.0             # no round is sent after a run has taken this long
"""


def policy_text(
    federation: str = "lab",
    max_epsilon: float = 8.0,
    max_delta: float = 1e-4,
    min_units: int = 50,
    algorithms: Sequence[str] = ("altmin",),
    secure_noise: bool = True,
    trust_model: str = "central",
) -> str:
    """A policy TOML (validated by loading it back)."""
    import tempfile

    from fedpers.runtime.flower.policy import load_policy

    text = DEFAULT_POLICY.format(
        federation=federation,
        max_epsilon=repr(float(max_epsilon)),
        max_delta=repr(float(max_delta)),
        min_units=int(min_units),
        algorithms=", ".join(f'"{a}"' for a in algorithms),
        secure="true" if secure_noise else "false",
        trust_model=trust_model,
    )
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "policy.toml").write_text(text)
        load_policy(Path(d) / "policy.toml")
    return text


def _san(hosts: Sequence[str]) -> list[x509.GeneralName]:
    from cryptography import x509

    names: list[x509.GeneralName] = []
    for h in dict.fromkeys(
        [*hosts, "127.0.0.1"]
    ):  # 127.0.0.1: the loopback SuperLink and its proxy use one certificate
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def make_certs(layout: Layout, *, days: int = 365, force: bool = False, policy: str | None = None) -> dict[str, Path]:
    """Write the CA, the SuperLink's certificate, the SuperNode keys, the SuperExec secret, the policy
    and ``commands.txt`` into ``layout.out`` (see the module docstring); returns name → path."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = layout.out
    if not 1 <= days <= 3650:
        raise ValueError(f"days must be in 1..3650; got {days}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"dir: {out} is a file, not a directory; choose another directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(
            f"{out} exists and is not empty; choose another directory or pass --force to overwrite its keys"
        )
    policy = policy if policy is not None else policy_text()
    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM

    def private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        """A TLS private key as unencrypted PKCS#8 PEM (kept in a private directory)."""
        return key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpers deployment CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    link_key = ec.generate_private_key(ec.SECP384R1())
    link = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, layout.hosts[0])]))
        .issuer_name(ca_name)
        .public_key(link_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(_san(layout.hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    files: dict[str, Path] = {}

    def put(directory: Path, name: str, data: bytes, key: str | None = None) -> None:
        private_dir(directory)
        write_private(directory / name, data)
        files[key or f"{directory.name}/{name}"] = directory / name

    root = out  # the recipe's paths are relative to it (and to each machine's copy)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    link_dir = root / layout.link
    put(root / "ca", "ca.crt", ca.public_bytes(pem))
    put(root / "ca", "ca.key", private_pem(ca_key))
    put(link_dir, "ca.crt", ca.public_bytes(pem))
    put(link_dir, "superlink.crt", link.public_bytes(pem))
    put(link_dir, "superlink.key", private_pem(link_key))
    put(link_dir, "superexec.secret", secrets.token_hex(32).encode())
    put(link_dir, "policy.toml", policy.encode())
    from fedpers.deploy.serverside import CONFIG_DIR

    private_dir(link_dir / CONFIG_DIR)  # the only place a run's config-file is read from
    for i in range(layout.supernodes):
        key = ec.generate_private_key(ec.SECP384R1())
        node_dir = root / layout.node(i)
        put(
            node_dir,
            f"supernode-{i}.key",
            key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()),
        )
        put(node_dir, "ca.crt", ca.public_bytes(pem))
        put(node_dir, "policy.toml", policy.encode())
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
        put(link_dir, f"supernode-{i}.pub", pub)
    write_private(
        root / "commands.txt", commands(layout).encode()
    )  # the root holds only the per-machine directories and this
    files["commands.txt"] = root / "commands.txt"
    return files


def connection_toml(ca: Path, link_port: int) -> str:
    """``flwr``'s connection on the SuperLink machine: the loopback address, the lab's CA (an absolute
    path: Flower refuses a relative one)."""
    return (
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{link_port}"\n'
        f"root-certificates = {json.dumps(str(ca))}\n"
    )


def write_connection(directory: Path, link_port: int = LINK_PORT) -> Path:
    """``DIRECTORY/flwr/config.toml``: ``flwr``'s connection to the loopback SuperLink, naming this
    machine's copy ``DIRECTORY/ca.crt`` by its absolute path (written where the recipe runs, so the
    recipe itself names no path of the machine that wrote it). Returns the file written."""
    if not 1 <= link_port <= 65535:
        raise ValueError(f"link_port must be in 1..65535; got {link_port}")
    ca = Path(directory).resolve() / "ca.crt"
    if not ca.is_file():
        raise ValueError(f"dir: {ca} is missing; give the SuperLink's directory written by `fedpers deploy certs`")
    home = ca.parent / "flwr"
    private_dir(home)
    write_private(home / "config.toml", connection_toml(ca, link_port).encode())
    return home / "config.toml"


STEP = "## "
"""Each step of ``commands.txt`` starts with ``## N. MACHINE: what``; the lines up to the next step are its command."""


def commands(layout: Layout) -> str:
    """The recipe: every command with this layout's hosts and ports, and paths relative to the directory
    each machine runs it from (see the module docstring)."""
    L, n = layout.link, layout.supernodes
    trust = layout.app_hash or f'"$(fedpers deploy app-hash {CHECKOUT})"'
    flwr_home = f"FLWR_HOME={L}/flwr"
    lines = [
        "# fedpers deployment recipe, written by `fedpers deploy certs` (the README's recipe; docs/flower.md: what each layer stops).",
        f"# Copy {L}/ to the SuperLink machine and supernode-I/ to SuperNode I's machine, each into a directory of your choice,",
        "# and run that machine's commands from there (every path below is relative to it). Keep ca/ offline.",
        "# --trust-app: the FAB hash of the lab's checkout (`fedpers deploy app-hash DIR`; recompute after every code change,",
        f"# on every machine). Edit {L}/policy.toml before the first run (its trust-model: the weakest the nodes' users accept)",
        "# and copy it to every SuperNode.",
        "",
        f"{STEP}1. superlink: the SuperLink, on loopback only, answering only this uid (Flower serves its Control and Runtime APIs on",
        "#    the same port as the Fleet API; --allow-uid UID lets a lab member's own uid in, e.g. through ssh -L)",
        f"fedpers deploy superlink --host 127.0.0.1 --port {layout.link_port} --ssl-ca-certfile {L}/ca.crt --ssl-certfile {L}/superlink.crt \\",
        f"    --ssl-keyfile {L}/superlink.key --enable-supernode-auth --isolation process --superexec-auth-secret-file {L}/superexec.secret \\",
        "    --disable-runtime-dependency-installation",
        "",
        f"{STEP}2. superlink: its SuperExec (the shared secret), running only the lab's ServerApp, under the lab's policy",
        f"FEDPERS_POLICY={L}/policy.toml fedpers deploy superexec --trust-app {trust} --runtime-api-address 127.0.0.1:{layout.link_port} \\",
        f"    --root-certificates {L}/ca.crt --superexec-auth-secret-file {L}/superexec.secret",
        "",
        f"{STEP}3. superlink: the only network face, the Fleet API (SuperNodes connect to {layout.hosts[0]}:{layout.port})",
        f"fedpers deploy fleet-proxy --listen {layout.listen}:{layout.port} --superlink 127.0.0.1:{layout.link_port} --ssl-certfile {L}/superlink.crt \\",
        f"    --ssl-keyfile {L}/superlink.key --ssl-ca-certfile {L}/ca.crt",
        "",
        f"{STEP}4. superlink: flwr's connection ({L}/flwr/config.toml, naming this machine's {L}/ca.crt), then register every",
        "#    SuperNode's key (flwr reaches the loopback SuperLink as the lab's uid: run it there, or through",
        f"#    `ssh -N -L {layout.link_port}:127.0.0.1:{layout.link_port} SUPERLINK-MACHINE` as an --allow-uid user); note the node ids printed",
        f"fedpers deploy connection {L} --link-port {layout.link_port}",
        *[f"{flwr_home} flwr supernode register {L}/supernode-{i}.pub {CONNECTION}" for i in range(n)],
        "",
    ]
    for i in range(n):
        d = layout.node(i)
        lines += [
            f"{STEP}{5 + i}. supernode-{i}: SuperNode {i} on its machine (partition {i} of {n}; its users in {layout.data_file})",
            f"FEDPERS_POLICY={d}/policy.toml FEDPERS_NODE_CACHE={d}/cache FLWR_HOME={d}/flwr fedpers deploy supernode --trust-app {trust} \\",
            f"    --root-certificates {d}/ca.crt --auth-supernode-private-key {d}/supernode-{i}.key --superlink {layout.hosts[0]}:{layout.port} \\",
            f"    --port {layout.node_port + i} --node-config \"partition-id={i} num-partitions={n} data-file='{layout.data_file}'\"",
            "",
        ]
    ids = " ".join(f"ID{i}={i}" for i in range(n))
    lines += [
        f"{STEP}{5 + n}. superlink: the job; node-partitions maps every registered node id (step 4) to its partition",
        "#    The SuperLink machine holds no user data: the config declares the public shapes of the nodes' files",
        "#    (n_users, dim, samples_per_user: every node refuses a task its file does not match) and no data= path.",
        "#    --app: the lab's checkout on this machine (the app whose hash the machines trust); out: where the ServerApp writes.",
        "#    It runs the central trust model (dp-model, default central: the server adds the noise to the nodes' exact sums);",
        "#    dp-model='distributed' or 'local' in --run-config moves the noise to the nodes (docs/flower.md).",
        f"{flwr_home} fedpers deploy run {CONNECTION} --app {CHECKOUT} --run-config \"config='n_users={layout.n_users} dim={layout.dim} "
        f"samples_per_user={layout.samples_per_user} rank=2 epsilon=4.0 cohorts=\\\"all\\\"' out='/abs/path/run' node-partitions='{ids}'\"",
    ]
    return "\n".join(lines) + "\n"


def steps(text: str) -> list[tuple[str, str]]:
    """``commands.txt`` → [(machine, command)], the command's continuation lines joined (for tests and scripts)."""
    out: list[tuple[str, str]] = []
    machine = ""
    body: list[str] = []
    for line in [*text.splitlines(), STEP + "0. end: "]:
        if line.startswith(STEP):
            joined = "\n".join(body).replace("\\\n", " ")
            out += (
                [(machine, c.strip()) for c in joined.splitlines() if c.strip() and not c.startswith("#")]
                if machine
                else []
            )
            machine, body = line[len(STEP) :].split(": ", 1)[0].split(". ", 1)[1], []
        elif not line.startswith("#"):
            body.append(line)
    return out
