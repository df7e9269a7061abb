"""LoRA through the server: `model` selects an adapter, /v1/models lists them, vLLM's load/unload routes with
their 400/404 cases, admin scope, reloads that never serve old weights, and the LoRA metrics."""

from __future__ import annotations

import hashlib
import json
import os

import httpx
import openai
import pytest
import torch

from live_server import MODEL_NAME, scrape, start_server, value
from pagedserve import LLM, LoRARequest, SamplingParams

PROMPT = "The quick brown fox"


def make_adapter(base_dir: str, out_dir: str, seed: int, modules=("q_proj", "v_proj"), rank=4, **extra) -> str:
    """A PEFT adapter of the tiny model with random (non-zero) weights, saved as peft saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(modules), init_lora_weights=False, **extra)
    get_peft_model(model, config).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(tiny_llama_dir, str(root / "a"), 1),
            "b": make_adapter(tiny_llama_dir, str(root / "b"), 2, modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                             "gate_proj", "up_proj", "down_proj"),
                              rank=8),
            "c": make_adapter(tiny_llama_dir, str(root / "c"), 3),
            "dora": make_adapter(tiny_llama_dir, str(root / "dora"), 4, use_dora=True)}


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256, enable_lora=True,
               max_loras=2, max_lora_rank=16)


def offline_text(offline, lora_request=None) -> str:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [out] = offline.generate(PROMPT, params, use_tqdm=False, lora_request=lora_request)
    return out.outputs[0].text


LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters):
    live = start_server(tiny_llama_dir, *LORA_FLAGS, "--allowed-lora-dirs", os.path.dirname(adapters["a"]),
                        "--lora-modules", f"a={adapters['a']}",
                        json.dumps({"name": "b", "path": adapters["b"]}))
    yield live
    live.stop()


def complete(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kw)


def test_model_selects_the_adapter_and_each_equals_the_offline_engine(server, offline, adapters):
    want_a = offline_text(offline, LoRARequest("a", 1, adapters["a"]))
    want_b = offline_text(offline, LoRARequest("b", 2, adapters["b"]))
    base = offline_text(offline)
    assert len({want_a, want_b, base}) == 3  # the adapters change the text: a silent fallback would show
    assert complete(server.url, "a") == want_a
    assert complete(server.url, "b") == want_b
    assert complete(server.url, MODEL_NAME) == base
    server.wait_idle()


def test_models_lists_each_adapter_with_its_parent_and_path(server, adapters):
    data = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert data["a"]["parent"] == MODEL_NAME and data["a"]["root"] == adapters["a"]
    assert data["b"]["parent"] == MODEL_NAME and data["b"]["root"] == adapters["b"]
    assert MODEL_NAME in data


def test_unknown_model_is_404_listing_the_adapters(server):
    r = post(server.url, "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and "a" in r.json()["error"]["message"].split("Served: ")[1]


def test_load_and_unload_at_run_time_with_their_error_cases(server, adapters, offline):
    r = post(server.url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
    assert r.status_code == 200, r.text
    assert complete(server.url, "c") == offline_text(offline, LoRARequest("c", 9, adapters["c"]))
    dup = post(server.url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "lora_name"
    missing = post(server.url, "/v1/load_lora_adapter",
                   {"lora_name": "x", "lora_path": os.path.join(os.path.dirname(adapters["a"]), "no-such-adapter")})
    assert missing.status_code == 400 and "x" in missing.json()["error"]["message"]
    dora = post(server.url, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": adapters["dora"]})
    assert dora.status_code == 400 and "dora" in dora.json()["error"]["message"].lower()
    assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    gone = post(server.url, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert gone.status_code == 404
    after = post(server.url, "/v1/completions", {"model": "c", "prompt": PROMPT, "max_tokens": 2})
    assert after.status_code == 404
    assert "c" not in {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
    server.wait_idle()


def test_a_runtime_load_from_outside_the_allowed_directories_is_refused(server, adapters, tmp_path):
    escape = os.path.join(os.path.dirname(adapters["a"]), "..", "elsewhere")
    link = os.path.join(os.path.dirname(adapters["a"]), "link-out")
    os.symlink(tmp_path, link)
    try:
        for path in (escape, link, str(tmp_path)):
            r = post(server.url, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": path})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
            assert "not inside a directory this server allows" in r.json()["error"]["message"]
    finally:
        os.unlink(link)
    assert "evil" not in {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}


def test_a_reload_under_the_same_name_never_serves_the_old_weights(server, adapters, offline):
    old = complete(server.url, "a")
    assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 200
    assert post(server.url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["c"]}).status_code == 200
    new = complete(server.url, "a")  # same prompt, same name: the old KV blocks must not be hit
    assert new == offline_text(offline, LoRARequest("c", 7, adapters["c"])) != old
    assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 200
    assert post(server.url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["a"]}).status_code == 200
    assert complete(server.url, "a") == old
    server.wait_idle()


def test_unloading_an_adapter_in_use_is_refused_until_its_requests_finish(server, adapters):
    assert post(server.url, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": adapters["c"]}).status_code == 200
    body = {"model": "busy", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is running now
        refused = post(server.url, "/v1/unload_lora_adapter", {"lora_name": "busy"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "lora_in_use"
        assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"  # it finishes
    server.wait_idle()
    assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200


def test_lora_metrics_count_requests_per_adapter(server):
    labels = {"lora_name": "b", "model_name": MODEL_NAME}
    before = value(scrape(server), "pagedserve:lora_requests_total", **labels)
    complete(server.url, "b")
    server.wait_idle()
    samples = scrape(server)
    assert value(samples, "pagedserve:lora_requests_total", **labels) == before + 1
    assert value(samples, "pagedserve:lora_generation_tokens_total", **labels) >= 8
    [info] = [labels for (name, labels) in samples if name == "pagedserve:lora_requests_info"]
    assert dict(info) == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def test_runtime_routes_need_the_flag(tiny_llama_dir, adapters):
    live = start_server(tiny_llama_dir, "--enable-lora", "--max-lora-rank", "16")
    try:
        r = post(live.url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
        assert r.status_code == 404
    finally:
        live.stop()


def test_runtime_routes_are_admin_only(tiny_llama_dir, adapters, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text("".join(f'[tenants.{name}]\nkey_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
                            f'scope = "{scope}"\n\n' for name, key, scope in
                            (("ops", "admin-key", "admin"), ("app", "user-key", "user"))))
    live = start_server(tiny_llama_dir, *LORA_FLAGS, "--api-keys-file", str(keys),
                        "--allowed-lora-dirs", os.path.dirname(adapters["c"]))
    try:
        body = {"lora_name": "c", "lora_path": adapters["c"]}
        user = post(live.url, "/v1/load_lora_adapter", body, headers={"Authorization": "Bearer user-key"})
        assert user.status_code == 403 and user.json()["error"]["code"] == "permission_denied"
        admin = post(live.url, "/v1/load_lora_adapter", body, headers={"Authorization": "Bearer admin-key"})
        assert admin.status_code == 200
        r = post(live.url, "/v1/completions", {"model": "c", "prompt": PROMPT, "max_tokens": 2},
                 headers={"Authorization": "Bearer user-key"})
        assert r.status_code == 200  # any key may use a loaded adapter
        live.wait_idle()
    finally:
        live.stop()


def test_a_bad_adapter_or_lora_modules_without_enable_lora_refuse_to_start(tiny_llama_dir, adapters):
    with pytest.raises(ValueError, match="needs --enable-lora"):
        start_server(tiny_llama_dir, "--lora-modules", f"a={adapters['a']}")
    with pytest.raises(ValueError, match="(?i)dora"):
        start_server(tiny_llama_dir, *LORA_FLAGS, "--lora-modules", f"d={adapters['dora']}")


@pytest.mark.parametrize("entry", ["no-equals-sign", '{"name": "x"}', '{"name": "x", "path": "/p", "r": 1}', "=p"])
def test_malformed_lora_modules_entries_are_cli_errors(entry, capsys):
    from pagedserve.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", entry])
    assert "--lora-modules" in capsys.readouterr().err
