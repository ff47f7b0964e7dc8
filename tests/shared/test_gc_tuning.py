"""shared/gc_tuning.py: once a serving process has started, its heap is frozen out of the
collector's walks and young collections run less often; in a child process, since the tuning
is for the whole process it runs in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import gc, json
from shared import gc_tuning
before = {"threshold": gc.get_threshold()[0], "frozen": gc.get_freeze_count()}
startup_heap = [[i] for i in range(1000)]  # long-lived objects made at startup
gc_tuning.tune_for_serving()
gc_tuning.tune_for_serving()  # idempotent
after = {"threshold": gc.get_threshold()[0], "frozen": gc.get_freeze_count()}
import atexit
print(json.dumps({"before": before, "after": after, "unfreezes_at_exit": atexit._ncallbacks()}))
"""


def test_the_startup_heap_is_frozen_and_young_collections_are_rarer_once() -> None:
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["before"] == {"threshold": 700, "frozen": 0}
    assert found["after"]["threshold"] == 10_000
    assert found["after"]["frozen"] >= 1000  # the startup heap, the 1,000 lists among it
    assert found["unfreezes_at_exit"] == 1  # registered once, though called twice


_ENGINE_CHILD = """
import gc, json, sys
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
seen = {"before": [gc.get_threshold()[0], gc.get_freeze_count()]}
with LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", num_kv_blocks=64),
               load_tokenizer_files=False) as engine:
    seen["serving"] = [gc.get_threshold()[0], gc.get_freeze_count()]
    engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
seen["closed"] = [gc.get_threshold()[0], gc.get_freeze_count()]
print(json.dumps(seen))
"""


def test_an_engine_used_in_process_tunes_the_collector_until_it_is_closed(tiny_checkpoints) -> None:
    # The Python API (no CLI, no tune_for_serving call) gets the serving tuning from the engine
    # itself; closing the last engine gives the frozen heap back to the collector.
    proc = subprocess.run([sys.executable, "-c", _ENGINE_CHILD, str(tiny_checkpoints["llama"])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["before"] == [700, 0]
    threshold, frozen = seen["serving"]
    assert threshold == 10_000 and frozen > 10_000  # torch, the model: the startup heap
    assert seen["closed"] == [700, 0]
