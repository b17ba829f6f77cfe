"""`fedpers deploy certs`: a CA, a SuperLink certificate for the hosts, SuperNode keys Flower reads."""

from __future__ import annotations

import ipaddress
import re
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from fedpers.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_certs_chain_hosts_keys_and_permissions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "certs"
    assert main(["deploy", "certs", str(out), "--host", "link.lab.org", "--host", "10.0.0.5", "--supernodes", "2"]) == 0
    printed = capsys.readouterr().out
    ca = x509.load_pem_x509_certificate((out / "ca" / "ca.crt").read_bytes())
    link = x509.load_pem_x509_certificate((out / "superlink" / "superlink.crt").read_bytes())
    link.verify_directly_issued_by(ca)  # raises if the chain is broken
    san = link.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["link.lab.org"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.5"),
        ipaddress.ip_address("127.0.0.1"),
    ]  # + the loopback SuperLink
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for i in range(2):
        key = load_ssh_private_key(
            (out / f"supernode-{i}" / f"supernode-{i}.key").read_bytes(), None
        )  # what flower-supernode reads
        pub = load_ssh_public_key(
            (out / "superlink" / f"supernode-{i}.pub").read_bytes()
        )  # what `flwr supernode register` reads
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        assert key.public_key().public_numbers() == pub.public_numbers()
        assert stat.S_IMODE((out / f"supernode-{i}" / f"supernode-{i}.key").stat().st_mode) == 0o600
        assert f"--auth-supernode-private-key supernode-{i}/supernode-{i}.key" in printed
    assert (
        stat.S_IMODE((out / "ca" / "ca.key").stat().st_mode) == 0o600
        and stat.S_IMODE((out / "superlink" / "superlink.key").stat().st_mode) == 0o600
    )
    assert "--enable-supernode-auth" in printed and "--insecure" not in printed
    assert "flwr supernode register superlink/supernode-1.pub deployment" in printed


def test_flower_accepts_the_supernode_public_key(tmp_path: Path) -> None:
    from flwr.cli.supernode.register import try_load_public_key

    assert main(["deploy", "certs", str(tmp_path / "c"), "--host", "127.0.0.1"]) == 0
    assert try_load_public_key(tmp_path / "c" / "superlink" / "supernode-0.pub")


def test_certs_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "c"
    assert main(["deploy", "certs", str(out)]) == 2
    assert "give at least one --host" in capsys.readouterr().err
    assert main(["deploy", "certs", str(out), "--host", "h", "--supernodes", "0"]) == 2
    assert "supernodes must be an integer >= 1" in capsys.readouterr().err
    missing = tmp_path / "lab-policy.toml"
    assert main(["deploy", "certs", str(tmp_path / "p"), "--host", "h", "--policy", str(missing)]) == 2
    assert f"--policy: {missing} is not a file" in capsys.readouterr().err and not (tmp_path / "p").exists()
    assert main(["deploy", "certs", str(out), "--host", "h"]) == 0
    before = (out / "ca" / "ca.key").read_bytes()
    assert main(["deploy", "certs", str(out), "--host", "h"]) == 2
    assert "pass --force" in capsys.readouterr().err and (out / "ca" / "ca.key").read_bytes() == before
    assert (
        main(["deploy", "certs", str(out), "--host", "h", "--force"]) == 0
        and (out / "ca" / "ca.key").read_bytes() != before
    )


def test_certs_print_the_jobs_declared_shapes_and_refuse_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    shape = ["--n-users", "5000", "--dim", "20", "--samples-per-user", "32"]
    assert main(["deploy", "certs", str(tmp_path / "c"), "--host", "h", *shape]) == 0
    assert "n_users=5000 dim=20 samples_per_user=32 " in capsys.readouterr().out
    assert main(["deploy", "certs", str(tmp_path / "d"), "--host", "h", "--dim", "0"]) == 2
    assert "dim must be an integer >= 1; got 0" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_deploy_run_refuses_a_timeout_that_is_not_seconds(capsys: pytest.CaptureFixture) -> None:
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as e:
            main(["deploy", "run", "deployment", "--timeout", bad])
        assert (
            e.value.code == 2 and f"--timeout: must be a number of seconds >= 0; got '{bad}'" in capsys.readouterr().err
        )


def test_each_machine_gets_only_its_own_keys_and_the_recipe_names_a_port_per_node(tmp_path: Path) -> None:
    """The CA key is in ca/ only; the SuperLink's directory holds no private key but its
    own TLS key; node I's directory holds node I's key only; every directory is 0700 and every file
    0600; commands.txt has one SuperNode line per node with its own --port and partition, a
    node-partitions entry per node, the SuperExec secret, the policy and the loopback SuperLink."""
    out = tmp_path / "c"
    assert (
        main(
            [
                "deploy",
                "certs",
                str(out),
                "--host",
                "link.lab.org",
                "--supernodes",
                "3",
                "--port",
                "7001",
                "--link-port",
                "7002",
                "--node-port",
                "7010",
            ]
        )
        == 0
    )
    owned = {d.name: sorted(p.name for p in d.rglob("*") if p.is_file()) for d in out.iterdir() if d.is_dir()}
    assert owned["ca"] == ["ca.crt", "ca.key"]
    assert owned["superlink"] == [
        "ca.crt",
        "policy.toml",
        "superexec.secret",
        "superlink.crt",
        "superlink.key",
        "supernode-0.pub",
        "supernode-1.pub",
        "supernode-2.pub",
    ]
    for i in range(3):
        assert owned[f"supernode-{i}"] == ["ca.crt", "policy.toml", f"supernode-{i}.key"]
    for p in out.rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    text = (out / "commands.txt").read_text()
    from fedpers.deploy.recipe import steps

    lines = steps(text)
    link = [c for m, c in lines if c.startswith("fedpers deploy superlink")][0]  # the uid-gated SuperLink
    assert (
        "--host 127.0.0.1 --port 7002" in link
        and "--isolation process" in link
        and "--superexec-auth-secret-file" in link
        and "0.0.0.0" not in link
    )
    assert any("fleet-proxy --listen 0.0.0.0:7001 --superlink 127.0.0.1:7002" in c for _, c in lines)
    nodes = [(m, c) for m, c in lines if "deploy supernode" in c]
    assert [m for m, _ in nodes] == ["supernode-0", "supernode-1", "supernode-2"]
    for i, (_, c) in enumerate(nodes):
        assert (
            f"--port {7010 + i} " in c
            and f"partition-id={i} num-partitions=3" in c
            and "--superlink link.lab.org:7001" in c
        )
        assert f"FEDPERS_POLICY=supernode-{i}/policy.toml " in c and "superlink/" not in c
    assert "node-partitions='ID0=0 ID1=1 ID2=2'" in text and "ca/ca.key" not in text


def test_the_recipe_names_no_path_of_the_machine_that_wrote_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe copied to another machine or user works there: no file `fedpers deploy certs` writes holds
    its directory's absolute path (nor the working directory's), every path a command names is relative
    (the data file is the lab's declared one, the checkout a placeholder for each machine's), and the policy names its trust model instead of a silent default."""
    import shlex

    from fedpers.deploy.recipe import CHECKOUT, steps
    from fedpers.runtime.flower.policy import load_policy

    work = tmp_path / "operator-home"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["deploy", "certs", "lab", "--host", "link.lab.org", "--supernodes", "2", "--app", str(ROOT)]) == 0
    for f in (work / "lab").rglob("*"):
        if f.is_file():
            text = f.read_bytes()
            assert str(tmp_path).encode() not in text and str(ROOT).encode() not in text, f
    for machine, command in steps((work / "lab" / "commands.txt").read_text()):
        for token in shlex.split(command):
            value = token.split("=", 1)[1] if re.match(r"^[A-Z_]+=", token) else token
            assert not value.startswith("/") or value in ("/data/users.npz", CHECKOUT), (machine, token)
    assert 'trust-model = "central"' in (work / "lab" / "superlink" / "policy.toml").read_text()
    assert load_policy(work / "lab" / "superlink" / "policy.toml").trust_model == "central"


def test_the_connection_is_written_on_the_superlink_machine_with_its_absolute_ca(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Step 4's `fedpers deploy connection superlink`, run from where the SuperLink's copy lies: flwr's
    config.toml names that copy's ca.crt absolutely (Flower refuses a relative one), private like every key."""
    import tomllib

    monkeypatch.chdir(tmp_path)
    assert main(["deploy", "certs", "lab", "--host", "h"]) == 0
    moved = tmp_path / "elsewhere"
    (tmp_path / "lab").rename(moved)
    monkeypatch.chdir(moved)
    assert main(["deploy", "connection", "superlink", "--link-port", "7002"]) == 0
    written = moved / "superlink" / "flwr" / "config.toml"
    conn = tomllib.loads(written.read_text())["superlink"]["deployment"]
    assert conn == {"address": "127.0.0.1:7002", "root-certificates": str(moved / "superlink" / "ca.crt")}
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and stat.S_IMODE(written.parent.stat().st_mode) == 0o700
    capsys.readouterr()
    assert main(["deploy", "connection", "nowhere"]) == 2
    assert "nowhere/ca.crt is missing" in capsys.readouterr().err


def test_deployment_processes_get_the_recipes_relative_paths_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy (and configs/ beside it), node cache and Flower home a deploy process starts with stay the
    same files in every process it starts, whatever directory those run in."""
    from fedpers.deploy.isolation import isolated_env

    monkeypatch.chdir(tmp_path)
    env = isolated_env(
        {"FEDPERS_POLICY": "superlink/policy.toml", "FLWR_HOME": "superlink/flwr", "FEDPERS_NODE_CACHE": ""}
    )
    assert env["FEDPERS_POLICY"] == str(tmp_path / "superlink" / "policy.toml")
    assert env["FLWR_HOME"] == str(tmp_path / "superlink" / "flwr") and env["FEDPERS_NODE_CACHE"] == ""
    assert isolated_env(env) == env  # already isolated: a re-executed process is not re-executed again
