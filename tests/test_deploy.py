"""`fedpers deploy certs`: a CA, a SuperLink certificate for the hosts, SuperNode keys Flower reads."""
from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from fedpers.cli import main


def test_certs_chain_hosts_keys_and_permissions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "certs"
    assert main(["deploy", "certs", str(out), "--host", "link.lab.org", "--host", "10.0.0.5", "--supernodes", "2"]) == 0
    printed = capsys.readouterr().out
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    link = x509.load_pem_x509_certificate((out / "superlink.crt").read_bytes())
    link.verify_directly_issued_by(ca)  # raises if the chain is broken
    san = link.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["link.lab.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5")]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for i in range(2):
        key = load_ssh_private_key((out / f"supernode-{i}.key").read_bytes(), None)  # what flower-supernode reads
        pub = load_ssh_public_key((out / f"supernode-{i}.pub").read_bytes())  # what `flwr supernode register` reads
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        assert key.public_key().public_numbers() == pub.public_numbers()
        assert stat.S_IMODE((out / f"supernode-{i}.key").stat().st_mode) == 0o600
        assert f"--auth-supernode-private-key {out.resolve()}/supernode-{i}.key" in printed
    assert stat.S_IMODE((out / "ca.key").stat().st_mode) == 0o600 and stat.S_IMODE((out / "superlink.key").stat().st_mode) == 0o600
    assert "--enable-supernode-auth" in printed and "--insecure" not in printed
    assert f"flwr supernode register {out.resolve()}/supernode-1.pub deployment" in printed


def test_flower_accepts_the_supernode_public_key(tmp_path: Path) -> None:
    from flwr.cli.supernode.register import try_load_public_key

    assert main(["deploy", "certs", str(tmp_path / "c"), "--host", "127.0.0.1"]) == 0
    assert try_load_public_key(tmp_path / "c" / "supernode-0.pub")


def test_certs_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "c"
    assert main(["deploy", "certs", str(out)]) == 2
    assert "give at least one --host" in capsys.readouterr().err
    assert main(["deploy", "certs", str(out), "--host", "h", "--supernodes", "0"]) == 2
    assert "supernodes must be an integer >= 1" in capsys.readouterr().err
    assert main(["deploy", "certs", str(out), "--host", "h"]) == 0
    before = (out / "ca.key").read_bytes()
    assert main(["deploy", "certs", str(out), "--host", "h"]) == 2
    assert "pass --force" in capsys.readouterr().err and (out / "ca.key").read_bytes() == before
    assert main(["deploy", "certs", str(out), "--host", "h", "--force"]) == 0 and (out / "ca.key").read_bytes() != before
