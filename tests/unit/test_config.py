"""Config parsing and validation: every bad value is a UserError with a usable message."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tierfs.commands import mount
from tierfs.config import Config
from tierfs.core.errors import UserError
from tierfs.core.parse import format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        ("1K", 1024),
        ("64G", 64 << 30),
        ("512MiB", 512 << 20),
        ("1.5T", 3 << 39),
        ("2gb", 2 << 30),
        (" 8 M ", 8 << 20),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "1X", "-5G", "G"])
def test_parse_size_rejects(text):
    with pytest.raises(UserError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize(
    "text, expected", [("90", 90), ("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("2d", 172800)]
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["soon", "5 minutes", "1h30", "m5"])
def test_parse_duration_rejects(text):
    with pytest.raises(UserError, match="invalid duration"):
        parse_duration(text)


def test_format_size():
    assert format_size(0) == "0 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 << 30) == "3.0 GiB"


def test_build_coerces_strings_and_derives_rank_dir():
    cfg = Config.build(mountpoint="mnt", ramdisk="/dev/shm/x", job="j", rank="2", nodes="4", capacity="1G")
    assert cfg.mountpoint == Path.cwd() / "mnt"
    assert (cfg.rank, cfg.nodes, cfg.capacity) == (2, 4, 1 << 30)
    assert cfg.rank_dir == Path("/dev/shm/x/j/rank-2")


def test_build_defaults():
    cfg = Config.build(mountpoint="/m", ramdisk=None, job=None)
    assert (cfg.ramdisk, cfg.job, cfg.rank, cfg.nodes, cfg.capacity) == (Path("/dev/shm/tierfs"), "default", 0, 1, None)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"rank": "4", "nodes": "4"}, "invalid rank 4: it must be in 0..3"),
        ({"rank": "-1"}, "invalid rank -1"),
        ({"nodes": "0"}, "invalid --nodes 0"),
        ({"job": "a/b"}, "invalid job id"),
        ({"job": ".hidden"}, "invalid job id"),
        ({"job": "x" * 129}, "invalid job id"),
        ({"capacity": "100K"}, "too small"),
        ({"log_level": "chatty"}, "invalid log level"),
        ({"wake_cpus": "sometimes"}, "invalid --wake-cpus 'sometimes': use on"),
        ({"peer_tls": "maybe"}, "invalid --peer-tls 'maybe': use on"),
        ({"engine": "libfuse"}, "invalid --engine 'libfuse': use auto, tierfs or pyfuse3"),
        ({"engine": "PyFuse3", "data_path": "passthrough"}, "--engine pyfuse3 cannot pass files through"),
        ({"restore_step": "-1"}, "invalid --restore-step -1: a step number is 0 or more"),
        ({"restore_step": "latest"}, "invalid restore-step 'latest': expected a whole number"),
        ({}, None),
    ],
)
def test_build_rejects(values, message):
    if message is None:
        with pytest.raises(UserError, match="missing MOUNTPOINT"):
            Config.build(**values)
        return
    with pytest.raises(UserError, match=message):
        Config.build(mountpoint="/m", **values)


def test_wake_cpus_is_on_unless_turned_off():
    assert Config.build(mountpoint="/m").wake_cpus is True
    assert Config.build(mountpoint="/m", wake_cpus="OFF").wake_cpus is False
    assert Config.build(mountpoint="/m", wake_cpus="yes").wake_cpus is True


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        (["mount", "/mnt/x"], {}, False),
        (["mount", "/mnt/x", "--start-fresh"], {}, True),
        (["mount", "/mnt/x"], {"TIERFS_START_FRESH": "1"}, True),
    ],
)
def test_start_fresh_from_the_flag_or_the_environment(monkeypatch, argv, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    mount.add_parser(parser.add_subparsers())
    assert mount.config_from_args(parser.parse_args(argv)).start_fresh is expected


PEERED = {"mountpoint": "/mnt/x", "listen": "127.0.0.2:7000", "peers": "127.0.0.3:7000", "secret": "s" * 20}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"erasure": "4x2", "nodes": 6}, r"invalid --erasure '4x2': expected D\+P, e.g. 4\+2"),
        ({"erasure": "40+2", "nodes": 50}, r"D=40: a stripe has 1 to 32 data parts"),
        ({"erasure": "4+5", "nodes": 9}, r"P=5: a stripe has 1 to 4 parity parts"),
        ({"erasure": "4+2", "nodes": 5}, r"a group has 6 ranks and the job has 5"),
        ({"erasure": "4+2", "nodes": 6, "replicas": 2}, r"--erasure and --replicas exclude each other"),
        ({"erasure": "4+2", "nodes": 6, "listen": None}, r"needs the peer service"),
    ],
)
def test_erasure_rejects(values, message):
    with pytest.raises(UserError, match=message):
        Config.build(**{**PEERED, **values})


def test_erasure_gives_its_shape():
    cfg = Config.build(**PEERED, erasure=" 4+2 ", nodes=6)
    assert (cfg.erasure, cfg.erasure_shape.d, cfg.erasure_shape.p) == ("4+2", 4, 2)
    assert Config.build(**PEERED, nodes=6).erasure_shape is None
