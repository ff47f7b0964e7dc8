"""Large models with random bf16 weights, built on the device (Llama-3-8B's shape, say), and a
folder to write them to. torch and transformers are imported on first use."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, rope_theta=500000.0, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)  # the scripts' --smoke model
INIT_STD = 0.02


def checkpoint_folder(num_bytes: int) -> Path:
    """A fresh folder in /dev/shm when it has room (loads at memory speed), else in the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.3 * num_bytes:
        return Path(tempfile.mkdtemp(prefix="tokenfleet-bench-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="tokenfleet-bench-"))


def random_model(config: Any, device: torch.device, *, std: float = INIT_STD,
                 embedding_std: float | None = None, seed: int = 0) -> torch.nn.Module:
    """A transformers model of `config` with random bf16 weights, built on the device: norms 1,
    embeddings and LM head normal(0, embedding_std or std), every other matrix and bias normal(0, std)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # explicit, whatever from_config initialised
            if "norm" in name and param.dim() == 1:
                param.fill_(1.0)
            elif "embed_tokens" in name or name.startswith("lm_head"):
                param.normal_(0.0, embedding_std or std, generator=generator)
            else:
                param.normal_(0.0, std, generator=generator)
    return model.eval()


def random_llama(shape: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A Llama of `shape` (transformers LlamaConfig fields, e.g. LLAMA3_8B) with random bf16 weights."""
    from transformers import LlamaConfig

    return random_model(LlamaConfig(**shape, initializer_range=INIT_STD), device, seed=seed)


def module_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class SavedModel(NamedTuple):
    folder: Path
    num_params: int
    num_bytes: int  # of its weights, as built (bf16)


def save_random_llama(shape: dict, device: torch.device, folder: Path | None = None) -> SavedModel:
    """random_llama(shape) saved as safetensors into `folder` (default: a checkpoint_folder with
    room for it), then freed: the engines that load it get the device memory back."""
    import gc

    import torch

    model = random_llama(shape, device)
    num_params, num_bytes = sum(p.numel() for p in model.parameters()), module_bytes(model)
    folder = folder or checkpoint_folder(num_bytes)
    model.save_pretrained(folder)
    del model
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return SavedModel(folder, num_params, num_bytes)


def write_llama3_8b_with_smollm2_tokenizer(folder: Path, device: torch.device,
                                           tokenizer: Path | None = None) -> int:
    """Write the GPU benchmarks' model into folder: Llama-3-8B's shape with SmolLM2's vocabulary,
    random bf16 weights built on the device, saved as safetensors, with SmolLM2's tokenizer files
    (from the folder `tokenizer`, default: the one `tokenfleet model fetch` makes). Returns its
    number of parameters. The device memory is handed back: the engine that loads it needs it."""
    from testkit.checkpoints import SMOLLM2_VOCAB_SIZE, copy_tokenizer

    if tokenizer is None:
        from workers.default_model import fetch_default_model

        tokenizer = fetch_default_model()
    saved = save_random_llama({**LLAMA3_8B, "vocab_size": SMOLLM2_VOCAB_SIZE}, device, folder)
    copy_tokenizer(tokenizer, folder)
    return saved.num_params
