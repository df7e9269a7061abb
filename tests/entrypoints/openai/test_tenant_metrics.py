"""The per-tenant metrics: their names and labels, and the bound on tenant label values (--max-metric-tenants)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.metrics.prometheus import PrometheusStatLogger, TenantLabels


def samples(logger: PrometheusStatLogger) -> dict:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(logger.render().decode()) for s in family.samples}


def test_tenants_beyond_the_first_n_seen_share_the_label_other():
    logger = PrometheusStatLogger("m", max_tenants=2)
    for tenant in ("a", "b", "c", "d", "a"):
        logger.tenants.count_request(tenant, 200)
    logger.tenants.count_tokens("c", 7, 3)
    logger.tenants.count_rate_limited("b", "tokens")
    got = samples(logger)

    def sample(name, **labels):
        return got[(f"pagedserve:{name}", frozenset({"model_name": "m", **labels}.items()))]

    assert sample("tenant_requests_total", tenant="a", status="200") == 2
    assert sample("tenant_requests_total", tenant="b", status="200") == 1
    assert sample("tenant_requests_total", tenant="other", status="200") == 2  # c and d
    assert sample("tenant_prompt_tokens_total", tenant="other") == 7
    assert sample("tenant_generation_tokens_total", tenant="other") == 3
    assert sample("rate_limited_requests_total", tenant="b", limit="tokens") == 1
    tenants = {dict(labels).get("tenant") for name, labels in got if name.startswith("pagedserve:tenant")}
    assert tenants == {"a", "b", "other"}


def test_zero_metric_tenants_fold_everyone_and_a_negative_bound_is_refused():
    labels = TenantLabels(0)
    assert labels("a") == labels("b") == "other"
    with pytest.raises(ValueError, match="max_metric_tenants"):
        TenantLabels(-1)
