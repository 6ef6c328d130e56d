"""A private CA for the tests' TLS servers: its certificate, and a server certificate it signed for an IP address."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Tls:
    ca_file: Path
    cert_file: Path
    key_file: Path


def private_ca(directory: Path, name: str, address: str = "127.0.0.1") -> Tls:
    """A CA named `name` and a server certificate it signed for `address`, valid for an hour, written in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    valid = {
        "not_valid_before": now - datetime.timedelta(minutes=5),
        "not_valid_after": now + datetime.timedelta(hours=1),
    }
    ca = (
        x509.CertificateBuilder(issuer_name=ca_name, subject_name=ca_name, public_key=ca_key.public_key(), **valid)
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder(
            issuer_name=ca_name,
            subject_name=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)]),
            public_key=server_key.public_key(),
            **valid,
        )
        .serial_number(x509.random_serial_number())
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = Tls(directory / "ca.crt", directory / "tls.crt", directory / "tls.key")
    paths.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths.cert_file.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths.key_file.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths
