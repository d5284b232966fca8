"""``pygmy certs``: a CA and one certificate per holder, with its role and names, kept unless forced."""

from __future__ import annotations

import stat
from pathlib import Path

from cryptography import x509

from pygmy.cluster import certs
from pygmy.cluster.local import pygmy
from pygmy.kit.config import ClusterConfig


def sans(path: Path) -> tuple[list[str], list[str]]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return ext.get_values_for_type(x509.UniformResourceIdentifier), [
        *ext.get_values_for_type(x509.DNSName), *map(str, ext.get_values_for_type(x509.IPAddress))]


def test_every_holder_gets_its_role_and_names(tmp_path: Path) -> None:
    config = ClusterConfig(catalog_replicas=2, order_replicas=1, frontends=2, netns="t", netns_subnet="10.9.0")
    issued = certs.ensure(config, tmp_path, hosts=["shop.example"])
    assert issued == ["catalog-1", "catalog-2", "order-1", "frontend-1", "frontend-2", "client", "admin"]
    uris, names = sans(tmp_path / "catalog-2.pem")
    assert uris == ["pygmy://role/catalog"]
    assert {"catalog-2", "localhost", "shop.example", "127.0.0.1", config.address("catalog-2")} <= set(names)
    assert sans(tmp_path / "admin.pem")[0] == ["pygmy://role/admin"]
    # The callers' certificates name no host and serve no server: a copy handed out (nginx holds
    # client.pem) cannot pass for a service to a caller that checks host names.
    for caller in ("client", "admin"):
        assert sans(tmp_path / f"{caller}.pem")[1] == [], caller
        usage = x509.load_pem_x509_certificate((tmp_path / f"{caller}.pem").read_bytes()).extensions.get_extension_for_class(
            x509.ExtendedKeyUsage).value
        assert list(usage) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH], caller
    subject = x509.load_pem_x509_certificate((tmp_path / "order-1.pem").read_bytes()).subject.rfc4514_string()
    assert "OU=order" in subject and "CN=order-1" in subject
    for key in tmp_path.glob("*key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_existing_certificates_are_kept_unless_forced(tmp_path: Path) -> None:
    config = ClusterConfig(catalog_replicas=1, order_replicas=1)
    certs.ensure(config, tmp_path)
    before = (tmp_path / "catalog-1.pem").read_bytes()
    assert certs.ensure(config, tmp_path) == []
    assert certs.ensure(config, tmp_path, only=["catalog-4"]) == ["catalog-4"]
    assert sans(tmp_path / "catalog-4.pem")[0] == ["pygmy://role/catalog"]
    assert (tmp_path / "catalog-1.pem").read_bytes() == before
    assert "catalog-1" in certs.ensure(config, tmp_path, force=True)
    assert (tmp_path / "catalog-1.pem").read_bytes() != before


def test_the_command_writes_them_under_the_data_dir(tmp_path: Path) -> None:
    r = pygmy("certs", "--data-dir", str(tmp_path), "--catalog-replicas", "1", "--order-replicas", "1")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "certs" / "ca.pem").exists() and (tmp_path / "certs" / "order-1-key.pem").exists()
    assert "issued catalog-1, order-1, frontend-1, client, admin" in r.stdout
