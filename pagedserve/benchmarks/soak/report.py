"""The soak's summary: printed as a table, written as JSON."""

from __future__ import annotations

from pagedserve.benchmarks.soak.tally import Tally


def summary_dict(base: dict, tally: Tally, warmup: Tally) -> dict:
    return {**base, "requests": tally.requests, "outcomes": dict(tally.outcomes),
            "statuses": dict(sorted(tally.statuses.items())),
            "by_tag": {tag: dict(counts) for tag, counts in tally.by_tag.items()},
            "server_errors_5xx": tally.server_errors, "greedy_checked": tally.greedy_checked,
            "completion_tokens": tally.completion_tokens, "warmup_requests": warmup.requests,
            "violations": tally.violations, "violation_samples": tally.samples}


def render(summary: dict) -> str:
    outcomes = summary["outcomes"]
    lines = [
        "============ pagedserve soak ============",
        f"CPU:                    {summary.get('cpu_kind')}",
        f"server:                 {summary.get('server')} (model {summary.get('model')})",
        f"load:                   {summary.get('request_rate')} req/s for {summary.get('load_seconds')} s "
        f"(capacity {summary.get('capacity_rps')} req/s measured in a {summary.get('warmup_s')} s warm-up)",
        f"requests:               {summary['requests']} (+{summary['warmup_requests']} in the warm-up)",
    ]
    lines += [f"  {name + ':':21} {outcomes.get(name, 0)}"
              for name in ("complete", "rejected", "throttled", "disconnected", "violation")]
    for tag, counts in summary["by_tag"].items():
        lines.append(f"  of them {tag + ':':13} {dict(counts)}")
    lines += [
        f"HTTP statuses:          {summary['statuses']}",
        f"5xx:                    {summary['server_errors_5xx']}",
        f"greedy runs checked:    {summary['greedy_checked']} (equal to the same request run alone)",
        f"tokens generated:       {summary['completion_tokens']}",
        f"drain to 0:             {summary.get('drain_seconds')} s",
    ]
    resources = summary.get("resources")
    if resources:
        before, after = resources["after_warmup"], resources["after_load"]
        lines.append(f"RSS MiB:                {before['rss_mib']} after warm-up, {after['rss_mib']} after the load "
                     f"(peak {resources['peak_rss_mib_during_load']} during it)")
        lines.append(f"threads / fds / procs:  {before['threads']}/{before['open_fds']}/{before['processes']} -> "
                     f"{after['threads']}/{after['open_fds']}/{after['processes']}")
    else:
        lines.append("resources:              not checked (no --server-pid; --serve-args gives one)")
    if "server_exit_code" in summary:
        lines.append(f"server exit on SIGTERM: {summary['server_exit_code']}")
    lines.append(f"violations:             {summary['violations']}")
    lines += [f"  - {s}" for s in summary["violation_samples"]]
    lines.append("PASS" if summary["violations"] == 0 else "FAIL")
    return "\n".join(lines)
