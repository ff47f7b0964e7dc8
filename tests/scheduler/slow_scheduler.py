"""A scheduler service whose every step takes `step_s` longer (a long prefill on a loaded
machine), in a process of its own so that a test can kill -9 it mid-step. Each step's start is
counted in Redis, at `test:steps:{scheduler id}`, before it sleeps.

    python -m tests.scheduler.slow_scheduler URL MODEL_DIR SCHEDULER_ID STEP_S LEASE_S
"""

from __future__ import annotations

import sys
import threading
import time

import redis

from scheduler.engine import LLMEngine
from service.scheduler_service import SchedulerService, ServiceSettings
from shared.config import EngineConfig


def main(url: str, model_dir: str, scheduler_id: str, step_s: float, lease_s: float) -> None:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=256,
                                    max_num_seqs=8, max_num_batched_tokens=256))
    client = redis.Redis.from_url(url)
    step = engine.step

    def slow_step():
        client.incr(f"test:steps:{scheduler_id}")
        time.sleep(step_s)  # (without the GIL, as a forward pass on the GPU mostly is)
        return step()

    engine.step = slow_step
    settings = ServiceSettings("tiny", scheduler_id, lease_s=lease_s, heartbeat_s=0.1, idle_block_ms=20)
    SchedulerService(engine, url, settings).run(threading.Event())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]))
