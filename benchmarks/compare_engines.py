"""W1 on pagedserve, vLLM's CPU build and llama.cpp's server, side by side in one run.

Offline (default): each engine runs the throughput workload W1 (256 requests x 128 random prompt ids ->
exactly 128 output tokens, greedy, ignore_eos; prompts from `pagedserve.benchmarks.throughput.make_prompts`,
seed 0) in a fresh subprocess:

  pagedserve     `pagedserve bench throughput --backend pagedserve` (this Python)
  pagedserve-gguf  the same with `--quantization gguf`: the default model's file computed from as stored
                 (Q4_1 weights, activations rounded to int8 per 32 for the dot products, as llama.cpp does)
  vllm           benchmarks/engines/vllm_w1.py in vLLM's own venv, with vLLM's recommended CPU settings:
                 tcmalloc and Intel OpenMP preloaded, VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>,
                 VLLM_CPU_KVCACHE_SPACE=4
  vllm-default   the same with only VLLM_CPU_KVCACHE_SPACE=4 (without it vLLM's default memory share does
                 not fit here and it refuses to start)
  llamacpp       benchmarks/engines/llamacpp_w1.py: llama-server with 256 parallel slots, the GGUF given by
                 --llamacpp-model (default: the BF16 GGUF, the same numbers pagedserve computes with)
  llamacpp-gguf  the same on the default model's own file (Q4_1), the weights pagedserve-gguf computes from

Engines alternate: run i starts with engine i mod n, so a drifting machine load hurts none systematically.
Medians over --runs are reported with the ratios of pagedserve to each other engine.

--serving runs the serving view instead: each engine's OpenAI server (`pagedserve serve`, `vllm serve`,
`llama-server`) is started fresh per scenario (after --settle-s seconds, see start_server), its time to a
healthy /health recorded, and
`pagedserve bench serve` sends W1 to /v1/completions all at once and with at most 16 in flight. With
--offline-baseline each run also measures pagedserve's offline W1, and the table gives serving all-at-once as a
fraction of it (the cost of the serving path). --stream-interval N gives pagedserve's and vLLM's servers the flag
of that name (a streamed chunk every N tokens).

--single-stream: one request, 128 prompt ids -> 256 tokens: pagedserve's decode tok/s
(benchmarks/single_stream.py) beside llama.cpp's `llama-bench -p 128 -n 256` tg rate on the GGUF of the same
dtype (llamacpp-gguf: on the default model's own file).

--dtype auto (the default) gives each engine the dtype that computes fastest on this CPU: bfloat16 where the CPU
has native bf16 dot products (AVX512-BF16 or AMX), else float32 (pagedserve's own `auto` makes the same choice;
llama.cpp then gets the BF16 or F32 GGUF). Every table names the CPU kind it was measured on.

The tables give each engine's rate over pagedserve's (bf16 or float32 weights, the numbers vLLM computes) and,
where it ran, over pagedserve-gguf's: different numerics, so reported apart.

    python benchmarks/compare_engines.py --runs 3
    python benchmarks/compare_engines.py --serving --engines pagedserve,vllm --offline-baseline
    python benchmarks/compare_engines.py --single-stream --engines pagedserve,llamacpp
    python benchmarks/compare_engines.py --runs 1 --num-prompts 8 --output-len 8   # smoke

Setup of the other engines: benchmarks/engines/setup.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from compare_serving import free_port, stop_server  # beside this file

from pagedserve.benchmarks.cpu_kind import cpu_kind
from pagedserve.benchmarks.throughput import make_prompts
from pagedserve.loader.default_model import default_model_path
from pagedserve.loader.model_loader import cpu_has_bf16

HERE = Path(__file__).resolve().parent
ENGINES_DIR = Path(os.environ.get("PAGEDSERVE_ENGINES_DIR", "/work/engines"))
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def best_dtype(requested: str) -> str:
    """The dtype the other engines get: `auto` is bfloat16 on CPUs with native bf16, else float32."""
    if requested != "auto":
        return requested
    return "bfloat16" if cpu_has_bf16() else "float32"


PAGEDSERVE = ("pagedserve", "pagedserve-gguf")
"""pagedserve at float weights, and computing from the default model's GGUF weights as stored."""
LLAMACPP = ("llamacpp", "llamacpp-gguf")
"""llama.cpp on the GGUF of --dtype (or --llamacpp-model), and on the default model's own file."""


def quantization_flags(engine: str) -> list[str]:
    return ["--quantization", "gguf"] if engine == "pagedserve-gguf" else []


def llamacpp_gguf(args, engine: str = "llamacpp") -> str:
    if engine == "llamacpp-gguf":
        return default_model_path()
    if args.llamacpp_model:
        return args.llamacpp_model
    return str(ENGINES_DIR / ("smollm2-bf16.gguf" if best_dtype(args.dtype) == "bfloat16" else "smollm2-f32.gguf"))


def vllm_env(args, tuned: bool) -> dict:
    env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
    if tuned:
        preload = [p for p in (TCMALLOC, str(Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so"))
                   if os.path.exists(p)]
        env.update(LD_PRELOAD=" ".join(preload), VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}")
    return env


def w1_prompts(args) -> list[list[int]]:
    """W1's prompts, exactly as `pagedserve bench throughput` makes them for the default model."""
    from pagedserve.loader.model_loader import open_checkpoint

    return make_prompts(args.num_prompts, args.input_len, int(open_checkpoint(None).config.vocab_size), 0)


def offline_command(engine: str, args, out_json: str) -> tuple[list[str], dict]:
    w1 = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
          "--output-len", str(args.output_len)]
    if engine in PAGEDSERVE:
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "throughput", "--backend", "pagedserve",
               "--dtype", args.dtype, "--output-json", out_json, *quantization_flags(engine), *w1]
        return cmd, {}
    if engine in ("vllm", "vllm-default"):
        prompts_json = os.path.join(os.path.dirname(out_json), "prompts.json")
        with open(prompts_json, "w") as f:
            json.dump(w1_prompts(args), f)
        cmd = [args.vllm_python, str(HERE / "engines" / "vllm_w1.py"), "--model", args.vllm_model,
               "--dtype", best_dtype(args.dtype), "--prompts-json", prompts_json, "--output-len", str(args.output_len)]
        return cmd, vllm_env(args, tuned=engine == "vllm")
    if engine in LLAMACPP:
        cmd = [sys.executable, str(HERE / "engines" / "llamacpp_w1.py"), "--server-bin", args.llama_server,
               "--model", llamacpp_gguf(args, engine), "--output-json", out_json, *w1]
        return cmd, {}
    raise SystemExit(f"unknown engine {engine!r}")


def run_offline(engine: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "result.json")
        cmd, extra_env = offline_command(engine, args, out_json)
        print(f"$ {' '.join(f'{k}={v!r}' for k, v in extra_env.items())} {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, env={**os.environ, **extra_env}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{engine} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        if engine in PAGEDSERVE:
            with open(out_json) as f:
                result = json.load(f)
            r = result["pagedserve"]
            return {"output_tok_s": r["output_tok_s"], "elapsed_s": r["elapsed_s"], "load_s": r["load_s"],
                    "exact": r["all_exact_output_len"], "dtype": pagedserve_dtype(engine, result["workload"]["dtype"])}
        line = [l for l in proc.stdout.splitlines() if l.startswith("{")][-1]
        r = json.loads(line)
        dtype = Path(llamacpp_gguf(args, engine)).stem if engine in LLAMACPP else best_dtype(args.dtype)
        return {"output_tok_s": r["output_tok_per_s"], "elapsed_s": r["elapsed_s"],
                "load_s": r.get("load_s", r.get("startup_s")), "exact": r["exact"], "dtype": dtype}


def pagedserve_dtype(engine: str, dtype: str) -> str:
    if engine == "pagedserve-gguf":
        return f"{Path(default_model_path()).stem} kept, {dtype} activations"
    return dtype


# -- serving -------------------------------------------------------------------------------------------------


def server_command(engine: str, args, port: int) -> tuple[list[str], dict]:
    if engine in PAGEDSERVE:
        return [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port), "--dtype",
                args.dtype, "--disable-log-requests", *quantization_flags(engine), *stream_interval_flags(args)], {}
    if engine in ("vllm", "vllm-default"):
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model,
                "--dtype", best_dtype(args.dtype), "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "256",
                "--served-model-name", "default", *stream_interval_flags(args)], vllm_env(args, engine == "vllm")
    if engine in LLAMACPP:
        slots = args.num_prompts
        return [args.llama_server, "--model", llamacpp_gguf(args, engine), "--port", str(port),
                "--parallel", str(slots),
                "--ctx-size", str(slots * (args.input_len + args.output_len)), "--threads", str(os.cpu_count()),
                "--threads-batch", str(os.cpu_count()), "--cont-batching", "--no-webui"], {}
    raise SystemExit(f"unknown engine {engine!r}")


def stream_interval_flags(args) -> list[str]:
    """pagedserve's and vLLM's flag of the same name (llama.cpp's server has none: it streams every token)."""
    return ["--stream-interval", str(args.stream_interval)] if args.stream_interval else []


def start_server(engine: str, args, log_path: str) -> tuple[subprocess.Popen, str, float]:
    # A server started right after another process freed its memory starts faster than a first start (on the
    # project's VMs memory given back is taken again at 0.1 s per GiB instead of 2.3 for 5-20 s, until the host has
    # it back: benchmarks/memory_first_touch.py): settle first, so that every engine's time to ready is a fresh
    # start's.
    time.sleep(args.settle_s)
    port = free_port()
    cmd, extra_env = server_command(engine, args, port)
    print(f"$ {' '.join(f'{k}={v!r}' for k, v in extra_env.items())} {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **extra_env})
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{engine} server exited with {proc.returncode}; see {log_path}")
        if time.monotonic() - start > args.start_timeout:
            proc.kill()
            raise SystemExit(f"{engine} server not healthy after {args.start_timeout} s; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url, time.monotonic() - start
        except OSError:
            time.sleep(0.2)


def run_serving(engine: str, args, workload: str, scenario: str, out_dir: str) -> dict:
    proc, url, ready_s = start_server(engine, args, os.path.join(out_dir, f"server_{engine}_{scenario}.log"))
    try:
        name = f"{engine}_{scenario}"
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--base-url", url,
               "--dataset-name", "jsonl", "--dataset-path", workload, "--num-prompts", str(args.num_prompts),
               "--ignore-eos", "--num-warmups", "2", "--label", name, "--disable-tqdm", "--no-server-metrics",
               "--save-result", "--result-dir", out_dir, "--result-filename", f"{name}.json"]
        if scenario != "all_at_once":
            cmd += ["--max-concurrency", str(args.max_concurrency)]
        print(f"$ {' '.join(cmd)}", flush=True)
        # bench serve exits 1 when some requests failed; its result file still has what completed.
        bench = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        result_file = os.path.join(out_dir, f"{name}.json")
        if not os.path.exists(result_file):
            raise SystemExit(f"bench serve against {engine} failed ({bench.returncode}) without a result")
        with open(result_file) as f:
            r = json.load(f)
    finally:
        stop_server(proc)
    return {"ready_s": ready_s, **{k: r[k] for k in ("completed", "failed", "output_throughput", "median_ttft_ms",
                                                     "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")}}


# -- single stream -------------------------------------------------------------------------------------------


def run_single_stream(engine: str, args) -> dict:
    if engine in PAGEDSERVE:
        cmd = [sys.executable, str(HERE / "single_stream.py"), "--dtype", args.dtype, "--runs", "1",
               "--input-len", str(args.input_len), "--output-len", str(args.single_output_len),
               *quantization_flags(engine)]
    elif engine in LLAMACPP:
        cmd = [str(Path(args.llama_server).with_name("llama-bench")), "-m", llamacpp_gguf(args, engine), "-p",
               str(args.input_len), "-n", str(args.single_output_len), "-t", str(os.cpu_count()), "-r", "1",
               "-o", "json"]
    else:
        raise SystemExit(f"--single-stream measures pagedserve and llama.cpp, not {engine!r}")
    print(f"$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{engine} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if engine in PAGEDSERVE:
        r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        return {"decode_tok_s": r["decode_tok_s"], "dtype": pagedserve_dtype(engine, r["dtype"])}
    tests = json.loads(proc.stdout)
    [tg] = [t for t in tests if t["n_gen"] > 0]
    return {"decode_tok_s": tg["avg_ts"], "dtype": Path(llamacpp_gguf(args, engine)).stem}


def single_stream_table(results: dict[str, list[dict]]) -> str:
    bases = ratio_bases(results, "decode_tok_s")
    lines = [("| engine | dtype | decode tok/s (median) | runs | " + ratio_header(bases)).rstrip(),
             "|---|---|---|---|" + "---|" * len(bases)]
    for engine, runs in results.items():
        tok = median_of(runs, "decode_tok_s")
        lines.append(f"| {engine} | {runs[0]['dtype']} | {tok:.1f} | "
                     f"{', '.join(format(r['decode_tok_s'], '.1f') for r in runs)} | {ratio_cells(bases, engine, tok)}")
    return "\n".join(lines)


# -- report --------------------------------------------------------------------------------------------------


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def ratio_bases(results: dict[str, list[dict]], key: str) -> dict[str, float]:
    """The median rate of each pagedserve variant that ran: the numerators of the tables' ratio columns."""
    return {engine: median_of(results[engine], key) for engine in PAGEDSERVE if engine in results}


def ratio_header(bases: dict[str, float]) -> str:
    return " ".join(f"{engine} / engine |" for engine in bases)


def ratio_cells(bases: dict[str, float], engine: str, rate: float) -> str:
    """Each pagedserve variant's rate over this engine's; blank against itself or the other variant."""
    return " ".join("|" if engine in PAGEDSERVE else f"**{base / rate:.2f}x** |" for base in bases.values())


def offline_table(results: dict[str, list[dict]]) -> str:
    bases = ratio_bases(results, "output_tok_s")
    header = "| engine | dtype | out tok/s (median) | runs | start-up s | exact lengths | " + ratio_header(bases)
    lines = [header.rstrip(),
             "|---|---|---|---|---|---|" + "---|" * len(bases)]
    for engine, runs in results.items():
        tok = median_of(runs, "output_tok_s")
        lines.append(f"| {engine} | {runs[0]['dtype']} | {tok:.1f} | "
                     f"{', '.join(format(r['output_tok_s'], '.0f') for r in runs)} | "
                     f"{median_of(runs, 'load_s'):.1f} | {all(r['exact'] for r in runs)} | "
                     f"{ratio_cells(bases, engine, tok)}")
    return "\n".join(lines)


def serving_table(results: dict[tuple[str, str], list[dict]]) -> str:
    lines = ["| engine | scenario | ready s | failed | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (engine, scenario), runs in results.items():
        cells = [median_of(runs, k) for k in ("ready_s", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                              "median_tpot_ms", "p99_tpot_ms")]
        failed = max(r["failed"] for r in runs)
        lines.append(f"| {engine} | {scenario} | {cells[0]:.1f} | {failed} | {cells[1]:.1f} | {cells[2]:.0f} | "
                     f"{cells[3]:.0f} | {cells[4]:.1f} | {cells[5]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="pagedserve,vllm,llamacpp",
                   help="comma-separated: pagedserve, pagedserve-gguf, vllm, vllm-default, llamacpp, llamacpp-gguf")
    p.add_argument("--runs", type=int, default=3, help="runs per engine (medians reported)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: each engine at the dtype that is fastest on this CPU (bfloat16 with native bf16)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--serving", action="store_true", help="the serving view instead of offline throughput")
    p.add_argument("--offline-baseline", action="store_true",
                   help="with --serving: also run pagedserve offline W1 in every run, for the serving/offline ratio")
    p.add_argument("--single-stream", action="store_true",
                   help="one request, --input-len prompt -> --single-output-len tokens: decode tok/s")
    p.add_argument("--single-output-len", type=int, default=256)
    p.add_argument("--scenarios", default="all_at_once,concurrency16", help="with --serving")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--stream-interval", type=int, default=None,
                   help="with --serving: tokens per streamed chunk, for pagedserve's and vLLM's servers alike")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--settle-s", type=float, default=25,
                   help="pause before each server start, so that memory freed by the last run is back with the host")
    p.add_argument("--vllm-python", default=str(ENGINES_DIR / "vllm-venv" / "bin" / "python"))
    p.add_argument("--vllm-model", default=str(ENGINES_DIR / "smollm2-hf"),
                   help="the default model as a Hugging Face folder (benchmarks/export_hf.py)")
    p.add_argument("--llama-server", default=shutil.which("llama-server")
                   or str(ENGINES_DIR / "llama.cpp-build" / "bin" / "llama-server"))
    p.add_argument("--llamacpp-model", default=None,
                   help="default: the BF16 or F32 GGUF of the default model, by --dtype")
    p.add_argument("--output-dir", default="engine_results")
    args = p.parse_args()
    engines = args.engines.split(",")
    os.makedirs(args.output_dir, exist_ok=True)

    if args.single_stream:
        name, (results, table) = "single_stream", measure_single_stream(engines, args)
    elif args.serving:
        name, (results, table) = "serving", measure_serving(engines, args)
    else:
        name, (results, table) = "offline", measure_offline(engines, args)
    table = f"CPU: {cpu_kind()}; --dtype {args.dtype}\n\n{table}"
    print("\n" + table)
    with open(os.path.join(args.output_dir, f"{name}.json"), "w") as f:
        json.dump({"args": vars(args), "cpu": cpu_kind(), "runs": results}, f, indent=1)
    with open(os.path.join(args.output_dir, f"{name}.md"), "w") as f:
        f.write(table + "\n")


def rotated(engines: list[str], i: int) -> list[str]:
    return engines[i % len(engines):] + engines[:i % len(engines)]


def measure_each(engines: list[str], args, run, key: str, unit: str) -> dict[str, list[dict]]:
    """`run(engine, args)` --runs times per engine, the order rotating from run to run."""
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for i in range(args.runs):
        for engine in rotated(engines, i):
            results[engine].append(run(engine, args))
            print(f"run {i + 1} {engine}: {results[engine][-1][key]:.1f} {unit}", flush=True)
    return results


def measure_offline(engines: list[str], args) -> tuple[dict, str]:
    results = measure_each(engines, args, run_offline, "output_tok_s", "out tok/s")
    return results, offline_table(results)


def measure_single_stream(engines: list[str], args) -> tuple[dict, str]:
    results = measure_each(engines, args, run_single_stream, "decode_tok_s", "decode tok/s")
    return results, single_stream_table(results)


def measure_serving(engines: list[str], args) -> tuple[dict, str]:
    workload = os.path.join(args.output_dir, "workload.jsonl")
    with open(workload, "w") as f:
        for ids in w1_prompts(args):
            f.write(json.dumps({"prompt": ids, "output_len": args.output_len}) + "\n")
    results: dict[tuple[str, str], list[dict]] = {}
    offline: list[dict] = []
    for i in range(args.runs):
        if args.offline_baseline:
            offline.append(run_offline("pagedserve", args))
            print(f"run {i + 1} pagedserve offline: {offline[-1]['output_tok_s']:.1f} tok/s", flush=True)
        for scenario in args.scenarios.split(","):
            for engine in rotated(engines, i):
                r = run_serving(engine, args, workload, scenario, args.output_dir)
                results.setdefault((engine, scenario), []).append(r)
                print(f"run {i + 1} {engine} {scenario}: ready {r['ready_s']:.1f} s, "
                      f"{r['output_throughput']:.1f} tok/s, TTFT p99 {r['p99_ttft_ms']:.0f} ms, "
                      f"TPOT p99 {r['p99_tpot_ms']:.1f} ms", flush=True)
    table = serving_table(results)
    if offline and ("pagedserve", "all_at_once") in results:
        served = median_of(results[("pagedserve", "all_at_once")], "output_throughput")
        base = median_of(offline, "output_tok_s")
        table += (f"\n\npagedserve offline W1 {base:.1f} tok/s (runs: "
                  f"{', '.join(format(r['output_tok_s'], '.0f') for r in offline)}); serving all at once / offline = "
                  f"**{served / base:.2f}x**")
    flat = {f"{e} {s}": v for (e, s), v in results.items()}
    if offline:
        flat["pagedserve offline"] = offline
    return flat, table


if __name__ == "__main__":
    main()
