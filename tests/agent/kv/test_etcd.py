"""EtcdKV and EtcdServer against real etcd processes: start and stop, crashes, hangs,
restarts, finding the binary, and the latency figures the agent's timeouts rest on."""

from __future__ import annotations

import logging
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keepstep.agent.kv import KVError, KVTimeout, KVUnavailable, WatchEvent
from keepstep.agent.kv.etcd import EtcdKV, parse_endpoint, range_end
from keepstep.elastic.errors import ConfigError
from keepstep.launch.etcd_server import EtcdServer, EtcdServerError, find_etcd, member_args


@pytest.fixture
def server(etcd_binary: str, tmp_path: Path) -> Iterator[EtcdServer]:
    """A private server that a test may kill, freeze or restart."""
    srv = EtcdServer.start(etcd_binary, tmp_path / "etcd")
    try:
        yield srv
    finally:
        if srv.running():
            os.kill(srv.pid, signal.SIGCONT)  # a test may have left it frozen
        srv.stop()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def port_free(port: int) -> bool:
    """Nobody listens on it (TIME_WAIT leftovers of closed connections do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def timed(call: Callable[[], object]) -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        call()
    except Exception as err:
        return err, time.monotonic() - start
    return None, time.monotonic() - start


# --------------------------------------------------------------------------- the server


def test_start_and_stop_leave_no_process_or_port(etcd_binary: str, tmp_path: Path) -> None:
    with EtcdServer.start(etcd_binary, tmp_path) as srv:
        host, port = parse_endpoint(srv.endpoint)
        assert host == "127.0.0.1" and srv.running() and not gone(srv.pid)
        kv = EtcdKV(srv.endpoint, timeout=2.0)
        assert kv.put("/x", b"1", 2.0) > 0
        kv.close()
        pid = srv.pid
    assert gone(pid) and not srv.running()
    assert port_free(port)
    assert (tmp_path / "etcd.log").exists() and (tmp_path / "data" / "member").is_dir()
    srv.stop()  # stopping twice is harmless


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def test_the_server_runs_one_go_scheduler_thread_unless_told_otherwise(
    etcd_binary: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    with EtcdServer.start(etcd_binary, tmp_path / "a") as srv:
        assert environ(srv.pid)["GOMAXPROCS"] == "1"
    monkeypatch.setenv("GOMAXPROCS", "3")
    with EtcdServer.start(etcd_binary, tmp_path / "b") as srv:
        assert environ(srv.pid)["GOMAXPROCS"] == "3"


def test_etcd_variables_do_not_reach_the_server_but_the_arch_permit_does(
    etcd_binary: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_NAME", "not-ours")  # would configure etcd behind our flags
    # etcd < 3.5 starts on arm64 only with this set; it configures nothing.
    monkeypatch.setenv("ETCD_UNSUPPORTED_ARCH", "arm64")
    with EtcdServer.start(etcd_binary, tmp_path / "a") as srv:
        env = environ(srv.pid)
        assert "ETCD_NAME" not in env and env["ETCD_UNSUPPORTED_ARCH"] == "arm64"


def test_early_exit_raises_with_the_log_tail(tmp_path: Path) -> None:
    fake = script(tmp_path / "etcd", "echo 'etcd: bad flag --frobnicate' >&2; exit 3")
    with pytest.raises(EtcdServerError, match="status 3") as info:
        EtcdServer.start(fake, tmp_path / "d", timeout=5.0)
    assert "bad flag --frobnicate" in str(info.value)


def test_a_server_that_never_answers_is_killed_after_the_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    fake = script(tmp_path / "etcd", f"echo $$ > {pid_file}; exec sleep 60")
    err, took = timed(lambda: EtcdServer.start(fake, tmp_path / "d", timeout=0.5))
    assert isinstance(err, EtcdServerError) and "not healthy within 0.5 s" in str(err)
    assert took < 3.0
    assert gone(int(pid_file.read_text()))


def test_start_rejects_bad_arguments(etcd_binary: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not an executable"):
        EtcdServer.start(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(ConfigError, match="election timeout >= 5 heartbeats"):
        EtcdServer.start(etcd_binary, tmp_path, heartbeat_ms=200, election_ms=500)
    with pytest.raises(ConfigError, match="client_port=70000"):
        EtcdServer.start(etcd_binary, tmp_path, client_port=70000)


# --------------------------------------------------------------------------- failures


def test_calls_to_a_killed_server_fail_within_their_timeout(server: EtcdServer) -> None:
    kv = EtcdKV(server.endpoint, timeout=1.0)
    lease = kv.grant_lease(5, 1.0)
    stop_keepalive = kv.keepalive(lease, 0.2)
    cancel = kv.watch_prefix("/w/", lambda e: None)
    server.kill()
    calls: list[Callable[[], object]] = [
        lambda: kv.put("/k", b"v", 1.0),
        lambda: kv.get("/k", 1.0),
        lambda: kv.get_prefix("/", 1.0),
        lambda: kv.create("/k", b"v", 1.0),
        lambda: kv.compare_and_put("/k", b"v", 0, 1.0),
        lambda: kv.delete_prefix("/k", 1.0),
        lambda: kv.grant_lease(1, 1.0),
        lambda: lease.refresh(),
        lambda: kv.watch_prefix("/other/", lambda e: None),
    ]
    for call in calls:
        err, took = timed(call)
        assert isinstance(err, KVError), err
        assert took < 1.5
    for stop in (stop_keepalive, cancel, kv.close):
        err, took = timed(stop)
        assert err is None and took < 1.5


def stop(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it is stopped: kill() returns once the
    signal is queued, and a thread of a loaded machine may still serve a request then."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
            states.append(stat.rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped after {timeout} s: {states}"
        time.sleep(0.01)


def test_calls_to_a_frozen_server_time_out(server: EtcdServer) -> None:
    kv = EtcdKV(server.endpoint, timeout=0.5)
    kv.put("/k", b"v", 1.0)
    cancel = kv.watch_prefix("/w/", lambda e: None)
    stop(server.pid)  # alive but silent: the case a deadline exists for
    try:
        for name, call in (
            ("get", lambda: kv.get("/k", 0.5)),
            ("put", lambda: kv.put("/k", b"w", 0.5)),
        ):
            err, took = timed(call)
            assert isinstance(err, KVTimeout), f"{name} gave {err!r} after {took:.2f} s"
            assert 0.4 < took < 1.5, f"{name} timed out after {took:.2f} s"
        err, took = timed(lambda: kv.watch_prefix("/v/", lambda e: None))
        assert isinstance(err, KVTimeout) and took < 1.5
        err, took = timed(cancel)
        assert err is None and took < 1.5
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert kv.get("/k", 5.0) is not None  # the same client works again once etcd does
    kv.close()


def test_watch_survives_a_server_restart_without_gaps_or_repeats(
    server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="keepstep.agent.kv.etcd")
    kv = EtcdKV(server.endpoint, timeout=2.0)
    seen: list[WatchEvent] = []
    lock = threading.Lock()

    def record(event: WatchEvent) -> None:
        with lock:
            seen.append(event)

    cancel = kv.watch_prefix("/w/", record)
    kv.put("/w/1", b"before", 2.0)
    server.kill()
    time.sleep(0.3)
    server.restart()
    deadline = time.monotonic() + 10.0
    while True:  # the channel reconnects with a short backoff
        try:
            kv.put("/w/2", b"after", 1.0)
            break
        except KVError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    kv.delete("/w/1", 2.0)
    deadline = time.monotonic() + 10.0
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    cancel()
    kv.close()
    assert [(e.kind, e.key, e.value) for e in seen] == [
        ("put", "/w/1", b"before"),
        ("put", "/w/2", b"after"),
        ("delete", "/w/1", None),
    ]
    assert [e.revision for e in seen] == sorted({e.revision for e in seen})
    # A lost stream is routine: said at INFO; a warning only from the third loss in a row.
    lost = [r.levelno for r in caplog.records if "lost its stream" in r.getMessage()]
    assert lost and lost[0] == logging.INFO, lost
    assert lost.count(logging.WARNING) == (1 if len(lost) >= 3 else 0), lost


def test_a_watch_opened_while_etcd_is_unreachable_is_retried_until_its_timeout(
    server: EtcdServer,
) -> None:
    kv = EtcdKV(server.endpoint, timeout=15.0)
    kv.put("/w/0", b"old", 2.0)
    server.kill()
    seen: list[WatchEvent] = []
    opened: list[Callable[[], None] | BaseException] = []

    def open_watch() -> None:
        try:
            opened.append(kv.watch_prefix("/w/", seen.append))
        except BaseException as error:  # reported below
            opened.append(error)

    thread = threading.Thread(target=open_watch)
    thread.start()
    time.sleep(1.0)  # its first tries meet a closed port (UNAVAILABLE)
    assert opened == []  # still trying, not failed
    server.restart()
    thread.join(20.0)
    assert len(opened) == 1 and callable(opened[0]), opened
    kv.put("/w/1", b"new", 5.0)
    deadline = time.monotonic() + 10.0
    while not seen and time.monotonic() < deadline:
        time.sleep(0.02)
    opened[0]()
    assert [(e.kind, e.key, e.value) for e in seen] == [("put", "/w/1", b"new")]
    # Still unreachable when its timeout ends: the cause is named, within the timeout.
    server.kill()
    short = EtcdKV(server.endpoint, timeout=1.0)
    err, took = timed(lambda: short.watch_prefix("/w/", seen.append))
    assert isinstance(err, KVUnavailable) and "UNAVAILABLE" in str(err), err
    assert took < 2.0
    short.close()
    kv.close()


class CountingLeases:
    """The client's lease stub, counting the keepalive streams it opens."""

    def __init__(self, stub: object) -> None:
        self._stub = stub
        self.streams = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)

    def LeaseKeepAlive(self, *args: object, **kwargs: object) -> object:
        self.streams += 1
        return self._stub.LeaseKeepAlive(*args, **kwargs)  # type: ignore[attr-defined]


def test_a_keepalive_beats_over_one_stream_and_reopens_it_after_a_restart(
    server: EtcdServer,
) -> None:
    kv = EtcdKV(server.endpoint, timeout=2.0)
    counting = CountingLeases(kv._leases)
    kv._leases = counting
    lease = kv.grant_lease(2, 2.0)
    kv.put("/alive", b"yes", 2.0, lease=lease)
    stop = kv.keepalive(lease, 0.1)
    time.sleep(4.5)  # ~40 beats, over twice the TTL
    assert kv.get("/alive", 2.0) is not None
    assert counting.streams == 1
    server.kill()
    time.sleep(0.3)
    server.restart()  # etcd keeps the lease and restarts its TTL; the stream is broken
    time.sleep(4.5)
    assert kv.get("/alive", 2.0) is not None  # refreshed over a new stream
    assert 2 <= counting.streams <= 40  # reopened, not once per beat
    stop()
    kv.close()


# --------------------------------------------------------------------------- find_etcd


def fake_etcd(directory: Path, version: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return Path(script(directory / "etcd", f"echo 'etcd Version: {version}'"))


def test_find_etcd_prefers_keepstep_etcd_bin_and_checks_it(tmp_path: Path) -> None:
    given = fake_etcd(tmp_path / "mine", "3.4.0")  # the oldest that works
    on_path = fake_etcd(tmp_path / "bin", "3.6.16")
    env = {"KEEPSTEP_ETCD_BIN": str(given), "PATH": str(on_path.parent)}
    assert find_etcd(env) == str(given)
    with pytest.raises(
        ConfigError, match=r"KEEPSTEP_ETCD_BIN='/nowhere/etcd' is not an executable"
    ):
        find_etcd({"KEEPSTEP_ETCD_BIN": "/nowhere/etcd"})


def test_an_etcd_older_than_the_minimum_is_refused_at_start_with_both_versions(
    tmp_path: Path,
) -> None:
    # What etcd 3.3 does with the flags every member gets: it has no --log-level.
    old = script(
        tmp_path / "etcd",
        'if [ "$1" = --version ]; then echo "etcd Version: 3.3.25"; exit 0; fi\n'
        "echo 'flag provided but not defined: -log-level' >&2; exit 2",
    )
    assert find_etcd({"KEEPSTEP_ETCD_BIN": old}) == old  # a named binary is not second-guessed
    with pytest.raises(EtcdServerError) as info:
        EtcdServer.start(old, tmp_path / "d", timeout=5.0)
    text = str(info.value)
    assert f"{old} is etcd 3.3.25, and keepstep needs etcd >= 3.4.0" in text
    assert "apt-get install etcd-server" in text and "-log-level" in text


def test_the_old_name_still_works_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    given = fake_etcd(tmp_path / "mine", "3.4.23")
    with caplog.at_level(logging.WARNING):
        assert find_etcd({"KEEPSTEP_ETCD": str(given), "PATH": ""}) == str(given)
    assert "KEEPSTEP_ETCD is deprecated" in caplog.text
    assert f"set KEEPSTEP_ETCD_BIN={given} instead" in caplog.text
    with pytest.raises(ConfigError, match=r"KEEPSTEP_ETCD='/nowhere/etcd' is not an executable"):
        find_etcd({"KEEPSTEP_ETCD": "/nowhere/etcd"})
    caplog.clear()
    newer = fake_etcd(tmp_path / "newer", "3.6.16")
    with caplog.at_level(logging.WARNING):
        both = {"KEEPSTEP_ETCD_BIN": str(newer), "KEEPSTEP_ETCD": str(given)}
        assert find_etcd(both) == str(newer)  # the new name wins
    assert f"KEEPSTEP_ETCD={given} is ignored: KEEPSTEP_ETCD_BIN is set" in caplog.text


def test_find_etcd_takes_a_distribution_etcd_on_path(tmp_path: Path) -> None:
    on_path = fake_etcd(tmp_path / "bin", "3.4.23")  # Debian 12's etcd-server
    fake_etcd(tmp_path / "cache" / "bin" / "etcd-v3.6.16", "3.6.16")
    env = {"PATH": str(tmp_path / "bin"), "KEEPSTEP_CACHE": str(tmp_path / "cache")}
    assert find_etcd(env) == str(on_path)


def test_find_etcd_skips_an_old_etcd_and_takes_the_newest_build(tmp_path: Path) -> None:
    fake_etcd(tmp_path / "bin", "3.3.25")
    cache = tmp_path / "cache"
    for version in ["3.5.13", "3.6.2", "3.6.16", "3.4.30", "3.3.27"]:
        fake_etcd(cache / "bin" / f"etcd-v{version}", version)
    env = {"PATH": str(tmp_path / "bin"), "KEEPSTEP_CACHE": str(cache)}
    assert find_etcd(env) == str(cache / "bin" / "etcd-v3.6.16" / "etcd")  # 16 > 2


def test_find_etcd_says_how_to_get_one(tmp_path: Path) -> None:
    fake_etcd(tmp_path / "bin", "3.3.0")
    fake_etcd(tmp_path / "cache" / "bin" / "etcd-v3.3.27", "3.3.27")
    env = {"PATH": str(tmp_path / "bin"), "KEEPSTEP_CACHE": str(tmp_path / "cache")}
    with pytest.raises(ConfigError) as info:
        find_etcd(env)
    text = str(info.value)
    assert "version 3.3.0, older than 3.4.0" in text
    assert str(tmp_path / "cache" / "bin") in text
    # Every way to get one: the distribution's package, a release binary on PATH, the
    # variable, and (from a checkout) the build script.
    assert "apt-get install etcd-server" in text
    assert "release binary" in text and "on PATH" in text
    assert "KEEPSTEP_ETCD_BIN=/path/to/etcd" in text
    assert "scripts/build-etcd" in text
    assert "\n" not in text  # the command line prints it as one line


def test_every_member_logs_through_zap_at_warn_level(tmp_path: Path) -> None:
    # etcd 3.4's default logger (capnslog) ignores --log-level and logs every raft step.
    args = member_args(
        "m", tmp_path, "127.0.0.1", 1, 2, "m=http://127.0.0.1:2", heartbeat_ms=50, election_ms=500
    )
    assert "--logger=zap" in args and "--log-level=warn" in args


def test_range_end_is_the_first_key_after_the_prefix() -> None:
    # As etcd's Go client computes it: trailing 0xff bytes are dropped, not kept.
    assert range_end(b"/job/") == b"/job0"
    assert range_end(b"a\xff") == b"b"
    assert range_end(b"\xff\xff") == b"\0"  # no key is after: to the end of the keyspace


def test_endpoint_must_be_host_and_port() -> None:
    assert parse_endpoint("http://127.0.0.1:2379") == ("127.0.0.1", 2379)
    for bad in ["127.0.0.1", "127.0.0.1:http", ":2379", "host:0"]:
        with pytest.raises(ConfigError, match="must look like"):
            EtcdKV(bad)


# --------------------------------------------------------------------------- figures


@pytest.mark.slow
def test_loopback_latency_and_lease_expiry_detection(etcd_server: str) -> None:
    """The figures membership timeouts are sized from; run with -s to print them."""
    kv = EtcdKV(etcd_server, timeout=5.0)
    put_s, get_s = [], []
    for i in range(200):
        t0 = time.perf_counter()
        kv.put("/figures/k", str(i).encode(), 5.0)
        t1 = time.perf_counter()
        kv.get("/figures/k", 5.0)
        put_s.append(t1 - t0)
        get_s.append(time.perf_counter() - t1)
    delays = []
    for _ in range(3):
        lease = kv.grant_lease(1, 5.0)
        kv.put("/figures/node", b"alive", 5.0, lease=lease)
        deleted = threading.Event()
        at: list[float] = []

        def on_event(
            event: WatchEvent, at: list[float] = at, deleted: threading.Event = deleted
        ) -> None:
            if event.kind == "delete":
                at.append(time.monotonic())
                deleted.set()

        cancel = kv.watch_prefix("/figures/node", on_event)
        stop = kv.keepalive(lease, 0.25)
        time.sleep(0.6)
        stop()
        stopped = time.monotonic()
        assert deleted.wait(5.0)
        delays.append(at[0] - stopped)
        cancel()
    kv.close()
    put_ms, get_ms = statistics.median(put_s) * 1e3, statistics.median(get_s) * 1e3
    print(
        f"\nloopback etcd: put median {put_ms:.2f} ms, get median {get_ms:.2f} ms (n=200); "
        f"TTL 1 s lease, keepalive stop -> watch sees delete: "
        + ", ".join(f"{d:.2f}" for d in delays)
        + " s"
    )
    assert put_ms < 50 and get_ms < 50
    # At most the TTL after the last refresh, plus etcd's 500 ms expiry sweep.
    assert all(0.5 < d < 2.5 for d in delays), delays
