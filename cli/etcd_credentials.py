"""Credentials of `springback up`'s local etcd: a private CA, certificates, a password.

`local_credentials` keeps them in one directory (mode 0700, every file 0600):
``ca.pem`` (a private CA made at the first start; its key is thrown away once
the two certificates are signed, so nothing else can ever be signed by it),
``server.pem``/``server-key.pem`` (SAN 127.0.0.1 and localhost),
``client.pem``/``client-key.pem`` (the coordinator's; its CN, `CLIENT_CN`, is
deliberately not an etcd user: with etcd's auth on, a certificate alone reaches
no key, a request also needs user ``springback``'s password) and ``password``.
A second start reuses them.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import stat

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from springback.cli.local import EtcdServerTls
from springback.client.errors import InvalidArgument

CLIENT_CN = "springback-client"
"""The client certificate's subject: not an etcd user (see the module docstring)."""

CERT_VALIDITY = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=30)
"""Certificates that expire within this are issued afresh (a new CA) at a start."""

FILES = {"ca_file": "ca.pem", "cert_file": "server.pem", "key_file": "server-key.pem",
         "client_cert_file": "client.pem", "client_key_file": "client-key.pem"}
PASSWORD_FILE = "password"


def random_password() -> str:
    """256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def local_credentials(directory: str, *, flag: str = "state-dir") -> EtcdServerTls:
    """The local etcd's TLS files and password under `directory`, made at the
    first call and reused after: the password is never changed (etcd's auth
    keeps it); the certificates are issued afresh (a new CA too) when one is
    missing, cannot be read or expires within `RENEW_BEFORE`. Files are
    written whole (a temporary file renamed), so an interrupted call leaves
    the old file or the new one, never half of one.

    Raises `InvalidArgument` naming `flag` when `directory` is not owned by
    this user, or it or a file in it can be read by others (a password that
    others could read must be taken as known: the message says how to start
    afresh), or it cannot be created."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        _check_private(directory, 0o077, flag)
        password_path = os.path.join(directory, PASSWORD_FILE)
        if os.path.exists(password_path):
            _check_private(password_path, 0o077, flag)
            with open(password_path, encoding="utf-8") as f:
                password = f.readline().rstrip("\n")
            if not password:
                raise InvalidArgument(flag, f"{password_path!r} is empty: {_AFRESH}")
        else:
            password = random_password()
            _write(password_path, (password + "\n").encode())
        paths = {field: os.path.join(directory, name) for field, name in FILES.items()}
        for path in paths.values():
            if os.path.exists(path):
                _check_private(path, 0o077, flag)
        if not _certs_usable(paths):
            issue_certs(paths)
    except OSError as e:
        raise InvalidArgument(flag, f"etcd credentials in {directory!r}: "
                              f"{e.strerror or e} ({e.filename or directory})") from None
    return EtcdServerTls(**paths, password=password)


_AFRESH = ("stop springback up and remove this directory and the etcd data beside it "
           "(its jobs are lost) to start afresh")


def _check_private(path: str, forbidden: int, flag: str) -> None:
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise InvalidArgument(flag, f"{path!r} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) & forbidden:
        raise InvalidArgument(flag, f"{path!r} has mode {stat.S_IMODE(st.st_mode):o}: others "
                              f"can read the etcd credentials; {_AFRESH}")


def _certs_usable(paths: dict[str, str]) -> bool:
    deadline = datetime.datetime.now(datetime.timezone.utc) + RENEW_BEFORE
    for field in ("ca_file", "cert_file", "client_cert_file"):
        try:
            with open(paths[field], "rb") as f:
                cert = x509.load_pem_x509_certificate(f.read())
        except (OSError, ValueError):
            return False
        if cert.not_valid_after_utc < deadline:
            return False
    return all(os.path.exists(paths[k]) for k in ("key_file", "client_key_file"))


def issue_certs(paths: dict[str, str], *, validity: datetime.timedelta = CERT_VALIDITY) -> None:
    """Writes a fresh CA, a server certificate (SAN 127.0.0.1, localhost) and a
    client certificate (CN `CLIENT_CN`) to `paths` (keys of `FILES`), P-256
    keys, each file 0600. Raises OSError when one cannot be written."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "springback local etcd CA")])
    ca = _issue(ca_name, ca_key, ca_name, ca_key, validity, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = _issue(_name("etcd"), server_key, ca_name, ca_key, validity,
                    sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
                    usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    client = _issue(_name(CLIENT_CN), client_key, ca_name, ca_key, validity,
                    usages=[ExtendedKeyUsageOID.CLIENT_AUTH])
    pem = serialization.Encoding.PEM
    _write(paths["ca_file"], ca.public_bytes(pem))
    _write(paths["cert_file"], server.public_bytes(pem))
    _write(paths["key_file"], _pem_key(server_key))
    _write(paths["client_cert_file"], client.public_bytes(pem))
    _write(paths["client_key_file"], _pem_key(client_key))


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(name: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
           issuer_key: ec.EllipticCurvePrivateKey, validity: datetime.timedelta, *,
           ca: bool = False, sans: list[x509.GeneralName] | None = None,
           usages: list[x509.ObjectIdentifier] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + validity)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: str, data: bytes) -> None:
    """`data` to `path` whole and 0600: a temporary file beside it, renamed."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a leftover temporary file keeps its old mode
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
