"""guidellm 0.8.1 and aiperf 0.13 against the fleet, streamed (their defaults send vLLM's
stream_options.continuous_usage_stats and read each request's token counts from it), beside
`tokenfleet bench` on the same load: chat, 2 at a time, 6 requests of ~32 prompt tokens and 8
output tokens (ignore_eos). Each run completes every request with the tokens asked for; their
TTFT and ITL medians are printed side by side (docs/benchmarks.md says how they differ).

The two tools pin packages below what this project needs (click, multidict, rich, psutil,
huggingface_hub), so they live in venvs of their own: $TOKENFLEET_GUIDELLM / $TOKENFLEET_AIPERF,
else on PATH, else ~/.cache/tokenfleet/tools/{guidellm,aiperf}/bin; the test skips without them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NUM_REQUESTS, CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 2, 32, 8


def tool(name: str) -> str:
    found = os.environ.get(f"TOKENFLEET_{name.upper()}") or shutil.which(name)
    if found is None:
        candidate = Path.home() / ".cache" / "tokenfleet" / "tools" / name / "bin" / name
        found = str(candidate) if candidate.exists() else None
    if found is None:
        pytest.skip(f"{name} is not installed (a venv of its own: see this module's docstring)")
    return found


def run(argv: list[str], **env: str) -> str:
    # The tools look for tokenizers on the hub unless given a folder; aiperf's offline mode
    # cannot load a folder, so the offline switches are left out of their environment.
    clean = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**clean, **env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_guidellm_aiperf_and_tokenfleet_bench_on_the_same_streamed_load(client_fleet, tmp_path):
    fleet = client_fleet
    run([tool("guidellm"), "run", "--backend", f"kind=openai_http,target={fleet.url}",
         "--profile", f"kind=concurrent,streams={CONCURRENCY}",
         "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
         "--tokenizer", f"kind=huggingface_auto,model={fleet.folder}",
         "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
         "--output", f"kind=json,path={tmp_path / 'guidellm.json'}", "--disable-console-interactive"])
    metrics = json.loads((tmp_path / "guidellm.json").read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0,
                                         "total": NUM_REQUESTS}
    # Read from the usage on the stream's chunks (continuous_usage_stats): 0 before it was served.
    assert metrics["output_token_count"]["successful"]["min"] == OUTPUT_TOKENS
    guidellm = (metrics["time_to_first_token_ms"]["successful"]["median"],
                metrics["inter_token_latency_ms"]["successful"]["median"])

    run([tool("aiperf"), "profile", "--model", fleet.model, "--url", fleet.url, "--endpoint-type", "chat",
         "--streaming", "--concurrency", str(CONCURRENCY), "--request-count", str(NUM_REQUESTS),
         "--synthetic-input-tokens-mean", str(PROMPT_TOKENS), "--output-tokens-mean", str(OUTPUT_TOKENS),
         "--extra-inputs", "ignore_eos:true", "--tokenizer", str(fleet.folder),
         "--artifact-dir", str(tmp_path / "aiperf"), "--ui-type", "none",
         # The counts the fleet reports on every chunk (continuous_usage_stats), as vLLM users run
         # it: re-tokenizing the streamed text may merge two of its tokens into one.
         "--use-server-token-count", "--per-chunk-usage",
         # One worker process and one record processor: the 6 requests need no more on 2 cores.
         "--workers-max", "1", "--record-processors", "1"])
    report = json.loads((tmp_path / "aiperf" / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == NUM_REQUESTS and not report.get("error_request_count")
    assert report["output_sequence_length"]["min"] == OUTPUT_TOKENS
    aiperf = (report["time_to_first_token"]["p50"], report["inter_token_latency"]["p50"])

    out = run([sys.executable, "-m", "tokenfleet.cli", "bench", "--url", fleet.url, "--model", fleet.model,
               "--num-requests", str(NUM_REQUESTS), "--concurrency", str(CONCURRENCY), "--prompt-words", "24",
               "--max-tokens", str(OUTPUT_TOKENS), "--json"])
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] == NUM_REQUESTS
    bench = (summary["ttft_ms"]["p50"], summary["itl_ms"]["p50"])
    print(f"\nmedian TTFT / ITL ms: guidellm {guidellm[0]:.0f} / {guidellm[1]:.0f}, "
          f"aiperf {aiperf[0]:.0f} / {aiperf[1]:.0f}, tokenfleet bench {bench[0]:.0f} / {bench[1]:.0f}")
