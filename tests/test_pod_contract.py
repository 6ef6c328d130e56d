"""One pod contract: `ctl run` starts each node from the rendered pod template (ctl/pod.py, the e2e pod executor's
code too), so a chart change reaches a laptop run without a Python change, and every variable the trainer reads
from trainer/names.py is one the rendered pods set (or is named as someone else's)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO, run_ctl, tiny_spec

import trainer.names as names
from ctl.local_pods import local_job, rendered_pods
from ctl.render import CHART_ENV, render
from ctl.spec import JobSpec
from trainer.location import PEM_CERTIFICATE, S3_CA_BUNDLE_ENV

# Prints what the container got: a chart variable, one the spec's env overrides, the operator's node rank, a
# downward-API field, and the run directory its mounted training.yaml names (a container path, rewritten here).
PRINT_CONTAINER = (
    "import os, sys, yaml; e = os.environ; config = yaml.safe_load(open(sys.argv[1]));"
    " print(e['DDPJOB_CHART_SAYS'], e['DDPJOB_JOB_NAME'], e['PET_NODE_RANK'], e['POD'], config['checkpoint']['dir'])"
)


def changed_chart(tmp_path: Path, replacements: dict[str, str]) -> Path:
    """A copy of the chart with text of its pod template (_helpers.tpl) replaced, each found exactly once."""
    chart = tmp_path / "chart"
    shutil.copytree(REPO / "helm" / "ddpjob", chart)
    helpers = chart / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    helpers.write_text(text)
    return chart


def test_ctl_run_follows_a_changed_chart_template_without_python_changes(
    tmp_path: Path, temporary: Path, write_spec, corpus_file: Path
) -> None:
    # The container's command, and one more variable in its env, changed in the template alone.
    added = '        - name: DDPJOB_CHART_SAYS\n          value: "from-the-template"\n'
    chart = changed_chart(
        tmp_path,
        {
            "command: [python, -m, trainer.launch, -m, trainer, --config,": (
                f"command: [python, -c, {json.dumps(PRINT_CONTAINER)},"
            ),
            "\n      env:\n": f"\n      env:\n{added}",
        },
    )

    spec = tiny_spec(corpus_file) | {
        "nodes": 2,
        # A chart-set variable overridden by the spec's env (the later entry wins, as in a pod), and a fieldRef.
        "env": [
            {"name": "DDPJOB_JOB_NAME", "value": "renamed"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
    }
    env = os.environ | {CHART_ENV: str(chart), "TMPDIR": str(temporary)}
    run = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    run_dir = tmp_path / "runs" / "tiny"  # the chart's <storage.mountPath>/<name>, the claim being ./runs
    assert sorted(run.stdout.splitlines()) == [
        f"from-the-template renamed 0 tiny-master-0 {run_dir}",
        f"from-the-template renamed 1 tiny-worker-0 {run_dir}",
    ]
    # This container made no run directory to keep the logs in: they stay in the temporary directory, named.
    kept = re.fullmatch(r"ctl: logs of every rank in (\S+)", run.stderr.splitlines()[-1])
    assert kept and Path(kept[1]).parent == temporary and (Path(kept[1]) / "node-1.log").is_file(), run.stderr


def test_a_pod_that_ctl_run_cannot_give_a_volume_is_one_line_and_nothing_written(
    tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    shared_memory = "emptyDir:\n        medium: Memory\n        sizeLimit: {{ .Values.resources.shm | quote }}"
    chart = changed_chart(tmp_path, {shared_memory: "hostPath:\n        path: /dev/shm"})
    run = run_ctl(
        "run", str(write_spec(tiny_spec(corpus_file))), cwd=tmp_path, env=os.environ | {CHART_ENV: str(chart)}
    )
    assert (run.returncode, run.stdout) == (1, "")
    assert run.stderr == "error: volume dshm: ctl run cannot provide a hostPath volume\n"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("api_kind", ["PyTorchJob", "TrainJob"])
def test_every_variable_the_trainer_reads_is_set_by_the_rendered_pods(api_kind: str, corpus_file: Path) -> None:
    declared = {name: value for name, value in vars(names).items() if name.endswith("_ENV") and isinstance(value, str)}
    not_the_charts = {
        "METRICS_HOST_ENV",
        "SLOW_RANK_ENV",
        "FREEZE_RANK_ENV",
        "HEARTBEAT_DIR_ENV",  # the launcher's, for its workers
        "PROGRESS_URL_ENV",
        "PROGRESS_CA_CERT_ENV",
        "PROGRESS_TOKEN_ENV",
    }
    assert set(declared) - not_the_charts == {n for n, v in declared.items() if v in names.POD_TEMPLATE_ENV}
    # Each is read by the trainer (not only declared).
    sources = "".join(p.read_text() for p in (REPO / "trainer").rglob("*.py") if p.name != "names.py")
    assert [name for name in declared if not re.search(rf"\b{name}\b", sources)] == []

    spec = JobSpec.model_validate(
        tiny_spec(corpus_file) | {"apiKind": api_kind, "nodes": 2, "prepare": {"enabled": True}}
    )
    with local_job(spec) as job:
        assert len(job.nodes) == 2
        for node in job.nodes:
            assert set(names.POD_TEMPLATE_ENV) <= set(node.container.env), node.replica
    # The trainer container has the name its controller requires, the name ctl reads logs and overrides from.
    for pod in rendered_pods(render(spec), spec).values():
        assert spec.kind.container in [c["name"] for c in pod["containers"]]


def test_a_configmap_file_that_is_data_reaches_ctl_run_as_written(corpus_file: Path) -> None:
    """training.yaml names container paths, which ctl run rewrites to its directories (the first test here);
    storage.caBundle's PEM is data: a base64 line may read like a mount path and must stay as it is."""
    values = tiny_spec(corpus_file) | {"storage": {"uri": "s3://runs/team"}}
    placeholder = JobSpec.model_validate(values | {"storage": values["storage"] | {"caBundle": PEM_CERTIFICATE}})
    (pod,) = rendered_pods(render(placeholder), placeholder).values()
    (variable,) = [var for var in pod["containers"][0]["env"] if var["name"] == S3_CA_BUNDLE_ENV]
    mount = variable["value"].rpartition("/")[0]  # where the pod finds it: the ConfigMap's mount path
    pem = f"{PEM_CERTIFICATE}\n{mount}/+ZW5k\n-----END CERTIFICATE-----\n"
    spec = JobSpec.model_validate(values | {"storage": values["storage"] | {"caBundle": pem}})
    with local_job(spec) as job:
        (node,) = job.nodes
        bundle = Path(node.container.env[S3_CA_BUNDLE_ENV])
        assert bundle.is_relative_to(job.work_dir) and bundle.read_text() == pem
