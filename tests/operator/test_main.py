"""The operator's command line turns into validated settings."""

from __future__ import annotations

import pytest

from keepstep.operator.__main__ import parse_args


def test_flags_become_settings() -> None:
    settings, verbose = parse_args(
        ["--etcd", "http://e:2379", "--namespace", "jobs", "--resync", "2", "--lost-pod-grace", "3"]
    )
    assert (settings.etcd, settings.namespace, settings.resync_s) == ("http://e:2379", "jobs", 2)
    assert settings.lost_pod_grace_s == 3 and settings.below_min_grace_s == 120
    assert settings.standalone and settings.peering is None and not verbose
    peered, verbose = parse_args(["--etcd", "http://e:2379", "--peering", "keepstep", "--verbose"])
    assert not peered.standalone and peered.peering == "keepstep" and verbose


def test_bad_values_are_refused_with_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--etcd", "http://e:2379", "--below-min-grace", "-1"])
    assert (
        "below_min_grace_s=-1.0 must be a finite number of seconds > 0" in capsys.readouterr().err
    )
