"""Server certificates the test CA (bench/lib/pki.py) does not issue: expired or self-signed ones,
for the tests that check the gateway refuses an upstream presenting them."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(cert: x509.Certificate, key, directory: Path, stem: str) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def issue_cert(pki, directory: Path, stem: str, names: list[str], ips: list[str] = (), *,
               expired: bool = False, self_signed: bool = False) -> tuple[Path, Path]:
    """A server certificate for names/IPs that the gateway's upstream check accepts (signed by the
    session's test CA, which the gateway trusts upstream) or refuses in one way only: expired
    (valid two days ago for one day) or self-signed."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    start, end = (now - datetime.timedelta(days=2), now - datetime.timedelta(days=1)) if expired else (
        now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    sans = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    if self_signed:
        issuer_name, signing_key = subject, key
    else:
        issuer_name, signing_key = pki._cert.subject, pki._key  # the session CA (bench/lib/pki.py)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    )
    if not self_signed:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(pki._key.public_key()), critical=False)
    return _write(builder.sign(signing_key, hashes.SHA256()), key, directory, stem)
