"""One rank's pooling model (`--runner pooling`): prefill only, one vector per input, nothing kept.

It answers the scheduler like the generating runner (`launch`, `finish`, `execute`), but a step's
result carries, for every input whose last chunk ran, its pooled vector (`StepResult.pooled`,
float32 bytes) and a placeholder token that ends the request (its SamplingParams ask for one
token): no logits, no sampling, no decode ever follows.

- A decoder (llama, mistral, qwen2, qwen3) runs its causal forward over the paged KV cache, so
  the scheduler's chunked prefill works as for generation: an input longer than the step's
  budget arrives in chunks, its K/V kept between them, and pooling carries across
  (workers/pooling.py). Its blocks go back when the request ends; prefix caching is off.
- An encoder (BERT) has no KV cache: it needs the whole input in one forward. The chunks the
  scheduler cuts are gathered here (their token ids only) and the input runs when its last
  chunk arrives, padded with the step's other whole inputs through SDPA (workers/models/bert.py).
  The scheduler's blocks then are bookkeeping only; no cache memory is allocated.

Every rank computes the step (TP collectives); only the driver pools and answers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.logging import get_logger
from shared.model_config import load_model_config
from shared.pooling_config import read_pooling_config
from shared.step import SampledToken, StepBatch, StepResult
from workers.device import place_rank
from workers.device_block_tables import DeviceBlockTables
from workers.host_staging import HostStaging
from workers.models.bert import EncoderBatch
from workers.models.registry import POOLING_MODEL_CLASSES
from workers.parallel import TensorParallel
from workers.pipeline import SINGLE_STAGE, PipelineStage
from workers.pooling import ChunkPooler
from workers.runner_build import free_cache_and_weights, kv_blocks_on_rank
from workers.step_inputs import build_step_inputs, eager_order
from workers.weight_loader import load_weights, resident_weight_bytes

# The token a pooling request "samples" to end: never shown (the engine drops it).
PLACEHOLDER_TOKEN_ID = 0


@dataclass
class PooledStep:
    step_id: int
    req_ids: list[str]  # the inputs this step ended, in batch order
    # [len(req_ids), hidden] float32: on CUDA a pinned host copy on its way (driver only)
    vectors: torch.Tensor | None
    event: torch.cuda.Event | None = None  # recorded after the copy (CUDA); None: already there

    @classmethod
    def to_host(cls, step_id: int, req_ids: list[str], vectors: torch.Tensor | None) -> PooledStep:
        """Start the vectors' copy to the host without waiting: under async scheduling the next
        step is launched before this one is finished, and a plain copy would wait for it too."""
        if vectors is None or vectors.device.type != "cuda":
            return cls(step_id, req_ids, vectors)
        host = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True)
        host.copy_(vectors, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(step_id, req_ids, host, event)


class PoolingRunner:
    decode_graphs = None  # (RankWorker.decode_graph_sizes): steps always run eagerly
    mixed_graphs = None
    num_host_kv_blocks = 0  # no host KV tier (nothing is kept after an input)

    def __init__(self, config: EngineConfig, tp: TensorParallel, stage: PipelineStage = SINGLE_STAGE) -> None:
        if stage.size > 1:
            raise ModelLoadError("--runner pooling runs in one pipeline stage (pp=1)")
        self.config = config
        self.tp = tp
        self.stage = stage
        self.world_size = tp.size
        self.rank = tp.rank
        self.is_driver = tp.is_driver
        self.log = get_logger("tokenfleet.worker", rank=self.rank)
        self.device, self.dtype = place_rank(config.device, config.dtype, self.rank, config.num_threads)
        self.model_config = load_model_config(config.model)
        if self.model_config.model_type not in POOLING_MODEL_CLASSES:
            raise ModelLoadError(f"model type {self.model_config.model_type!r} is not served with "
                                 f"--runner pooling (supported: {', '.join(POOLING_MODEL_CLASSES)})")
        self.pooling_config = read_pooling_config(config.model)
        self.max_model_len = min(config.max_model_len or self.model_config.context_window,
                                 self.model_config.context_window)
        self.block_size = config.block_size
        self.is_encoder = self.model_config.is_encoder
        self.model = self._build_model()
        self.weight_bytes = resident_weight_bytes(self.model)
        self.staging = HostStaging(self.device)
        self.pooler = ChunkPooler(self.pooling_config)
        self._encoder_chunks: dict[str, list[int]] = {}  # req_id -> its token ids so far (encoders)
        self.num_kv_blocks = self._decide_num_kv_blocks()
        self.kv_caches = None if self.is_encoder else self._allocate_kv_cache()
        self.block_tables = None if self.is_encoder else DeviceBlockTables(
            config.max_num_seqs + min(config.max_num_seqs, 64), -(-self.max_model_len // self.block_size),
            pad_block=self.num_kv_blocks, device=self.device)
        self.is_closed = False

    def _build_model(self) -> torch.nn.Module:
        start = time.perf_counter()
        cls = POOLING_MODEL_CLASSES[self.model_config.model_type]
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.model_config, self.tp, self.max_model_len, self.stage)
        except ValueError as exc:
            raise ModelLoadError(f"cannot shard {self.config.model!r}: {exc}") from None
        finally:
            torch.set_default_dtype(previous)
        load_weights(model, self.config.model)
        model.eval()
        self.log.info("pooling_model_loaded", model=self.config.model, device=str(self.device),
                      dtype=str(self.dtype), pooling=self.pooling_config.pooling_type.value,
                      normalize=self.pooling_config.normalize, weight_bytes=resident_weight_bytes(model),
                      seconds=round(time.perf_counter() - start, 2))
        return model

    @property
    def kv_block_bytes(self) -> int:
        cfg = self.model_config
        kv_heads = self.tp.shard(cfg.num_kv_heads)[1]
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * kv_heads * cfg.head_dim * elem

    def _decide_num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.is_encoder:  # bookkeeping only: every running input at its longest
            return self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        activations = 64 * self.config.max_num_batched_tokens * self.model_config.hidden_size * 4
        return kv_blocks_on_rank(self.config, self.device, self.world_size, block_bytes=self.kv_block_bytes,
                                 activation_bytes=activations)

    def _allocate_kv_cache(self) -> torch.Tensor:
        cfg = self.model_config
        shape = (cfg.num_layers, 2, self.num_kv_blocks + 1, self.block_size,
                 self.tp.shard(cfg.num_kv_heads)[1], cfg.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_caches is None else self.kv_caches.numel() * self.kv_caches.element_size()

    # -- steps ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult | None:
        return self.finish(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> PooledStep:
        """Queue the step's forward and pooling (nothing waits for the device on CUDA)."""
        if self.is_closed:
            raise RuntimeError("this pooling runner is closed; it runs no more steps")
        self.pooler.forget(batch.freed_req_ids)
        for req_id in batch.freed_req_ids:
            self._encoder_chunks.pop(req_id, None)
        if self.is_encoder:
            req_ids, vectors = self._encoder_step(batch)
        else:
            req_ids, vectors = self._decoder_step(batch)
        return PooledStep.to_host(batch.step_id, req_ids, vectors if self.is_driver else None)

    def _decoder_step(self, batch: StepBatch) -> tuple[list[str], torch.Tensor | None]:
        inputs = build_step_inputs(batch, self.block_size, self.device, self.block_tables, self.staging)
        hidden = self.model(inputs.token_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not self.is_driver:
            return [], None
        order = eager_order(batch.works)  # the rows' order: one-token works first
        works = [batch.works[i] for i in order]
        lens = [len(w.token_ids) for w in works]
        row_starts = np.cumsum([0, *lens[:-1]]).tolist()
        ended, vectors = self.pooler.pool(hidden, [w.req_id for w in works], row_starts, lens,
                                          [w.start_pos for w in works], [w.is_sampled for w in works],
                                          self.staging.upload)
        return self._in_batch_order(batch, ended, vectors)

    def _encoder_step(self, batch: StepBatch) -> tuple[list[str], torch.Tensor | None]:
        whole: list[tuple[str, list[int]]] = []  # inputs whose last chunk is here
        for work in batch.works:
            so_far = [] if work.start_pos == 0 else self._encoder_chunks.pop(work.req_id)
            token_ids = so_far + work.token_ids
            if work.is_sampled:
                whole.append((work.req_id, token_ids))
            else:
                self._encoder_chunks[work.req_id] = token_ids
        if not whole:
            return [], None
        lens = [len(ids) for _, ids in whole]
        flat = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in whole])
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        uploaded = self.staging.upload(np.concatenate([flat, positions]))
        token_ids, positions_t = uploaded[: len(flat)], uploaded[len(flat):]
        hidden = self.model(token_ids, positions_t, EncoderBatch.of(lens, self.staging.upload))
        if not self.is_driver:
            return [], None
        row_starts = np.cumsum([0, *lens[:-1]]).tolist()
        return self.pooler.pool(hidden, [r for r, _ in whole], row_starts, lens, [0] * len(whole),
                                [True] * len(whole), self.staging.upload)

    def _in_batch_order(self, batch: StepBatch, ended: list[str],
                        vectors: torch.Tensor | None) -> tuple[list[str], torch.Tensor | None]:
        """The ended inputs as the batch orders its sampled works (the scheduler's order)."""
        if vectors is None:
            return [], None
        where = {req_id: i for i, req_id in enumerate(ended)}
        ordered = [w.req_id for w in batch.works if w.is_sampled]
        index = np.fromiter((where[r] for r in ordered), dtype=np.int64, count=len(ordered))
        return ordered, vectors[self.staging.upload(index)]

    def sample(self, launched: PooledStep) -> None:
        """(Nothing samples late here.)"""

    def finish(self, launched: PooledStep) -> StepResult | None:
        """The step's result (driver) or None (other ranks): waits for the vectors' copy."""
        if not self.is_driver:
            return None
        if launched.vectors is None:
            return StepResult(launched.step_id, [])
        if launched.event is not None:
            launched.event.synchronize()  # this step's copy, not the steps launched after it
        host = launched.vectors.numpy()
        return StepResult(launched.step_id, [SampledToken(r, PLACEHOLDER_TOKEN_ID) for r in launched.req_ids],
                          pooled={r: host[i].tobytes() for i, r in enumerate(launched.req_ids)})

    def close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.staging = self.block_tables = None
        free_cache_and_weights(self)


def make_runner(config: EngineConfig, tp: TensorParallel, stage: PipelineStage = SINGLE_STAGE):
    """The rank's runner for `config.runner`: generating (ModelRunner) or pooling."""
    if config.runner == "pooling":
        return PoolingRunner(config, tp, stage)
    from workers.model_runner import ModelRunner

    return ModelRunner(config, tp, stage)
