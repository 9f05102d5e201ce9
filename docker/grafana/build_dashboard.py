"""Writes docker/grafana/dashboards/deepserve.json, the dashboard Grafana provisions.

The panels are listed here as (title, kind, queries) so a metric rename is one line and the JSON
stays consistent (ids, grid, datasource). tests/test_deploy_files.py checks the checked-in JSON is
this script's output; tests/test_deploy_topology.py runs every query against a real Prometheus.

    python docker/grafana/build_dashboard.py          # rewrite the JSON
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "deepserve.json"
DATASOURCE = {"type": "prometheus", "uid": "deepserve-prometheus"}
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # "timeseries" | "stat"
    width: int = 8
    description: str = ""
    extra: dict = field(default_factory=dict)


def rate(metric: str, by: str = "", where: str = "") -> str:
    selector = f"{metric}{{{where}}}" if where else metric
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({selector}[{RATE}]))"


def quantiles(histogram: str, legend: str = "", where: str = "") -> tuple[Query, ...]:
    selector = f"{histogram}_bucket{{{where}}}" if where else f"{histogram}_bucket"
    return tuple(
        Query(f"histogram_quantile({q}, sum by (le) (rate({selector}[{RATE}])))", f"p{p}{legend}")
        for q, p in ((0.5, 50), (0.9, 90), (0.99, 99))
    )


P = "deepserve:"
FRONTEND = 'job="deepserve-frontend"'
WORKERS = 'job=~"deepserve-(prefill|decode)"'
DECODE = 'job="deepserve-decode"'


def ratio(numerator: str, denominator: str) -> str:
    return f"{numerator} / {denominator}"


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Requests (at the frontend)",
        [
            Panel(
                "Requests/s by endpoint and status",
                (
                    Query(
                        rate(f"{P}http_requests_total", "endpoint, status", FRONTEND),
                        "{{endpoint}} {{status}}",
                    ),
                ),
                "reqps",
            ),
            Panel(
                "Errors/s (4xx, 5xx)",
                (
                    Query(
                        rate(f"{P}http_requests_total", "status", f'{FRONTEND}, status=~"4..|5.."'),
                        "{{status}}",
                    ),
                ),
                "reqps",
            ),
            Panel(
                "Finished requests/s by reason",
                (
                    Query(
                        rate(f"{P}request_success_total", "finished_reason", FRONTEND),
                        "{{finished_reason}}",
                    ),
                ),
                "reqps",
            ),
        ],
    ),
    (
        "Latency (as clients see it, at the frontend)",
        [
            Panel(
                "Time to first token",
                quantiles(f"{P}time_to_first_token_seconds", where=FRONTEND),
                "s",
            ),
            Panel(
                "Inter-token latency",
                quantiles(f"{P}inter_token_latency_seconds", where=FRONTEND),
                "s",
            ),
            Panel(
                "End-to-end request latency",
                quantiles(f"{P}e2e_request_latency_seconds", where=FRONTEND),
                "s",
            ),
        ],
    ),
    (
        "Throughput and load",
        [
            Panel(
                "Tokens/s in and out",
                (
                    Query(rate(f"{P}prompt_tokens_total", where=FRONTEND), "prompt (in)"),
                    Query(rate(f"{P}generation_tokens_total", where=FRONTEND), "generated (out)"),
                ),
            ),
            Panel(
                "Running requests per worker",
                (
                    Query(
                        f"sum by (instance) ({P}num_requests_running{{{WORKERS}}})", "{{instance}}"
                    ),
                ),
            ),
            Panel(
                "Waiting requests per worker",
                (
                    Query(
                        f"sum by (instance) ({P}num_requests_waiting{{{WORKERS}}})", "{{instance}}"
                    ),
                ),
            ),
            Panel(
                "KV cache usage per worker",
                (
                    Query(
                        f"max by (instance) ({P}kv_cache_usage_perc{{{WORKERS}}})", "{{instance}}"
                    ),
                ),
                "percentunit",
            ),
            Panel(
                "Queue time (workers)",
                quantiles(f"{P}request_queue_time_seconds", where=WORKERS),
                "s",
            ),
            Panel(
                "Preemptions/s per worker",
                (Query(rate(f"{P}num_preemptions_total", "instance", WORKERS), "{{instance}}"),),
            ),
        ],
    ),
    (
        "Prefix cache and KV tiers",
        [
            Panel(
                "Prefix hit rate by tier (cached / prompt tokens, at the frontend)",
                (
                    Query(
                        ratio(
                            rate(f"{P}cached_prompt_tokens_total", "tier", FRONTEND),
                            f"ignoring(tier) group_left {rate(f'{P}prompt_tokens_total', '', FRONTEND)}",
                        ),
                        "{{tier}}",
                    ),
                ),
                "percentunit",
            ),
            Panel(
                "Block hit rate by tier (hits / lookups, workers)",
                (
                    Query(
                        ratio(
                            rate(f"{P}kv_tier_hits_total", "tier"),
                            rate(f"{P}kv_tier_lookups_total", "tier"),
                        ),
                        "{{tier}}",
                    ),
                ),
                "percentunit",
            ),
            Panel(
                "L1 host bytes per worker",
                (
                    Query(
                        f'sum by (instance) ({P}kv_tier_used_bytes{{tier="host"}})', "{{instance}}"
                    ),
                ),
                "bytes",
            ),
            Panel(
                "Tier traffic (bytes/s)",
                (
                    Query(rate(f"{P}kv_tier_read_bytes_total", "tier"), "read {{tier}}"),
                    Query(rate(f"{P}kv_tier_written_bytes_total", "tier"), "written {{tier}}"),
                ),
                "Bps",
            ),
            Panel(
                "Tier operation latency p99",
                (
                    Query(
                        f"histogram_quantile(0.99, sum by (le, tier, op) "
                        f"(rate({P}kv_tier_op_seconds_bucket[{RATE}])))",
                        "{{tier}} {{op}}",
                    ),
                ),
                "s",
            ),
            Panel(
                "Integrity failures, store errors, evictions, dropped writes (/s)",
                (
                    Query(
                        rate(f"{P}kv_tier_integrity_failures_total", "tier"), "integrity {{tier}}"
                    ),
                    Query(rate(f"{P}kv_store_errors_total", "tier, op"), "error {{tier}} {{op}}"),
                    Query(rate(f"{P}kv_tier_evictions_total", "tier"), "evicted {{tier}}"),
                    Query(rate(f"{P}kv_tier_dropped_writes_total", "tier"), "dropped {{tier}}"),
                ),
            ),
        ],
    ),
    (
        "Speculative decoding and structured outputs",
        [
            Panel(
                "Speculative acceptance rate per worker",
                (
                    Query(
                        ratio(
                            rate(f"{P}spec_decode_num_accepted_tokens_total", "instance", WORKERS),
                            rate(f"{P}spec_decode_num_draft_tokens_total", "instance", WORKERS),
                        ),
                        "{{instance}}",
                    ),
                ),
                "percentunit",
            ),
            Panel(
                "Drafted and accepted tokens/s",
                (
                    Query(rate(f"{P}spec_decode_num_draft_tokens_total", where=WORKERS), "drafted"),
                    Query(
                        rate(f"{P}spec_decode_num_accepted_tokens_total", where=WORKERS), "accepted"
                    ),
                ),
            ),
            Panel(
                "Structured-output requests/s by kind",
                (
                    Query(
                        rate(f"{P}structured_output_requests_total", "kind", FRONTEND), "{{kind}}"
                    ),
                ),
                "reqps",
            ),
            Panel(
                "Grammar compile time (workers)",
                quantiles(f"{P}grammar_compile_seconds", where=WORKERS),
                "s",
            ),
        ],
    ),
    (
        "Router and prefill/decode hand-off",
        [
            Panel(
                "Router decisions/s by worker and policy",
                (
                    Query(
                        rate(f"{P}router_requests_total", "worker, policy"),
                        "{{worker}} ({{policy}})",
                    ),
                ),
                "reqps",
            ),
            Panel(
                "Worker health (1 = in rotation)",
                (
                    Query(
                        f"max by (worker, worker_role) ({P}router_worker_healthy)",
                        "{{worker_role}} {{worker}}",
                    ),
                ),
            ),
            Panel(
                "Retries and ejections (/s)",
                (
                    Query(rate(f"{P}router_retries_total", "worker_role"), "retry {{worker_role}}"),
                    Query(
                        rate(f"{P}router_worker_ejections_total", "worker"), "ejected {{worker}}"
                    ),
                ),
            ),
            Panel(
                "PD hand-off time",
                (
                    *quantiles(f"{P}pd_transfer_seconds", " write"),
                    Query(
                        f"histogram_quantile(0.99, sum by (le) (rate({P}kv_tier_op_seconds_bucket"
                        f'{{{DECODE}, tier="store", op="fetch"}}[{RATE}])))',
                        "p99 decode fetch",
                    ),
                ),
                "s",
            ),
            Panel(
                "PD hand-off bytes/s and blocks/s",
                (
                    Query(rate(f"{P}pd_transfer_bytes_total", "direction"), "bytes {{direction}}"),
                    Query(
                        rate(f"{P}pd_transfer_blocks_total", "direction, outcome"),
                        "blocks {{direction}} {{outcome}}",
                    ),
                ),
                "short",
            ),
            Panel(
                "Batch-invariant mode per worker",
                (
                    Query(
                        f"max by (instance) ({P}batch_invariant_mode{{{WORKERS}}})", "{{instance}}"
                    ),
                ),
                kind="stat",
            ),
        ],
    ),
]


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    targets = [
        {
            "datasource": DATASOURCE,
            "refId": chr(ord("A") + i),
            "expr": q.expr,
            "legendFormat": q.legend,
            "range": True,
        }
        for i, q in enumerate(panel.queries)
    ]
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": targets,
        **panel.extra,
    }


def dashboard_json() -> dict:
    panels, panel_id, y = [], 1, 0
    for title, row in ROWS:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(panel_json(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += 8
    return {
        "uid": "deepserve-overview",
        "title": "deepserve",
        "tags": ["deepserve", "llm-serving"],
        "timezone": "browser",
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard_json(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.exit(0)
