"""What the soak watches on the server: its engine gauges (/metrics), /health, and the RSS, threads and open
files of its processes (read from /proc, so only for a server on this machine whose pid is known)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


@dataclass(frozen=True)
class ProcessStats:
    """Summed over the server process and all its descendants (the engine core process among them)."""

    rss_bytes: int
    threads: int
    open_fds: int
    processes: int

    @classmethod
    def read(cls, pid: int) -> "ProcessStats":
        """ValueError when `pid` is not running."""
        pids = [pid, *_descendants(pid)]
        rss = threads = fds = 0
        for p in pids:
            try:
                status = _status_fields(p)
                rss += int(status.get("VmRSS", "0 kB").split()[0]) * 1024
                threads += int(status.get("Threads", "0"))
                fds += len(os.listdir(f"/proc/{p}/fd"))
            except (FileNotFoundError, ProcessLookupError):
                if p == pid:
                    raise ValueError(f"the server process {pid} is not running") from None
        return cls(rss, threads, fds, len(pids))

    def as_dict(self) -> dict:
        return {"rss_mib": round(self.rss_bytes / 2 ** 20, 1), "threads": self.threads, "open_fds": self.open_fds,
                "processes": self.processes}


def _status_fields(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def parse_gauges(text: str) -> dict[str, float]:
    """The engine gauges from a /metrics page (pagedserve's `pagedserve:` names or vLLM's `vllm:`), summed over
    label sets (a Ray ingress reports one per replica)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {name: 0.0 for name in GAUGES}
    for family in text_string_to_metric_families(text):
        short = family.name.split(":", 1)[-1]
        if short in values and family.name.split(":", 1)[0] in ("pagedserve", "vllm"):
            values[short] += sum(s.value for s in family.samples)
    return values


async def read_gauges(session, base_url: str, headers: dict) -> Optional[dict[str, float]]:
    """The gauges now, or None when /metrics does not answer 200."""
    async with session.get(base_url + "/metrics", headers=headers) as resp:
        if resp.status != 200:
            return None
        return parse_gauges(await resp.text())


async def health_status(session, base_url: str) -> int:
    async with session.get(base_url + "/health") as resp:
        await resp.read()
        return resp.status
