"""Models, built from the spec: a GPT-2-architecture transformer via transformers.

Using transformers' GPT2LMHeadModel (rather than a private GPT class) means the
`final/` export loads with `AutoModelForCausalLM` as is, outside this project.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from trainer.spec import ModelSpec


def build_char_gpt(spec: ModelSpec, vocab_size: int, special_id: int) -> GPT2LMHeadModel:
    """A randomly initialised GPT-2 with a character vocabulary."""
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=spec.block_size,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        resid_pdrop=spec.dropout,
        embd_pdrop=spec.dropout,
        attn_pdrop=spec.dropout,
        bos_token_id=special_id,
        eos_token_id=special_id,
        pad_token_id=special_id,
    )
    return GPT2LMHeadModel(config)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (weights, embeddings); leave biases and norm scales alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


@torch.no_grad()
def sample_tokens(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, block_size: int, temperature: float, top_k: int
) -> list[int]:
    """Autoregressive top-k sampling, cropping the context to the model's block size."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids[:, -block_size:]).logits[:, -1, :] / temperature
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, dim=-1), 1)], dim=1)
    return ids[0, len(prompt) :].tolist()
