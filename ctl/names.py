"""Names that ctl and the chart share. The chart reads them from templates/_names.tpl, which `python -m ctl.schema`
generates from this module, ctl/kinds and trainer/names.py (a test fails when it drifts)."""

from __future__ import annotations

from trainer.names import METRICS_DIR_ENV, PREPARED_BY_JOB_ENV, SHUTDOWN_TIMEOUT_ENV

# Kubernetes object names (and so pod hostnames) are DNS labels.
DNS_LABEL_MAX = 63
METRICS_PORT_NAME = "metrics"  # the trainer's container port of its Prometheus endpoint
# The chart's labels on everything it renders, and the component of the job's pods and of the prepare Job.
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
TRAINER_COMPONENT = "trainer"
PREPARE_COMPONENT = "prepare"
# torch's: a fresh rendezvous store every round of an elastic job (the chart sets it on elastic pods).
FRESH_RDZV_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# The threads of each trainer process (torch's and OpenMP's variable): the chart sets the pod's CPU request shared by
# its processes, unless the spec's env sets it; the prepare pod never gets the training processes' share.
THREADS_ENV = "OMP_NUM_THREADS"
# torch.compile's caches: torch's and Triton's variables, and each one's folder. With `training.compile` and the run
# directory on the volume, the chart puts them in the run directory's COMPILE_CACHE_DIR, one folder per pod (named by
# POD_KEY_ENV), so that a restarted pod finds what it compiled before; otherwise in the pod's scratch volume, where
# the image's ENV has them, and each new pod compiles again.
COMPILE_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TRITON_CACHE_DIR": "triton"}
COMPILE_CACHE_DIR = "compile-cache"
POD_KEY_ENV = "DDPJOB_POD_KEY"  # the pod's name for its folder there: the same when the pod is recreated
# The training pods' variables that the prepare Job's pod (the same template) must not get: it has no torchrun, no
# rendezvous and no shared metrics directory, compiles nothing, and it is the job the others wait for.
PREPARE_DENIED_ENV = (
    SHUTDOWN_TIMEOUT_ENV,
    FRESH_RDZV_STORE_ENV,
    METRICS_DIR_ENV,
    PREPARED_BY_JOB_ENV,
    POD_KEY_ENV,
    *COMPILE_CACHES,
)
# Where the chart mounts the trainer container's own volumes, which storage.mountPath must not be: training.yaml's
# ConfigMap, /dev/shm, the metric files, and the scratch volume at HOME (the image's, see the Dockerfile) and /tmp.
POD_MOUNTS = {
    "config": "/etc/ddpjob",
    "shm": "/dev/shm",
    "metrics": "/run/ddpjob-metrics",
    "home": "/home/ddpjob",
    "tmp": "/tmp",
}
# Refusals that ctl's spec model makes and the chart makes again for values files ctl never saw (`helm install -f`):
# formats that Python's % and Go's printf read alike.
POD_NAME_TOO_LONG = 'name: too long: pod name "%s" would have %d characters (at most %d)'
GPUS_BELOW_PROCESSES = "resources.gpu: %d GPU(s) per pod for procsPerNode %d: each process needs a GPU of its own"
# What a pod gets per torchrun process when the spec leaves resources.cpu/memory unset.
CPU_PER_PROCESS = 2
MEMORY_MIB_PER_PROCESS = 4096
# Kueue's labels on a job of `queue.kueue`: its LocalQueue, its WorkloadPriorityClass, its time budget.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
KUEUE_MAX_EXEC_TIME_LABEL = "kueue.x-k8s.io/max-exec-time-seconds"
# `ctl wait` and `submit --wait/--follow`: the job's outcome as the exit code (0 is the awaited state).
EXIT_JOB_FAILED = 100
EXIT_NOT_FINISHED = 101
EXIT_NOT_FOUND = 102
