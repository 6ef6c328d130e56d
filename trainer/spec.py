"""The `training:` section of a job spec: the trainer's whole input.

Torch-free on purpose: `ctl` imports it to validate specs before anything runs.
Keys are camelCase (as Helm and Kubernetes users write them); unknown keys are errors.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from trainer.location import S3Location
from trainer.names import EXIT_HUNG, GPT2_POSITIONS, RENDERED_BY_ENV


class SpecError(ValueError):
    """Bad input: one line naming the key (or file) and the problem."""


class KeyProblem(ValueError):
    """A model validator's problem with one of the model's keys (dotted, camelCase): the line names that key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key


# Every number and every flag of the spec is YAML's own: not a quoted "2", "0.002" or "true", not true as 1 (Python's
# bool is an int), as values.schema.json's "integer", "number" and "boolean" refuse them for helm. A whole number
# is a number (lr: 1).
Int = Annotated[int, Strict()]
Number = Annotated[float, Strict()]
Flag = Annotated[bool, Strict()]
# And every integer fits an int32 (SpecModel checks it; values.schema.json says it), as the API server's fields and
# Helm need: beyond int64 Helm wrapped it (a grace period of -9223372036854775808 s) or wrote 1e+23, which YAML reads
# back as text. Not a bound in `Int`: pydantic then ignores a field's own bounds.
INT_MIN, INT_MAX = -(2**31), 2**31 - 1


class SpecModel(BaseModel):
    """Base for every spec section: camelCase keys, unknown keys rejected, no infinite or NaN number anywhere, no
    integer beyond an int32."""

    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _integers_fit_an_int32(self) -> SpecModel:
        for name, value in self:
            if type(value) is int and not INT_MIN <= value <= INT_MAX:
                key = type(self).model_fields[name].alias or name
                raise KeyProblem(key, f"{value} is beyond an int32's range ({INT_MIN} to {INT_MAX})")
        return self

    def to_values(self) -> dict[str, Any]:
        """The section as plain YAML-ready data with camelCase keys."""
        return self.model_dump(by_alias=True, mode="json")


def not_default(section: BaseModel, names: tuple[str, ...]) -> str | None:
    """The key (camelCase) of the first of `names`, fields of `section`, that holds other than its default: a key
    given where another one makes it moot. By value, not by what was written: the chart writes every default into
    training.yaml."""
    fields = type(section).model_fields
    return next((fields[name].alias or name for name in names if getattr(section, name) != fields[name].default), None)


# The spec's patterns, each with what it asks for in words: an error names that, not the regular expression.
PATTERN_MEANINGS: dict[str, str] = {}


def pattern(regex: str, meaning: str) -> str:
    """`regex`, a field's pattern, whose error says the value `is not <meaning>`."""
    PATTERN_MEANINGS[regex] = meaning
    return regex


# An S3 endpoint URL (AWS_ENDPOINT_URL, storage.endpoint) the client can use: it panicked on a port beyond 65535,
# an empty host or a blank, rather than failing a request.
PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
ENDPOINT_URL = pattern(
    rf"^(https?://(\[[0-9A-Fa-f:.]+\]|[^\s/?#:@\[\]]+)(:{PORT})?(/\S*)?)?$",
    "an http:// or https:// URL with a host and an optional port from 1 to 65535, e.g. https://s3.example.com",
)


def written_as_s3(value: str | None) -> bool:
    """`s3:` in any case: meant as an S3 URI, even where it is not a valid one."""
    return bool(value) and value[:3].lower() == "s3:"


def s3_checked(value: str | None) -> str | None:
    """A value written as an S3 URI must be a valid one: `S3://b/x` or `s3:/b/x` would be a local path of that name,
    and a bad bucket name a failure of every rank, not a spec's."""
    if written_as_s3(value):
        S3Location.parse(value)
    return value


def not_from_home(value: str) -> str:
    """`~` is a shell's: in a spec's path it was a folder named `~` (and in a pod there is no user's home anyway)."""
    if value.startswith("~"):
        raise ValueError(
            f"{value!r} starts with ~, which a spec does not expand (its pods have no home of yours):"
            " write the whole path"
        )
    return value


# A path, directory, glob or s3:// URI: never empty or blank, which match nothing (or a file of that name in
# the current directory: one nobody means).
Source = Annotated[
    str,
    Field(pattern=pattern(r"\S", "a file, directory, glob or s3:// URI")),
    AfterValidator(s3_checked),
    AfterValidator(not_from_home),
]
# A path of the trainer's own; empty is the default.
PathText = Annotated[
    str, Field(pattern=pattern(r"^$|\S", "a path, or empty for the default")), AfterValidator(not_from_home)
]


class ModelSpec(SpecModel):
    """A GPT-2 model: a pretrained directory (or hub id), a named GPT-2 size, or the dimensions below."""

    pretrained: PathText | None = Field(
        None, description="Directory for from_pretrained (a hub id only when the network allows it)."
    )
    size: Literal["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"] | None = Field(
        None, description="A GPT-2 size built from its config with random weights."
    )
    n_layer: Int = Field(4, ge=1, description="Transformer blocks (without pretrained/size).")
    n_head: Int = Field(4, ge=1, description="Attention heads per block (without pretrained/size).")
    n_embd: Int = Field(128, ge=1, description="Embedding width, a multiple of nHead (without pretrained/size).")
    block_size: Int = Field(
        128,
        ge=2,
        description="Context length: the packing block (LM) or truncation length; at most the model's positions"
        " (1024 for a named size).",
    )
    dropout: Number = Field(0.0, ge=0.0, lt=1.0, description="Dropout on embeddings, attention and MLP.")

    @field_validator("block_size")
    @classmethod
    def _fits_the_size(cls, block_size: int, info: ValidationInfo) -> int:
        size = info.data.get("size")
        if size and block_size > GPT2_POSITIONS:
            raise ValueError(f"{block_size} is more than the {GPT2_POSITIONS} positions of {size}")
        return block_size

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.pretrained and self.size:
            raise ValueError("set either pretrained or size, not both")
        if self.n_embd % self.n_head:
            raise ValueError(f"nEmbd ({self.n_embd}) must be a multiple of nHead ({self.n_head})")
        return self


class TokenizerSpec(SpecModel):
    """causal-lm / classification: a tokenizer directory, or one trained here on the training text."""

    path: PathText | None = Field(
        None, description="Tokenizer directory (or hub id); default: model.pretrained, else train one."
    )
    vocab_size: Int = Field(2048, ge=260, description="Vocabulary of the byte-level BPE trained on the training text.")


def label_text(value: Any) -> Any:
    """A number as written ([0, 1] as the rows' 0 and 1 are "0", "1"). YAML reads yes/no/on/off/true/false unquoted
    as booleans: never what a label list means to say."""
    if isinstance(value, bool):
        raise ValueError("a YAML boolean (yes, no, on, off, true or false unquoted), not a label: quote it")
    return str(value) if isinstance(value, int | float) else value


SOURCE_LISTS = ("train", "val", "test")  # DataSpec's lists of sources, which also take a single one
# A label as the data's rows hold it: a string, or a number as written.
Label = Annotated[str, BeforeValidator(label_text), WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "number"}]})]


class DataSpec(SpecModel):
    """Where the examples come from. Paths are globs; `{stdlib}` expands to Python's standard library."""

    builtin: Literal["stdlib-docstrings"] | None = Field(
        None, description="classification: a dataset built offline from Python's standard library docstrings."
    )
    train: list[Source] = Field(
        default_factory=list,
        description="Training files: paths, directories (the files under one), globs (`**` recurses, into each folder"
        " once however many links lead there), or s3:// URIs (an object, a prefix ending in /, or a glob), downloaded"
        " once into the node's cache. A file is read once, however many of these name it (a link, another spelling).",
    )
    val: list[Source] = Field(default_factory=list, description="Validation files; empty: split off the end of train.")
    test: list[Source] = Field(default_factory=list, description="classification: files for the final report.")
    val_fraction: Number = Field(0.1, gt=0.0, lt=0.5, description="Share of train held out when `val` is empty.")
    text_field: str = Field(
        "text", min_length=1, description="The rows' field holding the text (JSONL, JSON, CSV, TSV, Parquet, Arrow)."
    )
    label_field: str = Field("label", min_length=1, description="classification: the rows' field holding the label.")
    labels: list[Label] | None = Field(
        None,
        min_length=2,
        description="classification: label set, e.g. [negative, positive] or [0, 1]; default: from train.",
    )
    cache_dir: PathText | None = Field(
        None,
        description="Dataset cache: prepared token files, one directory per fingerprint, shared by runs and jobs."
        " Default: `_datasets` next to the run directory (<storage.mountPath>/_datasets in a cluster).",
    )
    on_bad_file: Literal["error", "skip"] = Field(
        "error",
        description="A file that cannot be read, is not UTF-8 or has a bad row: error (exit 2), or skip it"
        " (counted, the first names logged).",
    )
    fingerprint: Literal["metadata", "content"] = Field(
        "metadata",
        description="What identifies the sources in the cache: size and modification time, or a hash of their"
        " contents (reads every file at each start).",
    )
    prepare_workers: Int = Field(
        0,
        ge=0,
        description="Processes that tokenize during preparation; 0: one per CPU it may use (in a pod, its CPU limit).",
    )
    prepare_buffer_mib: Int = Field(
        256,
        ge=1,
        alias="prepareBufferMiB",
        description="Text in flight during preparation (MiB): bounds its memory, whatever the corpus size.",
    )

    @model_validator(mode="before")
    @classmethod
    def _single_path_is_a_list(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: [v] if k in SOURCE_LISTS and isinstance(v, str) else v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if bool(self.train) == bool(self.builtin):
            raise ValueError("set train (files or globs) or builtin, one of the two")
        if self.val and (given := not_default(self, ("val_fraction",))):
            raise KeyProblem(given, "only without val: the validation split is val's files")
        return self

    @field_validator("cache_dir")
    @classmethod
    def _cache_on_the_node(cls, cache_dir: str | None) -> str | None:
        # It was taken as a local path: a folder named s3: in the working directory, on a pod's scratch disk.
        if written_as_s3(cache_dir):
            raise ValueError(
                f"{cache_dir!r} is an S3 URI; the dataset cache is a folder on each node (a run in a bucket shares its"
                " prepared datasets there, beside its run directory): leave cacheDir unset"
            )
        return cache_dir

    @field_validator("labels")
    @classmethod
    def _each_label_once(cls, labels: list[str] | None) -> list[str] | None:
        # A class listed twice would be two outputs of the model, one of them never a target.
        if twice := next((label for i, label in enumerate(labels or ()) if label in labels[:i]), None):
            raise ValueError(f"{twice!r} is listed twice")
        return labels


Beta = Annotated[Number, Field(ge=0.0, lt=1.0)]


class OptimizerSpec(SpecModel):
    """AdamW (fused)."""

    lr: Number = Field(1e-3, gt=0.0, description="Peak learning rate.")
    weight_decay: Number = Field(0.1, ge=0.0, description="Decoupled weight decay on matrices (not on biases/norms).")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="Adam betas, each in [0, 1).")
    eps: Number = Field(1e-8, gt=0.0, description="Adam epsilon.")


class ScheduleSpec(SpecModel):
    """Linear warmup, then cosine decay to `minLrRatio x lr` at the last step."""

    warmup_steps: Int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    min_lr_ratio: Number = Field(0.1, ge=0.0, le=1.0, description="Final learning rate as a share of the peak.")


class CheckpointSpec(SpecModel):
    """The run directory: checkpoints `step-<N>/`, the final export and the report land here."""

    dir: PathText | None = Field(
        None,
        description="Run directory. Default: ./runs/<name> for `ctl run`, <storage.mountPath>/<name> in a cluster;"
        " there, a folder under storage.mountPath or an s3:// URI (any other path is lost with each pod).",
    )
    every: Int = Field(500, ge=0, description="Save a checkpoint every N steps and at the end; 0: only at the end.")
    keep_last: Int = Field(3, ge=1, description="Newest checkpoints kept; older ones go once a new one is committed.")
    keep_best: Flag = Field(
        True,
        description="Also keep the checkpoint with the lowest validation loss, evaluated at each save as a periodic"
        " evaluation is (evalBatches): every checkpoint, the last one included, is ranked by the same estimate.",
    )
    async_save: Flag = Field(
        False, description="Write checkpoints from a background thread while training goes on (state copied first)."
    )
    allow_config_change: Flag = Field(
        False, description="Resume even when training settings differ from the checkpoint's (otherwise an error)."
    )

    _s3_uri = field_validator("dir")(s3_checked)


class TimeoutsSpec(SpecModel):
    """How long a rank waits before a stuck job is called hung; see docs/hangs.md."""

    collective_seconds: Int = Field(
        300,
        ge=10,
        description="Process-group timeout of the collectives on the step path (gradient all-reduce, log and"
        " evaluation reductions) from the second step on: a backstop behind the watchdog.",
    )
    long_work_seconds: Int = Field(
        1800,
        ge=10,
        description="Bound for one-off work: joining the process group, the first step (compile, warm-up),"
        " checkpoint saves, evaluations, and the barriers around them, which run on a process group of their own"
        " with this timeout.",
    )
    prepare_stall_seconds: Int = Field(
        1800,
        ge=10,
        description="How long training pods wait for a prepare Job (prepare.enabled) that shows no progress before"
        " they give up.",
    )
    watchdog: Flag = Field(
        True,
        description="Every rank watches for steps that stop completing, names the ranks behind, dumps its"
        f" Python stacks and exits {EXIT_HUNG} (retryable) so the pods restart and resume from the last checkpoint.",
    )
    hang_factor: Number = Field(
        10.0, ge=2.0, description="Watchdog: the job is hung when no step completed for this many recent step times."
    )
    hang_floor_seconds: Int = Field(
        120, ge=2, description="Watchdog: never call the job hung sooner than this after the last completed step."
    )


class SampleSpec(SpecModel):
    """Text generated by rank 0 from the final model (char-gpt)."""

    prompt: str = Field("\n", min_length=1, description="Text the sample starts from (at least one character).")
    max_new_tokens: Int = Field(300, ge=0, description="Tokens to generate; 0 disables the sample.")
    temperature: Number = Field(0.8, gt=0.0, description="Sampling temperature.")
    top_k: Int = Field(40, ge=1, description="Sample from the k most likely tokens.")


class TrainingSpec(SpecModel):
    """Everything the trainer needs; mounted as training.yaml in a pod."""

    task: Literal["char-gpt", "causal-lm", "classification"] = Field(
        "char-gpt",
        description="char-gpt: a GPT from scratch on characters; causal-lm: GPT-2 on text;"
        " classification: a GPT-2 document classifier.",
    )
    model: ModelSpec = Field(default_factory=ModelSpec)
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    data: DataSpec
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 autocast on GPUs that support it, fp32 otherwise; fp16 uses a GradScaler."
    )
    compile: Flag = Field(
        False,
        description="Wrap the model in torch.compile. On the cluster, with the run directory on the volume, each pod"
        " keeps torch.compile's caches there (compile-cache/<pod>/), so a recreated pod does not compile again.",
    )
    epochs: Int = Field(1, ge=1, description="Passes over the training data (when maxSteps is not set).")
    max_steps: Int | None = Field(None, ge=1, description="Optimizer steps; overrides epochs.")
    batch_size: Int = Field(16, ge=1, description="Sequences per process per micro-step.")
    grad_accum: Int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    grad_clip: Number = Field(1.0, ge=0.0, description="Max global grad norm; 0 disables clipping.")
    eval_every: Int = Field(0, ge=0, description="Evaluate every N steps; 0: only at the end.")
    eval_batches: Int = Field(
        0,
        ge=0,
        description="Global batches (world size x batchSize examples) a periodic evaluation (evalEvery, an epoch's"
        " end, a checkpoint's keepBest) scores, spread evenly over the validation split: an estimate, like"
        " nanoGPT's eval_iters; 0: the whole split. The final evaluation always scores the whole split.",
    )
    log_every: Int = Field(10, ge=1, description="Rank 0 logs a line every N steps.")
    seed: Int = Field(1337, description="Seed for init, data order and sampling.")
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers rank 0 reports to: tensorboard (event files in `<run dir>/tensorboard`),"
        " mlflow, wandb; [] for none. MLflow and W&B read their own environment (MLFLOW_TRACKING_URI,"
        " WANDB_API_KEY, WANDB_PROJECT...): set it with `env`/`envFrom`, secrets by reference.",
    )
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    timeouts: TimeoutsSpec = Field(default_factory=TimeoutsSpec)
    sample: SampleSpec = Field(default_factory=SampleSpec)

    @model_validator(mode="after")
    def _fits_the_task(self) -> TrainingSpec:
        if self.task != "classification":
            given = next((key for key in ("builtin", "test", "labels") if getattr(self.data, key)), None)
            if misplaced := given or not_default(self.data, ("label_field",)):
                raise KeyProblem(f"data.{misplaced}", "only for task classification")
        elif self.data.label_field == self.data.text_field:
            raise KeyProblem(
                "data.labelField", f"{self.data.label_field!r} is textField too: the label would be the text"
            )
        if self.task == "char-gpt" and (self.model.pretrained or self.model.size):
            raise KeyProblem("model", "char-gpt trains from scratch: no pretrained or size")
        # A named size's or pretrained model's own config sets these: a value given here would be ignored.
        model = self.model
        if (model.pretrained or model.size) and (given := not_default(model, ("n_layer", "n_head", "n_embd"))):
            config = f"{model.size}'s config" if model.size else "the pretrained model's config"
            raise KeyProblem(f"model.{given}", f"only without pretrained or size: {config} sets it")
        if self.task == "char-gpt" and self.tokenizer != TokenizerSpec():
            raise KeyProblem("tokenizer", "char-gpt's vocabulary is its text's characters: no tokenizer to set")
        return self


def describe_validation_error(error: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line for the first problem of validating `model`: `dotted.key: what is wrong` (+ how many more)."""
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    own = cause.key.split(".") if isinstance(cause, KeyProblem) else []
    loc = first["loc"]
    of_key = loc[-1:] == ("[key]",)  # a mapping's own key: pydantic's loc ends with the key and "[key]"
    if of_key:
        loc = loc[:-2]
    key = ".".join(str(part) for part in (prefix, *loc, *own) if part != "")
    if first["type"] == "extra_forbidden":
        *within, unknown = first["loc"]
        problem = "unknown key" + did_you_mean(str(unknown), known_keys(model, within))
    elif first["type"] == "missing" and isinstance(loc[-1], int):  # an item of a fixed-length list (betas)
        key = key.rpartition(".")[0]
        wanted = items_wanted(model, loc[:-1])
        problem = f"expected a list of exactly {wanted} items, not {len(first['input'])}"
    elif first["type"] == "missing":
        problem = "required key is missing"
    elif first["type"] == "too_short" and first["ctx"]["field_type"] == "List":
        problem = f"expected a list of at least {first['ctx']['min_length']} items, not {first['ctx']['actual_length']}"
    elif first["type"] == "too_long" and first["ctx"]["field_type"] == "Tuple":
        problem = f"expected a list of exactly {items_wanted(model, loc)} items, not {first['ctx']['actual_length']}"
    elif first["type"] == "string_type" and isinstance(read := first["input"], int | float):  # bool too
        problem = not_text(read)
    elif first["type"] in WANTED:
        problem = not_of_kind(first["type"], first["input"])
    elif first["type"] == "string_pattern_mismatch" and first["ctx"]["pattern"] in PATTERN_MEANINGS:
        what = f"key {first['input']!r}" if of_key else repr(first["input"])
        problem = f"{what} is not {PATTERN_MEANINGS[first['ctx']['pattern']]}"
    else:
        problem = first["msg"].removeprefix("Value error, ")
    if of_key and not problem.startswith("key "):
        problem = f"key {first['input']!r}: {problem}"
    more = error.error_count() - 1
    line = f"{key}: {problem}" if key else problem
    return line + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def error_path(error: ValidationError) -> tuple[str, ...]:
    """Where the first problem of `error` is: its location (a mapping's own key included), and a model validator's
    key within it."""
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    own = cause.key.split(".") if isinstance(cause, KeyProblem) else []
    return tuple(str(part) for part in (*first["loc"], *own) if part != "[key]")


def not_text(read: float) -> str:
    """The problem with a number or boolean (YAML's reading of an unquoted 1.10, true, 0755) where text belongs."""
    what = "boolean" if isinstance(read, bool) else "number"
    return f"expected text, but YAML read {json.dumps(read)} as a {what}: quote it"


# What a key takes, in words, by pydantic's error type for a value of another kind; with the type that YAML reads
# unquoted as one (a quoted "2" or "true").
WANTED: dict[str, tuple[str, tuple[type, ...]]] = {
    "int_type": ("a whole number", (int,)),
    "bool_type": ("true or false", (bool,)),
    "float_type": ("a number", (int, float)),
    "string_type": ("text", ()),  # a number or a boolean has its own line (not_text): this is null, a list...
    "list_type": ("a list", ()),
    "tuple_type": ("a list", ()),
    "dict_type": ("a mapping of keys", ()),
    "model_type": ("a mapping of keys", ()),
}


def not_of_kind(error_type: str, read: Any) -> str:
    """The problem with a value of another YAML kind than its key takes: quoted, a boolean, a number, null..."""
    wanted, kinds = WANTED[error_type]
    if isinstance(read, str):
        with contextlib.suppress(yaml.YAMLError):
            unquoted = read_yaml(read)
            if type(unquoted) in kinds:  # bool is int's subclass: "true" is no whole number
                return f"expected {wanted}, but {read!r} is quoted: YAML reads it as text"
        return f"expected {wanted}, not the text {read!r}"
    if isinstance(read, bool):
        return f"expected {wanted}, but YAML read {json.dumps(read)} as a boolean"
    if isinstance(read, int | float):
        return f"expected {wanted}, not the number {read!r}"
    return f"expected {wanted}, not {YAML_KINDS.get(type(read), type(read).__name__)}"


YAML_KINDS = {type(None): "null", list: "a list", dict: "a mapping"}


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """` (did you mean X?)` for the closest of `choices` to a mistyped `word`; nothing when none is close."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def known_keys(model: type[BaseModel], loc: Sequence[str | int]) -> list[str]:
    """The keys of the mapping at `loc` within `model`, as a spec writes them; none where that is no model."""
    for part in loc:
        if isinstance(part, int):  # an item of a list of models
            continue
        field = next((f for name, f in model.model_fields.items() if (f.alias or name) == part), None)
        inner = [t for t in nested_types(field.annotation) if is_model(t)] if field is not None else []
        if not inner:
            return []
        model = inner[0]
    return [field.alias or name for name, field in model.model_fields.items()]


def is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def items_wanted(model: type[BaseModel], loc: Sequence[str | int]) -> int:
    """How many items the fixed-length list (a tuple) at `loc` within `model` takes."""
    field = None
    for part in loc:
        if isinstance(part, int):  # an item of a list of models
            continue
        if field is not None:  # the model the last key holds
            model = next(t for t in nested_types(field.annotation) if is_model(t))
        field = next(f for name, f in model.model_fields.items() if (f.alias or name) == part)
    assert field is not None
    return len(get_args(field.annotation))


def nested_types(annotation: Any) -> list[Any]:
    """`annotation` and every type inside it (`Model | None`, `list[Model]`, `Annotated[...]`)."""
    return [annotation, *(t for arg in get_args(annotation) for t in nested_types(arg))]


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Parse a YAML file that must hold a mapping; every failure is a SpecError."""
    return parse_yaml_mapping(read_spec_text(path), str(path))


def read_spec_text(path: Path) -> str:
    """A spec file's text; every failure is a SpecError."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: a directory, not a file") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror or exc}") from None


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML would keep the last silently (a second
    `training:` drops the first's keys), where helm's and kubectl's parsers refuse the file. It reads numbers as
    they do (below)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            with contextlib.suppress(TypeError):  # an unhashable key: the loader's own error follows
                if key in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {lines[key] + 1})", key_node.start_mark
                    )
                lines[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


# A number with an exponent and no dot (3e-4; 1e-08 as Helm's toYaml writes it), or no sign in its exponent: text to
# PyYAML's YAML 1.1, a number to YAML 1.2, Helm and kubectl, and so to every spec here (a number key refuses text).
UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"), list("-+.0123456789")
)


def read_yaml(text: str) -> Any:
    """One YAML value as the specs read it (UniqueKeyLoader)."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def parse_yaml_mapping(text: str, name: str) -> dict[str, Any]:
    """Parse YAML text that must hold a mapping; every failure is a SpecError naming where the text came from."""
    try:
        data = read_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", exc)
        if problem == "but found another document":  # PyYAML's sentence begins in its context
            problem = "a second document (---): a spec is one mapping"
        raise SpecError(f"{name}{where}: invalid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{name}: expected a mapping of keys at the top level")
    return data


def load_training_spec(path: Path) -> TrainingSpec:
    """Read the mounted training.yaml (the `training:` section of a job spec). A spec the chart of another ddpjob
    rendered that this trainer refuses (most often a newer one's key) names both versions."""
    try:
        return TrainingSpec.model_validate(read_yaml_mapping(path))
    except ValidationError as exc:
        raise SpecError(f"{path}: {describe_validation_error(exc, TrainingSpec, 'training')}{versions()}") from None


def versions() -> str:
    """The versions of the chart that rendered the job and of this trainer, where they differ."""
    from importlib.metadata import PackageNotFoundError, version

    rendered_by = os.environ.get(RENDERED_BY_ENV)
    try:
        own = version("ddpjob")
    except PackageNotFoundError:  # the sources alone, not installed: no version to compare
        return ""
    if not rendered_by or rendered_by == own:
        return ""
    return (
        f" (the job was rendered by ddpjob {rendered_by}'s chart, and this trainer is ddpjob {own}: run the image"
        f" of {rendered_by}, or render the job with ctl {own})"
    )
