"""The operator's command line turns into validated settings."""

from __future__ import annotations

import pytest

from keepstep.operator.__main__ import parse_args
from keepstep.operator.settings import DecideConfig


def test_flags_become_settings() -> None:
    settings, verbose = parse_args(
        ["--etcd", "http://e:2379", "--namespace", "jobs", "--resync", "2", "--lost-pod-grace", "3"]
    )
    assert (settings.etcd, settings.resync_s) == ("http://e:2379", 2)
    assert settings.namespaces == ("jobs",)
    assert settings.lost_pod_grace_s == 3 and settings.below_min_grace_s == 120
    assert settings.standalone and settings.peering is None and not verbose
    peered, verbose = parse_args(["--etcd", "http://e:2379", "--peering", "keepstep", "--verbose"])
    assert not peered.standalone and peered.peering == "keepstep" and verbose
    assert peered.namespaces == ()  # every namespace: the cluster-wide install


def test_a_namespaced_install_names_its_namespaces() -> None:
    settings, _ = parse_args(["--etcd", "http://e", "--namespace", "a,b", "--namespace", "c"])
    assert settings.namespaces == ("a", "b", "c")


def test_failure_policy_defaults_come_from_flags() -> None:
    flags = ["--pending-grace", "60", "--backoff-limit", "2", "--failure-window", "120"]
    settings, _ = parse_args(
        ["--etcd", "http://e", *flags, "--backoff-base", "0.5", "--backoff-max", "8"]
    )
    config = DecideConfig.of(settings)
    assert (config.pending_s, config.backoff_limit, config.failure_window_s) == (60, 2, 120)
    assert (config.backoff_base_s, config.backoff_max_s) == (0.5, 8)


def test_bad_values_are_refused_with_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--etcd", "http://e:2379", "--below-min-grace", "-1"])
    assert (
        "below_min_grace_s=-1.0 must be a finite number of seconds > 0" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        parse_args(["--etcd", "http://e:2379", "--backoff-base", "10", "--backoff-max", "1"])
    assert "backoff_max_s=1 must be >= backoff_base_s=10" in capsys.readouterr().err
