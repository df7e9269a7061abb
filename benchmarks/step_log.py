"""Summarize engine step logs (PAGEDSERVE_STEP_LOG, pagedserve/engine/step_log.py): where a run's wall time went,
step by step. Typical use, the same W1 offline and through the server:

    PAGEDSERVE_STEP_LOG=/tmp/offline pagedserve bench throughput --backend pagedserve
    PAGEDSERVE_STEP_LOG=/tmp/served pagedserve serve --disable-log-requests &   # then pagedserve bench serve ...
    python benchmarks/step_log.py /tmp/offline-*.tsv /tmp/served-*.tsv

Per log, from the first step with at least --from-prefill prompt tokens (skipping warm-ups) to the end: the span,
the time inside steps and between them, the steps with prefill and the decode-only ones, and the median and p90 of
the decode-only steps that ran --decode-rows requests (default: the most any decode-only step ran), the steadiest
number to compare runs by.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    start: float
    end: float
    tokens: int
    requests: int
    prefill_tokens: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


def read_steps(path: str) -> list[Step]:
    with open(path) as f:
        lines = f.read().splitlines()[1:]  # the header
    return [Step(float(a), float(b), int(t), int(r), int(p)) for a, b, t, r, p in (line.split("\t") for line in lines)]


def summarize(steps: list[Step], from_prefill: int = 1024, decode_rows: int = 0) -> dict:
    first = next((i for i, s in enumerate(steps) if s.prefill_tokens >= from_prefill), None)
    if first is None:
        raise ValueError(f"no step with at least {from_prefill} prefill tokens (lower --from-prefill)")
    run = steps[first:]
    prefill = [s for s in run if s.prefill_tokens]
    decode = [s for s in run if not s.prefill_tokens]
    rows = decode_rows or max((s.requests for s in decode), default=0)
    full = sorted(s.seconds for s in decode if s.requests == rows)
    busy = sum(s.seconds for s in run)
    return {"steps": len(run), "span_s": run[-1].end - run[0].start, "in_steps_s": busy,
            "between_steps_s": run[-1].end - run[0].start - busy,
            "prefill_steps": len(prefill), "prefill_s": sum(s.seconds for s in prefill),
            "decode_steps": len(decode), "decode_s": sum(s.seconds for s in decode), "decode_rows": rows,
            "full_decode_steps": len(full), "full_decode_median_ms": statistics.median(full) * 1e3 if full else None,
            "full_decode_p90_ms": full[int(0.9 * (len(full) - 1))] * 1e3 if full else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--from-prefill", type=int, default=1024,
                        help="the run starts at the first step with at least this many prefill tokens")
    parser.add_argument("--decode-rows", type=int, default=0, help="decode steps of this many requests are timed")
    args = parser.parse_args()
    print(f"{'log':40} {'span s':>7} {'in steps':>8} {'between':>7} {'prefill s':>9} {'decode s':>8} "
          f"{'full decodes':>12} {'median ms':>9} {'p90 ms':>7}")
    for path in args.logs:
        r = summarize(read_steps(path), args.from_prefill, args.decode_rows)
        median = f"{r['full_decode_median_ms']:.1f}" if r["full_decode_median_ms"] is not None else "-"
        p90 = f"{r['full_decode_p90_ms']:.1f}" if r["full_decode_p90_ms"] is not None else "-"
        print(f"{path[-40:]:40} {r['span_s']:7.2f} {r['in_steps_s']:8.2f} {r['between_steps_s']:7.2f} "
              f"{r['prefill_s']:9.2f} {r['decode_s']:8.2f} {r['full_decode_steps']:>5} x {r['decode_rows']:<4} "
              f"{median:>9} {p90:>7}")


if __name__ == "__main__":
    main()
