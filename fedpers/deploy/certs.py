"""`fedpers deploy certs DIR`: what a lab needs to run the Flower apps across machines securely.

Public Flower only (``cryptography`` writes the files; the commands are Flower's own CLIs).

Writes, with the ``cryptography`` library:

- ``ca.crt`` / ``ca.key``: a certificate authority (EC P-384) of the lab;
- ``superlink.crt`` / ``superlink.key``: the SuperLink's TLS certificate, signed by the CA,
  for the given host names and IP addresses (subjectAltName);
- ``supernode-I.key`` / ``supernode-I.pub``: one OpenSSH EC P-384 key pair per SuperNode, the
  format Flower 1.41's SuperNode authentication reads (``--auth-supernode-private-key``) and
  registers (``flwr supernode register``);
- ``commands.txt``: the exact SuperLink, SuperNode, registration and ``config.toml`` lines.

Private keys are written with mode 0600; an existing directory is refused unless ``force``.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import Sequence

PORT = 8000
"""Flower 1.41's SuperLink serves SuperNodes and ``flwr`` on one HTTP(S) port (``--host``/``--port``)."""


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600 if private else 0o644)


def _san(hosts: Sequence[str]) -> list:
    from cryptography import x509

    names: list = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def make_certs(out: str | Path, hosts: Sequence[str], supernodes: int, *, days: int = 365, force: bool = False) -> dict[str, Path]:
    """Create the CA, the SuperLink certificate and ``supernodes`` SuperNode key pairs in ``out``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out)
    if not hosts:
        raise ValueError("host: give at least one --host (the SuperLink's name or IP address as the SuperNodes reach it)")
    if supernodes < 1:
        raise ValueError(f"supernodes must be an integer >= 1; got {supernodes}")
    if not 1 <= days <= 3650:
        raise ValueError(f"days must be in 1..3650; got {days}")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} exists and is not empty; choose another directory or pass --force to overwrite its keys")
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    pem = serialization.Encoding.PEM
    private_pem = dict(encoding=pem, format=serialization.PrivateFormat.PKCS8, encryption_algorithm=serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpers deployment CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    link_key = ec.generate_private_key(ec.SECP384R1())
    link = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])).issuer_name(ca_name)
        .public_key(link_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(_san(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    files = {"ca.crt": out / "ca.crt", "ca.key": out / "ca.key", "superlink.crt": out / "superlink.crt", "superlink.key": out / "superlink.key"}
    _write(files["ca.crt"], ca.public_bytes(pem), private=False)
    _write(files["ca.key"], ca_key.private_bytes(**private_pem), private=True)
    _write(files["superlink.crt"], link.public_bytes(pem), private=False)
    _write(files["superlink.key"], link_key.private_bytes(**private_pem), private=True)
    for i in range(supernodes):
        key = ec.generate_private_key(ec.SECP384R1())
        files[f"supernode-{i}.key"] = out / f"supernode-{i}.key"
        files[f"supernode-{i}.pub"] = out / f"supernode-{i}.pub"
        _write(files[f"supernode-{i}.key"], key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()), private=True)
        _write(files[f"supernode-{i}.pub"], key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n", private=False)
    files["commands.txt"] = out / "commands.txt"
    _write(files["commands.txt"], commands(out, hosts[0], supernodes).encode(), private=False)
    return files


def commands(out: Path, host: str, supernodes: int) -> str:
    """The lines a lab runs, with this directory's files (copy each SuperNode's key to its machine)."""
    d = out.resolve()
    lines = [
        "# 1. SuperLink (on the machine reachable as " + host + "):",
        f"flower-superlink --host 0.0.0.0 --port {PORT} --ssl-ca-certfile {d}/ca.crt --ssl-certfile {d}/superlink.crt \\",
        f"    --ssl-keyfile {d}/superlink.key --enable-supernode-auth --disable-runtime-dependency-installation",
        "",
        "# 2. The flwr connection (FLWR_HOME/config.toml of whoever runs `flwr`):",
        "[superlink.deployment]",
        f'address = "{host}:{PORT}"',
        f'root-certificates = "{d}/ca.crt"',
        "",
        "# 3. Register every SuperNode's public key (only registered SuperNodes may connect):",
        *[f"flwr supernode register {d}/supernode-{i}.pub deployment" for i in range(supernodes)],
        "",
        "# 4. SuperNode i on its machine (copy ca.crt and supernode-i.key there; mode 0600); `fedpers deploy supernode`",
        "#    is flower-supernode (same flags) with warm ClientApps and 0.2 s polls; --trust-app: it runs only this",
        "#    app (fedpers deploy app-hash DIR of the lab's checkout; recompute after every code change):",
        *[
            f"FEDPERS_NODE_CACHE=$HOME/.cache/fedpers-node fedpers deploy supernode --root-certificates {d}/ca.crt \\\n"
            f"    --auth-supernode-private-key {d}/supernode-{i}.key --superlink {host}:{PORT} \\\n"
            f"    --trust-app \"$(fedpers deploy app-hash /path/to/fedpers)\" \\\n"
            f"    --node-config \"partition-id={i} num-partitions={supernodes} data-file='/data/users.npz'\""
            for i in range(supernodes)
        ],
        "",
        "# 5. The job (secure noise is the default of deployment runs); with node-partitions the partitions",
        "#    come from the registered SuperNode ids printed in step 3, not from what the nodes claim:",
        "#    (`fedpers deploy run` = flwr run + flwr log --stream + flwr ls: it exits non-zero if the run did not complete)",
        "fedpers deploy run deployment --run-config \"config='data=\\\"/data/users.npz\\\" rank=2 epsilon=8.0' out='/abs/path/run' node-partitions='ID0=0 ID1=1'\"",
    ]
    return "\n".join(lines) + "\n"
