"""Test certificates (the `cryptography` dev dependency): a CA and certificates it signs, or one
self-signed certificate for localhost."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any


def issue(
    folder: Path, name: str, sans: list[Any], ca: tuple[Any, Any] | None = None
) -> tuple[Path, Path]:
    """(cert.pem, key.pem) of a certificate for `sans` (x509 general names), signed by `ca`
    ((certificate, key) objects, see `load`), else a self-signed CA; files named after `name`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, name)])
    issuer_cert, issuer_key = ca if ca is not None else (None, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder().subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert is not None else subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
    )  # fmt: skip
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def load(pair: tuple[Path, Path]) -> tuple[Any, Any]:
    """The (certificate, key) objects of a pair of PEM files, to sign others with."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert, key = pair
    return (
        x509.load_pem_x509_certificate(cert.read_bytes()),
        serialization.load_pem_private_key(key.read_bytes(), password=None),
    )


def localhost_names() -> list[Any]:
    from cryptography import x509

    return [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]


def self_signed_localhost(folder: Path, name: str = "specdec-test") -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1: its own root for clients."""
    return issue(folder, name, localhost_names())
