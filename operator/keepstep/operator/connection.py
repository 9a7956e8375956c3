"""Where the Kubernetes API server is and how to authenticate to it.

Where it sits: `__main__` loads a `Connection` once (from a kubeconfig, or a pod's service
account, parsed by the official client's loader) and hands it to `kube.Kube` and to kopf's
login handler. No API calls are made here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Connection:
    """Where the API server is and how to authenticate (paths may be temporary files).
    With `token_path` (a pod's service account) the token is read from that file, which
    the kubelet rotates, instead of `token`."""

    server: str
    ca_path: str | None = None
    token: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False
    token_path: str | None = None

    def current_token(self) -> str | None:
        if self.token_path is None:
            return self.token
        with open(self.token_path, encoding="utf-8") as f:
            return f.read().strip() or None


def load_connection(kubeconfig: str | None, in_cluster: bool = False) -> Connection:
    """The pod's service account if `in_cluster`, else `kubeconfig` (None: the default one)."""
    import kubernetes.client
    import kubernetes.config
    from kubernetes.config.incluster_config import SERVICE_TOKEN_FILENAME

    cfg = kubernetes.client.Configuration()
    if in_cluster:
        kubernetes.config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=cfg
        )
    header = cfg.get_api_key_with_prefix("BearerToken", alias="authorization")
    token = header.split(" ", 1)[-1] if header else None
    return Connection(
        server=str(cfg.host).rstrip("/"),
        ca_path=cfg.ssl_ca_cert or None,
        token=token,
        cert_path=cfg.cert_file or None,
        key_path=cfg.key_file or None,
        insecure=not cfg.verify_ssl,
        token_path=SERVICE_TOKEN_FILENAME if in_cluster else None,
    )
