"""`pagedserve keys add`, and the `pagedserve serve` flags of keys files and HTTPS refusing bad input at start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.tenants.keys_file import load_tenants
from pagedserve.tenants.rate_limiter import Limits
from pagedserve.tenants.tenant import hash_key


def test_keys_add_prints_a_new_key_once_and_stores_only_its_hash(tmp_path, capsys):
    path = tmp_path / "keys.toml"
    assert main(["keys", "add", "web", "--file", str(path), "--priority", "3", "--min-priority", "1",
                 "--requests-per-minute", "60", "--tokens-per-minute", "5000", "--max-concurrent-requests", "4"]) == 0
    out = capsys.readouterr()
    [key] = out.out.split()
    assert key.startswith("ps-") and len(key) > 40 and key not in out.err and "web" in out.err
    assert key not in path.read_text()
    [web] = load_tenants(str(path))
    assert (web.name, web.key_sha256, web.scope, web.priority, web.min_priority) == ("web", hash_key(key), "user",
                                                                                     3, 1)
    assert web.limits == Limits(60, 5000, 4)
    assert main(["keys", "add", "ops", "--file", str(path), "--scope", "admin"]) == 0
    second = capsys.readouterr().out.strip()
    assert second != key and [t.name for t in load_tenants(str(path))] == ["web", "ops"]


def test_keys_add_refuses_an_existing_name_bad_values_and_a_bad_file(tmp_path, capsys):
    path = tmp_path / "keys.json"
    assert main(["keys", "add", "web", "--file", str(path)]) == 0
    capsys.readouterr()
    before = path.read_text()
    assert main(["keys", "add", "web", "--file", str(path)]) == 2
    assert "exists already" in capsys.readouterr().err
    assert main(["keys", "add", "batch", "--file", str(path), "--requests-per-minute", "-1"]) == 2
    assert "requests_per_minute must be a positive integer" in capsys.readouterr().err
    assert main(["keys", "add", "batch", "--file", str(path), "--priority", "1", "--min-priority", "2"]) == 2
    assert "min_priority (2) must not be above priority (1)" in capsys.readouterr().err
    assert path.read_text() == before
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants.x]\nkey_sha256 = 'short'\n")
    assert main(["keys", "add", "batch", "--file", str(bad)]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err


def test_keys_add_does_not_import_torch(tmp_path):
    code = ("import sys; from pagedserve.entrypoints.cli import main; "
            f"assert main(['keys', 'add', 'web', '--file', {str(tmp_path / 'k.toml')!r}]) == 0; "
            "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_serve_refuses_a_bad_keys_file_before_loading_the_model(tmp_path, capsys):
    bad = tmp_path / "keys.toml"
    bad.write_text(f"[tenants.web]\nkey_sha256 = '{hash_key('k')}'\nscope = 'root'\n")
    # A model that does not exist: the keys file is refused first, so this error is the one reported.
    assert main(["serve", "--model", str(tmp_path / "no-model"), "--api-keys-file", str(bad)]) == 2
    assert f"error: {bad}:3: tenant 'web': scope must be" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "no-model"), "--api-keys-file", str(tmp_path / "none")]) == 2
    assert "cannot read the keys file" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--ssl-keyfile", "key.pem"], ["--ssl-certfile", "cert.pem"]])
def test_serve_needs_both_ssl_flags(tmp_path, capsys, flags):
    assert main(["serve", "--model", str(tmp_path / "no-model"), *flags]) == 2
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err


def test_serve_help_lists_the_tenant_and_https_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--api-keys-file", "--max-metric-tenants", "--ssl-keyfile", "--ssl-certfile", "--api-key"):
        assert flag in text, flag
