"""Entry point: `torchrun -m trainer --config /etc/ddpjob/training.yaml`.

Exit codes: 0 done, 1 error (traceback in TORCHELASTIC_ERROR_FILE), 2 bad input
(spec or data: one line naming the key and the problem).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import transformers
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from trainer.data import check_enough_samples, load_char_corpus
from trainer.dist import Dist, barrier, init_distributed, shutdown
from trainer.loop import train
from trainer.models import build_char_gpt, sample_tokens
from trainer.rundir import export_final, prepare_run_dir, write_report
from trainer.spec import SpecError, TrainingSpec, load_training_spec

EXIT_BAD_INPUT = 2


def run(spec: TrainingSpec, dist: Dist) -> None:
    def log(message: str) -> None:
        if dist.is_main:
            print(message, flush=True)

    transformers.utils.logging.disable_progress_bar()
    corpus = load_char_corpus(spec.data, spec.model.block_size)
    check_enough_samples(corpus.train, dist, spec.batch_size, "data.train")
    run_dir = prepare_run_dir(Path(spec.checkpoint.dir or Path("runs") / spec.task)) if dist.is_main else None

    torch.manual_seed(spec.seed)
    model = build_char_gpt(spec.model, corpus.vocab.size, corpus.vocab.special_id)
    log(f"char-gpt: {sum(p.numel() for p in model.parameters()):,} parameters, vocabulary of {corpus.vocab.size}")
    result = train(spec, dist, model, corpus.train, corpus.val, log)

    if run_dir is not None:
        export_final(run_dir, model, corpus.vocab.to_hf_tokenizer())
        write_report(
            run_dir,
            {
                "task": spec.task,
                "eval_loss": result.eval_loss,
                "perplexity": math.exp(result.eval_loss),
                "eval_tokens": result.eval_tokens,
                "train_loss": result.train_loss,
                "steps": result.steps,
                "samples": result.samples,
                "tokens": result.tokens,
                "world_size": dist.world_size,
                "train_seconds": result.seconds,
            },
        )
        if spec.sample.max_new_tokens:
            torch.manual_seed(spec.seed)
            text = corpus.vocab.decode(
                sample_tokens(
                    model,
                    corpus.vocab.encode(spec.sample.prompt).tolist(),
                    spec.sample.max_new_tokens,
                    spec.model.block_size,
                    spec.sample.temperature,
                    spec.sample.top_k,
                )
            )
            log(f"sample:\n{spec.sample.prompt}{text}\n")
        log(f"run directory: {run_dir}")
    barrier()


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="training.yaml (the spec's training: section)")
    args = parser.parse_args(argv)
    try:
        spec = load_training_spec(args.config)
        dist = init_distributed()
        try:
            run(spec, dist)
        finally:
            shutdown()
    except SpecError as exc:
        get_error_handler().record_exception(exc)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
