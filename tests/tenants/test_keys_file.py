"""The keys file: TOML and JSON read into tenants; every bad file refused with its path, line and problem;
add_tenant appends a tenant the reader accepts."""

from __future__ import annotations

import json
import os

import pytest

from pagedserve.tenants.keys_file import add_tenant, load_tenants, parse_tenants
from pagedserve.tenants.rate_limiter import Limits
from pagedserve.tenants.tenant import Tenant, hash_key

HASH_A, HASH_B = hash_key("key-a"), hash_key("key-b")

GOOD_TOML = f"""# two tenants
[tenants.chat-frontend]
key_sha256 = "{HASH_A}"
scope = "user"
priority = 2
min_priority = 1
requests_per_minute = 600
tokens_per_minute = 200000
max_concurrent_requests = 16

[tenants.ops]
key_sha256 = "{HASH_B.upper()}"
scope = "admin"
"""


def test_toml_file_gives_the_tenants_in_file_order_with_defaults(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(GOOD_TOML)
    chat, ops = load_tenants(str(path))
    assert (chat.name, chat.scope, chat.priority, chat.min_priority) == ("chat-frontend", "user", 2, 1)
    assert chat.limits == Limits(600, 200000, 16) and chat.key_sha256 == HASH_A
    assert (ops.name, ops.is_admin, ops.priority, ops.min_priority, ops.limits) == ("ops", True, 0, 0, Limits())
    assert ops.key_sha256 == HASH_B  # normalized to lower case
    assert chat.cache_salt and ops.cache_salt and chat.cache_salt != ops.cache_salt


def test_json_file_has_the_same_shape(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"batch": {"key_sha256": HASH_A, "priority": 10,
                                                      "tokens_per_minute": 1000}}}))
    [batch] = load_tenants(str(path))
    assert (batch.scope, batch.priority, batch.min_priority, batch.limits.tokens_per_minute) == ("user", 10, 10, 1000)


def toml_with(line: str) -> str:
    """A one-tenant file whose 4th line is `line`."""
    return f'# keys\n[tenants.t1]\nkey_sha256 = "{HASH_A}"\n{line}\npriority = 1\n'


@pytest.mark.parametrize("line,problem", [
    ("colour = 'blue'", "unknown field 'colour'"),
    ("scope = 'root'", "scope must be 'admin' or 'user'"),
    ("scope = 1", "scope must be"),
    ("requests_per_minute = -5", "requests_per_minute must be a positive integer"),
    ("tokens_per_minute = 0", "tokens_per_minute must be a positive integer"),
    ("max_concurrent_requests = '16'", "max_concurrent_requests must be an integer"),
    ("max_concurrent_requests = true", "max_concurrent_requests must be an integer"),
    ("min_priority = 3", "min_priority (3) must not be above priority (1)"),
])
def test_a_bad_toml_field_is_refused_with_its_line(tmp_path, line, problem):
    path = tmp_path / "keys.toml"
    path.write_text(toml_with(line))
    with pytest.raises(ValueError) as e:
        load_tenants(str(path))
    assert str(e.value).startswith(f"{path}:4: ") and problem in str(e.value)


def test_toml_syntax_error_names_its_line(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(toml_with("scope = user"))  # an unquoted string
    with pytest.raises(ValueError, match=rf"^{path}:4: invalid TOML"):
        load_tenants(str(path))


@pytest.mark.parametrize("key_hash", ["abc", HASH_A[:-1] + "g", "the-key-itself"])
def test_a_hash_that_is_not_64_hex_characters_is_refused(key_hash):
    text = f'[tenants.t1]\nscope = "user"\nkey_sha256 = "{key_hash}"\n'
    with pytest.raises(ValueError, match=r"^k.toml:3: .*64 hex characters"):
        parse_tenants(text, "k.toml")


def test_a_missing_hash_points_at_the_tenant_header():
    with pytest.raises(ValueError, match=r"^k.toml:3: tenant 't2': key_sha256 is missing"):
        parse_tenants(f'[tenants.t1]\nkey_sha256 = "{HASH_A}"\n[tenants.t2]\nscope = "user"\n', "k.toml")


def test_a_key_shared_by_two_tenants_is_refused_at_the_second():
    text = f'[tenants.t1]\nkey_sha256 = "{HASH_A}"\n\n[tenants.t2]\nscope = "admin"\nkey_sha256 = "{HASH_A}"\n'
    with pytest.raises(ValueError, match=r"^k.toml:6: tenant 't2' has the same key_sha256 as tenant 't1'"):
        parse_tenants(text, "k.toml")


@pytest.mark.parametrize("name", ["default", "other", "has space", "x" * 65])
def test_reserved_and_malformed_tenant_names_are_refused(name):
    with pytest.raises(ValueError, match=r"^k.json:3: .*(reserved|a tenant name is)"):
        parse_tenants(json.dumps({"tenants": {name: {"key_sha256": HASH_A}}}, indent=2), "k.json")


JSON_TENANTS = """{
  "tenants": {
    "web": {
      "key_sha256": "%s",
      "scope": "admin"
    },
    "batch": {
      "key_sha256": "%s",
      "requests_per_minute": -1
    }
  }
}
""" % (HASH_A, HASH_B)


def test_a_bad_json_field_is_refused_with_its_line():
    with pytest.raises(ValueError, match=r"^k.json:9: tenant 'batch': requests_per_minute must be a positive"):
        parse_tenants(JSON_TENANTS, "k.json")


def test_json_syntax_errors_and_duplicate_names_name_their_line():
    with pytest.raises(ValueError, match=r"^k.json:6: invalid JSON"):
        parse_tenants(JSON_TENANTS.replace('"admin"', '"admin",'), "k.json")
    twice = JSON_TENANTS.replace('"batch"', '"web"').replace("-1", "5")
    with pytest.raises(ValueError, match=r"^k.json:7: 'web' appears twice"):
        parse_tenants(twice, "k.json")


def test_unknown_top_level_keys_and_a_tenants_value_that_is_no_table_are_refused():
    with pytest.raises(ValueError, match=r"^k.toml:2: unknown top-level key 'users'"):
        parse_tenants('# x\nusers = 1\n', "k.toml")
    with pytest.raises(ValueError, match=r"^k.toml:1: `tenants` must be a table"):
        parse_tenants('tenants = 3\n', "k.toml")
    with pytest.raises(ValueError, match=r"^k.json:1: the keys file must be a table"):
        parse_tenants('[1, 2]', "k.json")


def test_a_missing_file_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="cannot read the keys file"):
        load_tenants(str(tmp_path / "absent.toml"))


def test_an_empty_file_has_no_tenants():
    assert parse_tenants("", "k.toml") == [] and parse_tenants("{}", "k.json") == []


@pytest.mark.parametrize("filename", ["keys.toml", "keys.json"])
def test_add_tenant_creates_then_appends_and_refuses_an_existing_name(tmp_path, filename):
    path = str(tmp_path / filename)
    first = Tenant.from_fields("web", {"key_sha256": HASH_A, "scope": "admin", "requests_per_minute": 60})
    second = Tenant.from_fields("team.batch", {"key_sha256": HASH_B, "priority": 5, "min_priority": 2})
    add_tenant(path, first)
    add_tenant(path, second)
    assert load_tenants(path) == [first, second]
    with pytest.raises(ValueError, match="exists already"):
        add_tenant(path, Tenant.from_fields("web", {"key_sha256": hash_key("new")}))
    with pytest.raises(ValueError, match="same key_sha256"):
        add_tenant(path, Tenant.from_fields("third", {"key_sha256": HASH_A}))
    assert load_tenants(path) == [first, second]
    assert [f for f in os.listdir(tmp_path) if f.startswith(".keys-")] == []  # no temporary files left


def test_add_tenant_keeps_the_comments_of_a_toml_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(GOOD_TOML.rstrip("\n"))  # no final newline
    add_tenant(str(path), Tenant.from_fields("new", {"key_sha256": hash_key("k3")}))
    text = path.read_text()
    assert text.startswith(GOOD_TOML.rstrip("\n")) and "# two tenants" in text
    assert [t.name for t in load_tenants(str(path))] == ["chat-frontend", "ops", "new"]
