"""The access-log record: one finish reason per request, text clipped to --max-log-len, quiet probes."""

from __future__ import annotations

import logging

from pagedserve.logging_utils.request_log import RequestLog, RequestLogConfig, RequestRecord


def test_finish_reason_is_the_choices_own_when_they_agree_else_in_order_with_abort_for_the_unfinished():
    record = RequestRecord(num_choices=3, finish_reasons={0: "stop", 1: "stop", 2: "stop"})
    assert record.finish_reason() == "stop"
    record.finish_reasons = {0: "length", 2: "stop"}
    assert record.finish_reason() == "length,abort,stop"
    assert record.finish_reason(status=503) == "length,error,stop"
    assert RequestRecord().finish_reason() is None


def test_health_and_metrics_are_logged_only_when_they_fail():
    log = RequestLog(RequestLogConfig())
    assert not log.wants("/health", 200) and not log.wants("/metrics", 200)
    assert log.wants("/health", 503) and log.wants("/v1/models", 200)
    assert not RequestLog(RequestLogConfig(enabled=False)).wants("/v1/models", 500)


def test_prompts_and_completions_appear_only_with_log_prompts_and_are_clipped(caplog):
    record = RequestRecord(model="m", num_choices=1, prompts=["a long prompt", [1, 2, 3, 4]],
                           completions={0: "the completion"})
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        RequestLog(RequestLogConfig()).write("r1", "t", "POST", "/v1/completions", 200, record, [])
        RequestLog(RequestLogConfig(log_prompts=True, max_log_len=3)).write("r2", "t", "POST", "/v1/completions",
                                                                            200, record, [])
    plain, with_text = caplog.records
    assert "prompt" not in plain.fields and "a long" not in plain.getMessage()
    assert with_text.fields["prompt"] == ["a l", [1, 2, 3]] and with_text.fields["completion"] == ["the"]
    assert plain.getMessage().startswith("POST /v1/completions 200 request_id=r1 tenant=t ")
