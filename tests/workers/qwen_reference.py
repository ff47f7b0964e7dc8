"""A float64 Qwen (v1) forward written from the published formulas, for judging our model past
`seq_length`, where transformers' Qwen2 (no logn, no dynamic NTK) is no reference.

Deliberately naive and independent of the code under test (it imports nothing of ours): the
whole sequence recomputed at every step, no cache, the formulas spelled out here again:
- dynamic NTK: alpha = max(2^ceil(log2(L / seq_length) + 1) - 1, 1) with L the prompt's length
  (kept for the tokens generated after it); rotary base * alpha^(d / (d - 2));
- logn: the query of the i-th token (i from 1) times log(i) / log(seq_length) when i > seq_length.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


class QwenReference:
    def __init__(self, folder: Path) -> None:
        self.cfg = json.loads((Path(folder) / "config.json").read_text())
        self.w: dict[str, torch.Tensor] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            self.w.update({k: v.double() for k, v in load_file(str(path)).items()})

    def alpha(self, prompt_len: int) -> float:
        if not self.cfg["use_dynamic_ntk"]:
            return 1.0
        value = math.log2(prompt_len / self.cfg["seq_length"]) + 1
        return max(2 ** math.ceil(value) - 1, 1)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["layer_norm_epsilon"]) * weight

    def logits(self, ids: list[int], prompt_len: int | None = None) -> torch.Tensor:
        """[len(ids), vocab] float64; the NTK alpha is the one of a prompt of `prompt_len`
        tokens (default: all of `ids`)."""
        cfg, w = self.cfg, self.w
        n, heads, d = len(ids), cfg["num_attention_heads"], cfg["kv_channels"]
        seq_length = cfg["seq_length"]
        base = cfg["rotary_emb_base"] * self.alpha(prompt_len or n) ** (d / (d - 2))
        inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        pos = torch.arange(n, dtype=torch.float64)
        freqs = torch.outer(pos, inv_freq)
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

        def rope(t):  # [heads, n, d]
            rotated = torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1)
            return t * cos + rotated * sin

        i = pos + 1
        logn = torch.where(i > seq_length, torch.log(i) / math.log(seq_length), torch.ones_like(i))
        if not cfg["use_logn_attn"]:
            logn = torch.ones_like(i)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        x = w["transformer.wte.weight"][torch.tensor(ids)]
        for layer in range(cfg["num_hidden_layers"]):
            p = f"transformer.h.{layer}."
            h = self._rms(x, w[p + "ln_1.weight"])
            qkv = h @ w[p + "attn.c_attn.weight"].T + w[p + "attn.c_attn.bias"]
            q, k, v = (t.view(n, heads, d).transpose(0, 1) for t in qkv.split(heads * d, -1))
            q, k = rope(q), rope(k)
            q = q * logn[None, :, None]
            scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
            scores = scores.masked_fill(~causal, float("-inf"))
            attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)
            x = x + attn @ w[p + "attn.c_proj.weight"].T
            h = self._rms(x, w[p + "ln_2.weight"])
            mlp = (h @ w[p + "mlp.w1.weight"].T) * torch.nn.functional.silu(h @ w[p + "mlp.w2.weight"].T)
            x = x + mlp @ w[p + "mlp.c_proj.weight"].T
        return self._rms(x, w["transformer.ln_f.weight"]) @ w["lm_head.weight"].T

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """Greedy continuation, the alpha of the prompt kept while decoding."""
        ids = list(prompt)
        for _ in range(num_tokens):
            ids.append(int(self.logits(ids, len(prompt))[-1].argmax()))
        return ids[len(prompt):]
