"""Where a run's checkpoints live: a local directory (the shared volume) or an `s3://bucket/prefix`.

Both stores offer the few operations checkpoint.py needs, with the same guarantee: a folder committed with
`commit` appears whole or not at all to a reader that checks its marker (trainer.checkpoint.MARKER).

- LocalStore: the folder is staged beside its target, fsynced and renamed into place (one atomic rename).
- S3Store: S3 has no rename of a prefix, so the staged folder's files are uploaded first and its marker object
  last; a reader (checkpoint.is_complete) ignores a prefix without a marker, or whose objects' sizes differ from
  the marker's list. Deletion goes the other way: the marker first, so a half-deleted folder is no checkpoint.

Data files named by s3:// URIs are downloaded once into the node's cache (`s3_sources`), and a run on object storage
shares its prepared datasets through an S3Store too (trainer.workloads.bucket_datasets).

The S3 client is obstore (docs/object-storage.md says why); the endpoint, credentials and region come from the
standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION) or, without
keys, from the pod's cloud identity, as the AWS SDKs find them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import functools
import hashlib
import html
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

from trainer.failures import first_line
from trainer.location import (
    PEM_CERTIFICATE,
    S3_ACCESS_KEY_ENV,
    S3_CA_BUNDLE_ENV,
    S3_ENDPOINT_ENV,
    S3_SECRET_KEY_ENV,
    S3Location,
    is_s3,
    run_cache,
    sources_cache,
)
from trainer.spec import ENDPOINT_URL, PATTERN_MEANINGS, CheckpointSpec, SpecError

if TYPE_CHECKING:
    import obstore.store
    from obstore import ObjectMeta

# In the XML error body that S3 servers answer with (the client quotes it in its exceptions).
S3_CODE = re.compile(r"<Code>(\w+)</Code>")
S3_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
# The units of Rust's Duration in its debug form (`997.611µs` for a local server's quick answer), in seconds.
DURATION_UNITS = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
# A request that got no S3 answer: the client's first line names it and its retries, the root cause is in the error
# chain it appends in Rust's debug form (the system's own words, a TLS error's name, or the kind of HTTP error).
REQUEST = re.compile(
    rf"Error performing (\w+) ([^?\s]+)\S* in ([\d.]+)({'|'.join(DURATION_UNITS)})(?:, after (\d+) retries)?"
)
SYSTEM_MESSAGE = re.compile(r'(?:message|error): "([^"]+)"')
TLS_ERROR = re.compile(r"(?:error|source): (Invalid\w+)\(([\w\s(]*\w)")
HTTP_STATUS = re.compile(r"Server returned non-2xx status code: (\d+ [^:]+)")
HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")


class Store(Protocol):
    """A run directory's top level: folders of files, each folder committed whole."""

    uploads: bool  # the run directory is a local copy whose files `publish` uploads (else it is the store itself)

    def names(self) -> list[str]: ...
    def sizes(self, folder: str) -> dict[str, int]: ...
    def read_bytes(self, path: str) -> bytes: ...
    def staging(self, folder: str) -> Path: ...  # where `folder` is written before `commit`
    def commit(self, staging: Path, folder: str, marker: str) -> None: ...
    def write_text(self, path: str, text: str) -> None: ...
    def delete(self, folder: str, marker: str) -> None: ...
    def local(self, folder: str) -> Path: ...
    def publish(self, local: Path, path: str) -> None: ...  # a file or folder of the local run directory
    def publish_new(self, files: list[Path], folder: str) -> None: ...  # those `folder` lacks at their size
    def describe(self, folder: str = "") -> str: ...


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """A directory on a (shared) filesystem: commit is an fsynced atomic rename."""

    uploads = False

    def __init__(self, root: Path) -> None:
        self.root = root

    def names(self) -> list[str]:
        return [path.name for path in self.root.iterdir()] if self.root.is_dir() else []

    def sizes(self, folder: str) -> dict[str, int]:
        path = self.root / folder
        return {file.name: file.stat().st_size for file in path.iterdir()} if path.is_dir() else {}

    def read_bytes(self, path: str) -> bytes:
        return (self.root / path).read_bytes()

    def staging(self, folder: str) -> Path:
        return self.root / f".{folder}.tmp"

    def commit(self, staging: Path, folder: str, marker: str) -> None:
        for path in staging.iterdir():
            fsync_path(path)
        fsync_path(staging)
        target = self.root / folder
        shutil.rmtree(target, ignore_errors=True)  # an uncommitted leftover of the same name
        os.replace(staging, target)
        fsync_path(self.root)

    def write_text(self, path: str, text: str) -> None:
        target = self.root / path
        staging = target.with_name(f".{target.name}.tmp")
        staging.write_text(text)
        fsync_path(staging)
        os.replace(staging, target)
        fsync_path(self.root)

    def delete(self, folder: str, marker: str) -> None:
        trash = self.root / f".trash-{folder}"
        os.replace(self.root / folder, trash)  # no longer a checkpoint from here on, even if deletion stops halfway
        shutil.rmtree(trash, ignore_errors=True)

    def local(self, folder: str) -> Path:
        return self.root / folder

    def describe(self, folder: str = "") -> str:
        return str(self.root / folder) if folder else str(self.root)

    def publish(self, local: Path, path: str) -> None:
        """Nothing to do: the run directory is the store."""

    def publish_new(self, files: list[Path], folder: str) -> None:
        """Nothing to do: the run directory is the store."""


@contextlib.contextmanager
def node_lock(target: Path) -> Iterator[None]:
    """One process of the node at a time makes `target`; the others wait for it, then find it there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def stream_to(store: obstore.store.S3Store, key: str, path: Path) -> None:
    """Object `key` into the file `path`, one chunk in memory at a time."""
    import obstore

    with path.open("wb") as file:
        for chunk in obstore.get(store, key):
            file.write(chunk)


P = ParamSpec("P")
R = TypeVar("R")


class StorageError(OSError):
    """An S3 request failed: the checkpoint code handles it as any other I/O error of its run directory."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # the one line, without OSError's "[Errno 5]"


class StorageUnreachable(StorageError):
    """No server answered (connection refused or reset, no such host, no reply in time): not bad input, since it may
    be a moment's outage (a restarting S3 server), so a rank that meets it exits 1, which the job's restart policy
    retries, with its one line."""


def s3_errors(method: Callable[P, R]) -> Callable[P, R]:
    """The client's errors as OSError, with the server's S3 error code and message as their reason."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import obstore.exceptions

        try:
            return method(*args, **kwargs)
        except obstore.exceptions.NotFoundError as exc:
            raise FileNotFoundError(errno.ENOENT, reason(exc)) from None
        except obstore.exceptions.BaseError as exc:
            unanswered = unreachable(str(exc))
            raise (StorageUnreachable if unanswered else StorageError)(errno.EIO, reason(exc)) from None

    return wrapper


# AWS's instance metadata service, where the client asks for credentials when no keys are set.
INSTANCE_METADATA = "169.254.169.254"


def reason(exc: BaseException) -> str:
    """The S3 error's code and message (`NoSuchBucket: The specified bucket does not exist`) when the server sent
    one; else the request and its root cause (`GET https://s3.example/runs: Connection refused (after 10 retries in
    2.1 s)`), or the client's first line."""
    text = str(exc)
    code, message = S3_CODE.search(text), S3_MESSAGE.search(text)
    if code:
        return f"{code[1]}: {html.unescape(message[1])}" if message else code[1]  # XML's &#34; is a quote
    first = first_line(exc)
    request = REQUEST.search(first)
    cause = root_cause(text)
    if not request or not cause:
        return first
    method, url, elapsed, unit, retries = request.groups()
    seconds = float(elapsed) * DURATION_UNITS[unit]
    tries = f"after {retries} retries in {seconds:.1f} s" if retries else f"in {seconds:.1f} s"
    if INSTANCE_METADATA in url:  # no keys set: the client asked the node's cloud identity, not the endpoint
        answer = status[1] if (status := HTTP_STATUS.search(text)) else cause
        return (
            f"no S3 keys: {S3_ACCESS_KEY_ENV} and {S3_SECRET_KEY_ENV} are not set (storage.secretName names a Secret"
            f" of them), and the node's cloud identity gave none ({method} {url}: {answer})"
        )
    return f"{method} {url}: {cause} ({tries})"


def root_cause(text: str) -> str | None:
    """What failed below the client, from its error chain: None where it has none that says more."""
    if tls := tls_error(text):
        error, detail = tls
        if detail == "UnknownIssuer":
            return (
                f"the server's TLS certificate is not trusted ({detail}): a private CA's certificates go in"
                f" {S3_CA_BUNDLE_ENV} (the chart's storage.caBundle)"
            )
        if error == "InvalidCertificate":  # expired, or for another name (NotValidForNameContext)
            return f"the server's TLS certificate is refused ({detail})"
        return f"TLS handshake failed ({error}: {detail}; is the endpoint https?)"
    if status := HTTP_STATUS.search(text):
        return f"{status[1]}, an answer that is no S3 error (is the endpoint an S3 server?)"
    if messages := SYSTEM_MESSAGE.findall(text):
        return messages[-1]  # the innermost: the system's own words
    if (kind := HTTP_KIND.search(text)) and kind[1] == "Timeout":
        return "no answer, timed out"
    return None


def unreachable(text: str) -> bool:
    """Whether the client's error chain says that no server answered: a connection that failed (no TLS error: a
    certificate is an answer) or timed out."""
    kind = HTTP_KIND.search(text)
    return bool(kind) and kind[1] in ("Connect", "Timeout", "Interrupted") and not tls_error(text)


def tls_error(text: str) -> tuple[str, str] | None:
    """A TLS error in the client's error chain: its name and innermost reason (InvalidCertificate, UnknownIssuer)."""
    if found := TLS_ERROR.search(text):
        return found[1], found[2].split("(")[-1].strip()
    return None


def s3_client(bucket: str, prefix: str = "") -> obstore.store.S3Store:
    """A client of `bucket` (its keys under `prefix`) from the standard AWS variables (an http:// endpoint allowed,
    a private CA's certificates trusted from AWS_CA_BUNDLE, as the AWS SDKs do)."""
    import obstore.exceptions
    import obstore.store

    endpoint = os.environ.get(S3_ENDPOINT_ENV, "")
    if not re.fullmatch(ENDPOINT_URL, endpoint):  # set by hand (ctl run passes the user's own): the chart's is checked
        raise SpecError(f"{S3_ENDPOINT_ENV}: {endpoint!r} is not {PATTERN_MEANINGS[ENDPOINT_URL]}")
    options: dict[str, str | bool] = {"allow_http": endpoint.startswith("http://")}
    keys = [name for name in (S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV) if os.environ.get(name)]
    if len(keys) == 1:  # the client's `Missing SecretAccessKey` came with a traceback, at the first request
        missing = ({S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV} - set(keys)).pop()
        raise SpecError(f"{missing}: not set, and {keys[0]} is: the two keys go together (storage.secretName's Secret)")
    bundle = os.environ.get(S3_CA_BUNDLE_ENV)
    if bundle:
        options["root_certificate"] = ca_certificates(bundle)
    try:
        return obstore.store.S3Store(bucket, prefix=prefix or None, client_options=options)
    except obstore.exceptions.BaseError as exc:  # the client is built at once: the certificates are parsed here
        if bundle and (tls := tls_error(str(exc))):
            raise SpecError(f"{S3_CA_BUNDLE_ENV}: {bundle!r}: a certificate it holds is invalid ({tls[1]})") from None
        if bundle and "invalid certificate encoding" in str(exc):  # not base64 between the PEM lines
            raise SpecError(f"{S3_CA_BUNDLE_ENV}: {bundle!r}: a certificate it holds is not PEM (base64)") from None
        raise


def ca_certificates(path: str) -> str:
    """The PEM certificates of the file AWS_CA_BUNDLE names, or SpecError naming it."""
    try:
        pem = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not a PEM file"
        raise SpecError(f"{S3_CA_BUNDLE_ENV}: cannot read {path!r}: {why}") from None
    if PEM_CERTIFICATE not in pem:
        raise SpecError(f"{S3_CA_BUNDLE_ENV}: {path!r} holds no PEM certificate ({PEM_CERTIFICATE})")
    return pem


class S3Store:
    """A prefix in an S3 bucket; files are staged and read back through a local directory (`cache`)."""

    uploads = True

    def __init__(self, location: S3Location, cache: Path) -> None:
        self.location = location
        self.cache = cache
        self.store = s3_client(location.bucket, location.prefix)
        # What `publish_new` knows each of its folders to hold, name -> size: listed at its first call, then kept by
        # its own uploads (one process writes there: rank 0 of the run's current attempt).
        self.published: dict[str, dict[str, int]] = {}

    @s3_errors
    def names(self) -> list[str]:
        import obstore

        listed = obstore.list_with_delimiter(self.store)
        return [name.rstrip("/").rsplit("/", 1)[-1] for name in listed["common_prefixes"]] + [
            meta["path"].rsplit("/", 1)[-1] for meta in listed["objects"]
        ]

    @s3_errors
    def sizes(self, folder: str) -> dict[str, int]:
        return {name: meta["size"] for name, meta in self.listing(folder).items()}

    def listing(self, folder: str) -> dict[str, ObjectMeta]:
        """Every object under `folder`, by its path inside it."""
        import obstore

        return {
            meta["path"].removeprefix(f"{folder}/"): meta
            for batch in obstore.list(self.store, f"{folder}/")
            for meta in batch
        }

    @s3_errors
    def read_bytes(self, path: str) -> bytes:
        import obstore

        return bytes(obstore.get(self.store, path).bytes())

    def staging(self, folder: str) -> Path:
        return self.cache / f".{folder}.upload"

    @s3_errors
    def commit(self, staging: Path, folder: str, marker: str) -> None:
        import obstore

        files = sorted(path for path in staging.rglob("*") if path.is_file() and path.name != marker)
        for path in [*files, staging / marker]:  # the marker last: only then is the folder complete
            obstore.put(self.store, f"{folder}/{path.relative_to(staging)}", path)

    @s3_errors
    def write_text(self, path: str, text: str) -> None:
        import obstore

        obstore.put(self.store, path, text.encode())  # one PUT: S3 replaces an object whole

    @s3_errors
    def delete(self, folder: str, marker: str) -> None:
        import obstore

        obstore.delete(self.store, f"{folder}/{marker}")  # no longer a checkpoint from here on
        obstore.delete(self.store, sorted(f"{folder}/{name}" for name in self.sizes(folder)))

    @s3_errors
    def remove(self, path: str) -> None:
        import obstore

        obstore.delete(self.store, path)

    @s3_errors
    def exists(self, path: str) -> bool:
        import obstore
        import obstore.exceptions

        try:
            obstore.head(self.store, path)
        except (FileNotFoundError, obstore.exceptions.NotFoundError):  # head raises the former
            return False
        return True

    @s3_errors
    def local(self, folder: str, target: Path | None = None) -> Path:
        """A local copy of `folder` (at `target`), downloaded once (several ranks of a node may ask at the same time).
        By default the copy is named by the objects' ETags: a folder written again under the same name (a reused
        prefix) is a new copy."""
        listing = self.listing(folder)
        version = hashlib.sha256(json.dumps(sorted((n, m["e_tag"]) for n, m in listing.items())).encode())
        target = target or self.cache / f"{folder}-{version.hexdigest()[:16]}"
        with node_lock(target):
            if not target.is_dir():
                download = target.with_name(f".{target.name}.download")
                shutil.rmtree(download, ignore_errors=True)
                for name in listing:
                    (download / name).parent.mkdir(parents=True, exist_ok=True)
                    stream_to(self.store, f"{folder}/{name}", download / name)
                os.replace(download, target)
        return target

    def describe(self, folder: str = "") -> str:
        return f"{self.location}/{folder}" if folder else str(self.location)

    @s3_errors
    def publish(self, local: Path, path: str) -> None:
        import obstore

        files = sorted(file for file in local.rglob("*") if file.is_file()) if local.is_dir() else [local]
        for file in files:
            obstore.put(self.store, f"{path}/{file.relative_to(local)}" if local.is_dir() else path, file)

    def publish_new(self, files: list[Path], folder: str) -> None:
        """Upload each of `files` into `folder` unless the bucket has it there at its size. The files are closed ones
        (trainer.tracking.Tracker.seal_events), never written again, but for the one still open at the end's upload,
        after which nothing is uploaded: the folder is listed at the first call, and a file found there or put since
        is not looked at again. So a run that adds a file at every checkpoint does not list the bucket's, nor stat
        its own, at every checkpoint."""
        if not files:
            return
        first = folder not in self.published
        if first:
            self.published[folder] = self.sizes(folder)
        known = self.published[folder]
        for file in files:
            if not first and file.name in known:
                continue
            size = file.stat().st_size
            if known.get(file.name) != size:
                self.publish(file, f"{folder}/{file.name}")
                known[file.name] = size

    def check(self, writable: bool) -> None:
        """SpecError naming checkpoint.dir when the bucket cannot be listed (missing, refused credentials) or, with
        `writable`, written, StorageUnreachable when no server answers: before any training."""
        try:
            self.names()
            if writable:
                probe = f".write-test-{os.getpid()}"
                self.write_text(probe, "ok")
                self.remove(probe)
        except StorageUnreachable as exc:
            raise StorageUnreachable(
                errno.EIO, f"training.checkpoint.dir: cannot reach {self.location}: {exc.strerror}"
            ) from None
        except OSError as exc:
            raise SpecError(f"training.checkpoint.dir: cannot use {self.location}: {exc.strerror}") from None


def open_store(location: str | None, run_dir: Path) -> Store:
    """The store of `checkpoint.dir`: the bucket when it is an s3:// URI (`run_dir` then its local cache)."""
    if is_s3(location):
        return S3Store(S3Location.parse(str(location)), run_dir / ".downloads")
    return LocalStore(run_dir)


def run_dir_of(spec: CheckpointSpec, task: str) -> Path:
    """Where this process writes the run directory: `checkpoint.dir`, ./runs/<task> by default, or the node-local
    cache of an s3:// one."""
    if is_s3(spec.dir):
        return run_cache(S3Location.parse(str(spec.dir)))
    return Path(spec.dir or Path("runs") / task).absolute()


# Glob characters in an s3:// data URI: its objects are then those of the prefix before the first one that match it.
GLOB = re.compile(r"[*?\[]")


@s3_errors
def matching_objects(store: obstore.store.S3Store, pattern: str) -> list[ObjectMeta]:
    """The objects a data URI's key names: that object, every object under it as a folder, or those its glob
    matches, as a local path, folder or glob names files (trainer.text.expand_paths)."""
    import obstore
    import obstore.exceptions

    if glob := GLOB.search(pattern):
        prefix = pattern[: glob.start()].rpartition("/")[0]
    else:
        prefix = pattern.rstrip("/")
        if prefix and prefix == pattern:  # an object's key: the client lists a prefix as a folder, never its object
            with contextlib.suppress(FileNotFoundError, obstore.exceptions.NotFoundError):  # head raises the former
                return [obstore.head(store, prefix)]
        pattern = f"{prefix}/**" if prefix else "**"  # a folder names its files as a `**` glob, as a local one does
    parts = pattern.split("/")
    listed = obstore.list(store, prefix or None)
    return [meta for batch in listed for meta in batch if glob_matches(parts, meta["path"].split("/"))]


def glob_matches(parts: list[str], names: list[str]) -> bool:
    """Whether a key's folder and file names match a glob's parts as Python's `glob(recursive=True)` matches a
    local path: `*`, `?` and `[...]` within one name, `**` any folders (none too) or, last, any files under them,
    and a wildcard never a hidden name (`.git`), so a folder of a bucket names what the same folder on disk would."""
    if not parts:
        return not names
    part, rest = parts[0], parts[1:]
    if part == "**":
        visible = 0  # how many of the leading names `**` may stand for
        while visible < len(names) and names[visible][:1] not in ("", "."):
            visible += 1
        if not rest:
            return visible == len(names) > 0
        return any(glob_matches(rest, names[skipped:]) for skipped in range(visible + 1))
    if not names or not names[0] or (names[0].startswith(".") and not part.startswith(".")):  # "": a folder's key
        return False
    return fnmatch.fnmatchcase(names[0], part) and glob_matches(rest, names[1:])


@s3_errors
def download(store: obstore.store.S3Store, meta: ObjectMeta, target: Path) -> Path:
    """`target`, downloaded unless this node has it already (the same size and modification time as the object,
    which the copy keeps): one process of the node downloads it while the others wait for it."""
    mtime_ns = int(meta["last_modified"].timestamp() * 1e9)

    def present() -> bool:
        with contextlib.suppress(OSError):
            info = target.stat()
            return info.st_size == meta["size"] and info.st_mtime_ns == mtime_ns
        return False

    with node_lock(target):
        if not present():
            partial = target.with_name(f".{target.name}.part")
            stream_to(store, meta["path"], partial)
            os.utime(partial, ns=(mtime_ns, mtime_ns))
            os.replace(partial, target)
    return target


def s3_source(bucket: str, prefix: str = "") -> Path:
    """Where this node's cache keeps the objects of `bucket` under `prefix` (a folder's mirror)."""
    return sources_cache() / bucket / prefix


def s3_sources(uri: str, key: str) -> list[Path]:
    """The local copies of the objects a data URI names (`s3://bucket/file`, `s3://bucket/prefix/`, or a glob),
    each downloaded once into this node's cache (sources/<bucket>/<key>); a restart finds them there, so the
    prepared dataset's fingerprint (path, size, modification time) is the same on every node and every start."""
    try:
        location = S3Location.parse(uri)
    except ValueError as exc:
        raise SpecError(f"{key}: {exc}") from None
    store = s3_client(location.bucket)
    root = s3_source(location.bucket)
    try:
        objects = matching_objects(store, location.prefix)
        if not objects:
            raise SpecError(f"{key}: no object matches {uri!r}")
        return [download(store, meta, root / meta["path"]) for meta in objects]
    except StorageUnreachable as exc:
        raise StorageUnreachable(errno.EIO, f"{key}: cannot reach {uri}: {exc.strerror}") from None
    except OSError as exc:
        raise SpecError(f"{key}: cannot read {uri}: {exc.strerror}") from None
