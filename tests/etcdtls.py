"""Throw-away certificates for an etcd behind TLS in tests.

`make_certs` writes a CA, a server certificate (SAN 127.0.0.1 and localhost)
and a client certificate signed by it, with P-256 keys (fast to make), and
returns an `EtcdServerTls` for `springback.cli.local.EtcdServer`. The client
certificate's CN is deliberately not an etcd user: with etcd's auth enabled a
request is allowed only with a password token, never by the certificate alone.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from springback.cli.local import EtcdServerTls

CLIENT_CN = "springback-client"


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def _issue(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
           issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
           sans: list[x509.GeneralName] | None = None,
           usages: list[x509.ObjectIdentifier] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_certs(directory: str, *, password: str | None = None) -> EtcdServerTls:
    """A CA, a server and a client certificate under `directory`; with
    `password`, the etcd enables auth for user ``springback`` with it."""
    os.makedirs(directory, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "springback test CA")])
    ca = _issue("springback test CA", ca_key, ca_name, ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = _issue("etcd", server_key, ca_name, ca_key,
                    sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
                    usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    client = _issue(CLIENT_CN, client_key, ca_name, ca_key, usages=[ExtendedKeyUsageOID.CLIENT_AUTH])
    pem = serialization.Encoding.PEM
    return EtcdServerTls(
        ca_file=_write(os.path.join(directory, "ca.pem"), ca.public_bytes(pem)),
        cert_file=_write(os.path.join(directory, "server.pem"), server.public_bytes(pem)),
        key_file=_write(os.path.join(directory, "server-key.pem"), _pem_key(server_key)),
        client_cert_file=_write(os.path.join(directory, "client.pem"), client.public_bytes(pem)),
        client_key_file=_write(os.path.join(directory, "client-key.pem"), _pem_key(client_key)),
        password=password,
    )


def random_password() -> str:
    return secrets.token_urlsafe(16)
