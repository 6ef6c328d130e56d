# The training image: CUDA PyTorch with ddpjob's trainer installed; every pod runs
# `python -m trainer.launch -m trainer --config /etc/ddpjob/training.yaml` (the chart sets
# that command; trainer.launch is torchrun with signal exit codes, see trainer/launch.py).
#   docker build -t registry.example.com/ml/ddpjob:0.1.0 .
# (`make image` builds it here with podman, as ddpjob:0.1.0, and BASE_IMAGE a local stand-in where the base
# cannot be pulled: docs/testing.md.)
# The tag is the chart's appVersion (helm/ddpjob/Chart.yaml), the image the chart's pods run by default.
# The base image's torch (2.14.1, CUDA 12.6: drivers from 560, or 525 with CUDA's minor-version
# compatibility) satisfies pyproject's torch and transformers' (which disables its PyTorch models
# under torch 2.6), so pip keeps it. 2.12 and up also read TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which
# the chart sets from the pod's grace period.
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

# HOME, the Hugging Face cache and torch.compile's caches must be writable by the non-root user. In a pod the
# root filesystem is read-only and the chart mounts a size-limited scratch volume at this HOME (and /tmp),
# setting the same variables (a test keeps them equal).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/ddpjob \
    XDG_CACHE_HOME=/home/ddpjob/.cache \
    HF_HOME=/home/ddpjob/.cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/home/ddpjob/.cache/torchinductor \
    TRITON_CACHE_DIR=/home/ddpjob/.cache/triton

# jemalloc: data preparation preloads it into its tokenizing processes where it is installed (trainer/prepare.py
# fast_malloc); the Rust tokenizer spends ~40% of its time in glibc's malloc and free, and encodes 15-20% faster.
# g++ (and with it gcc): `training.compile` builds its kernels with them at run time, C++ on a CPU and Triton's
# launchers in C on a GPU; a runtime base image need not have them (pytorch/pytorch's had none before 2.10).
# Any version will do, so the base image's distribution pins them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libjemalloc2 g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/ddpjob
COPY pyproject.toml README.md ./
COPY trainer ./trainer
COPY ctl ./ctl

# Only what pods use: the `train` extra's requirements, read from pyproject.toml (the one source of the
# dependency set), then the project itself without the client's dependencies (kubernetes, Typer, Helm's engine).
# setuptools builds in the source tree: its build/ (a second copy of the packages) and egg-info go too.
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['train'], sep='\n')" > /tmp/train.txt \
    && pip install --no-cache-dir -r /tmp/train.txt \
    && pip install --no-cache-dir --no-deps . \
    && rm -r /tmp/train.txt build ddpjob.egg-info \
    && python -c "import torch, transformers, tokenizers, safetensors, tensorboard, trainer.__main__"

# The chart runs as 1000:1000 (security.runAsUser/runAsGroup/fsGroup); /checkpoints is the default mount.
RUN groupadd --gid 1000 ddpjob \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/ddpjob --shell /bin/bash ddpjob \
    && mkdir -p /home/ddpjob/.cache/huggingface /checkpoints \
    && chown -R 1000:1000 /home/ddpjob /checkpoints

USER 1000:1000
WORKDIR /home/ddpjob

# NCCL_* and OMP_NUM_THREADS are left to the job spec's `env`; torchrun reads its flags from PET_*.
ENTRYPOINT ["python", "-m", "trainer.launch", "-m", "trainer"]
CMD ["--config", "/etc/ddpjob/training.yaml"]
