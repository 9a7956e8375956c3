"""The operator's defaults of every agent container's environment (`--agent-env`).

- The flag repeats into (name, value) pairs in the settings and the decision's config; a
  value without `=`, an empty name, a name a job could not set itself, a name given twice
  or a value the agent would refuse ends the parse with one usage line that names it.
- A pod gets the defaults after its identity and before the job's trainer.env; a name the
  job sets is not defaulted (the job wins), a valueFrom included.
- A default KEEPSTEP_TELEMETRY=prometheus gives every job's pods the container port
  `metrics` (the port the job's NetworkPolicy admits scrapers on), unless the job says
  otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from op_builders import CONFIG, ETCD, T0, job, run

from keepstep.operator.__main__ import parse_args
from keepstep.operator.actions import CreatePod
from keepstep.operator.agent_defaults import AGENT_ENV_NAMES, parse_agent_env
from keepstep.operator.decide import decide
from keepstep.operator.errors import SpecError
from keepstep.operator.model import AgentView, Job
from keepstep.operator.podspec import agent_metrics_port, network_policy_manifest, pod_manifest
from keepstep.operator.settings import DecideConfig, OperatorSettings

COLLECTOR = "http://otel-collector.monitoring:4318"
DEFAULTS = (("KEEPSTEP_TELEMETRY", "otlp"), ("OTEL_EXPORTER_OTLP_ENDPOINT", COLLECTOR))


def container(j: Job, defaults: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    (only,) = pod_manifest(j, 0, ETCD, env_defaults=defaults)["spec"]["containers"]
    return dict(only)


def env_of(j: Job, defaults: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    return list(container(j, defaults)["env"])


def test_the_repeated_flag_becomes_the_configs_defaults() -> None:
    flags = [f"--agent-env={name}={value}" for name, value in DEFAULTS]
    settings, _ = parse_args(["--etcd", ETCD, *flags, "--agent-env", "KEEPSTEP_REPLY_TIMEOUT=60"])
    assert settings.agent_env == (*DEFAULTS, ("KEEPSTEP_REPLY_TIMEOUT", "60"))
    assert DecideConfig.of(settings).agent_env == settings.agent_env
    # A value may hold `=` (headers) or be empty (KEEPSTEP_TELEMETRY= turns it off).
    pairs = parse_agent_env(["OTEL_EXPORTER_OTLP_HEADERS=auth=Bearer x", "KEEPSTEP_TELEMETRY="])
    assert pairs == (("OTEL_EXPORTER_OTLP_HEADERS", "auth=Bearer x"), ("KEEPSTEP_TELEMETRY", ""))
    assert parse_args(["--etcd", ETCD])[0].agent_env == ()


def test_only_what_a_job_may_set_can_be_defaulted() -> None:
    assert "KEEPSTEP_TELEMETRY_PORT" in AGENT_ENV_NAMES
    assert "KEEPSTEP_S3_ENDPOINT" in AGENT_ENV_NAMES
    assert "OTEL_EXPORTER_OTLP_HEADERS" in AGENT_ENV_NAMES
    for identity in ("KEEPSTEP_JOB", "KEEPSTEP_ETCD_ENDPOINTS", "KEEPSTEP_NODE", "KEEPSTEP_HOST"):
        assert identity not in AGENT_ENV_NAMES


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["KEEPSTEP_TELEMETRY"], "agent_env='KEEPSTEP_TELEMETRY' must be NAME=VALUE; allowed"),
        (["=otlp"], "agent_env='=otlp' must be NAME=VALUE; allowed names: KEEPSTEP_S3_ENDPOINT"),
        (["KEEPSTEP_JOB=x"], "agent_env='KEEPSTEP_JOB=x': KEEPSTEP_JOB may not be defaulted"),
        (["OTEL_SERVICE_NAME=a"], "OTEL_SERVICE_NAME may not be defaulted; allowed names: "),
        (["PATH=/bin"], "agent_env='PATH=/bin': PATH may not be defaulted"),
        (
            ["KEEPSTEP_TELEMETRY=otlp", "KEEPSTEP_TELEMETRY=file"],
            "agent_env='KEEPSTEP_TELEMETRY=file': KEEPSTEP_TELEMETRY is given twice",
        ),
        (["KEEPSTEP_TELEMETRY=otlp,statsd"], "unknown exporter 'statsd'; a comma list of otlp"),
        (["KEEPSTEP_TELEMETRY_PORT=http"], "'KEEPSTEP_TELEMETRY_PORT=http': must be a port 0-"),
        (["KEEPSTEP_TELEMETRY_PORT=70000"], "must be a port 0-65535"),
        (["KEEPSTEP_TELEMETRY_INTERVAL=0"], "'KEEPSTEP_TELEMETRY_INTERVAL=0': must be a number"),
        (["KEEPSTEP_DECISION_TIMEOUT=soon"], "must be a number of seconds > 0"),
        (["OTEL_EXPORTER_OTLP_ENDPOINT=collector:4318"], "must be an http:// or https:// URL"),
    ],
)
def test_a_bad_default_is_a_usage_error_that_names_it(
    values: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--etcd", ETCD, *(f for v in values for f in ("--agent-env", v))])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    (line,) = [line for line in err.splitlines() if "error:" in line]  # one line
    assert line.startswith("python -m keepstep.operator: error: agent_env=")


def test_a_bad_headers_default_is_refused_without_repeating_it() -> None:
    secret = "OTEL_EXPORTER_OTLP_HEADERS=Bearer s3cr3t"
    with pytest.raises(SpecError, match="name=value entries") as refused:
        parse_agent_env([secret])
    assert "s3cr3t" not in str(refused.value)
    twice = ["OTEL_EXPORTER_OTLP_HEADERS=a=s3cr3t", "OTEL_EXPORTER_OTLP_HEADERS=b=s3cr3t"]
    with pytest.raises(SpecError, match="given twice") as refused:
        parse_agent_env(twice)
    assert "s3cr3t" not in str(refused.value)


def test_settings_built_in_code_are_checked_the_same_way() -> None:
    with pytest.raises(SpecError, match="KEEPSTEP_NODE may not be defaulted"):
        OperatorSettings(ETCD, agent_env=(("KEEPSTEP_NODE", "x"),))
    with pytest.raises(SpecError, match="given twice"):
        DecideConfig(ETCD, agent_env=(("KEEPSTEP_TELEMETRY", "otlp"),) * 2)


def test_pods_get_the_defaults_after_their_identity_and_before_the_jobs_env() -> None:
    env = env_of(job(env=[{"name": "LR", "value": "0.1"}]), DEFAULTS)
    assert [e["name"] for e in env] == [
        "KEEPSTEP_ETCD_ENDPOINTS",
        "KEEPSTEP_JOB",
        "KEEPSTEP_NODE",
        "KEEPSTEP_HOST",
        "KEEPSTEP_TELEMETRY",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "LR",
    ]
    by_name = {e["name"]: e for e in env}
    assert by_name["KEEPSTEP_TELEMETRY"] == {"name": "KEEPSTEP_TELEMETRY", "value": "otlp"}
    assert by_name["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == COLLECTOR
    # Without defaults the pod is what it always was.
    assert "KEEPSTEP_TELEMETRY" not in {e["name"] for e in env_of(job(), ())}


def test_the_jobs_own_setting_wins_over_a_default() -> None:
    headers = {"secretKeyRef": {"name": "otlp-auth", "key": "headers"}}
    own = [
        {"name": "KEEPSTEP_TELEMETRY", "value": "file"},
        {"name": "OTEL_EXPORTER_OTLP_HEADERS", "valueFrom": headers},
    ]
    defaults = (*DEFAULTS, ("OTEL_EXPORTER_OTLP_HEADERS", "auth=cluster"))
    env = env_of(job(env=own), defaults)
    names = [e["name"] for e in env]
    assert names.count("KEEPSTEP_TELEMETRY") == 1
    assert names.count("OTEL_EXPORTER_OTLP_HEADERS") == 1
    by_name = {e["name"]: e for e in env}
    assert by_name["KEEPSTEP_TELEMETRY"]["value"] == "file"
    assert by_name["OTEL_EXPORTER_OTLP_HEADERS"] == {
        "name": "OTEL_EXPORTER_OTLP_HEADERS",
        "valueFrom": headers,
    }
    assert by_name["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == COLLECTOR  # not set by the job


def test_a_default_prometheus_opens_the_metrics_port_unless_the_job_says_otherwise() -> None:
    prometheus = (("KEEPSTEP_TELEMETRY", "prometheus"),)
    assert agent_metrics_port(job().spec, prometheus) == 9464
    assert container(job(), prometheus)["ports"] == [
        {"name": "metrics", "containerPort": 9464, "protocol": "TCP"}
    ]
    on_9100 = (*prometheus, ("KEEPSTEP_TELEMETRY_PORT", "9100"))
    assert container(job(), on_9100)["ports"][0]["containerPort"] == 9100
    # The job's port over the default's; the job's exporters over the default's.
    port = [{"name": "KEEPSTEP_TELEMETRY_PORT", "value": "9200"}]
    assert agent_metrics_port(job(env=port).spec, on_9100) == 9200
    otlp = [{"name": "KEEPSTEP_TELEMETRY", "value": "otlp"}]
    assert agent_metrics_port(job(env=otlp).spec, on_9100) is None
    assert "ports" not in container(job(env=otlp), on_9100)
    # A job that sets it from a valueFrom: unknown until the pod starts, nothing declared.
    known_later = [{"name": "KEEPSTEP_TELEMETRY", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]
    assert agent_metrics_port(job(env=known_later).spec, prometheus) is None
    # And a job's prometheus takes the default port.
    on = [{"name": "KEEPSTEP_TELEMETRY", "value": "prometheus"}]
    assert agent_metrics_port(job(env=on).spec, (("KEEPSTEP_TELEMETRY_PORT", "9300"),)) == 9300


def test_the_decision_creates_pods_with_the_configs_defaults() -> None:
    """Through `decide`: every new pod of every job gets the defaults, and a default
    prometheus declares the port the job's NetworkPolicy admits scrapers on."""
    config = replace(CONFIG, agent_env=(("KEEPSTEP_TELEMETRY", "prometheus"),))
    j = job(nodes=2)
    d = decide(j, [], AgentView(), T0, config=config)
    created = d.of(CreatePod)
    assert len(created) == 2
    policy = network_policy_manifest(j)
    (admitted,) = [rule["ports"] for rule in policy["spec"]["ingress"] if "ports" in rule]
    for pod in created:
        (agent,) = pod.manifest["spec"]["containers"]
        assert {"name": "KEEPSTEP_TELEMETRY", "value": "prometheus"} in agent["env"]
        assert [p["name"] for p in agent["ports"]] == [p["port"] for p in admitted]
    # The shared builders' config has none: the pods are what they were.
    (plain, _) = run(j, [], AgentView()).of(CreatePod)
    assert "ports" not in plain.manifest["spec"]["containers"][0]
