"""Reads safetensors files so that each rank reads only its own slices of each tensor.

Each checkpoint tensor is mapped to a parameter of our model (renaming q/k/v and
gate/up onto the fused layers); the owning layer's `weight_loader` picks the rows or
columns of its rank through `safe_open(...).get_slice(name)`, a lazy view of the file.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import nn

from shared.errors import ModelLoadError
from workers.layers import kv_scales

# Tensors some checkpoints carry that we recompute instead of loading.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: nn.Module, folder: str | Path) -> None:
    """Fill every parameter of `model` from the folder's *.safetensors files."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {str(folder)!r} holds no *.safetensors file")
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules", {})
    # Tied: the LM head is the embedding's parameter (a last pipeline stage without the
    # embedding has a head of its own, loaded from the embedding's tensor).
    tied = (bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
            and "model.embed_tokens.weight" in params and "lm_head.weight" in params)
    stage_tensor_name = getattr(model, "stage_tensor_name", lambda name: name)
    loaded: dict[str, set] = {}  # our parameter name -> shard ids filled
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is no dict)
                    if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    stage_name = stage_tensor_name(name)
                    if stage_name is None:
                        continue  # another pipeline stage's: this rank never reads it
                    if kv_scales.is_unused_scale(stage_name):
                        continue
                    # A KV cache scale (before the q/k/v fusing: "k_proj.output_scale" is one).
                    scale_targets = kv_scales.checkpoint_targets(stage_name)
                    for target, shard_id in ([(t, None) for t in scale_targets] if scale_targets
                                             else [_map_name(stage_name, packed)]):
                        if target not in params:
                            raise ModelLoadError(f"{path.name}: tensor {name!r} matches no model parameter")
                        _load_one(modules, params, target, shard_id, reader.get_slice(name), path)
                        loaded.setdefault(target, set()).add(shard_id)
        except SafetensorError as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from None
    # Scales that online quantization computed while loading count as loaded.
    for name in params:
        module = modules[name.rsplit(".", 1)[0]]
        if name.endswith(".weight_scale") and getattr(module, "scale_computed", False):
            loaded.setdefault(name, set()).update(loaded.get(name.replace("weight_scale", "weight"), set()))
    _check_complete(params, packed, loaded, tied)


def _map_name(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    for original, (fused, shard_id) in packed.items():
        if f".{original}." in name:
            return name.replace(f".{original}.", f".{fused}."), shard_id
    return name, None


def _load_one(modules, params, target: str, shard_id, tensor_slice, path: Path) -> None:
    module = modules[target.rsplit(".", 1)[0]]
    param = params[target]
    try:
        if hasattr(module, "weight_loader"):
            module.weight_loader(param, tensor_slice, shard_id)
        else:  # norms and other replicated parameters
            whole = tensor_slice[:]
            if tuple(whole.shape) != tuple(param.shape):
                raise ValueError(f"shape {tuple(whole.shape)} != expected {tuple(param.shape)}")
            param.data.copy_(whole)
    except (ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{path.name}: cannot load {target!r}: {exc}") from None


def _check_complete(params: dict, packed: dict, loaded: dict[str, set], tied: bool) -> None:
    """Every parameter filled, and fused ones from every shard (q, k, v / gate, up)."""
    missing = []
    for name in params:
        if (tied and name == "lm_head.weight") or kv_scales.is_scale_parameter(name):
            continue  # (KV scales: checkpoints without them get measured or unit ones)
        module_attr = name.rsplit(".", 2)[-2]
        wanted = {sid for fused, sid in packed.values() if fused == module_attr} or {None}
        have = loaded.get(name, set())
        if have != wanted:
            missing.append(name if not have else f"{name} (shards {sorted(map(str, wanted - have))})")
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total
