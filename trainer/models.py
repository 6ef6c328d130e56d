"""Models built from the spec, every one a GPT-2 whose `final/` export loads with transformers' Auto classes.

A language model built from a config is trainer/gpt.py's plain-torch GPT-2, saved in GPT-2's format; a
pretrained model and every classifier are transformers' own classes, imported only then (seconds per process).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from trainer.gpt import GPT, GPTConfig
from trainer.heap import importing
from trainer.names import GPT2_POSITIONS
from trainer.spec import ModelSpec, SpecError
from trainer.text import pretrained_failure, pretrained_options, unloadable_model_errors

PRETRAINED = "training.model.pretrained"  # the key a pretrained model's problems are named by
# (layers, heads, width) of the published GPT-2 sizes; all have GPT2_POSITIONS positions.
GPT2_SIZES = {
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


def check_positions_fit(positions: int, width: int) -> None:
    """A position table (fp32) larger than this machine's memory cannot be built: name the key, not the allocator."""
    table = positions * width * 4
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if table > memory:
        raise SpecError(
            f"training.model.blockSize: {positions} positions x nEmbd {width} take {table / 2**30:.0f} GiB for"
            f" the position embeddings alone, more than this machine's {memory / 2**30:.0f} GiB of memory"
        )


def gpt_config(spec: ModelSpec, vocab_size: int, eos_id: int) -> GPTConfig:
    """A named GPT-2 size, or the spec's own dimensions; random weights come later."""
    n_layer, n_head, n_embd = GPT2_SIZES[spec.size] if spec.size else (spec.n_layer, spec.n_head, spec.n_embd)
    if not spec.size:
        check_positions_fit(spec.block_size, n_embd)
    positions = GPT2_POSITIONS if spec.size else spec.block_size
    return GPTConfig(vocab_size, positions, n_embd, n_layer, n_head, spec.dropout, eos_id)


def from_pretrained(auto_class: Any, spec: ModelSpec, **kwargs: Any) -> Any:
    options = pretrained_options(spec.pretrained, PRETRAINED)
    try:
        with importing():  # the model's transformers module
            model = auto_class.from_pretrained(spec.pretrained, **options, **kwargs)
    except unloadable_model_errors() as exc:
        why = pretrained_failure(spec.pretrained, exc, options)
        raise SpecError(f"{PRETRAINED}: cannot load {spec.pretrained!r}: {why}") from None
    check_block_size(spec, config_positions(model.config))
    return model


def check_pretrained_block_size(spec: ModelSpec) -> None:
    """blockSize against a pretrained model's positions, from its config alone: before the data is prepared (minutes
    on a large corpus), not after. A config that does not load is left to the model's load, which says why."""
    if not spec.pretrained:
        return
    from transformers import AutoConfig

    try:
        with importing():
            config = AutoConfig.from_pretrained(spec.pretrained, **pretrained_options(spec.pretrained, PRETRAINED))
    except unloadable_model_errors():
        return
    check_block_size(spec, config_positions(config))


def check_block_size(spec: ModelSpec, positions: int | None) -> None:
    if positions and spec.block_size > positions:
        raise SpecError(f"training.model.blockSize: {spec.block_size} is more than the model's {positions} positions")


def config_positions(config: Any) -> int | None:
    """How many tokens a model of this config takes at most (its position embeddings), when the config says."""
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def fit_vocabulary(model: Any, tokenizer: Any) -> Any:
    """Grow the embeddings when the tokenizer knows more tokens than the pretrained model."""
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def build_char_gpt(spec: ModelSpec, vocab_size: int, special_id: int) -> GPT:
    """A randomly initialised GPT-2 with a character vocabulary."""
    return GPT(gpt_config(spec, vocab_size, special_id))


def build_causal_lm(spec: ModelSpec, tokenizer: Any) -> torch.nn.Module:
    if spec.pretrained:
        with importing():
            from transformers import AutoModelForCausalLM

        return fit_vocabulary(from_pretrained(AutoModelForCausalLM, spec), tokenizer)
    return GPT(gpt_config(spec, len(tokenizer), tokenizer.eos_token_id))


def build_classifier(spec: ModelSpec, tokenizer: Any, labels: list[str]) -> torch.nn.Module:
    """GPT2ForSequenceClassification: the last non-pad token's state feeds a linear head."""
    with importing():
        from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2ForSequenceClassification

    names = {"id2label": dict(enumerate(labels)), "label2id": {label: i for i, label in enumerate(labels)}}
    if spec.pretrained:
        model = from_pretrained(AutoModelForSequenceClassification, spec, num_labels=len(labels), **names)
        return fit_vocabulary(model, tokenizer)
    config = gpt_config(spec, len(tokenizer), tokenizer.eos_token_id)
    return GPT2ForSequenceClassification(GPT2Config(**config.gpt2_values(), **names))


def forward_options(model: torch.nn.Module) -> dict[str, Any]:
    """Keyword arguments of every training and evaluation forward of `model` (the plain module).

    transformers' decoders fill a key/value cache unless told not to. Only generation reads it; in
    training it is one more copy of every layer's keys and values each step.
    """
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


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
