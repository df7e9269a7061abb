"""`pagedserve serve --help` explains every flag the issue names."""

import pytest

from pagedserve.entrypoints.cli import build_parser, main

FLAGS = ["--model", "--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs",
         "--max-num-batched-tokens", "--block-size", "--kv-cache-memory-bytes", "--dtype",
         "--max-num-queued-requests", "--max-logprobs", "--disable-log-requests", "--max-request-body-bytes",
         "--shutdown-timeout"]


def test_serve_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in text, flag
    assert "Authorization: Bearer" in text and "PAGEDSERVE_API_KEY" in text


def test_serve_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.api_key, args.max_logprobs) == ("127.0.0.1", 8000, None, None, 20)
