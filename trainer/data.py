"""Text in, token blocks out: the char-gpt corpus, its vocabulary and the samplers.

Training shards with `DistributedSampler` (shuffled per epoch, equal shard sizes so
every rank takes the same number of steps). Evaluation shards with `ShardSampler`,
which never pads, so no sample is counted twice.
"""

from __future__ import annotations

import glob
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from trainer.dist import Dist
from trainer.spec import DataSpec, SpecError

SPECIAL_TOKEN = "<|endoftext|>"


def expand_paths(patterns: list[str], key: str) -> list[Path]:
    """Expand globs (and `{stdlib}`) into a sorted list of files; no match is a SpecError."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files: set[Path] = set()
    for pattern in patterns:
        expanded = pattern.replace("{stdlib}", stdlib)
        matches = [Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file()]
        if not matches:
            raise SpecError(f"{key}: no file matches {expanded!r}")
        files.update(matches)
    return sorted(files)


def read_text(paths: list[Path], key: str) -> str:
    """Concatenate UTF-8 files, one newline between them."""
    parts = []
    for path in paths:
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise SpecError(f"{key}: {path} is not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise SpecError(f"{key}: cannot read {path}: {exc.strerror}") from None
    return "\n".join(parts)


class CharVocab:
    """Characters sorted by code point, then one special token (unknown / end of text)."""

    def __init__(self, chars: list[str]) -> None:
        self.chars = sorted(chars)
        self.codepoints = torch.tensor([ord(c) for c in self.chars], dtype=torch.int64)
        self.special_id = len(self.chars)

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls(list(set(text)))

    @property
    def size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> torch.Tensor:
        points = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).to(torch.int64)
        ids = torch.searchsorted(self.codepoints, points).clamp_(max=len(self.chars) - 1)
        return torch.where(self.codepoints[ids] == points, ids, self.special_id)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else SPECIAL_TOKEN for i in ids)

    def to_hf_tokenizer(self):  # -> transformers.PreTrainedTokenizerFast
        """The same mapping as a transformers tokenizer, so `final/` loads with AutoTokenizer."""
        from tokenizers import Tokenizer, decoders, models
        from transformers import PreTrainedTokenizerFast

        vocab = {c: i for i, c in enumerate(self.chars)} | {SPECIAL_TOKEN: self.special_id}
        # BPE without merges splits text into single characters; Fuse joins them back.
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKEN))
        backend.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, unk_token=SPECIAL_TOKEN, eos_token=SPECIAL_TOKEN, bos_token=SPECIAL_TOKEN
        )


class TokenBlocks(Dataset):
    """Consecutive non-overlapping windows: input `block_size` tokens, target shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


@dataclass
class CharCorpus:
    vocab: CharVocab
    train: TokenBlocks
    val: TokenBlocks


def load_char_corpus(spec: DataSpec, block_size: int) -> CharCorpus:
    """Read the text, build the vocabulary over all of it, and cut train/val blocks."""
    train_text = read_text(expand_paths(spec.train, "data.train"), "data.train")
    if not train_text.strip():
        raise SpecError("data.train: the files hold no text")
    if spec.val:
        val_text = read_text(expand_paths(spec.val, "data.val"), "data.val")
    else:
        cut = int(len(train_text) * (1 - spec.val_fraction))
        train_text, val_text = train_text[:cut], train_text[cut:]
    vocab = CharVocab.from_text(train_text + val_text)
    corpus = CharCorpus(
        vocab, TokenBlocks(vocab.encode(train_text), block_size), TokenBlocks(vocab.encode(val_text), block_size)
    )
    if not len(corpus.val):
        raise SpecError(f"data.val: {len(val_text)} characters, fewer than one block of {block_size + 1}")
    return corpus


def check_enough_samples(dataset: Dataset, dist: Dist, batch_size: int, key: str) -> None:
    """Every rank needs at least one full batch, or training would take no step."""
    needed = dist.world_size * batch_size
    if len(dataset) < needed:
        raise SpecError(
            f"{key}: {len(dataset)} samples, fewer than world size x batchSize = {dist.world_size} x {batch_size}"
        )


class ShardSampler(Sampler[int]):
    """Rank r takes indices r, r+W, r+2W, ...: shards may differ by one, nothing is duplicated."""

    def __init__(self, length: int, dist: Dist) -> None:
        self.indices = range(dist.rank, length, dist.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class TrainBatches:
    """Endless (epoch, batch) stream; the sampler reshuffles with `set_epoch` each epoch."""

    def __init__(self, dataset: Dataset, dist: Dist, batch_size: int, seed: int) -> None:
        self.sampler = DistributedSampler(
            dataset, num_replicas=dist.world_size, rank=dist.rank, shuffle=True, seed=seed, drop_last=True
        )
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=True,
            pin_memory=dist.device.type == "cuda",
        )

    @property
    def batches_per_epoch(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            for batch in self.loader:
                yield epoch, batch
            epoch += 1


def eval_loader(dataset: Dataset, dist: Dist, batch_size: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ShardSampler(len(dataset), dist),
        pin_memory=dist.device.type == "cuda",
    )
