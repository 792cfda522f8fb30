"""Test certificates made with `cryptography`: a CA and leaf certificates it signed, valid for
127.0.0.1, localhost and any addresses a test names, as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _certificate(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    addresses: Sequence[str] = (),
) -> x509.Certificate:
    """A certificate for `name` (valid for 127.0.0.1, localhost and `addresses`) signed by
    `issuer`, or a self-signed CA."""
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        ips = [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", *addresses)]
        names: list[x509.GeneralName] = [*ips, x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def tls_files(directory: Path, ca_name: str, addresses: Sequence[str] = ()) -> dict[str, tuple[Path, Path]]:
    """A CA and two leaf certificates it signed ("worker", "gateway"), also valid for `addresses`:
    name -> (cert, key) files; "ca" -> (cert, key) of the CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    files = {}
    for name in ("ca", "worker", "gateway"):
        key = ca_key if name == "ca" else _key()
        certificate = _certificate(
            ca_name if name == "ca" else name, key, None if name == "ca" else (ca_name, ca_key), addresses
        )
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        files[name] = (cert_path, key_path)
    return files
