"""Certificates for the job etcd: a CA, server certificates for its members, client
certificates whose common name is the etcd user they act as.

Where it sits: `keepstep run` makes a private authority for its etcd on loopback
(`keepstep.launch.etcd_tls`), and the operator makes the cluster's one and issues each
TrainJob its client certificate (`keepstep.operator.etcd_access`). etcd runs with
`--client-cert-auth`: a client must present a certificate signed by the CA, and with auth
enabled etcd takes the certificate's common name as the user, whose role grants one job's
key prefix (`etcd_auth`). No passwords or tokens travel or expire; revoking a job's access
is deleting its etcd user.

Keys are ECDSA P-256 (small, fast to make: a job's certificate costs about a millisecond).
Everything is PEM bytes; writing them to disk with tight modes is `EtcdCredentials.write`.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from keepstep.errors import ConfigError

__all__ = ["KeyPair", "common_name", "issue", "make_ca"]

_BACKDATE = datetime.timedelta(minutes=5)  # clocks of the machines involved may differ


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM."""

    cert: bytes
    key: bytes


def make_ca(name: str = "keepstep etcd CA", days: int = 3650) -> KeyPair:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    _check_days(days)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(_cert_pem(cert), _key_pem(key))


def issue(
    ca: KeyPair,
    name: str,
    *,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
    server: bool = False,
    days: int = 365,
) -> KeyPair:
    """A certificate for `name` signed by `ca`: a client certificate (etcd takes `name` as
    the user), or with `server` one an etcd member serves with and also presents to its
    peers; `dns` and `ips` are the names it is valid for (a server needs at least one)."""
    _check_days(days)
    if not name or len(name) > 64:
        raise ConfigError(f"certificate name {name!r} must be 1..64 characters")
    if server and not dns and not ips:
        raise ConfigError(f"server certificate {name!r} needs at least one DNS name or IP")
    try:
        addresses = [ipaddress.ip_address(ip) for ip in ips]
    except ValueError as err:
        raise ConfigError(f"certificate {name!r}: {err}") from None
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError("the CA key must be an ECDSA key (as make_ca makes it)")
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if server:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(a) for a in addresses]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return KeyPair(_cert_pem(builder.sign(ca_key, hashes.SHA256())), _key_pem(key))


def common_name(cert: bytes) -> str:
    """The common name of a PEM certificate (the etcd user it authenticates as)."""
    names = x509.load_pem_x509_certificate(cert).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise ConfigError("the certificate has no common name")
    value = names[0].value
    return value if isinstance(value, str) else value.decode()


def _check_days(days: int) -> None:
    if not 1 <= days <= 36500:
        raise ConfigError(f"days={days} must be 1..36500")


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
