"""How long /health takes while the server streams: the Kubernetes liveness/readiness probes hit it under load.

    python benchmarks/health_under_load.py [--url http://127.0.0.1:8000] [--streams 16] [--seconds 25]

against a running `pagedserve serve` (default model). Prints the probe latencies (median, p99, worst) and the
CPU kind."""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import threading
import time

import httpx


def cpu_kind() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        flags = next(line for line in out.splitlines() if line.startswith("Flags"))
        isa = "amx_bf16" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else \
            "avx512f" if "avx512f" in flags else "avx2"
        return f"{name} ({isa})"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def stream_until(url: str, deadline: float) -> None:
    body = {"prompt": "Tell me a story about a cat. " * 20, "max_tokens": 128, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < deadline:
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--seconds", type=float, default=25.0)
    args = p.parse_args()
    deadline = time.monotonic() + args.seconds
    load = [threading.Thread(target=stream_until, args=(args.url, deadline)) for _ in range(args.streams)]
    for t in load:
        t.start()
    time.sleep(2)  # the streams are running
    latencies = []
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            start = time.monotonic()
            assert client.get(args.url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.25)
    for t in load:
        t.join()
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    print(f"CPU: {cpu_kind()}; {args.streams} streams; /health probes: n={len(latencies)} "
          f"median={statistics.median(latencies) * 1000:.1f} ms p99={p99 * 1000:.1f} ms "
          f"worst={latencies[-1] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
