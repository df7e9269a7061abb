"""`pagedserve bench soak`: drive a live OpenAI-compatible server past its capacity with a hostile mix, and
check that nothing is lost, duplicated, mixed up or leaked.

mix.py draws the requests (chat and completions, streaming or not, n > 1, stop strings, logprobs, random
max_tokens, shared prefixes, greedy probes, clients that disconnect, malformed bodies); client.py sends one and
records what came back; checks.py judges it (every request exactly one outcome, token counts equal to usage,
finish reasons that fit, greedy text equal to the same request run alone); server_probe.py watches the server
(its engine gauges, /health, and its processes' RSS, threads and open files); runner.py runs the phases
(warm-up, references, load, drain) and report.py prints the summary. Any violation makes the exit status 1.
"""
