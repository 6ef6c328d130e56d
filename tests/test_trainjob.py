"""apiKind TrainJob: the chart's Kubeflow Trainer v2.3 objects (a TrainingRuntime carrying the pod template and
a TrainJob referencing it), validated against the real v2.3 CRDs and checked against what Trainer v2.3's
controller and webhooks do with them (pkg/runtime/framework/plugins/{torch,jobset}, pkg/webhooks at v2.3.0)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conftest import REPO, processes_with_marker, rank_log, run_ctl, tiny_spec
from test_chart import ALL_SPECS, VARIANTS, crd_schema, objects, pod_templates, spec_of, trainer_container

from ctl.kinds import TRAINJOB
from ctl.kinds.trainjob import ANCESTOR_LABEL, NODE, RUNTIME_PLURAL
from ctl.render import notes
from ctl.spec import JobSpec, load_spec

TRAINER = "github.com/kubeflow/trainer/v2@v2.3.0"
CRDS = f"manifests/base/crds/{TRAINJOB.group}_{{}}.yaml"
TRAINJOB_SPECS = [(name, spec) for name, spec in ALL_SPECS if spec.api_kind == "TrainJob"]


@pytest.fixture(scope="session")
def trainer_schemas() -> dict[str, dict[str, Any]]:
    """kind -> strict schema, from the Trainer v2.3.0 Go module's own CRDs."""
    return {
        kind: crd_schema(TRAINER, CRDS.format(plural), kind, version=TRAINJOB.version)
        for kind, plural in ((TRAINJOB.kind, TRAINJOB.plural), ("TrainingRuntime", RUNTIME_PLURAL))
    }


def test_the_example_and_variants_cover_trainjob() -> None:
    assert {"trainjob", "trainjob-gang", "trainjob-volcano", "trainjob-everything"} <= {n for n, _ in TRAINJOB_SPECS}


@pytest.mark.parametrize(("name", "spec"), TRAINJOB_SPECS, ids=[name for name, _ in TRAINJOB_SPECS])
def test_trainjob_and_runtime_validate_against_the_real_crds(
    name: str, spec: JobSpec, trainer_schemas: dict[str, dict[str, Any]]
) -> None:
    by_kind = objects(spec)
    assert "PyTorchJob" not in by_kind
    for kind in ("TrainJob", "TrainingRuntime"):
        assert by_kind[kind]["apiVersion"] == TRAINJOB.api_version
        jsonschema.Draft7Validator(trainer_schemas[kind]).validate(by_kind[kind])


def test_strict_trainer_schemas_catch_unknown_fields(trainer_schemas: dict[str, dict[str, Any]]) -> None:
    by_kind = objects(spec_of(apiKind="TrainJob"))
    by_kind["TrainJob"]["spec"]["trainer"]["numProcsPerNode"] = 2
    with pytest.raises(jsonschema.ValidationError, match="numProcsPerNode"):
        jsonschema.Draft7Validator(trainer_schemas["TrainJob"]).validate(by_kind["TrainJob"])
    by_kind["TrainingRuntime"]["spec"]["mlPolicy"]["torch"] = {"numProcPerNode": 2}  # gone in v2.2
    with pytest.raises(jsonschema.ValidationError, match="numProcPerNode"):
        jsonschema.Draft7Validator(trainer_schemas["TrainingRuntime"]).validate(by_kind["TrainingRuntime"])


def test_runtime_is_what_the_webhook_and_torch_plugin_expect() -> None:
    spec = spec_of(apiKind="TrainJob", nodes=4, procsPerNode=8, resources={"gpu": 8, "cpu": "32"})
    by_kind = objects(spec)
    runtime, job = by_kind["TrainingRuntime"], by_kind["TrainJob"]
    assert runtime["metadata"]["annotations"]["helm.sh/hook"] == "pre-install"  # before the TrainJob
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 4, "torch": {}}
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    # The webhook: an ancestor-labelled replicated job has replicas 1 and, for the trainer, a container `node`.
    assert replicated["name"] == NODE and replicated["replicas"] == 1
    assert replicated["template"]["metadata"]["labels"][ANCESTOR_LABEL] == "trainer"
    template = replicated["template"]["spec"]["template"]
    container = trainer_container(template)
    assert container["name"] == TRAINJOB.container
    assert template["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == TRAINJOB.container
    assert template["spec"]["restartPolicy"] == "OnFailure"  # a Job's pods: OnFailure or Never
    # No v1 rendezvous port: the torch plugin adds 29500 itself.
    assert [p["name"] for p in container["ports"]] == ["metrics"]
    assert job["spec"]["runtimeRef"] == {"apiGroup": TRAINJOB.group, "kind": "TrainingRuntime", "name": "job"}
    trainer = job["spec"]["trainer"]
    # The torch plugin's numProcPerNode default is "auto" (GPUs, else CPUs): the spec's count instead.
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 8)
    assert trainer["image"] == container["image"] and trainer["command"] == container["command"]
    assert trainer["resourcesPerNode"] == container["resources"]
    assert "env" not in trainer  # the webhook refuses PET_* there; the pod template carries the env
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PYTHONUNBUFFERED"] == "1"  # the operator v1 sets it itself; Trainer v2 does not
    assert not [name for name in env if name.startswith("PET_")]  # the torch plugin's, upserted over ours


def without_api_differences(template: dict[str, Any]) -> dict[str, Any]:
    """A pod template less what the two APIs need differently (container name, v1's port, Job restartPolicy,
    the env the operator v1 sets itself)."""
    template["metadata"]["annotations"].pop("kubectl.kubernetes.io/default-container")
    template["spec"].pop("restartPolicy", None)
    container = trainer_container(template)
    container.pop("name")
    container["ports"] = [p for p in container["ports"] if p["name"] != "pytorchjob-port"]
    container["env"] = [e for e in container["env"] if e["name"] != "PYTHONUNBUFFERED"]
    return template


@pytest.mark.parametrize("variant", ["everything", "monitoring"])
def test_both_apis_run_the_same_pod_template(variant: str) -> None:
    values = VARIANTS[variant] | {"runPolicy": {}, "restartPolicy": "OnFailure", "nodes": 2}
    v1 = pod_templates(objects(spec_of(**values))["PyTorchJob"])
    v2 = pod_templates(objects(spec_of(**values, apiKind="TrainJob"))["TrainingRuntime"])
    assert list(v2) == [NODE]
    assert without_api_differences(v2[NODE]) == without_api_differences(v1["Master"])


def test_exit_code_policy_fails_the_job_on_errors_and_retries_signals() -> None:
    runtime = objects(spec_of(**VARIANTS["trainjob-everything"]))["TrainingRuntime"]
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["containerName"] == TRAINJOB.container
    assert rule["onExitCodes"]["operator"] == "In" and rule["onExitCodes"]["values"] == list(range(1, 128))


def test_gang_scheduling_and_kueue() -> None:
    gang = objects(spec_of(**VARIANTS["trainjob-gang"]))
    labels = gang["TrainJob"]["metadata"]["labels"]
    assert (labels["kueue.x-k8s.io/queue-name"], labels["kueue.x-k8s.io/priority-class"]) == ("team-a", "high")
    assert labels["kueue.x-k8s.io/max-exec-time-seconds"] == "86400"  # Kueue reads a string of digits
    assert gang["TrainJob"]["spec"]["suspend"] is True
    assert gang["TrainingRuntime"]["spec"]["podGroupPolicy"] == {"coscheduling": {"scheduleTimeoutSeconds": 600}}
    (template,) = pod_templates(gang["TrainingRuntime"]).values()
    assert template["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    volcano = objects(spec_of(**VARIANTS["trainjob-volcano"]))["TrainingRuntime"]
    assert volcano["spec"]["podGroupPolicy"] == {"volcano": {}}
    assert volcano["spec"]["template"]["metadata"]["annotations"] == {"scheduling.volcano.sh/queue-name": "research"}
    (template,) = pod_templates(volcano).values()
    assert template["spec"]["schedulerName"] == "volcano"
    assert "podGroupPolicy" not in objects(spec_of(apiKind="TrainJob"))["TrainingRuntime"]["spec"]
    untimed = objects(spec_of(apiKind="TrainJob", queue={"coscheduling": "sched"}))["TrainingRuntime"]["spec"]
    assert untimed["podGroupPolicy"] == {"coscheduling": {}}  # the CRD's default timeout (60 s)
    # The same Kueue labels on a PyTorchJob.
    queue = {"kueue": "team-a", "kueuePriorityClass": "high", "kueueMaxExecutionSeconds": 86400}
    v1 = objects(spec_of(queue=queue))["PyTorchJob"]["metadata"]["labels"]
    kueue_labels = {k: v for k, v in v1.items() if k.startswith("kueue.x-k8s.io/")}
    assert len(kueue_labels) == 3 and labels.items() >= kueue_labels.items()


def test_pod_monitor_names_jobs_and_nodes_by_jobset_labels() -> None:
    monitor = objects(spec_of(**VARIANTS["trainjob-everything"]))["PodMonitor"]["spec"]
    assert monitor["jobLabel"] == TRAINJOB.job_label
    assert monitor["podTargetLabels"] == list(TRAINJOB.index_labels)


def test_the_migration_is_one_key(tmp_path: Path) -> None:
    """examples/trainjob.yaml is a PyTorchJob spec but for apiKind: rendering it either way differs only there."""
    example = REPO / "examples" / "trainjob.yaml"
    as_v1 = objects(load_spec(example, ["apiKind=PyTorchJob"]))
    as_v2 = objects(load_spec(example))
    assert set(as_v1) - set(as_v2) == {"PyTorchJob"} and set(as_v2) - set(as_v1) == {"TrainJob", "TrainingRuntime"}
    assert as_v1["ConfigMap"] == as_v2["ConfigMap"]


BAD = [
    ("elastic.enabled=true", "elastic.enabled: Kubeflow Trainer v2.3 has no elastic training"),
    ("restartPolicy=Always", "restartPolicy: Always is not allowed for the Job pods of a TrainJob"),
    ("masterPort=29501", "masterPort: PyTorchJob only"),  # a TrainJob's is Trainer v2's: it was ignored, silently
    ("runPolicy.ttlSecondsAfterFinished=60", "runPolicy.ttlSecondsAfterFinished: PyTorchJob only"),
    ("runPolicy.cleanPodPolicy=All", "runPolicy.cleanPodPolicy: PyTorchJob only"),
    ("runPolicy.schedulingPolicy.minAvailable=1", "runPolicy.schedulingPolicy.minAvailable: PyTorchJob only"),
    ("metrics.port=29500", "metrics.port: 29500 is already Trainer v2's port, the rendezvous port"),
    ("queue={volcano: a, coscheduling: b}", "queue: set either volcano or coscheduling, not both"),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[b[0].split("=")[0] for b in BAD])
def test_what_trainer_v2_cannot_do_is_refused_in_one_line(
    override: str, message: str, tmp_path: Path, ctl_here
) -> None:
    example = REPO / "examples" / "trainjob.yaml"
    extra = ["--set", "elastic.maxNodes=4"] if override.startswith("elastic") else []
    result = ctl_here("render", str(example), "--set", override, *extra, cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


def test_coscheduling_is_refused_for_a_pytorchjob(tmp_path: Path) -> None:
    example = REPO / "examples" / "quickstart.yaml"
    result = run_ctl("render", str(example), "--set", "queue.coscheduling=sched", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert "queue.coscheduling: TrainJob only" in result.stderr and result.stderr.count("\n") == 1


def test_notes_and_alerts_point_at_the_trainjob_pods() -> None:
    spec = spec_of(apiKind="TrainJob", nodes=2)
    text = notes(spec, namespace="ml")
    node_zero = "-l jobset.sigs.k8s.io/jobset-name=job,batch.kubernetes.io/job-completion-index=0 -c node"
    assert "TrainJob job in namespace ml: 2 pod(s)" in text
    assert "kubectl get trainjob job -n ml -w" in text and f"kubectl logs -n ml -f {node_zero}" in text
    assert "ctl status job -n ml\n" in text and "ctl logs job -n ml -f\n" in text
    assert "kubectl delete trainingruntime job -n ml" in text
    rules = objects(spec_of(apiKind="TrainJob", metrics={"alerts": {"enabled": True}}))["PrometheusRule"]
    annotations = " ".join(v for g in rules["spec"]["groups"] for r in g["rules"] for v in r["annotations"].values())
    assert node_zero in annotations and "kubectl describe trainjob" in annotations
    assert "-c pytorch" not in annotations


def test_ctl_run_trains_two_trainjob_nodes_with_trainer_v2s_env(tmp_path, write_spec, corpus_file, marked_env) -> None:
    """`ctl run` of a 2-node TrainJob: the agents rendezvous through PET_* alone, as Trainer v2's pods do."""
    env, marker = marked_env
    spec = tiny_spec(corpus_file) | {"apiKind": "TrainJob", "nodes": 2, "procsPerNode": 1}
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank 0] step 5/5 | loss " in result.stdout
    rank1 = rank_log(tmp_path / "runs" / "tiny", 1, 0)
    assert rank1.read_text().startswith("rank 1 of 2 on ")
    report = json.loads((tmp_path / "runs" / "tiny" / "report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 5
    assert processes_with_marker(marker) == []
