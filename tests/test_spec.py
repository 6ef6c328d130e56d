"""The job spec: examples load; bad specs and flags get one clear line and exit 2, and nothing is created."""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, run_ctl, tiny_spec
from pydantic import BaseModel

from ctl.schema import spec_reference
from ctl.spec import JobSpec, apply_overrides, load_spec, merge_values, read_overrides
from trainer.names import RENDERED_BY_ENV
from trainer.spec import OptimizerSpec, SpecError, load_training_spec, nested_types

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(example: Path) -> None:
    spec = load_spec(example)
    assert isinstance(spec, JobSpec)
    assert spec.training.data.train or spec.training.data.builtin


def test_overrides_are_typed_and_nested() -> None:
    values = apply_overrides(
        {"name": "a", "training": {"data": {"train": "x"}}},
        read_overrides(
            ["nodes=2", "training.maxSteps=50", "training.compile=true", "training.optimizer.betas=[0.9, 0.99]"]
        ),
    )
    spec = JobSpec.model_validate(values)
    assert (spec.nodes, spec.training.max_steps, spec.training.compile) == (2, 50, True)
    assert spec.training.optimizer.betas == (0.9, 0.99)


def test_overrides_take_helms_list_syntax_and_keep_a_values_commas() -> None:
    """`key={a,b}` is a list as in helm (YAML reads a mapping of nulls); a colon makes it YAML's mapping; a value's
    commas are its own unless another key of the spec follows (below: `set-helm-pairs`); `\\.` is a dot in a key."""
    values = apply_overrides(
        {"name": "a", "training": {"task": "classification", "data": {"train": "x"}}},
        read_overrides(
            [
                "training.data.train={a.txt, b.txt}",
                "training.data.labels={neg,1,*}",
                "training.model={nLayer: 2}",
                "training.sample.prompt=Hello, world=1",
                "nodeSelector.kubernetes\\.io/arch=amd64",  # helm's escaped dot: one key
                "training.optimizer.lr=0.5",
                "training.optimizer=null",  # as in helm: back to the default
            ]
        ),
    )
    assert values["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    spec = JobSpec.model_validate(values)
    assert (spec.training.data.train, spec.training.data.labels) == (["a.txt", "b.txt"], ["neg", "1", "*"])
    assert (spec.training.model.n_layer, spec.training.sample.prompt) == (2, "Hello, world=1")
    assert spec.training.optimizer == OptimizerSpec()


def test_a_set_value_is_its_text_where_the_spec_wants_text(tmp_path: Path, corpus_file: Path) -> None:
    """`--set image.tag=1.10` is the tag 1.10, not YAML's number 1.1 (helm needs --set-string for it); `yes` is a
    prompt, not a boolean. The same unquoted in the file is refused (below: `text-read-as-number`)."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(tiny_spec(corpus_file)))
    spec = load_spec(tmp_path / "spec.yaml", ["image.tag=1.10", "training.sample.prompt=yes", "nodes=2"])
    assert (spec.image.tag, spec.training.sample.prompt, spec.nodes) == ("1.10", "yes", 2)
    # The same within a key in Kubernetes form: a label's value, under a label key that has dots of its own.
    label = r"networkPolicy.prometheusPodSelector.matchLabels.example\.com/scraper=true"
    spec = load_spec(tmp_path / "spec.yaml", [label])
    assert spec.network_policy.prometheus_pod_selector["matchLabels"]["example.com/scraper"] == "true"


def test_values_files_layer_over_the_spec_in_order_before_set(tmp_path: Path, corpus_file: Path) -> None:
    """helm's -f: `--values` files merged over the spec in order (mappings key by key, lists and scalars replaced,
    null back to the default), then --set; a problem names the file and line that gave its key."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(tiny_spec(corpus_file, sample={"prompt": "a"})))
    cluster = {"image": {"repository": "registry.example/ddpjob"}, "nodes": 3, "training": {"sample": None}}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    (tmp_path / "team.yaml").write_text(yaml.safe_dump({"nodes": 2, "training": {"maxSteps": 9, "reportTo": []}}))
    layers = [tmp_path / "cluster.yaml", tmp_path / "team.yaml"]
    spec = load_spec(tmp_path / "spec.yaml", ["training.maxSteps=7"], layers=layers)
    assert (spec.image.repository, spec.nodes, spec.training.max_steps) == ("registry.example/ddpjob", 2, 7)
    assert (spec.training.batch_size, spec.training.report_to, spec.training.sample.prompt) == (4, [], "\n")
    assert spec.training.model.n_embd == 32  # the spec's own, under a layered mapping
    (tmp_path / "bad.yaml").write_text("nodes: 0\n")
    flags = ["--values", "cluster.yaml", "--values", "bad.yaml"]
    result = run_ctl("render", "spec.yaml", *flags, cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "error: bad.yaml:1: nodes: Input should be greater than or equal to 1\n"
    rendered = run_ctl("render", "spec.yaml", "--values", "cluster.yaml", cwd=tmp_path)
    assert rendered.returncode == 0 and 'image: "registry.example/ddpjob:' in rendered.stdout, rendered.stderr
    # A null in a values file is checked as a key too; any key goes within a mapping of free keys.
    (tmp_path / "typo.yaml").write_text("training:\n  sampel: null\npodLabels:\n  team: null\n")
    typo = run_ctl("render", "spec.yaml", "--values", "typo.yaml", cwd=tmp_path)
    assert (typo.returncode, typo.stderr) == (
        2,
        "error: typo.yaml:2: training.sampel: unknown key (did you mean sample?)\n",
    )
    assert (
        load_spec(tmp_path / "spec.yaml", ["podLabels.team=null"], layers=[tmp_path / "cluster.yaml"]).pod_labels == {}
    )
    missing = run_ctl("render", "spec.yaml", "--values", "absent.yaml", cwd=tmp_path)
    assert (missing.returncode, missing.stderr) == (2, "error: absent.yaml: no such file\n")
    # Every key commented out: a layer of none, as helm's -f takes it (it was "expected a mapping of keys").
    (tmp_path / "commented.yaml").write_text("# nodes: 4\n")
    assert load_spec(tmp_path / "spec.yaml", layers=[tmp_path / "commented.yaml"]).nodes == 1


def test_spec_round_trips_through_camel_case_values(corpus_file: Path) -> None:
    spec = JobSpec.model_validate(tiny_spec(corpus_file))
    values = spec.to_values()
    assert values["procsPerNode"] == 1 and values["training"]["model"]["blockSize"] == 32
    assert JobSpec.model_validate(values) == spec


LONG_NAME = "a" * 56  # "-worker-0" makes it 65 characters
BAD_SPECS = [
    ("unknown-key", {"nodez": 2}, [], "nodez: unknown key"),
    (
        "unknown-nested-key",
        {"training": {"optimizer": {"lrr": 1}}},
        [],
        "training.optimizer.lrr: unknown key (did you mean lr?)",
    ),
    ("wrong-type", {"nodes": "two"}, [], "nodes: expected a whole number, not the text 'two'"),
    ("section-not-a-mapping", {}, ["--set", "training=5"], "training: expected a mapping of keys, not the number 5"),
    ("labels-as-a-list", {"podLabels": ["team"]}, [], "podLabels: expected a mapping of keys, not a list"),
    # A tuple's missing item was `betas.1: required key is missing`; one too many, pydantic's "Tuple should have...".
    (
        "one-beta",
        {"training": {"optimizer": {"betas": [0.9]}}},
        [],
        "training.optimizer.betas: expected a list of exactly 2 items, not 1",
    ),
    (
        "three-betas",
        {},
        ["--set", "training.optimizer.betas={0.9,0.9,0.9}"],
        "training.optimizer.betas: expected a list of exactly 2 items, not 3",
    ),
    ("text-as-a-list", {"nodeSelector": {"pool": ["a"]}}, [], "nodeSelector.pool: expected text, not a list"),
    # YAML's own kinds, as values.schema.json asks for them: pydantic's lax mode took all of these.
    ("quoted-integer", {"nodes": "2"}, [], "spec.yaml:2: nodes: expected a whole number, but '2' is quoted"),
    (
        "boolean-integer",
        {},
        ["--set", "procsPerNode=true"],
        "procsPerNode: expected a whole number, but YAML read true",
    ),
    ("fraction-integer", {"training": {"maxSteps": 2.0}}, [], "training.maxSteps: expected a whole number, not the"),
    ("quoted-number", {"training": {"optimizer": {"lr": "0.002"}}}, [], "lr: expected a number, but '0.002' is quoted"),
    # Clipping was turned off (false as 0), and yes read as 1.
    ("boolean-number", {}, ["--set", "training.gradClip=false"], "gradClip: expected a number, but YAML read false"),
    ("quoted-beta", {}, ["--set", "training.optimizer.betas={'0.9',0.95}"], "betas.0: expected a number, but '0.9'"),
    ("quoted-boolean", {"training": {"compile": "false"}}, [], "training.compile: expected true or false, but 'false'"),
    ("number-boolean", {}, ["--set", "training.compile=1"], "training.compile: expected true or false, not the number"),
    # Beyond an int32: Helm wrapped such a number (a negative grace period) or wrote 1e+23, which YAML reads as text.
    (
        "beyond-int32",
        {},
        ["--set", "terminationGracePeriodSeconds=99999999999999999999"],
        "--set 'terminationGracePeriodSeconds=99999999999999999999': terminationGracePeriodSeconds:"
        " 99999999999999999999 is beyond an int32's range (-2147483648 to 2147483647)",
    ),
    ("below-int32", {"training": {"seed": -(2**31) - 1}}, [], "spec.yaml:18: training.seed: -2147483649 is beyond"),
    ("nodes-zero", {"nodes": 0}, [], "nodes: Input should be greater than or equal to 1"),
    (
        "tokenizer-for-char-gpt",  # it was ignored, silently
        {"training": {"tokenizer": {"vocabSize": 300}}},
        [],
        "training.tokenizer: char-gpt's vocabulary is its text's characters: no tokenizer to set",
    ),
    # Each was ignored, silently: a key that another one makes moot.
    (
        "dimensions-with-a-size",
        {"training": {"task": "causal-lm", "model": {"size": "gpt2"}}},
        [],
        "training.model.nLayer: only without pretrained or size: gpt2's config sets it",
    ),
    (
        "val-fraction-with-val",
        {"training": {"data": {"val": "val.txt", "valFraction": 0.2}}},
        [],
        "training.data.valFraction: only without val: the validation split is val's files",
    ),
    (
        "label-field-for-char-gpt",
        {},
        ["--set", "training.data.labelField=topic"],
        "--set 'training.data.labelField=topic': training.data.labelField: only for task classification",
    ),
    (
        "label-field-is-text-field",
        {"training": {"task": "classification", "data": {"labelField": "text"}}},
        [],
        "training.data.labelField: 'text' is textField too: the label would be the text",
    ),
    # `~` was a folder of that name in the working directory (or in the pod), and for data, no file matched.
    (
        "home-in-a-run-directory",
        {"training": {"checkpoint": {"dir": "~/runs/tiny"}}},
        [],
        "training.checkpoint.dir: '~/runs/tiny' starts with ~, which a spec does not expand (its pods have no home",
    ),
    (
        "home-in-a-source",
        {},
        ["--set", "training.data.train=~/corpus.txt"],
        "training.data.train.0: '~/corpus.txt' starts with ~, which a spec does not expand",
    ),
    ("procs-zero", {"procsPerNode": 0}, [], "procsPerNode: Input should be greater than or equal to 1"),
    # Both were found only after training: the sample failed to encode nothing (exit 1); the cache was a folder named
    # s3: in the working directory.
    (
        "empty-prompt",
        {"training": {"sample": {"prompt": ""}}},
        [],
        "training.sample.prompt: String should have at least",
    ),
    (
        "cache-in-a-bucket",
        {"training": {"data": {"cacheDir": "s3://bucket/datasets"}}},
        [],
        "training.data.cacheDir: 's3://bucket/datasets' is an S3 URI; the dataset cache is a folder on each node",
    ),
    ("name-not-dns", {"name": "News_Classifier"}, [], "name: 'News_Classifier' is not a DNS-1035 label"),
    ("name-too-long", {"name": LONG_NAME, "nodes": 2}, [], f'name: too long: pod name "{LONG_NAME}-worker-0"'),
    (
        "missing-data-path",
        {"training": {"data": {"train": None}}},
        [],
        "training.data: set train (files or globs) or builtin",
    ),
    ("missing-name", {"name": None}, [], "name: required key is missing"),
    # An empty or blank path would match nothing: refused here, before a trainer rank finds no file for it.
    (
        "empty-source",
        {"training": {"data": {"val": ["val.txt", ""]}}},
        [],
        "training.data.val.1: '' is not a file, directory, glob or s3:// URI",
    ),
    (
        "blank-source",
        {"training": {"data": {"train": " \t"}}},
        [],
        "training.data.train.0: ' \\t' is not a file, directory, glob or s3:// URI",
    ),
    # The trainer's own paths take empty (their default) but not blanks: a run directory named ' '.
    (
        "blank-run-directory",
        {"training": {"checkpoint": {"dir": " "}}},
        [],
        "training.checkpoint.dir: ' ' is not a path, or empty for the default",
    ),
    (
        "text-read-as-number",
        {"image": {"tag": 1.10}},
        [],
        "image.tag: expected text, but YAML read 1.1 as a number: quote it",
    ),
    # A rule across keys names the key it refuses, in full as `--set` takes it.
    (
        "labels-outside-classification",
        {"training": {"data": {"labels": ["a", "b"]}}},
        [],
        "spec.yaml:7: training.data.labels: only for task classification",
    ),
    ("char-gpt-pretrained", {"training": {"model": {"size": "gpt2"}}}, [], "spec.yaml:11: training.model: char-gpt"),
    ("heads", {"training": {"model": {"nEmbd": 30, "nHead": 4}}}, [], "must be a multiple of nHead"),
    ("elastic-range", {"nodes": 5, "elastic": {"enabled": True, "maxNodes": 4}}, [], "elastic: nodes (5)"),
    (
        "bad-task",
        {"training": {"task": "translation"}},
        [],
        "training.task: Input should be 'char-gpt', 'causal-lm' or 'classification'",
    ),
    (
        "val-fraction",
        {"training": {"data": {"valFraction": 0.7}}},
        [],
        "training.data.valFraction: Input should be less",
    ),
    (
        "labels-yaml-boolean",  # `labels: [yes, no]`: YAML's booleans, not the rows' "yes" and "no"
        {"training": {"task": "classification", "data": {"labels": ["maybe", True]}}},
        [],
        "training.data.labels.1: a YAML boolean (yes, no, on, off, true or false unquoted), not a label: quote it",
    ),
    # A required key left out was `None is not a Secret's or ConfigMap's key`.
    (
        "secret-key-missing",
        {"env": [{"name": "FOO", "valueFrom": {"secretKeyRef": {"name": "s"}}}]},
        [],
        "env.0.valueFrom.secretKeyRef.key: missing: a Secret's or ConfigMap's key",
    ),
    ("set-without-value", {}, ["--set", "nodes"], "--set 'nodes': expected dotted.key=value"),
    ("set-into-scalar", {}, ["--set", "nodes.count=2"], "--set 'nodes.count=2': nodes is not a mapping"),
    ("set-bad-value", {}, ["--set", "training.batchSize=-1"], "training.batchSize: Input should be greater"),
    # A flag that makes an unknown key by a key inside it: the spec file was named (with the line of `training:`).
    ("set-inside-unknown-key", {}, ["--set", "trainingg.maxSteps=1"], "error: --set 'trainingg.maxSteps=1': trainin"),
    (
        "set-file-inside-unknown-key",
        {},
        ["--set-file", "training.sampl.prompt=spec.yaml"],
        "error: --set-file 'training.sampl.prompt=spec.yaml': training.sampl: unknown key (did you mean sample?)",
    ),
    # null takes a key back to its default: the key is still checked, or a mistyped one would do nothing, silently.
    (
        "set-null-unknown-key",
        {},
        ["--set", "training.optimizer.lrr=null"],
        "error: --set 'training.optimizer.lrr=null': training.optimizer.lrr: unknown key (did you mean lr?)",
    ),
    (
        "set-helm-pairs",
        {},
        ["--set", "nodes=2,training.maxSteps=3"],
        "--set 'nodes=2,training.maxSteps=3': one key per --set (a value is YAML, commas included):"
        " --set nodes=2 --set training.maxSteps=3",
    ),
    (
        "set-file-missing",
        {},
        ["--set-file", "storage.caBundle=absent.crt"],
        "--set-file 'storage.caBundle=absent.crt': cannot read absent.crt: No such file or directory",
    ),
    ("set-file-without-path", {}, ["--set-file", "storage.caBundle"], "--set-file 'storage.caBundle': expected"),
    # It said that the file's text was quoted.
    (
        "set-file-for-a-number",
        {},
        ["--set-file", "nodes=spec.yaml"],
        "--set-file 'nodes=spec.yaml': nodes: expected a whole number, and --set-file gives a file's text, as helm's"
        " does: use --set",
    ),
    (
        "set-list-item",
        {},
        ["--set", "training.data.train[0]=x.txt"],
        "--set 'training.data.train[0]=x.txt': no list items by index; set the whole list, training.data.train=[a, b]",
    ),
]


def strictness(node: Any, at: str = "") -> Iterator[tuple[str, bool]]:
    """(where, strict) of every integer and boolean in a pydantic core schema, nested models' definitions too."""
    if isinstance(node, dict):
        if node.get("type") in ("int", "float", "bool"):
            yield at, bool(node.get("strict"))
        for key, value in node.items():
            yield from strictness(value, f"{at}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from strictness(value, f"{at}/{index}")


def test_every_number_and_boolean_of_the_spec_is_strict() -> None:
    """A field declared `int`, `float` or `bool`, not trainer.spec's Int, Number or Flag, would take "2" and true for
    numbers again."""
    found = dict(strictness(JobSpec.__pydantic_core_schema__))
    assert len(found) > 60
    assert [at for at, strict in found.items() if not strict] == []


def test_numbers_with_an_exponent_are_numbers_as_helm_reads_them(tmp_path: Path, corpus_file: Path) -> None:
    """`lr: 3e-4` is text to PyYAML (YAML 1.1) and a number to Helm; Helm's toYaml writes 1e-08 into the training
    config the trainer reads. Quoted, it is text, and refused."""
    spec = tmp_path / "spec.yaml"
    values = tiny_spec(corpus_file)
    spec.write_text(
        yaml.safe_dump(values).replace("training:\n", "training:\n  optimizer: {lr: 3e-4, eps: 1e-08}\n", 1)
    )
    loaded = load_spec(spec).training.optimizer
    assert (loaded.lr, loaded.eps) == (3e-4, 1e-8)
    assert load_spec(spec, ["training.optimizer.lr=2E+1"]).training.optimizer.lr == 20.0
    with pytest.raises(
        SpecError, match=re.escape("lr: expected a number, but '1e-3' is quoted: YAML reads it as text")
    ):
        load_spec(spec, ["training.optimizer.lr='1e-3'"])


@pytest.mark.parametrize(("patch", "flags", "message"), [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_is_one_line_and_exit_2(
    tmp_path: Path, corpus_file: Path, patch: dict, flags: list, message: str, ctl_here
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(merge_values(tiny_spec(corpus_file), patch)))
    result = ctl_here("run", str(spec), *flags, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert result.stdout == ""
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("name: [unclosed\n", "spec.yaml:2: invalid YAML: expected ',' or ']'"),
        ("- just\n- a list\n", "expected a mapping"),
        # PyYAML would keep the second silently, dropping the first's keys; helm and kubectl refuse the file.
        (
            "name: a\ntraining: {}\nnodes: 1\ntraining: {}\n",
            "spec.yaml:4: invalid YAML: duplicate key 'training' (first at line 2)",
        ),
        ("name: a\n---\nname: b\n", "spec.yaml:2: invalid YAML: a second document (---): a spec is one mapping"),
    ],
    ids=["invalid-yaml", "not-a-mapping", "duplicate-key", "two-documents"],
)
def test_unreadable_spec_file(tmp_path: Path, content: str, message: str) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(content)
    with pytest.raises(SpecError, match=re.escape(message)):
        load_spec(spec)
    result = run_ctl("run", str(spec), cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr


def test_a_problem_names_the_file_and_line_that_gave_its_key(tmp_path: Path) -> None:
    """As a data file's problems do (`file:line:`); a missing key, the line of the mapping that misses it; a --values
    file over the spec, the file whose value holds (its line, though the spec's is later); a --set, the flag."""
    spec = tmp_path / "spec.yaml"
    text = "# a job\nname: job\nnodes: 1\n\ntraining:\n  task: causal-lm\n  data: {train: [a.txt]}\n  batchSize: 0\n"
    spec.write_text(text)
    with pytest.raises(SpecError, match=re.escape("spec.yaml:8: training.batchSize: Input should be greater")):
        load_spec(spec)
    spec.write_text(text + "env:\n  - name: A\n    value: x\n  - name: B\n    value: 1\n")
    with pytest.raises(SpecError, match=re.escape("spec.yaml:13: env.1.value: expected text, but YAML read 1")):
        load_spec(spec, ["training.batchSize=2"])
    spec.write_text("name: job\ntraining:\n  task: causal-lm\n  maxSteps: 3\n")
    with pytest.raises(SpecError, match=re.escape("spec.yaml:2: training.data: required key is missing")):
        load_spec(spec)
    (tmp_path / "steps.yaml").write_text("training: {maxSteps: 0}\n")
    with pytest.raises(SpecError, match=re.escape("steps.yaml:1: training.maxSteps: Input should be greater")):
        load_spec(spec, ["training.data.train=[a.txt]"], layers=[tmp_path / "steps.yaml"])
    with pytest.raises(SpecError, match=re.escape("--set 'training.maxSteps=-1': training.maxSteps: Input should")):
        load_spec(spec, ["training.data.train=[a.txt]", "training.maxSteps=-1"], layers=[tmp_path / "steps.yaml"])
    # A rule across keys names the key it refuses, in the file that wrote it.
    spec.write_text("name: job\napiKind: TrainJob\ntraining: {data: {train: [a.txt]}}\nrestartPolicy: Always\n")
    with pytest.raises(SpecError, match=re.escape("spec.yaml:4: restartPolicy: Always is not allowed")):
        load_spec(spec)


def test_missing_spec_file(tmp_path: Path) -> None:
    result = run_ctl("run", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'nope.yaml'}: no such file"


def spec_keys(model: type[BaseModel], prefix: str = "") -> dict[str, bool]:
    """Every key of `model` as a spec writes it (dotted, camelCase), with whether it is a section of keys."""
    keys = {}
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        inner = [t for t in nested_types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
        keys[key] = bool(inner)
        for section in inner:
            keys |= spec_keys(section, key + ".")
    return keys


def test_every_key_the_messages_and_docs_name_is_a_key_of_the_spec() -> None:
    """A key named in a message or a page (`training.checkpoint.dir: cannot create ...`, `metrics.podMonitor.enabled`)
    is typed there, not taken from the model: a key renamed or mistyped in one place fails here. In the code the
    trainer's section (`training.` in its messages); in the docs any section's key in backticks. Below a key that
    takes a mapping (labels, affinity) any key goes."""
    keys = spec_keys(JobSpec)
    sections = "|".join(re.escape(key) for key, section in keys.items() if section and "." not in key)
    path = r"((?:[a-z][A-Za-z0-9]*)(?:\.[a-z][A-Za-z0-9]*)*)"
    in_code = re.compile(rf"\b(training)\.{path}(?![\w/.-])")
    in_docs = re.compile(rf"`({sections})\.{path}(?=[`:= ])")
    pages = [*REPO.glob("docs/*.md"), REPO / "README.md"]
    named = [
        (p, m)
        for p in [*REPO.glob("trainer/**/*.py"), *REPO.glob("ctl/**/*.py")]
        for m in in_code.finditer(p.read_text())
    ]
    named += [(p, m) for p in pages for m in in_docs.finditer(p.read_text())]
    assert len(named) > 100  # the patterns still find keys

    def known(key: str) -> bool:
        parts = key.split(".")
        prefixes = (".".join(parts[:i]) for i in range(1, len(parts)))
        return key in keys or any(keys.get(prefix) is False for prefix in prefixes)  # within a mapping's own keys

    unknown = {f"{p.relative_to(REPO)}: {m[1]}.{m[2]}" for p, m in named if not known(f"{m[1]}.{m[2]}")}
    assert sorted(k for k in unknown if not k.endswith((".yaml", ".json"))) == []


def test_a_trainer_names_both_versions_when_another_ddpjobs_chart_rendered_its_spec(
    tmp_path: Path, corpus_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart passes every training key, defaults included: an image older than the chart that rendered its job
    refuses the newer keys, and says so (the chart sets RENDERED_BY_ENV: tests/test_pod_contract.py)."""
    own = version("ddpjob")
    config = tmp_path / "training.yaml"
    config.write_text(yaml.safe_dump(tiny_spec(corpus_file)["training"] | {"newerKey": 1}))
    monkeypatch.setenv(RENDERED_BY_ENV, "99.0.0")
    with pytest.raises(SpecError) as failure:
        load_training_spec(config)
    assert str(failure.value) == (
        f"{config}: training.newerKey: unknown key (the job was rendered by ddpjob 99.0.0's chart, and this trainer"
        f" is ddpjob {own}: run the image of 99.0.0, or render the job with ctl {own})"
    )
    monkeypatch.setenv(RENDERED_BY_ENV, own)
    with pytest.raises(SpecError, match=r"training\.newerKey: unknown key$"):
        load_training_spec(config)


def test_the_spec_reference_gives_a_tuple_s_item_type_and_length() -> None:
    """docs/spec.md said `list of any (at least 2 items)` of the betas, which take exactly two numbers."""
    row = next(line for line in spec_reference().splitlines() if line.startswith("| `training.optimizer.betas` |"))
    assert "| list of number (≥ 0.0, < 1.0) (exactly 2 items) |" in row
