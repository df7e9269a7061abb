"""The LoRA adapters a server serves by name: `--lora-modules` at start, vLLM's load/unload routes at run time.

A request picks an adapter by putting its name in `model`. The names live here (the HTTP side); the weights
live in the engine core, which loads and checks each adapter when it is added (`AsyncLLM.add_lora`), so a bad
adapter is refused at start or by the load route, never served as the base model. Every load gets a new
`lora_int_id`: a reload under the same name is a new adapter to the core, and its prefix-cache blocks are new.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Optional

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.allowed_paths import PathNotAllowedError, confined
from pagedserve.entrypoints.openai.errors import OpenAIError


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path` or vLLM's JSON `{"name", "path", "base_model_name"}`."""

    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_module(text: str) -> LoRAModule:
    """argparse type of `--lora-modules`; ValueError naming the entry when it is malformed."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules entry {text!r} is not valid JSON: {e}") from None
        unknown = set(data) - {"name", "path", "base_model_name"}
        if not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str) or unknown:
            raise ValueError(f"--lora-modules entry {text!r}: needs string 'name' and 'path' (and optionally "
                             "'base_model_name'), nothing else")
        return _checked(LoRAModule(data["name"], data["path"], data.get("base_model_name")))
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"--lora-modules entry {text!r}: expected name=path or a JSON object")
    return _checked(LoRAModule(name.strip(), path.strip()))


def _checked(module: LoRAModule) -> LoRAModule:
    if not module.name or not module.path:
        raise ValueError(f"--lora-modules entry {module}: the name and the path must not be empty")
    return module


class LoRAModules:
    """name -> LoRARequest of the adapters this server serves, kept in step with the engine core."""

    def __init__(self, async_llm: AsyncLLM, base_model_names: list[str], enabled: bool,
                 allowed_dirs: tuple[str, ...] = ()) -> None:
        """`allowed_dirs` (resolved: allowed_paths.resolved_dirs) are where the load route may read adapters
        from (--allowed-lora-dirs); none: it loads nothing. `--lora-modules` paths, the operator's own, are
        not confined."""
        self.async_llm = async_llm
        self.base_model_names = base_model_names
        self.enabled = enabled
        self.allowed_dirs = allowed_dirs
        self._by_name: dict = {}
        self._paths: dict[str, str] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    def get(self, name: str):
        """The LoRARequest of an adapter name, or None when `name` is no adapter."""
        return self._by_name.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def load_at_start(self, modules: list[LoRAModule]) -> None:
        """Load the `--lora-modules` adapters (blocking; ValueError on the first bad one)."""
        if modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        for module in modules:
            self._check_new_name(module.name, ValueError)
            self._add(module.name, module.path)

    async def load(self, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter: 400 for a duplicate name or an adapter the engine refuses."""
        if not self.enabled:
            raise OpenAIError("LoRA is not enabled on this server (start it with --enable-lora)", 400,
                              param="lora_name")
        if not self.allowed_dirs:
            raise OpenAIError("this server loads no adapter at run time from a request's path: start it with "
                              "--allowed-lora-dirs DIR to allow the adapters under DIR", 400, param="lora_path")
        try:
            path = confined(path, self.allowed_dirs, "lora_path")
        except PathNotAllowedError as e:
            raise OpenAIError(str(e), 400, param="lora_path") from None
        async with self._lock:
            self._check_new_name(name, lambda message: OpenAIError(message, 400, param="lora_name"))
            try:
                await asyncio.to_thread(self._add, name, path)
            except ValueError as e:
                raise OpenAIError(str(e), 400, param="lora_path") from None

    async def unload(self, name: str) -> None:
        """POST /v1/unload_lora_adapter: 404 for an unknown name; 409 while requests use the adapter (the core
        refuses, so that no request changes weights half-way: retry once they have finished). Afterwards a
        request naming it gets 404."""
        async with self._lock:
            lora_request = self._by_name.get(name)
            if lora_request is None:
                raise OpenAIError(f"The LoRA adapter `{name}` is not loaded.", 404, param="lora_name",
                                  code="model_not_found")
            try:
                await asyncio.to_thread(self.async_llm.remove_lora, lora_request.lora_int_id)
            except ValueError as e:
                raise OpenAIError(f"The LoRA adapter `{name}` was not unloaded: {e}", 409, param="lora_name",
                                  code="lora_in_use") from None
            del self._by_name[name], self._paths[name]

    def model_cards(self, created: int) -> list[dict]:
        """/v1/models entries: each adapter with its base model as `parent` and its path as `root`."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "pagedserve",
                 "root": self._paths[name], "parent": self.base_model_names[0],
                 "max_model_len": self.async_llm.max_model_len} for name in self._by_name]

    def _check_new_name(self, name: str, error) -> None:
        if not name:
            raise error("an adapter name must not be empty")
        if name in self._by_name or name in self.base_model_names:
            raise error(f"the name `{name}` is already served (a loaded adapter or the base model); unload it "
                        "first to load other weights under it")

    def _add(self, name: str, path: str) -> None:
        from pagedserve.lora.request import LoRARequest

        lora_request = LoRARequest(name, next(self._ids), path)
        self.async_llm.add_lora(lora_request)  # raises ValueError naming the adapter and the reason
        self._by_name[name], self._paths[name] = lora_request, path
