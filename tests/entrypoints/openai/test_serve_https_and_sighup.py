"""`pagedserve serve` as a real process: a keys file made by `pagedserve keys add`, HTTPS with a self-signed
certificate through the official openai client, and SIGHUP re-reading the keys file while a stream runs."""

from __future__ import annotations

import datetime
import ipaddress
import json
import signal
import ssl
import subprocess

import httpx
import openai
import pytest

from live_server import CLI, ENGINE_FLAGS, ServeProcess, free_port
from pagedserve.tenants.tenant import hash_key



def write_self_signed_certificate(folder) -> tuple[str, str]:
    """(key path, certificate path) of a certificate for 127.0.0.1 / localhost that is its own CA."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pagedserve test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, False, False, False), True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .add_extension(ski, False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), False)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = str(folder / "key.pem"), str(folder / "cert.pem")
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def keys_add(keys_file, name: str, *flags: str) -> str:
    """Run `pagedserve keys add` and return the key it printed."""
    done = subprocess.run([*CLI, "keys", "add", name, "--file", str(keys_file), *flags], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    [key] = done.stdout.split()
    return key


@pytest.fixture(scope="module")
def tls(tmp_path_factory, tiny_llama_dir):
    folder = tmp_path_factory.mktemp("tls")
    key_path, cert_path = write_self_signed_certificate(folder)
    keys_file = folder / "keys.toml"
    web_key = keys_add(keys_file, "web", "--requests-per-minute", "1000")
    port = free_port()
    server = ServeProcess("--model", tiny_llama_dir, "--port", str(port), "--api-keys-file", str(keys_file),
                          "--ssl-keyfile", key_path, "--ssl-certfile", cert_path, *ENGINE_FLAGS)
    try:
        server.wait_for_output("pagedserve is ready", timeout=120)
        yield {"url": f"https://127.0.0.1:{port}", "port": port, "server": server, "keys_file": keys_file,
               "web_key": web_key, "verify": ssl.create_default_context(cafile=cert_path)}
    finally:
        server.stop()


def test_keys_add_writes_a_file_the_server_accepts_with_the_key_absent(tls):
    text = tls["keys_file"].read_text()
    assert tls["web_key"] not in text and hash_key(tls["web_key"]) in text
    with httpx.Client(base_url=tls["url"], verify=tls["verify"]) as http:
        ok = http.get("/v1/models", headers={"Authorization": f"Bearer {tls['web_key']}"})
        assert ok.status_code == 200 and ok.headers["x-ratelimit-limit-requests"] == "1000"
        assert http.get("/v1/models", headers={"Authorization": "Bearer ps-wrong"}).status_code == 401


def test_https_serves_the_openai_client_and_refuses_plain_http(tls):
    with httpx.Client(verify=tls["verify"]) as http_client, \
            openai.OpenAI(base_url=tls["url"] + "/v1", api_key=tls["web_key"], http_client=http_client,
                          max_retries=0) as client:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3 and reply.id.startswith("chatcmpl-")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{tls['port']}/health", timeout=5)
    assert any(f"pagedserve is ready: https://127.0.0.1:{tls['port']}/v1" in line for line in tls["server"].lines)


def test_sighup_reloads_the_keys_file_and_a_stream_in_flight_finishes(tls):
    url, proc = tls["url"], tls["server"].proc
    batch_key = keys_add(tls["keys_file"], "batch")
    with httpx.Client(base_url=url, verify=tls["verify"], timeout=60) as http:
        def status(key: str) -> int:
            return http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

        assert status(batch_key) == 401  # not before the reload
        with http.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {tls['web_key']}"},
                         json={"prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGHUP)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        tls["server"].wait_for_output("tenant(s): batch, web")
        assert status(batch_key) == 200 and status(tls["web_key"]) == 200
        tls["keys_file"].write_text(tls["keys_file"].read_text() + "[tenants.broken]\n")
        proc.send_signal(signal.SIGHUP)
        tls["server"].wait_for_output("keys file not reloaded")
        assert status(batch_key) == 200 and proc.poll() is None
