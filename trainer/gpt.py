"""GPT-2 in plain torch: the model ddpjob builds from a config (char-gpt, and causal-lm without `pretrained`).

Why not transformers' `GPT2LMHeadModel`: importing it costs about 1.8 CPU seconds per process over torch
(transformers' masking utilities import `torch._dynamo` whatever `compile` says), and a start of a process is
most of what a small run spends besides its steps (docs/performance.md). This module keeps GPT-2's parameter
names and layouts (`Conv1D`: a weight of in x out features), so its state dict is `GPT2LMHeadModel`'s key for
key: checkpoints are unchanged, and `save_pretrained` writes a `final/` that `AutoModelForCausalLM` loads as a
`GPT2LMHeadModel` giving the same logits (tests/test_gpt.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import safetensors.torch
import torch
from torch import nn
from torch.nn import functional as F

LAYER_NORM_EPSILON = 1e-5
INITIALIZER_RANGE = 0.02
# The exact (erf) GELU, as nanoGPT and transformers' "gelu" compute it, not GPT-2's tanh approximation: the two differ
# by 5e-4 at most, and on a CPU (torch 2.15, AVX2) the tanh kernel took 3.7x as long forward and 2.5x backward, 8% of
# a baby GPT's step (docs/performance.md). A model trained from scratch gains nothing from the approximation.
ACTIVATION = "gelu"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    dropout: float
    eos_token_id: int

    def gpt2_values(self) -> dict[str, Any]:
        """The same model as transformers' `GPT2Config` keys: `final/`'s config.json, and a classifier's config."""
        return {
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "resid_pdrop": self.dropout,
            "embd_pdrop": self.dropout,
            "attn_pdrop": self.dropout,
            "activation_function": ACTIVATION,
            "layer_norm_epsilon": LAYER_NORM_EPSILON,
            "initializer_range": INITIALIZER_RANGE,
            "bos_token_id": self.eos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.eos_token_id,
            "tie_word_embeddings": True,
        }


class Output(NamedTuple):
    logits: torch.Tensor


class Conv1D(nn.Module):
    """GPT-2's linear layer: the weight is in x out features (nn.Linear's transposed), as its checkpoints store it."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = Conv1D(3 * config.n_embd, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).view(batch, length, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(batch, length, width)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * config.n_embd, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, 4 * config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # ACTIVATION


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPSILON)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPSILON)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.n_positions, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                "ln_f": nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPSILON),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's: normal(0.02) matrices and embeddings, and the residual projections scaled by 1/sqrt(2 x layers)."""
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, std=INITIALIZER_RANGE / math.sqrt(2 * self.config.n_layer))
            elif param.dim() >= 2:
                nn.init.normal_(param, std=INITIALIZER_RANGE)
            elif ".ln_" in name and name.endswith("weight"):
                nn.init.ones_(param)
            else:
                nn.init.zeros_(param)

    def forward(self, input_ids: torch.Tensor) -> Output:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        return Output(self.lm_head(self.transformer.ln_f(x)))

    def save_pretrained(self, directory: Path) -> None:
        """A transformers export: `AutoModelForCausalLM.from_pretrained(directory)` is a `GPT2LMHeadModel`."""
        directory.mkdir(parents=True, exist_ok=True)
        # The tied head is stored once, under the embedding's name, as transformers stores it.
        state = {name: t.detach().contiguous() for name, t in self.state_dict().items() if name != "lm_head.weight"}
        safetensors.torch.save_file(state, directory / WEIGHTS, metadata={"format": "pt"})
        dtype = str(self.lm_head.weight.dtype).removeprefix("torch.")
        config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **self.config.gpt2_values()}
        (directory / CONFIG).write_text(json.dumps(config | {"dtype": dtype}, indent=2) + "\n", encoding="utf-8")
