"""Finding data files and getting a tokenizer for them (trainer/preparation/readers.py reads the files).

Every problem is a SpecError naming the spec key: the trainer turns it into one line and exit code 2.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import json
import os
import socket
import sysconfig
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trainer.heap import importing
from trainer.location import S3Location, is_s3
from trainer.spec import SpecError
from trainer.storage import s3_source, s3_sources

EOS = "<|endoftext|>"
HUB_CONNECT_TIMEOUT_S = 5.0


def expand_paths(patterns: list[str], key: str) -> list[Path]:
    """Expand globs (and `{stdlib}`) into a sorted list of files; a directory names the files under it, as a `**`
    glob (hidden ones left out), as an S3 prefix names its objects; one that `save_to_disk` wrote, on disk or in a
    bucket, names its data files. No match is a SpecError."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files: set[Path] = set()
    for pattern in patterns:
        if is_s3(pattern):  # downloaded once into this node's cache
            sources = s3_sources(pattern, key)
            location = S3Location.parse(pattern)
            mirror = s3_source(location.bucket, location.prefix.strip("/"))  # a folder's copy: save_to_disk's?
            # Only what the bucket has now: the cache may still hold objects an earlier run downloaded.
            saved = saved_dataset_files(mirror, key, pattern.rstrip("/"), set(sources).__contains__)
            files.update(sources if saved is None else saved)
            continue
        expanded = pattern.replace("{stdlib}", stdlib)
        folder = os.path.isdir(expanded)
        if folder and (saved := saved_dataset_files(Path(expanded), key, expanded.rstrip("/"))) is not None:
            files.update(saved)
            continue
        if not folder and os.path.isfile(expanded):  # a file, even one whose name has `[`, `*` or `?` in it
            files.add(Path(expanded))
            continue
        try:
            found = recursive_glob(expanded, ["**", "*"]) if folder else pattern_matches(expanded)
        except RecursionError:  # a Python frame or two a folder
            raise SpecError(f"{key}: {expanded!r}: its folders nest deeper than can be walked") from None
        matches = [Path(p) for p in found if Path(p).is_file()]
        if not matches:
            raise SpecError(f"{key}: {no_match(expanded, folder)}")
        files.update(matches)
    return once_each(files)


def pattern_matches(pattern: str) -> list[str]:
    """What `pattern` names, as `glob.glob(pattern, recursive=True)`; one with a `**` in it, by recursive_glob."""
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return glob.glob(pattern)
    literal = next(index for index, part in enumerate(parts) if glob.has_magic(part))  # the folder it begins in
    if literal == 0:  # relative, from here: named as glob names them, without a leading "./"
        return [path.removeprefix(os.curdir + os.sep) for path in recursive_glob(os.curdir, parts)]
    return recursive_glob(os.sep.join(parts[:literal]) or os.sep, parts[literal:])


def recursive_glob(folder: str, parts: list[str]) -> list[str]:
    """The paths under `folder` that match the pattern's `parts`, as glob's (`**`: any folders, hidden ones aside;
    `*`: no hidden name), except that a `**` enters each folder once: glob follows links to folders above to the
    system's limit of 40 (two of them: 2^40 paths, a hang), and links between folders along every path (n folders
    that link to each other: n! paths). Links are followed after every real folder, so a file keeps its plainest
    name."""
    walked: set[tuple[int, int, int]] = set()  # (device, inode, parts left) of the folders a `**` entered
    links: deque[tuple[str, list[str]]] = deque()  # the links to folders a `**` is to enter after the real ones

    def matches(folder: str, parts: list[str]) -> list[str]:
        head, rest = parts[0], parts[1:] or (["*"] if parts[0] == "**" else [])  # files: what a trailing `**` gives
        try:
            if head == "**":
                with os.scandir(folder) as entries:
                    subfolders = [(e.path, e.is_symlink()) for e in entries if e.name[0] != "." and e.is_dir()]
                links.extend((sub, parts) for sub, link in sorted(subfolders) if link)
                found = matches(folder, rest)  # no folder between
                return found + [path for sub, link in sorted(subfolders) if not link for path in walk(sub, parts)]
            if glob.has_magic(head):
                hidden = head.startswith(".")
                names = [n for n in os.listdir(folder) if fnmatch.fnmatchcase(n, head) and (hidden or n[0] != ".")]
            else:
                names = [head] if os.path.lexists(os.path.join(folder, head)) else []
        except OSError:  # a folder this process may not list, or no folder: as glob, nothing in it matches
            return []
        paths = [os.path.join(folder, name) for name in names]
        return [found for path in paths for found in matches(path, rest)] if rest else paths

    def walk(folder: str, parts: list[str]) -> list[str]:
        """A folder a `**` goes into, unless it went into it before."""
        try:
            info = os.stat(folder)
        except OSError:
            return []
        if (info.st_dev, info.st_ino, len(parts)) in walked:
            return []
        walked.add((info.st_dev, info.st_ino, len(parts)))
        return matches(folder, parts)

    found = walk(folder, parts) if parts[0] == "**" else matches(folder, parts)
    while links:
        found += walk(*links.popleft())
    return found


def once_each(files: set[Path]) -> list[Path]:
    """`files` sorted, each file once: named two ways (relative and absolute, `..`, a link to it or to a folder it is
    in), it would be read, and trained on, once per name.
    The shortest name stays (the plainest, mostly). By device and inode: one `stat` a file."""
    kept: dict[object, Path] = {}
    for path in sorted(files, key=lambda path: (len(str(path)), str(path))):
        try:
            info = path.stat()
        except OSError:  # gone since it matched: reading it says so (stat_sources)
            kept[path] = path
            continue
        kept.setdefault((info.st_dev, info.st_ino), path)
    return sorted(kept.values())


def no_match(expanded: str, folder: bool) -> str:
    """Why a path names no file: an empty folder, a link to nothing, a FIFO or device, or nothing there."""
    if folder:
        return f"no file in the directory {expanded!r}"
    if os.path.islink(expanded) and not os.path.exists(expanded):
        return f"{expanded!r} is a link to {os.readlink(expanded)!r}, which does not exist"
    if os.path.exists(expanded):
        return f"{expanded!r} is not a regular file (a FIFO, a socket or a device)"
    return f"no file matches {expanded!r}"


def saved_dataset_files(
    folder: Path, key: str, name: str, present: Callable[[Path], bool] = Path.is_file
) -> list[Path] | None:
    """The Arrow files of a Hugging Face dataset saved with `save_to_disk`, as its state.json lists them (not its
    metadata, dataset_info.json and state.json, which are no rows); None for any other folder. A saved DatasetDict
    (a folder a split) is bad input naming its splits' folders: one of them is the data. `name`: the folder's name
    for messages (an s3:// URI for a bucket's folder copied to this node); `present`: whether the folder has a
    file (for a bucket's copy, whether the bucket has it)."""
    try:
        splits = present_json(folder / "dataset_dict.json", present)["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    else:
        named = ", ".join(f"{name}/{split}" for split in splits)
        raise SpecError(f"{key}: {name} is a saved DatasetDict: name one split's folder ({named})")
    try:
        state = present_json(folder / "state.json", present)
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        refuse_datasets_cache(folder, key, name, present)
        return None  # a folder of files (its state.json, if any, is not a dataset's)
    files = [folder / name for name in names]
    if missing := [path for path in files if not present(path)]:
        raise SpecError(f"{key}: {name}: the saved dataset's {missing[0].name} (in state.json) is missing")
    return files


def refuse_datasets_cache(folder: Path, key: str, name: str, present: Callable[[Path], bool]) -> None:
    """A folder of the datasets cache (what `load_dataset` wrote: dataset_info.json, and every split's Arrow files
    side by side, `<dataset>-<split>.arrow` or `<dataset>-<split>-00000-of-00002.arrow`) is bad input naming each
    split's files: one split is the data, and its metadata is no rows."""
    try:
        info = present_json(folder / "dataset_info.json", present)
        splits = list(info["splits"]) if "builder_name" in info else []
    except (OSError, ValueError, KeyError, TypeError):
        return
    if splits:
        prefix = info.get("dataset_name") or info["builder_name"]  # the files' (datasets before 2.13: the builder's)
        named = ", ".join(cached_split(folder, name, f"{prefix}-{split}", present) for split in splits)
        raise SpecError(f"{key}: {name} is a Hugging Face datasets cache: name one split's files ({named})")


def cached_split(folder: Path, name: str, stem: str, present: Callable[[Path], bool]) -> str:
    """A split's files in the datasets cache, exactly (a glob of `*-train*` would take a split `train_x` too): its one
    file, or its shards (`<stem>-00000-of-00002.arrow`)."""
    return f"{name}/{stem}.arrow" if present(folder / f"{stem}.arrow") else f"{name}/{stem}-*-of-*.arrow"


def present_json(path: Path, present: Callable[[Path], bool]) -> Any:
    """The JSON `path` holds; FileNotFoundError when the folder has no such file (by `present`)."""
    if not present(path):
        raise FileNotFoundError(path)
    return json.loads(path.read_text(encoding="utf-8"))


def train_tokenizer(texts: Iterable[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    """A GPT-2-style byte-level BPE trained on `texts`; its one special token is eos = pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with importing():
        from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS)


def pretrained_options(source: str, key: str) -> dict[str, Any]:
    """from_pretrained's options for `source`. A source that is no existing path must be a hub id: otherwise a
    directory is missing (and transformers would answer with its rules for repo ids). Where the hub cannot be reached
    (a pod without network, a mistyped relative path), only the hub's local cache is asked: the hub client would
    retry for about 25 s a file first."""
    if Path(source).exists():
        return {}
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        raise SpecError(f"{key}: {source}: no such directory") from None
    return {"local_files_only": True} if hub_out_of_reach() else {}


@functools.cache
def hub_out_of_reach() -> bool:
    """No TCP connection to the hub's endpoint (or to the HTTPS proxy when one is set) within HUB_CONNECT_TIMEOUT_S.
    False where it cannot tell (an address without a host) and with HF_HUB_OFFLINE set: the hub client then keeps to
    its cache itself. Asked once a process: a pretrained model's tokenizer is loaded from the same name."""
    from huggingface_hub import constants

    url = urllib.parse.urlsplit(urllib.request.getproxies().get("https") or constants.ENDPOINT)
    if constants.HF_HUB_OFFLINE or not url.hostname:
        return False
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError):
        return True
    return False


def unloadable_model_errors() -> tuple[type[Exception], ...]:
    """What from_pretrained raises for a model directory's bad files: a missing or unreadable one (OSError), bad JSON or
    values (ValueError), a config value of the wrong type (huggingface_hub's strict dataclasses), weights cut short
    (safetensors). Imported only then: both come with transformers."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    return OSError, ValueError, StrictDataclassError, SafetensorError


def pretrained_failure(source: str, exc: Exception, options: dict[str, Any]) -> str:
    """Why from_pretrained failed, whole in one line (transformers' messages list what it tried over several); for a
    name that is no path here, where else it was looked for."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    if Path(source).exists():
        return reason
    where = "in the hub's local cache (the hub cannot be reached)" if options else "on the hub"
    return f"no such directory here, nor {where}: {reason}"


# The files a saved tokenizer has one of (save_pretrained: the fast serialization, its config, a vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def load_tokenizer(source: str, key: str):  # -> PreTrainedTokenizerBase
    """From a directory (or a hub id when the network allows); pad = eos when it has no pad token."""
    if Path(source).is_dir() and not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        # A model saved without its tokenizer: transformers makes an empty GPT-2 tokenizer of its config.json (every
        # text 0 tokens), or without one says to install sentencepiece or tiktoken.
        why = f"no tokenizer in the directory (none of {', '.join(TOKENIZER_FILES)})"
        raise SpecError(f"{key}: cannot load a tokenizer from {source!r}: {why}")
    options = pretrained_options(source, key)
    try:
        with importing():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source, **options)
    except unloadable_model_errors() as exc:  # it reads the model's config too
        why = pretrained_failure(source, exc, options)
        raise SpecError(f"{key}: cannot load a tokenizer from {source!r}: {why}") from None
    if tokenizer.eos_token is None:
        raise SpecError(f"{key}: the tokenizer in {source!r} has no eos token")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer
