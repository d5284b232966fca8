"""``pygmy certs``: a cluster's CA and the certificates its services and tools show each other.

Laid out in one folder (``<data-dir>/certs`` unless ``--certs-dir``), each file on its own so
that ``pygmy up``, compose and Swarm secrets can hand a service just its own:

* ``ca.pem`` (the CA certificate, every holder trusts it) and ``ca-key.pem`` (its key: stays with
  the operator; only ``pygmy certs`` reads it, to issue more);
* ``<name>.pem`` and ``<name>-key.pem`` for each service (``catalog-1``, ``order-2``,
  ``frontend-1``): role = its tier, names = its name, ``localhost``, its host and ``--host``s;
* ``client.pem`` / ``admin.pem`` (and keys): role ``client`` (any outside caller of the frontend,
  optional there) and ``admin`` (the operator's tools that speak to replicas);
* ``proxy.pem`` (and key): role ``proxy``, what the nginx in front of the frontends serves HTTPS with
  (``deploy/proxy/``).

The role is a URI subject alternative name ``pygmy://role/<role>`` (and the subject's OU), read by
``pygmy/kit/tls.py``. Keys are EC P-256 (fast handshakes), written 0600. Existing files are kept
(``force`` issues them anew, e.g. to rotate: services load the new ones without a restart).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pygmy.kit.config import ClusterConfig
from pygmy.kit.tls import ROLE_URI, ROLES

#: How long certificates are valid: a CA ten years, the others two (rotate by issuing again).
CA_DAYS, LEAF_DAYS = 3650, 730


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write ``path`` whole or not at all (a service reloading it never reads half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common: str, role: str, cluster: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"Pygmy {cluster}"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(folder: Path, cluster: str = "cluster", days: int = CA_DAYS) -> None:
    """A new CA in ``folder`` (``ca.pem``, ``ca-key.pem``)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"Pygmy CA {cluster}", "ca", cluster)
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write(folder / "ca-key.pem", _key_pem(key), private=True)
    _write(folder / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)


#: Roles that only ever call (the outside callers' ``client``, the operator's ``admin``): their
#: certificates name no host and serve no TLS server, so a copy handed out (nginx holds ``client``)
#: cannot pass for a service to a caller that checks the host name.
CALLERS = ("client", "admin")


def issue(folder: Path, holder: str, role: str, hosts: Iterable[str] = (), days: int = LEAF_DAYS) -> Path:
    """A certificate and key for ``holder`` with ``role``, signed by the CA in ``folder``; its names
    are ``holder``, ``localhost``, 127.0.0.1 and ``hosts`` (names or IP addresses), none for a
    ``CALLERS`` role (a client certificate only). Returns its path."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    ca_key = serialization.load_pem_private_key((folder / "ca-key.pem").read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{folder / 'ca-key.pem'} is not an EC key made by pygmy certs")
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(ROLE_URI + role)]
    seen: set[str] = set()
    caller = role in CALLERS  # only ever a client: no names, and no use as a server's certificate
    for host in () if caller else (holder, "localhost", "127.0.0.1", *hosts):
        if not host or host in seen or host in ("0.0.0.0", "::"):
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    org = ca.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    subject = x509.Name([*org, x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                         x509.NameAttribute(NameOID.COMMON_NAME, holder)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.CLIENT_AUTH] if caller else [ExtendedKeyUsageOID.SERVER_AUTH,
                                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    # The key first, then the certificate: a service reloading between the two finds a pair that
    # does not match, keeps its old one and looks again (pygmy/kit/tls.py Identity.refresh).
    _write(folder / f"{holder}-key.pem", _key_pem(key), private=True)
    _write(folder / f"{holder}.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
    return folder / f"{holder}.pem"


def holders(config: ClusterConfig) -> dict[str, tuple[str, list[str]]]:
    """``{holder: (role, hosts)}`` of a cluster: every service at its address, and the two tools."""
    out: dict[str, tuple[str, list[str]]] = {}
    for name in config.names():
        tier = name.rpartition("-")[0]
        hosts = [config.address(name)]
        if config.advertise_host:
            hosts.append(config.advertise_host)
        out[name] = (tier, hosts)
    out["client"] = ("client", [])
    out["admin"] = ("admin", [])
    return out


def ensure(config: ClusterConfig, folder: Path, hosts: Iterable[str] = (), force: bool = False,
           only: Iterable[str] = ()) -> list[str]:
    """The CA (made if missing) and a certificate for each holder of ``config`` (or just ``only``)
    that has none (every one with ``force``), each with ``hosts`` among its names too. Returns
    the holders issued."""
    if not (folder / "ca.pem").exists():
        make_ca(folder, cluster=str(config.port_base))
    elif not (folder / "ca-key.pem").exists():
        missing = [h for h in holders(config) if force or not (folder / f"{h}.pem").exists()]
        if missing:
            raise RuntimeError(f"{folder / 'ca-key.pem'} is not there: cannot issue {', '.join(missing)}")
        return []
    wanted = holders(config)
    for name in only:
        if name not in wanted:
            tier = name.rpartition("-")[0]
            wanted[name] = (tier if tier in ROLES else name, [])
    issued = []
    extra = list(hosts)
    for holder, (role, own) in wanted.items():
        if only and holder not in set(only):
            continue
        if force or not (folder / f"{holder}.pem").exists() or not (folder / f"{holder}-key.pem").exists():
            issue(folder, holder, role, [*own, *extra])
            issued.append(holder)
    return issued
