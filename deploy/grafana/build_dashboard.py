"""Writes dashboards/pagedserve.json, the Grafana dashboard of pagedserve's metrics (panel titles after vLLM's
where it has one). Edit the panels here and run `python deploy/grafana/build_dashboard.py`: a test checks that
the JSON is this script's output, that every query names only metrics the server exports, and that every query
returns data from a real Prometheus scraping a live server."""

from __future__ import annotations

import json
import os

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SERVER = 'job=~"$job", instance=~"$instance"'
ENGINE = SERVER + ', model_name=~"$model_name"'
GENERATION_ROUTES = 'handler=~"/v1/completions|/v1/chat/completions"'
RATE = "[$__rate_interval]"
QUANTILES = (0.5, 0.9, 0.99)


def quantiles(metric: str) -> list[tuple[str, str]]:
    """p50/p90/p99 of a histogram, and its mean, per model."""
    targets = [(f"histogram_quantile({q}, sum by (le, model_name) (rate({metric}_bucket{{{ENGINE}}}{RATE})))",
                f"p{round(q * 100)} {{{{model_name}}}}") for q in QUANTILES]
    targets.append((f"sum by (model_name) (rate({metric}_sum{{{ENGINE}}}{RATE})) / "
                    f"sum by (model_name) (rate({metric}_count{{{ENGINE}}}{RATE}))", "mean {{model_name}}"))
    return targets


def heatmap(metric: str) -> list[tuple[str, str]]:
    return [(f"sum by (le) (increase({metric}_bucket{{{ENGINE}}}{RATE}))", "{{le}}")]


# (row title, [(panel title, panel type, unit, description, [(expr, legend)])])
ROWS = [
    ("Requests", [
        ("Request Rate", "timeseries", "reqps", "Completion and chat requests per second, by HTTP status.",
         [(f"sum by (status) (rate(http_requests_total{{{SERVER}, {GENERATION_ROUTES}}}{RATE}))", "{{status}}")]),
        ("Errors by Status", "timeseries", "reqps", "HTTP answers of 400 and above per second, by route and status "
         "(429: a full queue or a rate limit; 503: the engine is dead or the server drains).",
         [(f'sum by (handler, status) (rate(http_requests_total{{{SERVER}, status=~"4..|5.."}}{RATE}))',
           "{{status}} {{handler}}")]),
        ("Engine Restarts", "timeseries", "short", "Times the engine process died and was started again "
         "(--restart-on-engine-failure), per interval.",
         [(f"sum by (instance) (increase(pagedserve:engine_restarts_total{{{ENGINE}}}{RATE}))", "{{instance}}")]),
        ("Finish Reason", "timeseries", "short", "Finished requests per interval, by finish reason (stop: EOS or a "
         "stop string; length: max_tokens or the context).",
         [(f"sum by (finished_reason) (increase(pagedserve:request_success_total{{{ENGINE}}}{RATE}))",
           "{{finished_reason}}")]),
    ]),
    ("Latency", [
        ("Time To First Token Latency", "timeseries", "s", "Arrival to first token.",
         quantiles("pagedserve:time_to_first_token_seconds")),
        ("Inter Token Latency", "timeseries", "s", "Time between a request's outputs (vLLM's Time Per Output "
         "Token).", quantiles("pagedserve:inter_token_latency_seconds")),
        ("E2E Request Latency", "timeseries", "s", "Arrival to finish.",
         quantiles("pagedserve:e2e_request_latency_seconds")),
        ("Queue Time", "timeseries", "s", "Arrival to first scheduled.",
         quantiles("pagedserve:request_queue_time_seconds")),
    ]),
    ("Throughput and scheduler", [
        ("Token Throughput", "timeseries", "short", "Prompt tokens computed and tokens generated per second.",
         [(f"sum by (model_name) (rate(pagedserve:prompt_tokens_total{{{ENGINE}}}{RATE}))",
           "prompt tokens/s {{model_name}}"),
          (f"sum by (model_name) (rate(pagedserve:generation_tokens_total{{{ENGINE}}}{RATE}))",
           "generation tokens/s {{model_name}}")]),
        ("Scheduler State", "timeseries", "short", "Requests in the running batch and waiting to be scheduled "
         "(the autoscalers' metric).",
         [(f"sum by (model_name) (pagedserve:num_requests_running{{{ENGINE}}})", "running {{model_name}}"),
          (f"sum by (model_name) (pagedserve:num_requests_waiting{{{ENGINE}}})", "waiting {{model_name}}")]),
        ("Cache Utilization", "timeseries", "percentunit", "Share of KV-cache blocks in use, per server.",
         [(f"pagedserve:kv_cache_usage_perc{{{ENGINE}}}", "{{instance}} {{model_name}}")]),
        ("Preemptions", "timeseries", "short", "Requests preempted per second (their KV blocks were needed; they "
         "are recomputed later).",
         [(f"sum by (model_name) (rate(pagedserve:num_preemptions_total{{{ENGINE}}}{RATE}))", "{{model_name}}")]),
        ("Prefix Cache Hit Rate", "timeseries", "percentunit", "Share of prompt tokens served from the prefix "
         "cache.",
         [(f"sum by (model_name) (rate(pagedserve:prefix_cache_hits_total{{{ENGINE}}}{RATE})) / "
           f"sum by (model_name) (rate(pagedserve:prefix_cache_queries_total{{{ENGINE}}}{RATE}))", "{{model_name}}")]),
    ]),
    ("Request lengths", [
        ("Request Prompt Length", "heatmap", "short", "Prompt tokens of finished requests.",
         heatmap("pagedserve:request_prompt_tokens")),
        ("Request Generation Length", "heatmap", "short", "Generated tokens of finished requests (all n samples).",
         heatmap("pagedserve:request_generation_tokens")),
    ]),
    ("Tenants", [
        ("Requests by Tenant", "timeseries", "reqps", "Completion and chat requests per second, by tenant and "
         "status.",
         [(f"sum by (tenant, status) (rate(pagedserve:tenant_requests_total{{{ENGINE}}}{RATE}))",
           "{{tenant}} {{status}}")]),
        ("Tokens by Tenant", "timeseries", "short", "Prompt and generated tokens per second, by tenant.",
         [(f"sum by (tenant) (rate(pagedserve:tenant_prompt_tokens_total{{{ENGINE}}}{RATE}))", "prompt {{tenant}}"),
          (f"sum by (tenant) (rate(pagedserve:tenant_generation_tokens_total{{{ENGINE}}}{RATE}))",
           "generated {{tenant}}")]),
        ("Rate-Limited Requests by Tenant", "timeseries", "reqps", "Requests refused by a tenant's limit, by limit "
         "(requests, tokens, concurrency).",
         [(f"sum by (tenant, limit) (rate(pagedserve:rate_limited_requests_total{{{ENGINE}}}{RATE}))",
           "{{tenant}} {{limit}}")]),
    ]),
    ("LoRA adapters (with --enable-lora)", [
        ("Requests by LoRA Adapter", "timeseries", "reqps", "Finished or aborted requests per second, by adapter.",
         [(f"sum by (lora_name) (rate(pagedserve:lora_requests_total{{{ENGINE}}}{RATE}))", "{{lora_name}}")]),
        ("Generated Tokens by LoRA Adapter", "timeseries", "short", "Tokens generated per second, by adapter.",
         [(f"sum by (lora_name) (rate(pagedserve:lora_generation_tokens_total{{{ENGINE}}}{RATE}))",
           "{{lora_name}}")]),
        ("Running and Waiting Adapters", "table", "short", "vLLM's lora_requests_info: the adapters of the running "
         "and waiting requests now.",
         [(f"max by (instance, running_lora_adapters, waiting_lora_adapters, max_lora) "
           f"(pagedserve:lora_requests_info{{{SERVER}}})", "")]),
    ]),
]


def variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE, "refresh": 2,
            "query": {"query": query, "refId": name}, "definition": query, "includeAll": True, "multi": True,
            "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}


def panel(panel_id: int, title: str, kind: str, unit: str, description: str, targets, x: int, y: int) -> dict:
    out = {"id": panel_id, "title": title, "type": kind, "description": description, "datasource": DATASOURCE,
           "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
           "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
           "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(65 + i),
                        **({"format": "heatmap"} if kind == "heatmap" else {}),
                        **({"format": "table", "instant": True} if kind == "table" else {})}
                       for i, (expr, legend) in enumerate(targets)]}
    if kind == "heatmap":
        out["options"] = {"calculate": False, "yAxis": {"unit": unit}, "cellGap": 1}
    return out


def dashboard() -> dict:
    panels, y, next_id = [], 0, 1
    for row_title, row_panels in ROWS:
        panels.append({"id": next_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y = next_id + 1, y + 1
        for i, spec in enumerate(row_panels):
            panels.append(panel(next_id, *spec, x=12 * (i % 2), y=y + 8 * (i // 2)))
            next_id += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    datasource = {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
                  "current": {"text": "Prometheus", "value": "prometheus"}}
    return {"uid": "pagedserve", "title": "pagedserve", "tags": ["pagedserve", "llm", "vllm"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"}, "graphTooltip": 1,
            "templating": {"list": [datasource,
                                    variable("job", "Job", "label_values(pagedserve:num_requests_running, job)"),
                                    variable("instance", "Instance", 'label_values(pagedserve:num_requests_running'
                                             '{job=~"$job"}, instance)'),
                                    variable("model_name", "Model", 'label_values(pagedserve:num_requests_running'
                                             '{job=~"$job"}, model_name)')]},
            "annotations": {"list": []}, "panels": panels}


PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboards", "pagedserve.json")


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(render())
    print(f"wrote {PATH}")
