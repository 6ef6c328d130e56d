"""DDP correctness, for real: torchrun + gloo processes against one process on the same global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import rank_log, run_ctl, tiny_spec
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP

from ctl.processes import free_port
from trainer.dist import barrier, cuda_device, init_distributed
from trainer.loop import slow_precision_warning, wrap_model
from trainer.spec import SpecError, TrainingSpec

STEPS = 6


def train_weights(workdir: Path, corpus: Path, name: str, **layout) -> dict[str, torch.Tensor]:
    """Run `ctl run` with the given layout/batching and return the final weights."""
    nodes = layout.pop("nodes", 1)
    procs = layout.pop("procsPerNode", 1)
    spec = tiny_spec(corpus, maxSteps=STEPS, **layout) | {"name": name, "nodes": nodes, "procsPerNode": procs}
    spec_file = workdir / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    result = run_ctl("run", str(spec_file), cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    return load_file(workdir / "runs" / name / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, corpus_file) -> dict[str, torch.Tensor]:
    """One process, global batch 8 in one micro-batch."""
    return train_weights(tmp_path_factory.mktemp("single"), corpus_file, "single", batchSize=8)


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=atol, msg=key)


@pytest.mark.parametrize(
    "layout",
    [
        {"procsPerNode": 2, "batchSize": 4},
        {"nodes": 2, "procsPerNode": 1, "batchSize": 4},
        {"procsPerNode": 2, "batchSize": 2, "gradAccum": 2},
    ],
    ids=["1x2-procs", "2x1-nodes", "1x2-procs-grad-accum"],
)
def test_ddp_equals_single_process(tmp_path, corpus_file, single_process, layout) -> None:
    weights = train_weights(tmp_path, corpus_file, "ddp", **layout)
    assert_same_weights(weights, single_process)


def test_grad_accum_equals_big_batch(tmp_path, corpus_file, single_process) -> None:
    weights = train_weights(tmp_path, corpus_file, "accum", batchSize=4, gradAccum=2)
    assert_same_weights(weights, single_process)


def test_half_the_batch_gives_other_weights(tmp_path, corpus_file, single_process) -> None:
    """Guards the equality tests: a different global batch must give different weights."""
    weights = train_weights(tmp_path, corpus_file, "half-batch", batchSize=4)
    assert any(not torch.allclose(weights[k], single_process[k]) for k in weights)


def test_compiled_ddp_equals_single_process(tmp_path, corpus_file, single_process) -> None:
    """torch.compile (the model and the loss) changes how a step runs, not what it computes.

    The equal keys also show that checkpoints and the export hold the plain module's names.
    """
    weights = train_weights(tmp_path, corpus_file, "compiled", procsPerNode=2, batchSize=4, compile=True)
    # Compiled kernels sum in another order: 7e-7 apart after 6 steps with transformers 5.23, 1.3e-6
    # with 5.0 (the floors tier). A real difference is three orders larger (bf16 below: 1e-4 or more).
    assert_same_weights(weights, single_process, atol=1e-5)


def test_bf16_compiled_ddp_stays_close_to_fp32(tmp_path, corpus_file, single_process) -> None:
    """The settings a GPU runs with (bf16 autocast + compile): rounding moves the weights a little, never far."""
    weights = train_weights(tmp_path, corpus_file, "bf16", procsPerNode=2, batchSize=4, precision="bf16", compile=True)
    assert weights.keys() == single_process.keys()
    largest = max((weights[key] - single_process[key]).abs().max().item() for key in weights)
    # Above: autocast took effect. Below: 6 AdamW steps at lr 1e-3 move a weight by about 6e-3 at most.
    assert 1e-4 < largest < 6e-3, largest
    # Rank 0 warned (stderr, in the run's logs) exactly when this CPU has no native bf16 matrix instructions.
    rank_logs = rank_log(tmp_path / "runs" / "bf16", 0, 0).read_text()
    assert "rank 0 of 2" in rank_logs
    assert (
        "warning: training.precision: bf16 on a CPU without" in rank_logs
    ) != torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_warned_about_only_on_a_cpu_without_its_instructions(monkeypatch, dtype) -> None:
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    monkeypatch.setattr(torch.ops.mkldnn, f"_is_mkldnn_{name}_supported", lambda: True)
    assert slow_precision_warning(dtype, torch.device("cpu")) is None
    monkeypatch.setattr(torch.ops.mkldnn, f"_is_mkldnn_{name}_supported", lambda: False)
    assert slow_precision_warning(dtype, torch.device("cpu")).startswith(
        f"warning: training.precision: {name} on a CPU"
    )
    assert slow_precision_warning(dtype, torch.device("cuda", 0)) is None
    assert slow_precision_warning(None, torch.device("cpu")) is None  # fp32


def test_a_node_with_fewer_gpus_than_processes_is_bad_input_naming_procs_per_node(monkeypatch) -> None:
    """Each process takes the GPU of its local rank (NCCL cannot share one): a second process on a one-GPU node is
    refused by name, not CUDA's "invalid device ordinal" (what `ctl run` of 2 processes on one H100 printed)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cuda_device(0, 1) == torch.device("cuda", 0)
    with pytest.raises(SpecError, match=r"^procsPerNode: 2 processes on this node, but 1 GPU\(s\) visible to it"):
        cuda_device(1, 1)


def test_one_process_under_torchrun_has_the_store_but_no_process_group_and_no_ddp(monkeypatch, corpus_file) -> None:
    """torchrun's one worker has no peer: no process group (gloo's event loop would wake every 10 ms) and no DDP
    (its all-reduce at every step would wake gloo's threads), which both preempt the compute threads on a CPU. The
    watchdog and the barriers still have torchrun's store."""
    torchrun = {"TORCHELASTIC_RUN_ID": "one", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # no agent here: rank 0 serves the store, as torch does then
    spec = TrainingSpec.model_validate(tiny_spec(corpus_file)["training"])
    one = init_distributed(spec.timeouts)
    assert not torch.distributed.is_initialized() and not one.is_distributed
    barrier(one)
    one.store.set("key", "value")
    assert one.store.get("key") == b"value"
    forward, sync = wrap_model(spec, one, torch.nn.Linear(2, 2))
    assert not isinstance(forward, DDP)
    assert sync is None
