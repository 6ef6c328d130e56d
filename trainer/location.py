"""Run locations on object storage: `s3://bucket/prefix` URIs, parsed without any client (ctl checks them too)."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

S3_SCHEME = "s3://"
# Where a node keeps what it has of object storage (~/.cache/ddpjob unless set): runs/<bucket>/<prefix>, the local
# side of runs, and sources/<bucket>/<key>, the data files downloaded once.
NODE_CACHE_ENV = "DDPJOB_NODE_CACHE"
# A run on object storage (storage.uri): the standard AWS variables the chart sets from storage.endpoint,
# storage.region and the keys of storage.secretName, which the S3 client reads (trainer/storage.py).
S3_ENDPOINT_ENV = "AWS_ENDPOINT_URL"
S3_REGION_ENV = "AWS_REGION"
S3_ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
S3_SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
# PEM certificates of the CA(s) that signed the endpoint's certificate (a private CA), trusted beside the system's;
# the chart sets it to its file of storage.caBundle (a key of the job's ConfigMap).
S3_CA_BUNDLE_ENV = "AWS_CA_BUNDLE"
PEM_CERTIFICATE = "-----BEGIN CERTIFICATE-----"
# Every variable of the S3 client that the chart may set.
S3_VARIABLES = (S3_ENDPOINT_ENV, S3_REGION_ENV, S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, S3_CA_BUNDLE_ENV)
# S3's bucket naming rules (3-63 characters of lower-case letters, digits, dots and hyphens).
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def is_s3(location: str | None) -> bool:
    return bool(location) and str(location).startswith(S3_SCHEME)


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # without leading or trailing slashes; "" for the bucket's root

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        """`s3://bucket/prefix`, or ValueError (the spec models check every URI they accept with it)."""
        bucket, _, prefix = uri.removeprefix(S3_SCHEME).partition("/")
        if not uri.startswith(S3_SCHEME) or not BUCKET.fullmatch(bucket) or "//" in prefix:
            raise ValueError(f"{uri!r} is not an S3 URI of the form s3://bucket/prefix (with a valid bucket name)")
        if {".", ".."} & set(prefix.split("/")):  # a key's own name in S3, which the client refuses
            raise ValueError(f"{uri!r}: an S3 key has no '.' or '..' folders")
        return cls(bucket, prefix.strip("/"))

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}".rstrip("/")


def node_cache() -> Path:
    return Path(os.environ.get(NODE_CACHE_ENV, Path.home() / ".cache" / "ddpjob"))


def sources_cache() -> Path:
    """Where this node keeps the data files it downloaded: sources/<bucket>/<key>."""
    return node_cache() / "sources"


def source_name(path: Path | str) -> str:
    """A data file as the user named it: the s3:// URI of a copy in this node's cache, else the path itself."""
    with contextlib.suppress(ValueError):
        return f"{S3_SCHEME}{Path(path).absolute().relative_to(sources_cache().absolute())}"
    return str(path)


def run_cache(location: S3Location) -> Path:
    """The node-local side of a run on S3: what the trainer writes before uploading (TensorBoard events, the export,
    `ctl run`'s logs) and the checkpoints it downloaded."""
    return node_cache() / "runs" / location.bucket / location.prefix
