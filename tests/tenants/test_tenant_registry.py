"""Authentication against the registry, --api-key keys as admins, and reloads that swap the registry whole or
keep the old one."""

from __future__ import annotations

import logging

import pytest

from pagedserve.tenants.registry import ANONYMOUS, DEFAULT_TENANT, TenantStore, build_registry
from pagedserve.tenants.tenant import hash_key


def keys_file(path, **tenants: str) -> str:
    """A TOML keys file with one user tenant per name -> key."""
    path.write_text("".join(f'[tenants.{name}]\nkey_sha256 = "{hash_key(key)}"\n' for name, key in tenants.items()))
    return str(path)


def test_each_key_finds_its_own_tenant_and_nothing_else_passes(tmp_path):
    registry = build_registry(["cli-key"], keys_file(tmp_path / "k.toml", web="web-key", batch="batch-key"))
    assert registry.auth_required
    assert registry.authenticate(b"web-key").name == "web"
    assert registry.authenticate(b"batch-key").name == "batch"
    cli = registry.authenticate(b"cli-key")
    assert (cli.name, cli.is_admin) == (DEFAULT_TENANT, True)
    for token in (b"", b"web-key ", b"WEB-KEY", hash_key("web-key").encode()):
        assert registry.authenticate(token) is None


def test_cli_keys_keep_a_cache_salt_each(tmp_path):
    registry = build_registry(["k1", "k2", "k1"], None)
    one, two = registry.authenticate(b"k1"), registry.authenticate(b"k2")
    assert len(registry.tenants) == 2 and one.name == two.name == DEFAULT_TENANT
    assert one.cache_salt != two.cache_salt


def test_without_keys_no_auth_is_needed_but_an_empty_keys_file_still_needs_keys(tmp_path):
    assert not build_registry([], None).auth_required
    empty = tmp_path / "k.toml"
    empty.write_text("")
    assert build_registry([], str(empty)).auth_required
    assert not ANONYMOUS.cache_salt and ANONYMOUS.is_admin


def test_a_file_key_equal_to_an_api_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has the key of an --api-key key"):
        build_registry(["same"], keys_file(tmp_path / "k.toml", web="same"))


def test_reload_swaps_in_the_new_tenants(tmp_path):
    path = tmp_path / "k.toml"
    store = TenantStore([], keys_file(path, web="web-key"))
    before = store.registry
    keys_file(path, batch="batch-key")
    assert store.reload() is True
    assert store.registry is not before and before.authenticate(b"web-key").name == "web"  # the old one unchanged
    assert store.registry.authenticate(b"web-key") is None
    assert store.registry.authenticate(b"batch-key").name == "batch"


def test_a_bad_file_on_reload_keeps_the_old_keys_and_logs_an_error(tmp_path, caplog):
    path = tmp_path / "k.toml"
    seen = []
    store = TenantStore([], keys_file(path, web="web-key"), on_load=seen.append)
    before = store.registry
    path.write_text(path.read_text() + "scope = 'root'\n")
    with caplog.at_level(logging.ERROR, logger="pagedserve.tenants.registry"):
        assert store.reload() is False
    assert store.registry is before and seen == [before]
    assert f"{path}:3:" in caplog.text and "previous keys stay in force" in caplog.text


def test_a_bad_file_at_start_is_a_value_error(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text("[tenants.web]\n")
    with pytest.raises(ValueError, match=r"k.toml:1: tenant 'web': key_sha256 is missing"):
        TenantStore([], str(path))
