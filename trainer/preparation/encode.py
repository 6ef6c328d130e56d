"""Tokenizing in a pool: documents in chunks to a pool of processes (one per usable CPU by default), tokens back in
document order, with at most `data.prepareBufferMiB` of text in flight, and an allocator preloaded into the
pool's processes. Torch-free: the pool's processes import it without torch.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import types
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.preparation.readers import Document

# Text per chunk a pool process tokenizes at most (one round trip to the pool): small enough that the processes
# finish the last chunks of a split close together, large next to a round trip's cost (~1 ms).
CHUNK_BYTES = 2**20
# Text per call of the Rust tokenizer within a chunk: it takes over 100 bytes per byte of text while it encodes
# (alignments, offsets, token strings, masks), so a whole 4 MiB chunk at once held ~200 MB per process, and one
# 4 MB document alone ~500 MB. A longer document is encoded in pieces of about this size where that leaves its
# ids unchanged (Encoder.cut).
ENCODE_BATCH_BYTES = 256 * 2**10


@dataclass(frozen=True)
class Encoder:
    """How a chunk of documents becomes tokens; picklable, so the pool's processes get it once."""

    dtype: str
    tokenizer_json: str | None = None  # a BPE's backend (tokenizers' JSON)
    chars: str | None = None  # char-gpt: the sorted vocabulary; a chunk's documents are joined by "\n"
    eos_id: int | None = None  # appended after every document (causal-lm packing)
    max_length: int | None = None  # classification: truncation
    cut: int | None = None  # pieces of about this many characters for long documents (see cuts_within_documents)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, per-document lengths) of a chunk."""
        if self.chars is not None:
            points = np.frombuffer("\n".join(texts).encode("utf-32-le"), dtype=np.uint32)
            tokens = np.searchsorted(_codepoints(self.chars), points).astype(self.dtype)
            return tokens, np.array([len(t) for t in texts], dtype=np.int64)
        backend = _backend(self.tokenizer_json)
        special = self.max_length is not None
        pieces = [(doc, piece) for doc, text in enumerate(texts) for piece in pieces_of(text, self.cut)]
        ids_of: list[list[np.ndarray]] = [[] for _ in texts]
        for batch in text_batches(pieces, ENCODE_BATCH_BYTES):
            # encode_batch_fast: the same ids without the offsets, which take a third of the tokenizer's memory.
            encodings = backend.encode_batch_fast([piece for _, piece in batch], add_special_tokens=special)
            for (doc, _), encoding in zip(batch, encodings, strict=True):
                ids_of[doc].append(np.array(encoding.ids, dtype=self.dtype))
        parts = []
        for pieces_ids in ids_of:
            ids = np.concatenate(pieces_ids)[: self.max_length]
            parts.append(ids if self.eos_id is None else np.append(ids, np.array(self.eos_id, dtype=self.dtype)))
        lengths = np.array([len(part) for part in parts], dtype=np.int64)
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)
        return flat, lengths


# Where a long document may be cut (cuts_within_documents): before a newline or a space that follows a printable
# ASCII character (a line of code or prose ends so; words of minified text are spaced so).
CUT = re.compile(r"(?<=[!-~])[\n ]")


def cuts_within_documents(tokenizer_json: str) -> bool:
    r"""Whether cutting a text at a CUT leaves its ids unchanged.

    So for GPT-2's byte-level BPE (and the one preparation trains): no normalizer, and the ByteLevel
    pre-tokenizer's regex without a prefix space. No regex match runs from a printable ASCII character into
    the whitespace after it, so a match starts there (` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` or a
    whitespace run); none looks behind, BPE merges stay within a match, and no added token holds a newline
    or a space or takes the whitespace around it. Other tokenizers are never cut.
    """
    config = json.loads(tokenizer_json)
    pre = config.get("pre_tokenizer") or {}
    added = config.get("added_tokens") or []
    return (
        config.get("normalizer") is None
        and (config.get("model") or {}).get("type") == "BPE"
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
        and not any(
            "\n" in token["content"] or " " in token["content"] or token.get("lstrip") or token.get("rstrip")
            for token in added
        )
    )


def pieces_of(text: str, size: int | None) -> list[str]:
    """`text` in pieces of at least `size` characters, each cut at a CUT; the whole text when `size` is None or
    no cut exists (a document without a newline or a space after a printable ASCII character)."""
    if size is None:
        return [text]
    pieces, start = [], 0
    while (cut := CUT.search(text, start + size)) is not None:
        pieces.append(text[start : cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


_BACKENDS: dict[str, Any] = {}
_CODEPOINTS: dict[str, np.ndarray] = {}
_POOL_ENCODER: list[Encoder] = []  # set in each pool process by its initializer


def _backend(tokenizer_json: str | None) -> Any:
    if tokenizer_json not in _BACKENDS:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(tokenizer_json)
        backend.no_truncation()  # transformers' call also turns any saved truncation/padding off
        backend.no_padding()
        _BACKENDS[tokenizer_json] = backend
    return _BACKENDS[tokenizer_json]


def _codepoints(chars: str) -> np.ndarray:
    if chars not in _CODEPOINTS:
        _CODEPOINTS[chars] = np.array([ord(c) for c in chars], dtype=np.uint32)
    return _CODEPOINTS[chars]


def _init_pool(encoder: Encoder) -> None:
    # One process per core already: the tokenizer's own threads would only compete with them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _POOL_ENCODER.append(encoder)


def _encode_in_pool(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _POOL_ENCODER[0].encode(texts)


def text_batches(pieces: list[tuple[int, str]], batch_bytes: int) -> Iterator[list[tuple[int, str]]]:
    """(document, text) pieces in consecutive runs of about `batch_bytes` characters (a longer piece: alone)."""
    start = size = 0
    for end, (_, text) in enumerate(pieces, start=1):
        size += len(text)
        if size >= batch_bytes:
            yield pieces[start:end]
            start, size = end, 0
    if start < len(pieces):
        yield pieces[start:]


def chunks(docs: Iterable[Document], chunk_bytes: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += doc.size
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@contextlib.contextmanager
def without_main() -> Iterator[None]:
    """Start processes that do not import the parent's `__main__` first.

    A spawned process runs the parent's main module before anything else: for a trainer rank that
    is `trainer.__main__` (torch, transformers: seconds and hundreds of MB per process) when the
    pool's processes need only this module.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def fast_malloc() -> str | None:
    """jemalloc's shared library where the system has it (the image installs it), for the tokenizing processes.

    The Rust tokenizer allocates a few small strings and vectors per token and spends about 40% of its time in
    glibc's malloc and free; with jemalloc it encodes 15-20% faster (docs/data.md).
    """
    return ctypes.util.find_library("jemalloc")


@contextlib.contextmanager
def preloading(library: str | None) -> Iterator[None]:
    """Processes started meanwhile load `library` before any other (LD_PRELOAD); this one is unchanged."""
    before = os.environ.get("LD_PRELOAD")
    if library is not None:
        os.environ["LD_PRELOAD"] = f"{library}:{before}" if before else library
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


@contextlib.contextmanager
def encoding_pool(encoder: Encoder, workers: int, allocator: str | None = None) -> Iterator[Any]:
    """The processes that tokenize, started once for every split of a preparation, with `allocator` preloaded;
    None: tokenize in this one."""
    if workers == 1:
        yield None
        return
    with contextlib.ExitStack() as stack:
        # spawn: the parent may hold threads (a process group, the tokenizer's pool) that fork would copy half-alive.
        # A signal handler that raises (trainer.prepare's SIGTERM) waits until the pool is whole and will be ended.
        with without_main(), preloading(allocator), signals_held(signal.SIGTERM, signal.SIGINT):
            stack.enter_context(pool := multiprocessing.get_context("spawn").Pool(workers, _init_pool, (encoder,)))
        yield pool


@contextlib.contextmanager
def signals_held(*signums: int) -> Iterator[None]:
    """Runs the body whole: `signums` that arrive meanwhile go to their handlers at its end. An exception raised in
    the middle of a pool's start left the processes it had started running (the pool cleans up after an Exception
    only), and one whose start-up data the parent had not finished writing failed with EOFError."""
    if threading.current_thread() is not threading.main_thread():  # handlers run in the main thread only
        yield
        return
    arrived: list[int] = []
    # Not a handler installed outside Python (getsignal gives None): it could not be put back.
    held = [signum for signum in signums if signal.getsignal(signum) is not None]
    handlers = {signum: signal.signal(signum, lambda signum, frame: arrived.append(signum)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for signum in arrived:
            signal.raise_signal(signum)


def encoded(
    encoder: Encoder, docs: Iterable[Document], pool: Any, workers: int, buffer_bytes: int
) -> Iterator[tuple[list[Document], np.ndarray, np.ndarray]]:
    """(chunk, tokens, lengths) in document order; at most `buffer_bytes` of text in flight."""
    if pool is None:
        for chunk in chunks(docs, min(CHUNK_BYTES, buffer_bytes)):
            yield (chunk, *encoder.encode([d.text for d in chunk]))
        return
    in_flight = 4 * workers  # a few chunks queued per process: it never waits for the parent, busy as it may be
    pending: deque = deque()
    for chunk in chunks(docs, max(1, min(CHUNK_BYTES, buffer_bytes // in_flight))):
        pending.append((chunk, pool.apply_async(_encode_in_pool, ([d.text for d in chunk],))))
        if len(pending) >= in_flight:
            done, result = pending.popleft()
            yield (done, *result.get())
    while pending:
        done, result = pending.popleft()
        yield (done, *result.get())
