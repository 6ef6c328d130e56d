"""trainer/gpt.py: the project's own GPT-2 is transformers' GPT-2 on the outside (state dict, `final/`, logits),
and a char-gpt trainer never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from conftest import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from trainer.data import SPECIAL_TOKEN, CharVocab
from trainer.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=37, n_positions=16, n_embd=24, n_layer=2, n_head=3, dropout=0.1, eos_token_id=36)


def trained_a_little(model: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial weights: a few steps move every parameter off its initial value (biases start at zero)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.n_positions))
    for _ in range(3):
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def test_final_loads_as_transformers_gpt2_with_the_same_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = trained_a_little(GPT(CONFIG))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is GPT2LMHeadModel
    assert loaded.config.to_diff_dict() | {"dtype": None} == (
        GPT2Config(**CONFIG.gpt2_values(), architectures=["GPT2LMHeadModel"]).to_diff_dict() | {"dtype": None}
    )
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    ids = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.n_positions))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids, use_cache=False).logits)
        # Shorter than the block, and generation (transformers' own loop over the loaded model).
        assert torch.equal(model(input_ids=ids[:, :5]).logits, loaded(input_ids=ids[:, :5]).logits)
    assert loaded.generate(ids[:1, :4], max_new_tokens=6, do_sample=False).shape == (1, 10)


def test_a_transformers_gpt2_state_dict_loads_strictly_with_the_same_logits() -> None:
    """Checkpoints written while the model was transformers' GPT2LMHeadModel resume as they are."""
    torch.manual_seed(1)
    theirs = trained_a_little(GPT2LMHeadModel(GPT2Config(**CONFIG.gpt2_values())))
    ours = GPT(CONFIG).eval()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.n_positions))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids, use_cache=False).logits)


def test_gpt2s_initialisation_scales_the_residual_projections() -> None:
    torch.manual_seed(2)
    config = GPTConfig(vocab_size=50, n_positions=64, n_embd=256, n_layer=8, n_head=4, dropout=0.0, eos_token_id=0)
    params = dict(GPT(config).named_parameters())
    assert abs(params["transformer.h.0.attn.c_attn.weight"].std().item() - 0.02) < 0.001
    assert abs(params["transformer.h.7.mlp.c_proj.weight"].std().item() - 0.02 / 4) < 0.0003
    assert torch.equal(params["transformer.h.3.ln_2.weight"], torch.ones(256))
    assert not params["transformer.h.3.mlp.c_fc.bias"].any()


def test_the_char_vocabulary_saves_a_tokenizer_that_autotokenizer_loads_as_the_same_mapping(tmp_path: Path) -> None:
    vocab = CharVocab(list("ab c\n:"))
    vocab.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "a:b c\nz" + SPECIAL_TOKEN + "a"  # "z" is no character of the vocabulary: the special token
    assert tokenizer(text).input_ids == vocab.encode(text.replace(SPECIAL_TOKEN, "z")).tolist()
    assert tokenizer.decode(tokenizer("ab c\n").input_ids) == "ab c\n"
    assert len(tokenizer) == len(vocab) == 7
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == (SPECIAL_TOKEN,) * 3
    assert tokenizer.eos_token_id == vocab.special_id
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_a_char_gpt_trainer_builds_its_model_without_importing_transformers() -> None:
    """transformers costs about 1.8 CPU seconds per process over torch (docs/performance.md): only the tasks that
    use it import it."""
    code = (
        "import sys, torch, trainer.__main__\n"
        "from trainer.models import build_char_gpt\n"
        "from trainer.spec import ModelSpec\n"
        "spec = ModelSpec.model_validate({'nLayer': 1, 'nHead': 1, 'nEmbd': 8, 'blockSize': 8})\n"
        "print(build_char_gpt(spec, 5, 4)(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape)\n"
        "print(sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    assert result.stdout.splitlines() == ["torch.Size([1, 8, 5])", "[]"]
