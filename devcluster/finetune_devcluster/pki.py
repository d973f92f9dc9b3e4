"""Certificates and keys for a loopback-only control plane.

One CA signs the apiserver's serving certificate and an admin client certificate (group
``system:masters``); a separate RSA key pair signs service-account tokens. Uses the ``cryptography``
package when it is importable, else the ``openssl`` command line.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

VALID_DAYS = 365
ADMIN_USER = "finetune-dev-admin"
ADMIN_GROUP = "system:masters"


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def serving_crt(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def admin_crt(self) -> Path:
        return self.dir / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.dir / "admin.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def generate(directory: Path, service_ip: str) -> Pki:
    """Create every file of :class:`Pki` in ``directory`` (overwriting)."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    dns = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    ips = ["127.0.0.1", service_ip]
    try:
        import cryptography  # noqa: F401
    except ImportError:
        _generate_openssl(pki, dns, ips)
    else:
        _generate_cryptography(pki, dns, ips)
    for key in (pki.ca_key, pki.serving_key, pki.admin_key, pki.sa_key):
        key.chmod(0o600)
    return pki


def _generate_cryptography(pki: Pki, dns: list[str], ips: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # tolerate small clock skew

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    def name(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("finetune-dev-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write_key(pki.ca_key, ca_key)
    pki.ca_crt.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(
        subject: x509.Name, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName] | None, crt: Path, key_path: Path
    ) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_encipherment=True,
                    content_commitment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        write_key(key_path, key)
        crt.write_bytes(b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))

    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    leaf(name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans, pki.serving_crt, pki.serving_key)
    leaf(name(ADMIN_USER, ADMIN_GROUP), ExtendedKeyUsageOID.CLIENT_AUTH, None, pki.admin_crt, pki.admin_key)

    # Service-account tokens: RS256 is what every JWT consumer supports.
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_key(pki.sa_key, sa)
    pki.sa_pub.write_bytes(
        sa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def _openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("need the 'cryptography' Python package or the 'openssl' command to make certificates")
    subprocess.run([exe, *args], check=True, capture_output=True)


def _generate_openssl(pki: Pki, dns: list[str], ips: list[str]) -> None:
    days = str(VALID_DAYS)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(pki.ca_key))
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(pki.ca_key),
        "-sha256",
        "-days",
        days,
        "-subj",
        "/CN=finetune-dev-ca",
        "-out",
        str(pki.ca_crt),
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,digitalSignature,keyCertSign,cRLSign",
    )
    with tempfile.TemporaryDirectory() as tmp:

        def leaf(subj: str, ext: str, crt: Path, key: Path) -> None:
            csr = Path(tmp) / "req.csr"
            extfile = Path(tmp) / "ext.cnf"
            extfile.write_text(
                "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n" + ext
            )
            _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
            _openssl("req", "-new", "-key", str(key), "-subj", subj, "-out", str(csr))
            _openssl(
                "x509",
                "-req",
                "-in",
                str(csr),
                "-CA",
                str(pki.ca_crt),
                "-CAkey",
                str(pki.ca_key),
                "-set_serial",
                str(int.from_bytes(os.urandom(8), "big")),
                "-days",
                days,
                "-sha256",
                "-extfile",
                str(extfile),
                "-out",
                str(crt),
            )

        san = ",".join([f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips])
        leaf(
            "/CN=kube-apiserver",
            f"extendedKeyUsage=serverAuth\nsubjectAltName={san}\n",
            pki.serving_crt,
            pki.serving_key,
        )
        leaf(f"/O={ADMIN_GROUP}/CN={ADMIN_USER}", "extendedKeyUsage=clientAuth\n", pki.admin_crt, pki.admin_key)
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(pki.sa_key))
    _openssl("pkey", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub))


def issue_client(pki: Pki, stem: str, cn: str, org: str | None = None) -> tuple[Path, Path]:
    """A client certificate ``<stem>.crt``/``<stem>.key`` signed by the cluster CA (e.g. a kubelet's
    ``system:node:<name>`` in ``system:nodes``); returns (certificate, key)."""
    crt, key = pki.dir / f"{stem}.crt", pki.dir / f"{stem}.key"
    subj = (f"/O={org}" if org else "") + f"/CN={cn}"
    with tempfile.TemporaryDirectory() as tmp:
        csr, ext = Path(tmp) / "req.csr", Path(tmp) / "ext.cnf"
        ext.write_text(
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=clientAuth\n"
        )
        _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
        _openssl("req", "-new", "-key", str(key), "-subj", subj, "-out", str(csr))
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_crt), "-CAkey", str(pki.ca_key),
            "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", str(VALID_DAYS), "-sha256",
            "-extfile", str(ext), "-out", str(crt),
        )  # fmt: skip
    key.chmod(0o600)
    return crt, key
