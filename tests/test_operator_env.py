"""The env contract: what the training operator v1.9 or Trainer v2.3 injects into each pod (docs/internals.md,
docs/trainer-v2.md)."""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import pytest
from conftest import tiny_spec

from ctl.console import Console
from ctl.local import agent_env, start_agent
from ctl.local_pods import local_job
from ctl.operator_env import Replica, operator_env, replicas
from ctl.processes import free_port
from ctl.spec import JobSpec
from trainer.cpus import usable_cpus
from trainer.names import SHUTDOWN_TIMEOUT_ENV


def job(corpus: Path, **fields) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(corpus) | {"name": "news"} | fields)


def test_master_and_workers(corpus_file: Path) -> None:
    spec = job(corpus_file, nodes=3, procsPerNode=4)
    assert replicas(spec) == [Replica("master", 0), Replica("worker", 0), Replica("worker", 1)]
    common = {
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": "news-master-0",
        "PET_MASTER_ADDR": "news-master-0",
        "MASTER_PORT": "23456",
        "PET_MASTER_PORT": "23456",
        "WORLD_SIZE": "12",
        "PET_NNODES": "3",
        "PET_NPROC_PER_NODE": "4",
    }
    assert operator_env(spec, Replica("master", 0)) == common | {"RANK": "0", "PET_NODE_RANK": "0"}
    assert operator_env(spec, Replica("worker", 0)) == common | {"RANK": "1", "PET_NODE_RANK": "1"}
    assert operator_env(spec, Replica("worker", 1)) == common | {"RANK": "2", "PET_NODE_RANK": "2"}


def test_single_node_is_a_lone_master(corpus_file: Path) -> None:
    spec = job(corpus_file, nodes=1, procsPerNode=2, masterPort=29500)
    assert replicas(spec) == [Replica("master", 0)]
    env = operator_env(spec, Replica("master", 0))
    assert env["WORLD_SIZE"] == "2" and env["PET_NNODES"] == "1" and env["PET_MASTER_PORT"] == "29500"


def test_elastic_workers_get_rendezvous_and_no_master(corpus_file: Path) -> None:
    spec = job(
        corpus_file, nodes=2, procsPerNode=8, elastic={"enabled": True, "minNodes": 1, "maxNodes": 4, "maxRestarts": 5}
    )
    assert replicas(spec) == [Replica("worker", 0), Replica("worker", 1)]
    expected = {
        "PYTHONUNBUFFERED": "1",
        "PET_NPROC_PER_NODE": "8",
        "PET_RDZV_ENDPOINT": "news-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:4",
        "PET_MAX_RESTARTS": "5",
    }
    for replica in replicas(spec):
        assert operator_env(spec, replica) == expected


def local_env(spec: JobSpec, replica: Replica, tmp_path: Path) -> dict[str, str]:
    """What `ctl run` gives `replica`'s agent: rendezvous port 40123, metrics port 40124, files under tmp_path."""
    with local_job(spec) as job:
        (node,) = [node for node in job.nodes if node.replica == replica]
        return agent_env(spec, node, 40123, tmp_path / "error.json", 40124, tmp_path / "logs", False)


def test_local_agents_get_the_same_env_with_a_loopback_master(corpus_file: Path, tmp_path: Path, monkeypatch) -> None:
    # An outer launcher's variables must not leak into a simulated pod.
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("PET_RDZV_ID", "outer")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    spec = job(corpus_file, nodes=2, procsPerNode=2)
    env = local_env(spec, Replica("worker", 0), tmp_path)
    injected = operator_env(spec, Replica("worker", 0), address="127.0.0.1", port=40123)
    assert {k: env[k] for k in injected} == injected
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["PET_MASTER_PORT"] == "40123" and env["RANK"] == "1"
    assert "PET_RDZV_ID" not in env
    assert env["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "error.json")
    # The chart's metrics env, with the simulated pod's own port, and its metrics volume a directory of its own.
    assert env["DDPJOB_METRICS_PORT"] == "40124" and env["DDPJOB_METRICS_HOST"] == "127.0.0.1"
    assert env["PROMETHEUS_MULTIPROC_DIR"].endswith("/news-worker-0/volumes/metrics")
    assert env["DDPJOB_JOB_NAME"] == spec.name


def test_local_agents_get_the_pods_shutdown_timeout_unless_one_is_exported(
    corpus_file: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv(SHUTDOWN_TIMEOUT_ENV, raising=False)
    spec = job(corpus_file, terminationGracePeriodSeconds=300)
    env = local_env(spec, Replica("master", 0), tmp_path)
    assert env[SHUTDOWN_TIMEOUT_ENV] == "295"  # the chart's: the grace period less 5 s
    monkeypatch.setenv(SHUTDOWN_TIMEOUT_ENV, "7")
    env = local_env(spec, Replica("master", 0), tmp_path)
    assert env[SHUTDOWN_TIMEOUT_ENV] == "7"


@pytest.mark.parametrize(("nodes", "procs"), [(1, 1), (1, 2), (2, 2), (1, 64)])
def test_local_processes_share_the_cpus_of_this_machine(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: int, procs: int
) -> None:
    """`ctl run`: OMP_NUM_THREADS of every process is the CPUs ctl may use shared among all local processes, at
    least 1, whatever CPU request the pods would make of a cluster; the spec's `env`, or an exported value, wins."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = job(corpus_file, nodes=nodes, procsPerNode=procs, resources={"cpu": "32"})
    for replica in replicas(spec):
        assert local_env(spec, replica, tmp_path)["OMP_NUM_THREADS"] == str(max(1, usable_cpus() // (nodes * procs)))
    given = job(corpus_file, nodes=nodes, procsPerNode=procs, env=[{"name": "OMP_NUM_THREADS", "value": "3"}])
    assert local_env(given, replicas(given)[0], tmp_path)["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert local_env(spec, replicas(spec)[0], tmp_path)["OMP_NUM_THREADS"] == "5"


def test_trainjob_nodes_get_the_torch_plugin_env(corpus_file: Path) -> None:
    """Trainer v2.3's torch plugin: PET_* only (torchrun derives the rest), node rank = completion index."""
    spec = job(corpus_file, apiKind="TrainJob", nodes=3, procsPerNode=4)
    assert [(r.type, r.index) for r in replicas(spec)] == [("node", 0), ("node", 1), ("node", 2)]
    assert [r.pod_name(spec.name) for r in replicas(spec)] == ["news-node-0-0", "news-node-0-1", "news-node-0-2"]
    for replica in replicas(spec):
        assert operator_env(spec, replica) == {
            "PET_NNODES": "3",
            "PET_NPROC_PER_NODE": "4",
            "PET_NODE_RANK": str(replica.index),
            "PET_MASTER_ADDR": "news-node-0-0.news",
            "PET_MASTER_PORT": "29500",
        }


def test_local_trainjob_nodes_get_the_same_env_with_a_loopback_master(
    corpus_file: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "16")
    spec = job(corpus_file, apiKind="TrainJob", nodes=2)
    node_1 = replicas(spec)[1]
    env = local_env(spec, node_1, tmp_path)
    assert env.items() >= operator_env(spec, node_1, address="127.0.0.1", port=40123).items()
    assert (env["PET_MASTER_ADDR"], env["PET_MASTER_PORT"], env["PET_NODE_RANK"]) == ("127.0.0.1", "40123", "1")
    assert not {"MASTER_ADDR", "RANK", "WORLD_SIZE"} & set(env)  # Trainer v2 sets none of them
    assert env["PYTHONUNBUFFERED"] == "1"  # the chart's, on TrainJob pods (test_trainjob.py)


def test_local_commands_expand_variable_references_as_the_kubelet_does(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`$(VAR)` in a pod's command and args is the pod's variable (the operator's too); `$$` escapes; a name the pod
    does not define stays as written, even where this machine has it."""
    monkeypatch.setenv("ONLY_ON_THIS_MACHINE", "x")
    spec = job(corpus_file)
    argv = [sys.executable, "-c", "import sys; print(sys.argv[1:])"]
    argv += ["$(DDPJOB_JOB_NAME)-$(PET_NODE_RANK)", "$$(DDPJOB_JOB_NAME)", "$(ONLY_ON_THIS_MACHINE)"]
    with local_job(spec) as pods:
        (node,) = pods.nodes
        node = dataclasses.replace(node, container=dataclasses.replace(node.container, command=argv))
        console = Console(io.StringIO(), io.StringIO())
        agent, _ = start_agent(
            spec, dataclasses.replace(pods, nodes=[node]), 0, free_port(), tmp_path, console, False, None
        )
        out, _ = agent.process.communicate(timeout=60)
    assert out.strip() == str(["news-0", "$(DDPJOB_JOB_NAME)", "$(ONLY_ON_THIS_MACHINE)"])


def test_local_env_values_expand_earlier_variables_as_the_kubelet_does(
    corpus_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`$(VAR)` in an env value is a variable listed before it (the chart's own among them); a later one, or one
    only this machine has, stays as written; `$$` escapes."""
    monkeypatch.setenv("ONLY_ON_THIS_MACHINE", "x")
    env = [
        {"name": "RUN_TAG", "value": "$(DDPJOB_JOB_NAME)-run"},
        {"name": "NESTED", "value": "$(RUN_TAG)/$(LATER)/$$(RUN_TAG)/$(ONLY_ON_THIS_MACHINE)"},
        {"name": "LATER", "value": "late"},
    ]
    with local_job(job(corpus_file, env=env)) as pods:
        (node,) = pods.nodes
    assert node.container.env["RUN_TAG"] == "news-run"
    assert node.container.env["NESTED"] == "news-run/$(LATER)/$(RUN_TAG)/$(ONLY_ON_THIS_MACHINE)"
