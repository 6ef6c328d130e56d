"""The two peers `bench/throughput.py` measures the trainer against, each run under torchrun:

    torchrun --nproc-per-node N bench/peers.py reference  --workdir DIR ...
    torchrun --nproc-per-node N bench/peers.py hf-trainer --workdir DIR ...

`reference`: a minimal hand-written DDP loop (the floor on overhead). `hf-trainer`: transformers'
`Trainer` with matching arguments. Both read the same text with the same tokenizer as the
trainer, pack it into the same blocks, and build the same GPT-2 from a config; rank 0 prints
one `step N` line per optimizer step, which the driver timestamps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from trainer.data import TokenBlocks
from trainer.gpt import ACTIVATION
from trainer.prepare import read_texts
from trainer.text import expand_paths


def tokenize_packed(tokenizer, documents: list[str]) -> np.ndarray:
    """One stream of token ids, documents separated by eos (GPT-2's packing), in this process."""
    ids: list[int] = []
    for encoded in tokenizer(documents, add_special_tokens=False, verbose=False)["input_ids"]:
        ids += encoded
        ids.append(tokenizer.eos_token_id)
    return np.array(ids, dtype=np.int32)


def load_blocks(settings: dict) -> TokenBlocks:
    documents = list(read_texts(expand_paths(settings["train"], "training.data.train"), "text", "training.data.train"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(settings["tokenizer"])
    return TokenBlocks(tokenize_packed(tokenizer, documents), settings["block"])


def gpt2(settings: dict) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=settings["vocab"],
        n_positions=settings["block"],
        n_layer=settings["layers"],
        n_head=settings["heads"],
        n_embd=settings["embd"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function=ACTIVATION,  # the trainer's
    )
    return transformers.GPT2LMHeadModel(config)


def reference(settings: dict) -> None:
    """The plainest correct DDP loop: no logging beyond one line a step, no evaluation, no checkpoints."""
    cuda = settings["device"] == "cuda"
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(settings["seed"])
    blocks = load_blocks(settings)
    model = gpt2(settings).to(device)
    forward = torch.compile(model) if settings["compile"] else model
    ddp = DDP(forward, device_ids=[local_rank] if cuda else None, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=settings["lr"],
        weight_decay=0.0,
        fused=True,  # as the trainer's
    )
    sampler = DistributedSampler(blocks, shuffle=True, seed=settings["seed"], drop_last=True)
    loader = DataLoader(blocks, batch_size=settings["batch"], sampler=sampler, drop_last=True, pin_memory=cuda)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings["bf16"])
    step, epoch = 0, 0
    while step < settings["steps"]:
        sampler.set_epoch(epoch)
        for batch in loader:
            x, y = batch["input_ids"].to(device, non_blocking=True), batch["labels"].to(device, non_blocking=True)
            with amp:
                # As the trainer does: the key/value cache transformers fills by default is for generation.
                logits = ddp(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if dist.get_rank() == 0:
                print(f"step {step}", flush=True)
            if step == settings["steps"]:
                break
        epoch += 1
    if cuda and dist.get_rank() == 0:
        print_peak_gpu_memory()
    dist.destroy_process_group()


def print_peak_gpu_memory() -> None:
    """The line the driver reads, in the trainer's words."""
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)


class StepLines(transformers.TrainerCallback):
    """One `step N` line a step from rank 0, like the other two (HF's own log line needs a loss sync)."""

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.is_world_process_zero:
            print(f"step {state.global_step}", flush=True)


class HFBlocks(torch.utils.data.Dataset):
    """The same blocks as the model inputs HF expects: labels = input_ids (the model shifts them itself)."""

    def __init__(self, blocks: TokenBlocks) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids = self.blocks[index]["input_ids"]
        return {"input_ids": input_ids, "labels": input_ids}


def hf_trainer(settings: dict, workdir: Path) -> None:
    cuda = settings["device"] == "cuda"
    transformers.set_seed(settings["seed"])
    arguments = transformers.TrainingArguments(
        output_dir=str(workdir / "hf-output"),
        per_device_train_batch_size=settings["batch"],
        max_steps=settings["steps"],
        learning_rate=settings["lr"],
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=settings["warmup"],
        optim="adamw_torch_fused",  # its default
        bf16=settings["bf16"],
        torch_compile=settings["compile"],
        use_cpu=not cuda,
        ddp_backend="nccl" if cuda else "gloo",
        dataloader_drop_last=True,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=settings["seed"],
    )
    trainer = transformers.Trainer(
        model=gpt2(settings),
        args=arguments,
        train_dataset=HFBlocks(load_blocks(settings)),
        callbacks=[StepLines()],
    )
    trainer.train()
    if cuda and trainer.is_world_process_zero():
        print_peak_gpu_memory()
    # Accelerate's end of a run destroys the process group, which joins gloo's threads while the interpreter
    # is whole. Without it, one that still held the last all_gather's tensors aborted a rank now and then at
    # exit (docs/performance.md).
    trainer.accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=["reference", "hf-trainer"])
    parser.add_argument("--workdir", type=Path, required=True, help="holds settings.json, written by the driver")
    args = parser.parse_args()
    settings = json.loads((args.workdir / "settings.json").read_text())
    transformers.utils.logging.set_verbosity_error()
    started = time.perf_counter()
    if args.peer == "reference":
        reference(settings)
    else:
        hf_trainer(settings, args.workdir)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"done in {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
