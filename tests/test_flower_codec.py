"""Flower message encoding, partitions and run-config parsing (no Flower run needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedpers import config as config_lib
from fedpers.app import from_run_config, parse_pairs
from fedpers.experiments import EXPERIMENTS
from fedpers.protocols.base import Message
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.partition import unit_ranges


def test_reply_round_trip_keeps_values_and_dtypes():
    msg = Message({"A": torch.randn(4, 4, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float32)}, 7, 2)
    back = codec.decode_reply(codec.encode_reply(msg, 3, "d"), expect=(3, "d"))
    assert back.count == 7 and back.zeroed == 2 and set(back.stats) == {"A", "b"}
    for k in msg.stats:
        assert back.stats[k].dtype == msg.stats[k].dtype
        torch.testing.assert_close(back.stats[k], msg.stats[k], rtol=0, atol=0)


def test_a_reply_to_another_round_or_broadcast_is_refused():
    broadcast = {"U": torch.eye(3, 2, dtype=torch.float64)}
    digest = codec.broadcast_digest(2, broadcast)
    assert digest != codec.broadcast_digest(1, broadcast)
    assert digest != codec.broadcast_digest(2, {"U": torch.eye(3, 2, dtype=torch.float64) * 2})
    content = codec.encode_reply(Message({"b": torch.zeros(2)}, 1), 2, digest)
    assert codec.decode_reply(content, expect=(2, digest)).count == 1
    with pytest.raises(codec.MalformedReply, match="replayed or stale"):
        codec.decode_reply(content, expect=(3, codec.broadcast_digest(3, broadcast)))
    with pytest.raises(codec.MalformedReply, match="replayed or stale"):
        codec.decode_reply(
            content, expect=(2, codec.broadcast_digest(2, {"U": torch.zeros(3, 2, dtype=torch.float64)}))
        )


def test_messages_are_three_flower_objects_and_large_tensors_one_chunked_array(monkeypatch):
    """Flower 1.41 moves each object with a call of its own on every hop: a task and a reply
    are a Message, its RecordDict and one ConfigRecord; above INLINE_BYTES, one Array more."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    def objects(content: RecordDict) -> int:
        return 1 + len(get_all_nested_objects(content))  # the Message itself, its RecordDict, the records …

    job = codec.Job("altmin", "{}", "abc")
    broadcast = {"U": torch.randn(50, 3, dtype=torch.float64), "round": torch.tensor(2)}
    reply = Message({"A": torch.randn(150, 150, dtype=torch.float64), "b": torch.randn(150, dtype=torch.float64)}, 4)
    assert objects(codec.encode_task(job, 1, range(0, 5), codec.broadcast_record(broadcast))) == 3
    assert objects(codec.encode_reply(reply, 1, "d", symmetric=["A"])) == 3
    monkeypatch.setattr(codec, "INLINE_BYTES", 1000)
    content = codec.encode_reply(reply, 1, "d", symmetric=["A"])
    assert objects(content) == 6  # + ArrayRecord, Array, its one chunk
    back = codec.decode_reply(content, expect=(1, "d"))
    assert torch.equal(back.stats["A"], reply.stats["A"].triu() + reply.stats["A"].triu(1).T) and torch.equal(
        back.stats["b"], reply.stats["b"]
    )
    task = codec.decode_task(codec.encode_task(job, 1, range(0, 5), codec.broadcast_record(broadcast)))
    assert all(torch.equal(task.broadcast[k], v) for k, v in broadcast.items())


def test_task_round_trip():
    job = codec.Job("altmin", '{"seed": 1}', "abc")
    content = codec.encode_task(
        job, 3, range(10, 20), codec.broadcast_record({"U": torch.eye(3, 2, dtype=torch.float64)})
    )
    task = codec.decode_task(content)
    assert (task.job, task.round, task.start, task.stop) == (job, 3, 10, 20)
    torch.testing.assert_close(task.broadcast["U"], torch.eye(3, 2, dtype=torch.float64))


@pytest.mark.parametrize("inline", [True, False])
def test_a_rounds_tasks_copied_from_one_checked_record_equal_tasks_built_alone(inline, monkeypatch):
    """GridGather builds a round's tasks from one TaskEncoder: each node's task carries exactly the
    entries (and the shared broadcast Array, above INLINE_BYTES) of a task built alone, its own
    range only, and no task's range leaks into the shared record or another task."""
    if not inline:
        monkeypatch.setattr(codec, "INLINE_BYTES", 100)
    job = codec.Job("altmin", '{"seed": 1}', "abc", '{"z": 1.5}')
    packed = codec.broadcast_record({"U": torch.randn(50, 3, dtype=torch.float64)})
    encode = codec.TaskEncoder(job, 4, packed)
    tasks = [encode(r) for r in (range(0, 3), range(3, 7), range(7, 8))]
    for r, content in zip((range(0, 3), range(3, 7), range(7, 8)), tasks):
        alone = codec.encode_task(job, 4, r, packed)
        assert dict(content[codec.JOB]) == dict(alone[codec.JOB]) and set(content) == set(alone)
        assert content.array_records.keys() == alone.array_records.keys()
        task = codec.decode_task(content)
        assert (task.job, task.round, task.start, task.stop) == (job, 4, r.start, r.stop)
    assert codec.UNIT_START not in encode.record and codec.UNIT_STOP not in encode.record
    assert (tasks[0][codec.JOB][codec.UNIT_START], tasks[0][codec.JOB][codec.UNIT_STOP]) == (0, 3)


def _tag(**extra) -> ConfigRecord:
    return ConfigRecord(
        {codec.ROUND: 0, codec.DIGEST_OF_BROADCAST: "x", codec.UNITS: 1, codec.LAYOUT: "[]", codec.BLOB: b"", **extra}
    )


F8 = lambda *shape: json.dumps([["A", "<f8", list(shape)]])


@pytest.mark.parametrize(
    "content, match",
    [
        (RecordDict({}), "lacks"),
        (RecordDict({codec.TAG: _tag(**{codec.UNITS: 2.0})}), "integer"),
        (RecordDict({codec.TAG: _tag(**{codec.UNITS: [1, 2]})}), "integer"),
        (RecordDict({codec.TAG: _tag(**{codec.ZEROED: True})}), "integer"),
        (
            RecordDict(
                {
                    codec.TAG: ConfigRecord(
                        {codec.ROUND: 0, codec.DIGEST_OF_BROADCAST: "x", codec.LAYOUT: "[]", codec.BLOB: b""}
                    )
                }
            ),
            "lacks",
        ),
        (
            RecordDict({codec.TAG: ConfigRecord({codec.ROUND: 0, codec.DIGEST_OF_BROADCAST: "x", codec.UNITS: 1})}),
            "lacks its tensors",
        ),
        (RecordDict({codec.TAG: _tag(**{codec.LAYOUT: "not json"})}), "lacks its tensors"),
        (RecordDict({codec.TAG: _tag(**{codec.LAYOUT: F8(2), codec.BLOB: b"12"})}), "needs 16 bytes"),
        (RecordDict({codec.TAG: _tag(**{codec.LAYOUT: F8(1), codec.BLOB: bytes(9)})}), "1 bytes beyond"),
        (RecordDict({codec.TAG: _tag(**{codec.LAYOUT: F8(-1)})}), "bad tensor layout"),
        (
            RecordDict({codec.TAG: _tag(**{codec.LAYOUT: json.dumps([["A", "|O", [1]]]), codec.BLOB: bytes(8)})}),
            "bad tensor layout",
        ),
        (
            RecordDict(
                {
                    codec.TAG: _tag(
                        **{codec.LAYOUT: json.dumps([["A", "<f8", [1]], ["A", "<f8", [1]]]), codec.BLOB: bytes(16)}
                    )
                }
            ),
            "bad tensor layout",
        ),
        (RecordDict({codec.TAG: _tag(**{codec.LAYOUT: json.dumps({"A": 1})})}), "must be a list"),
        (RecordDict({codec.TAG: _tag(**{codec.BLOB: "text"})}), "must be bytes"),
        (
            RecordDict(
                {
                    codec.TAG: ConfigRecord(
                        {codec.ROUND: 0, codec.DIGEST_OF_BROADCAST: "x", codec.UNITS: 1, codec.LAYOUT: F8(2)}
                    ),
                    codec.TENSORS: ArrayRecord({codec.BLOB: Array(torch.zeros(2, dtype=torch.float64).numpy())}),
                }
            ),
            "1-D uint8",
        ),
        (
            RecordDict(
                {
                    codec.TAG: ConfigRecord(
                        {codec.ROUND: 0, codec.DIGEST_OF_BROADCAST: "x", codec.UNITS: 1, codec.LAYOUT: F8(2)}
                    ),
                    codec.TENSORS: ArrayRecord(
                        {codec.BLOB: Array(dtype="uint8", shape=(16,), stype="numpy.ndarray", data=b"12")}
                    ),
                }
            ),
            "cannot decode",
        ),
    ],
)
def test_malformed_replies_are_refused(content, match):
    with pytest.raises(codec.MalformedReply, match=match):
        codec.decode_reply(content)


def test_node_report_must_be_a_valid_partition():
    assert codec.decode_node(codec.encode_node(2, 5)) == (2, 5)
    with pytest.raises(codec.MalformedReply, match="partition-id"):
        codec.decode_node(RecordDict({codec.NODE: MetricRecord({codec.PARTITION_ID: 5, codec.NUM_PARTITIONS: 5})}))


def test_protocol_digest_depends_on_every_public_parameter():
    exp = EXPERIMENTS["altmin"]
    base = dict(n_users=40, dim=4, rank=2, samples_per_user=8, epsilon=math.inf)
    p1 = exp.protocol(config_lib.build(exp.config_type, base))
    p2 = exp.protocol(config_lib.build(exp.config_type, {**base, "clip_model": 0.5}))
    assert codec.protocol_digest(p1) == codec.protocol_digest(exp.protocol(config_lib.build(exp.config_type, base)))
    assert codec.protocol_digest(p1) != codec.protocol_digest(p2)


def test_unit_ranges_cover_every_unit_once():
    for n, p in [(10, 3), (10, 10), (10_000, 8), (7, 1)]:
        ranges = unit_ranges(n, p)
        assert [u for r in ranges for u in r] == list(range(n)) and min(len(r) for r in ranges) >= 1
    assert unit_ranges(10, 4, users_per_node=3) == [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]
    assert unit_ranges(500, 500, users_per_node=1)[499] == range(499, 500)


@pytest.mark.parametrize(
    "args, match",
    [
        ((5, 6), "nodes=6 exceeds the 5 units"),
        ((10, 3, 3), "needs nodes=4"),
        ((10, 0), "nodes must be >= 1"),
        ((0, 1), "num_units"),
    ],
)
def test_unit_ranges_refuse_bad_splits(args, match):
    with pytest.raises(ValueError, match=match):
        unit_ranges(*args)


def test_run_config_pairs():
    assert parse_pairs("n_users=2000 epsilon=8.0 cohorts=all psd=\"ridge\" data-file='/x y.npz'") == {
        "n_users": 2000,
        "epsilon": 8.0,
        "cohorts": "all",
        "psd": "ridge",
        "data_file": "/x y.npz",
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_pairs("n_users 2000")


def test_run_config_builds_the_job(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("n_users = 300\nrank = 3\n")
    job = from_run_config(
        {
            "algorithm": "altmin",
            "config": "rank=2 epsilon=inf",
            "config-file": str(toml),
            "out": "",
            "min-fraction": 0.5,
            "round-timeout": 30.0,
            "users-per-node": 0,
        }
    )
    assert (job.cfg.n_users, job.cfg.rank, job.cfg.epsilon) == (300, 2, math.inf)
    assert job.options.runtime.value == "flower" and job.options.min_fraction == 0.5 and job.out is None
    assert job.options.secure_noise  # flwr run (a deployment) draws secure noise unless told otherwise
    assert not from_run_config({"algorithm": "altmin", "secure-noise": False}).options.secure_noise
    with pytest.raises(ValueError, match="algorithm must be one of"):
        from_run_config({"algorithm": "nope"})
    with pytest.raises(ValueError, match="unknown AltMinConfig field"):
        from_run_config({"algorithm": "altmin", "config": "n_user=3"})
    with pytest.raises(ValueError, match="min_fraction must be"):
        from_run_config({"algorithm": "altmin", "min-fraction": 2.0})
    with pytest.raises(ValueError, match="unknown key"):
        from_run_config({"algorithm": "altmin", "bogus": 1})
    assert from_run_config({"algorithm": "altmin", "resume": "runs/x"}).resume == Path("runs/x")
    with pytest.raises(ValueError, match="its own configuration"):
        from_run_config({"algorithm": "altmin", "resume": "runs/x", "config": "rank=2"})


ROOT = Path(__file__).resolve().parents[1]


def flwr_run_config(override: str) -> dict:
    """What ``flwr run . --run-config OVERRIDE`` hands the ServerApp: Flower's own parsing of the
    override fused into the pyproject's declared keys (an undeclared key is Flower's error)."""
    from flwr.common.config import flatten_dict, fuse_dicts, get_project_config, parse_config_args

    declared = flatten_dict(get_project_config(ROOT)["tool"]["flwr"]["app"]["config"])
    return fuse_dicts(declared, parse_config_args([override]))


def test_flat_keys_give_the_config_the_config_string_gives():
    """A run config that carries fields as flat keys (an in-process run, or an app whose pyproject
    declares them) builds the config that `flwr run . --run-config "config='...'"` builds."""
    flat = from_run_config(
        {"algorithm": "dpals", "n-users": 300, "epsilon": 4, "steps": 2, "center": 3.5, "private-center": False}
    )
    string = from_run_config(
        flwr_run_config("algorithm='dpals' config='n_users=300 epsilon=4 steps=2 center=3.5 private_center=false'")
    )
    assert flat.cfg == string.cfg and (flat.cfg.n_users, flat.cfg.steps, flat.cfg.private_center) == (300, 2, False)
    defaults = from_run_config(flwr_run_config("algorithm='dpals'")).cfg
    assert defaults == config_lib.build(EXPERIMENTS["dpals"].config_type, {})  # nothing given: every default
    assert from_run_config({"algorithm": "altmin", "epsilon": "", "rank": ""}).cfg == config_lib.build(
        EXPERIMENTS["altmin"].config_type, {}
    )  # "" leaves a flat key's default
    assert from_run_config(flwr_run_config("algorithm='altmin' config='epsilon=inf'")).cfg.epsilon == math.inf


def test_an_unknown_or_foreign_flat_key_is_refused_naming_it():
    with pytest.raises(ValueError, match="n-users"):  # Flower refuses a key pyproject does not declare
        flwr_run_config("algorithm='dpals' n-users=300")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['n-user'\]"):  # and so does the ServerApp
        from_run_config({"algorithm": "dpals", "n-user": 300})
    with pytest.raises(ValueError, match="cohorts is not a field of dpals"):  # an AltMin field given to DPALS
        from_run_config({"algorithm": "dpals", "cohorts": "all"})
    with pytest.raises(ValueError, match="given both as flat keys and in config"):
        from_run_config({"algorithm": "dpals", "n-users": 300, "config": "n_users=400"})
    with pytest.raises(ValueError, match="its own configuration"):
        from_run_config({"resume": "runs/x", "epsilon": 2})


def test_the_pyproject_declares_the_apps_own_keys_only():
    """Nothing generated: `[tool.flwr.app.config]` holds the app's hand-written keys, every one of
    which the ServerApp reads; an algorithm's fields travel in `config` / `config-file`."""
    from flwr.common.config import flatten_dict, get_project_config

    from fedpers.app import KNOWN, RUN_CONFIG_DEFAULTS

    declared = flatten_dict(get_project_config(ROOT)["tool"]["flwr"]["app"]["config"])
    assert set(declared) == set(KNOWN)
    assert declared == RUN_CONFIG_DEFAULTS  # a staged app's pyproject is written from the defaults


def test_the_simulation_starts_its_own_ray_unless_told_to_attach(monkeypatch):
    """Flower's simulation calls ray.init() without an address: RAY_ADDRESS decides, so it is always set
    (``local``: a new Ray, never the last `ray start` cluster); the resources go in Flower's
    simulation settings, the GPUs of the simulation's own Ray only when it starts one."""
    from fedpers.runner import RuntimeOptions
    from fedpers.runtime.flower.simulation import federation_config, ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    opts = config_lib.build(
        RuntimeOptions, {"runtime": "flower", "nodes": 5, "client_cpus": 2.0, "client_gpus": 0.25, "sim_gpus": 1}
    )
    assert ray_address(opts) == "local"
    assert federation_config(opts) == {
        "num-supernodes": 5,
        "client-resources-num-cpus": 2,
        "client-resources-num-gpus": 0.25,  # exact in 32 bits
        "init-args-logging-level": "error",
        "init-args-log-to-driver": True,
        "init-args-num-gpus": 1,
    }
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(opts) == "10.0.0.1:6379" and "init-args-num-gpus" not in federation_config(opts)
    opts = config_lib.build(RuntimeOptions, {"runtime": "flower", "ray_address": "127.0.0.1:1234"})
    assert ray_address(opts) == "127.0.0.1:1234" and "init-args-num-gpus" not in federation_config(opts)


def test_a_fractional_cpu_share_is_refused_before_anything_starts():
    """Flower's simulation settings hold whole CPUs per node actor (an unsigned integer): 0.5 is refused naming the field."""
    from fedpers.runner import RuntimeOptions
    from fedpers.runtime.flower.simulation import check_engine

    opts = config_lib.build(RuntimeOptions, {"runtime": "flower", "client_cpus": 0.5})
    with pytest.raises(ValueError, match=r"client_cpus=0.5: .*whole number of CPUs"):
        check_engine(opts)
    check_engine(config_lib.build(RuntimeOptions, {"runtime": "flower", "client_cpus": 2.0}))


def test_symmetric_statistics_travel_as_their_upper_triangle():
    from fedpers.protocols.base import Message

    A = torch.randn(6, 6, dtype=torch.float64)
    A = A + A.T
    msg = Message({"A": A, "b": torch.ones(5, dtype=torch.float64)}, 3)
    content = codec.encode_reply(msg, 1, "d", symmetric=["A"])
    assert json.loads(content.config_records[codec.TAG][codec.LAYOUT])[0] == [
        "A",
        "<f8",
        [21],
    ]  # 6·7/2 numbers instead of 36
    back = codec.decode_reply(content, expect=(1, "d"))
    assert torch.equal(back.stats["A"], A) and torch.equal(back.stats["b"], msg.stats["b"])
    content.config_records[codec.TAG][codec.PACKED] = "A,b"  # b (5 numbers) is no triangle
    with pytest.raises(codec.MalformedReply, match="packed symmetric statistic must be a 1-D upper triangle"):
        codec.decode_reply(content)


def test_a_node_reads_the_broadcast_digest_the_server_computes():
    """The digest a node tags its reply with is read off the packed task: it must equal the
    server's broadcast_digest for scalars, several dtypes, any layout order and the Array path."""
    job = codec.Job("altmin", "{}", "abc")
    cases = [
        {"U": torch.randn(50, 3, dtype=torch.float64)},
        {"b": torch.randn(4), "a": torch.ones(2, 2, dtype=torch.float32), "z": torch.tensor(3.0), "i": torch.arange(3)},
        {"e": torch.zeros(0, 3)},
        {"big": torch.randn(codec.INLINE_BYTES // 8 + 1, dtype=torch.float64)},
    ]
    for broadcast in cases:
        for round in (0, 7):
            task = codec.decode_task(codec.encode_task(job, round, range(0, 1), codec.broadcast_record(broadcast)))
            assert task.digest == codec.broadcast_digest(round, broadcast)
    content = codec.encode_task(job, 2, range(0, 1), codec.broadcast_record({"a": torch.ones(2), "b": torch.zeros(3)}))
    rec = content.config_records[codec.JOB]
    layout = json.loads(str(rec[codec.LAYOUT]))
    rec[codec.LAYOUT] = json.dumps(layout[::-1])  # another order: the bytes follow the layout
    sizes = [math.prod(shape) * 4 for _, _, shape in layout]
    blob = bytes(rec[codec.BLOB])
    rec[codec.BLOB] = blob[sizes[0] :] + blob[: sizes[0]]
    task = codec.decode_task(content)
    assert (
        task.digest
        == codec.broadcast_digest(2, task.broadcast)
        == codec.broadcast_digest(2, {"a": torch.ones(2), "b": torch.zeros(3)})
    )


def test_the_server_skips_only_the_symmetry_check_of_what_it_rebuilt_from_a_triangle():
    """A packed statistic comes back symmetric whatever the node sent (each entry and its mirror
    are one sent number), so its symmetry check is skipped; a full matrix is still checked, and
    finiteness and the norm bound are checked on every statistic."""
    from fedpers.protocols.base import StatSpec, verify_message

    S = torch.randn(5, 5, dtype=torch.float64)  # any numbers: the node is not trusted
    msg = Message({"A": S, "b": torch.ones(3, dtype=torch.float64)}, 2)
    content = codec.encode_reply(msg, 1, "d", symmetric=["A"])
    back, rebuilt = codec.decode_reply_symmetric(content, expect=(1, "d"))
    assert rebuilt == {"A"} and torch.equal(back.stats["A"], back.stats["A"].T)
    assert torch.equal(back.stats["A"].triu(), S.triu())
    full, none = codec.decode_reply_symmetric(codec.encode_reply(msg, 1, "d"), expect=(1, "d"))
    assert none == frozenset() and torch.equal(full.stats["A"], S)

    specs = (StatSpec("A", (5, 5), 100.0, symmetric=True), StatSpec("b", (3,), 100.0))
    assert "not symmetric" in verify_message(full, specs, 2, torch.float64).reason  # sent whole: checked
    assert verify_message(full, specs, 2, torch.float64, frozenset({"A"})).accepted  # told rebuilt: skipped
    assert verify_message(back, specs, 2, torch.float64, rebuilt).accepted
    bad = Message({"A": back.stats["A"].clone(), "b": torch.tensor([1.0, float("inf"), 0.0], dtype=torch.float64)}, 2)
    assert "b: non-finite" in verify_message(bad, specs, 2, torch.float64, rebuilt).reason
    bad.stats["b"] = torch.ones(3, dtype=torch.float64)
    bad.stats["A"][0, 0] = float("nan")
    assert "A: non-finite" in verify_message(bad, specs, 2, torch.float64, rebuilt).reason
    huge = Message({"A": torch.full((5, 5), 1e200, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}, 2)
    assert (
        "norm" in verify_message(huge, specs, 2, torch.float64).reason
    )  # finite entries, norm overflows: a norm refusal
    unbounded = tuple(StatSpec(s.name, s.shape, math.inf, s.symmetric) for s in specs)
    assert verify_message(huge, unbounded, 2, torch.float64).accepted  # as before: finite entries pass


def test_a_layout_is_parsed_once_a_refused_one_every_time_and_a_long_one_never_cached():
    """unpack reads a short layout through a per-process cache (a pure function of its text): the
    same tensors as parsing it afresh; a malformed layout is refused on every message (a refusal is
    not cached); a layout above LAYOUT_CACHE_CHARS is parsed each time and never held."""
    codec._cached_layout.cache_clear()
    msg = Message({"A": torch.randn(3, 3, dtype=torch.float64), "b": torch.arange(4, dtype=torch.int32)}, 1)
    for _ in range(3):
        back = codec.decode_reply(codec.encode_reply(msg, 1, "d", symmetric=[]), expect=(1, "d"))
        assert all(torch.equal(back.stats[k], v) for k, v in msg.stats.items())
    assert codec._cached_layout.cache_info().misses == 1 and codec._cached_layout.cache_info().hits == 2
    for _ in range(2):
        with pytest.raises(codec.MalformedReply, match="bad tensor layout"):
            codec.decode_reply(RecordDict({codec.TAG: _tag(**{codec.LAYOUT: F8(-1)})}))
    assert codec._cached_layout.cache_info().currsize == 1  # only the good layout is held
    many = {f"t{i:04d}": torch.tensor([float(i)]) for i in range(200)}  # a layout of ~4.6k characters
    content = codec.encode_reply(Message(many, 1), 1, "d")
    assert len(str(content.config_records[codec.TAG][codec.LAYOUT])) > codec.LAYOUT_CACHE_CHARS
    back = codec.decode_reply(content, expect=(1, "d"))
    assert all(torch.equal(back.stats[k], v) for k, v in many.items())
    assert codec._cached_layout.cache_info().currsize == 1
