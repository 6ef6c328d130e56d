"""GPT-2 causal LM: a model saved to a directory and loaded back through the production path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_ctl
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from trainer.text import train_tokenizer


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory, corpus_file) -> Path:
    """A tiny GPT-2 and a locally trained tokenizer, saved the way users keep models on the shared volume."""
    path = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    tokenizer = train_tokenizer([corpus_file.read_text()], vocab_size=400)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", stdout)]


def test_a_block_longer_than_the_pretrained_positions_is_refused_before_the_data_is_prepared(
    tmp_path, corpus_file, pretrained_dir
) -> None:
    """The refusal came only once the model loaded, after the corpus had been tokenized into the cache."""
    training = {
        "task": "causal-lm",
        "model": {"pretrained": str(pretrained_dir), "blockSize": 128},
        "data": {"train": str(corpus_file)},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"name": "long", "training": training}))
    result = run_ctl("run", "spec.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    line = "error: training.model.blockSize: 128 is more than the model's 64 positions"
    assert result.stderr.splitlines()[-1] == line, result.stderr
    assert not (tmp_path / "runs").exists()  # no run directory, no prepared dataset beside it


def test_pretrained_directory_fine_tunes_and_exports(tmp_path, corpus_file, pretrained_dir) -> None:
    docs = tmp_path / "docs.jsonl"
    text = corpus_file.read_text()
    docs.write_text("\n".join(json.dumps({"body": text[i : i + 2000]}) for i in range(0, len(text), 2000)))
    spec = {
        "name": "finetune",
        "procsPerNode": 2,
        "training": {
            "task": "causal-lm",
            "model": {"pretrained": str(pretrained_dir), "blockSize": 64},
            "data": {"train": str(docs), "textField": "body", "valFraction": 0.1},
            "optimizer": {"lr": 0.003},
            "maxSteps": 30,
            "batchSize": 4,
            "logEvery": 5,
            "sample": {"prompt": "def ", "maxNewTokens": 8},
        },
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    result = run_ctl("run", "spec.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    logged = losses(result.stdout)
    assert len(logged) == 6 and logged[-1] < logged[0] - 0.5, logged

    run_dir = tmp_path / "runs" / "finetune"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["task"] == "causal-lm" and report["world_size"] == 2
    assert report["perplexity"] == pytest.approx(2.718281828 ** report["eval_loss"])
    prepared = list((tmp_path / "runs" / "_datasets").glob("causal-lm-*/manifest.json"))
    assert len(prepared) == 1, "tokenized once into the dataset cache next to the run directory"

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    assert len(tokenizer) == len(AutoTokenizer.from_pretrained(pretrained_dir))
    ids = tokenizer("import json", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape[1] == ids.shape[1] + 5 and isinstance(tokenizer.decode(out[0]), str)


def test_named_gpt2_sizes_are_built_from_their_configs() -> None:
    from trainer.models import build_causal_lm
    from trainer.spec import ModelSpec

    tokenizer = train_tokenizer(["a tiny corpus for a tokenizer"], vocab_size=300)
    model = build_causal_lm(ModelSpec.model_validate({"size": "gpt2"}), tokenizer)
    config = model.config
    assert (config.n_layer, config.n_head, config.n_embd, config.n_positions) == (12, 12, 768, 1024)
    # GPT-2 124M has 124,439,808 parameters with its 50257-token vocabulary; this one has a tiny vocabulary.
    assert sum(p.numel() for p in model.parameters()) == 124_439_808 - (50257 - len(tokenizer)) * 768


def test_training_forwards_fill_no_key_value_cache() -> None:
    from transformers import GPT2ForSequenceClassification

    from trainer.models import forward_options

    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2, pad_token_id=0)
    ids = torch.ones(2, 8, dtype=torch.long)
    for model in (GPT2LMHeadModel(config), GPT2ForSequenceClassification(config)):
        assert model(input_ids=ids).past_key_values is not None  # what transformers does by default
        assert model(input_ids=ids, **forward_options(model)).past_key_values is None
    assert forward_options(torch.nn.Linear(2, 2)) == {}  # a forward without the option gets none


def test_trained_tokenizer_and_model_from_dimensions(tmp_path, corpus_file) -> None:
    """No model or tokenizer given: a BPE is trained on the data and saved next to the model."""
    spec = {
        "name": "scratch",
        "training": {
            "task": "causal-lm",
            "model": {"nLayer": 1, "nHead": 2, "nEmbd": 32, "blockSize": 32},
            "tokenizer": {"vocabSize": 300},
            "data": {"train": str(corpus_file)},
            "maxSteps": 3,
            "batchSize": 4,
            "sample": {"maxNewTokens": 0},
        },
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    result = run_ctl("run", "spec.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "scratch"
    (trained,) = (tmp_path / "runs" / "_datasets").glob("causal-lm-*/tokenizer")  # prepared with the data
    assert len(AutoTokenizer.from_pretrained(trained)) == 300
    assert len(AutoTokenizer.from_pretrained(run_dir / "final")) == 300
    assert AutoModelForCausalLM.from_pretrained(run_dir / "final").config.vocab_size == 300
