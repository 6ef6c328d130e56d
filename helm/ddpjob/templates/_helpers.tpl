{{/*
The chart name.
*/}}
{{- define "ddpjob.name" -}}
{{- .Chart.Name | trunc (int (include "ddpjob.names" . | fromJson).dnsLabelMax) | trimSuffix "-" }}
{{- end }}

{{/*
The job's name: the spec's `name` (not the release name), so `ctl` and `helm install` name the
job alike and its pods are `<name>-master-0`, `<name>-worker-<i>` (TrainJob: `<name>-node-0-<i>`). The spec
model keeps those pod names within 63 characters; this check covers `helm install` with a values file ctl never saw.
*/}}
{{- define "ddpjob.fullname" -}}
{{- $name := required "name is required: the job's name (a DNS-1035 label)" .Values.name -}}
{{- $longest := include "ddpjob.longestPodName" . -}}
{{- $names := include "ddpjob.names" . | fromJson -}}
{{- $max := int $names.dnsLabelMax -}}
{{- if gt (len $longest) $max -}}
{{- fail (printf $names.refusals.podNameTooLong $longest (len $longest) $max) -}}
{{- end -}}
{{- $name -}}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "ddpjob.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc (int (include "ddpjob.names" . | fromJson).dnsLabelMax) | trimSuffix "-" }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "ddpjob.labels" -}}
helm.sh/chart: {{ include "ddpjob.chart" . }}
{{ include "ddpjob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ddpjob
{{- end }}

{{/*
Selector labels: stable for the life of a release.
*/}}
{{- define "ddpjob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddpjob.name" . }}
{{- $names := include "ddpjob.names" . | fromJson }}
{{ $names.instanceLabel }}: {{ .Release.Name | trunc (int $names.dnsLabelMax) | trimSuffix "-" | quote }}
{{- end }}

{{/*
The pods' ServiceAccount.
*/}}
{{- define "ddpjob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ddpjob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The run directory inside the pods: training.checkpoint.dir, or <storage.uri>/<name> (object storage), or
<storage.mountPath>/<name> (the volume).
*/}}
{{- define "ddpjob.checkpointDir" -}}
{{- $dir := dig "checkpoint" "dir" "" .Values.training -}}
{{- $root := default .Values.storage.mountPath .Values.storage.uri -}}
{{- default (printf "%s/%s" (trimSuffix "/" $root) (include "ddpjob.fullname" .)) $dir -}}
{{- end }}

{{/*
"true" when training.compile is on and the run directory is on the volume: torch.compile's caches go there.
*/}}
{{- define "ddpjob.compileCacheOnVolume" -}}
{{- $s3 := (include "ddpjob.names" . | fromJson).s3Scheme -}}
{{- if and (dig "compile" false .Values.training) (not .Values.storage.uri) (not (hasPrefix $s3 (include "ddpjob.checkpointDir" .))) -}}
true
{{- end -}}
{{- end }}

{{/*
The standard AWS variables of the S3 server of a run on object storage (storage.uri) or of s3:// data: endpoint,
region, the private CA's file, and the keys of storage.secretName; without a Secret the client finds the pod's cloud
identity.
*/}}
{{- define "ddpjob.s3Env" -}}
{{- $names := include "ddpjob.names" . | fromJson -}}
{{- with .Values.storage.endpoint }}
- name: {{ $names.env.s3Endpoint }}
  value: {{ . | quote }}
{{- end }}
{{- with .Values.storage.region }}
- name: {{ $names.env.s3Region }}
  value: {{ . | quote }}
{{- end }}
{{- if .Values.storage.caBundle }}
- name: {{ $names.env.s3CaBundle }}
  value: {{ printf "%s/%s" (include "ddpjob.configDir" .) (include "ddpjob.s3CaFile" .) | quote }}
{{- end }}
{{- with .Values.storage.secretName }}
{{- range $key := list $names.env.s3AccessKey $names.env.s3SecretKey }}
- name: {{ $key }}
  valueFrom:
    secretKeyRef:
      name: {{ $.Values.storage.secretName | quote }}
      key: {{ $key }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The PVC holding run directories.
*/}}
{{- define "ddpjob.claimName" -}}
{{- default (printf "%s-checkpoints" (include "ddpjob.fullname" .)) .Values.storage.existingClaim -}}
{{- end }}

{{/*
The ConfigMap holding training.yaml.
*/}}
{{- define "ddpjob.configMapName" -}}
{{- printf "%s-training" (include "ddpjob.fullname" .) -}}
{{- end }}

{{/*
Where training.yaml is mounted; the container command reads it.
*/}}
{{- define "ddpjob.configDir" -}}
{{- (include "ddpjob.names" . | fromJson).mounts.config -}}
{{- end }}

{{/*
The file of that ConfigMap holding storage.caBundle (a run on object storage with a private CA).
*/}}
{{- define "ddpjob.s3CaFile" -}}
s3-ca.crt
{{- end }}

{{/*
Where the trainer processes of a pod keep their metric files (prometheus_client's multiprocess mode).
*/}}
{{- define "ddpjob.metricsDir" -}}
{{- (include "ddpjob.names" . | fromJson).mounts.metrics -}}
{{- end }}

{{/*
Labels of the job's pods (selectorLabels + component): the PodMonitor selects pods by them.
*/}}
{{- define "ddpjob.podSelectorLabels" -}}
{{- $names := include "ddpjob.names" . | fromJson -}}
{{ include "ddpjob.selectorLabels" . }}
{{ $names.componentLabel }}: {{ $names.trainerComponent }}
{{- end }}

{{/*
The prepare Job's name (prepare.enabled).
*/}}
{{- define "ddpjob.prepareJobName" -}}
{{- printf "%s-prepare" (include "ddpjob.fullname" .) -}}
{{- end }}

{{/*
A PromQL selector for this job's series: Prometheus' `job` label is the PyTorchJob's name (the PodMonitor's jobLabel).
*/}}
{{- define "ddpjob.jobSelector" -}}
{{- printf "job=%q" (include "ddpjob.fullname" .) -}}
{{- end }}

{{/*
A dashboard JSON file with the chart's defaults for its DCGM label variables. Takes (dict "json" TEXT "values" .Values.metrics.dashboard).
*/}}
{{- define "ddpjob.dashboard" -}}
{{- $dashboard := fromJson .json -}}
{{- $defaults := dict "dcgm_pod_label" .values.dcgmPodLabel "dcgm_namespace_label" .values.dcgmNamespaceLabel -}}
{{- range $variable := $dashboard.templating.list -}}
{{- with get $defaults $variable.name -}}
{{- $_ := set $variable "query" . -}}
{{- $_ := set $variable "current" (dict "text" . "value" .) -}}
{{- end -}}
{{- end -}}
{{- toPrettyJson $dashboard -}}
{{- end }}

{{/*
A byte quantity (the spec's pattern: a number and an optional Ki/Mi/Gi/Ti/Pi or k/M/G/T/P suffix) in whole MiB, rounded up.
*/}}
{{- define "ddpjob.mebibytes" -}}
{{- $suffix := regexFind "[kKMGTP]i?$" . -}}
{{- $factor := get (dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "k" 1000.0 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15) $suffix -}}
{{- $bytes := mulf (float64 (trimSuffix $suffix .)) $factor -}}
{{- ceil (divf $bytes 1048576.0) | int64 -}}
{{- end }}

{{/*
The pod's CPU request: resources.cpu, else cpuPerProcess for each process.
*/}}
{{- define "ddpjob.cpuRequest" -}}
{{- $names := include "ddpjob.names" . | fromJson -}}
{{- default (toString (mul (int $names.cpuPerProcess) (int .Values.procsPerNode))) .Values.resources.cpu -}}
{{- end }}

{{/*
OMP_NUM_THREADS of each trainer process: the pod's CPU request shared by its processes, at least 1. Without it
torch starts a thread per core of the node, whatever the pod asked for (torchrun sets 1 for more than one process
a pod, which leaves the rest of the request idle).
*/}}
{{- define "ddpjob.threadsPerProcess" -}}
{{- $cpu := include "ddpjob.cpuRequest" . -}}
{{- $millicores := hasSuffix "m" $cpu | ternary (trimSuffix "m" $cpu | int64) (round (mulf (float64 $cpu) 1000.0) 0 | int64) -}}
{{- max 1 (div $millicores (mul 1000 (int .Values.procsPerNode))) -}}
{{- end }}

{{/*
"true" when the chart sets OMP_NUM_THREADS: the spec's `env` does not.
*/}}
{{- define "ddpjob.setsThreads" -}}
{{- $names := include "ddpjob.names" . | fromJson -}}
{{- $given := list -}}
{{- range .Values.env }}{{ $given = append $given .name }}{{ end -}}
{{- if not (has $names.env.threads $given) }}true{{ end -}}
{{- end }}

{{/*
Container resources, scaled from the spec. Requests: CPU (2 per process unless set), memory (the trainer's, 4Gi
per process unless set, plus the /dev/shm volume, which is memory the pod is charged for) and ephemeral storage
(the scratch volume). Limits: memory equal to its request (memory cannot be taken back, only the pod killed) and
GPUs (extended resources require limit = request); no CPU limit, whose throttling would slow every rank.
*/}}
{{- define "ddpjob.resources" -}}
{{- $r := .Values.resources -}}
{{- $procs := int .Values.procsPerNode -}}
{{- $names := include "ddpjob.names" . | fromJson -}}
{{- $trainer := mul (int $names.memoryMiPerProcess) $procs -}}
{{- with $r.memory }}{{ $trainer = include "ddpjob.mebibytes" . | int64 }}{{ end -}}
{{- $memory := printf "%dMi" (add $trainer (include "ddpjob.mebibytes" $r.shm | int64)) -}}
{{- $requests := dict "cpu" (include "ddpjob.cpuRequest" .) "memory" $memory "ephemeral-storage" $r.cache -}}
{{- $limits := dict "memory" $memory -}}
{{- /* NCCL gives each process a GPU of its own; ctl's spec model refuses this too, for values files it never saw. */ -}}
{{- if and (gt (int $r.gpu) 0) (lt (int $r.gpu) $procs) -}}
{{- fail (printf $names.refusals.gpusBelowProcesses (int $r.gpu) $procs) -}}
{{- end -}}
{{- if gt (int $r.gpu) 0 }}
{{- $_ := set $requests "nvidia.com/gpu" (int $r.gpu) -}}
{{- $_ := set $limits "nvidia.com/gpu" (int $r.gpu) -}}
{{- end -}}
requests:
  {{- toYaml $requests | nindent 2 }}
limits:
  {{- toYaml $limits | nindent 2 }}
{{- end }}

{{/*
The container image: the chart's appVersion unless the spec pins a tag (`tag@sha256:...` digests too).
*/}}
{{- define "ddpjob.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end }}

{{/*
Where the scratch volume is mounted: HOME and the caches under it (the image's HOME, see the Dockerfile), and /tmp.
*/}}
{{- define "ddpjob.home" -}}
{{- (include "ddpjob.names" . | fromJson).mounts.home -}}
{{- end }}

{{/*
The default access modes of the created claim: ReadWriteMany when the job's pods may run on several nodes.
*/}}
{{- define "ddpjob.accessModes" -}}
{{- $pods := ternary (int .Values.elastic.maxNodes) (int .Values.nodes) .Values.elastic.enabled -}}
{{- toYaml (default (list (ternary "ReadWriteMany" "ReadWriteOnce" (gt $pods 1))) .Values.storage.accessModes) -}}
{{- end }}

{{/*
Where NCCL's flight recorder dumps its files: the run directory, or HOME's scratch on object storage.
*/}}
{{- define "ddpjob.traceDir" -}}
{{- ternary (include "ddpjob.home" .) (include "ddpjob.checkpointDir" .) (not (empty .Values.storage.uri)) -}}
{{- end }}

{{/*
PyTorch's NCCL error handling and flight recorder, set on every pod by default (docs/hangs.md): a collective
that times out tears the process down, and each rank first dumps its last NCCL operations into the run
directory on the shared volume (nccl_trace_rank_<rank>, read with torch's flight-recorder analyzer). An
entry of the same name in `env` replaces a default here.
*/}}
{{- define "ddpjob.ncclEnv" -}}
{{- $overridden := dict -}}
{{- range .Values.env }}{{ $_ := set $overridden .name true }}{{ end -}}
{{- $defaults := list
  (dict "name" "TORCH_NCCL_ASYNC_ERROR_HANDLING" "value" "3")
  (dict "name" "TORCH_NCCL_DUMP_ON_TIMEOUT" "value" "1")
  (dict "name" "TORCH_FR_BUFFER_SIZE" "value" "2000")
  (dict "name" "TORCH_FR_DUMP_TEMP_FILE" "value" (printf "%s/nccl_trace_rank_" (include "ddpjob.traceDir" .)))
-}}
{{- range $defaults }}
{{- if not (hasKey $overridden .name) }}
- name: {{ .name }}
  value: {{ .value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The pod template shared by Master and Worker replicas (PyTorchJob) and by the TrainingRuntime's replicated
job `node` (TrainJob); what differs between the two APIs comes from _apikind.tpl.
*/}}
{{- define "ddpjob.podTemplate" -}}
{{- $names := include "ddpjob.names" . | fromJson -}}
metadata:
  labels:
    {{- include "ddpjob.podSelectorLabels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    kubectl.kubernetes.io/default-container: {{ include "ddpjob.containerName" . }}
    {{- if .Values.metrics.annotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ .Values.metrics.port | int | toString | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "ddpjob.serviceAccountName" . | quote }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  {{- if .Values.queue.volcano }}
  schedulerName: volcano
  {{- else if .Values.queue.coscheduling }}
  schedulerName: {{ .Values.queue.coscheduling | quote }}
  {{- end }}
  {{- with include "ddpjob.podRestartPolicy" . }}
  restartPolicy: {{ . }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . | quote }}
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  terminationGracePeriodSeconds: {{ int .Values.terminationGracePeriodSeconds }}
  # The sandbox's pause is PID 1 and the command is not: the kernel drops a signal that a namespace's PID 1 has no
  # handler for, and Python has none until its first lines run (the interpreter starting, slow on a loaded node),
  # which held a pod stopped then until its grace period ended. Pause also reaps orphaned processes.
  shareProcessNamespace: true
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ int .Values.security.runAsUser }}
    runAsGroup: {{ int .Values.security.runAsGroup }}
    fsGroup: {{ int .Values.security.fsGroup }}
    fsGroupChangePolicy: OnRootMismatch
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: {{ include "ddpjob.containerName" . }}
      image: {{ include "ddpjob.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      # The operator injects PET_* (torchrun's flags; v1 also MASTER_*, RANK and WORLD_SIZE). trainer.launch
      # is torchrun that exits 128 + signal when stopped by one, so restartPolicy ExitCode retries it.
      command: [python, -m, trainer.launch, -m, trainer, --config, {{ printf "%s/training.yaml" (include "ddpjob.configDir" .) | quote }}]
      # A failed container's last log lines become its termination message: trainer.launch's (and
      # trainer.prepare's) last line is the one-line root cause, which `ctl status` and `kubectl describe` show.
      terminationMessagePolicy: FallbackToLogsOnError
      ports:
        {{- if not (include "ddpjob.isTrainJob" .) }}
        - name: pytorchjob-port
          containerPort: {{ int .Values.masterPort }}
          protocol: TCP
        {{- end }}
        # Local rank 0 serves the metrics of all the pod's processes here.
        - name: {{ $names.metricsPort }}
          containerPort: {{ int .Values.metrics.port }}
          protocol: TCP
      env:
        - name: {{ $names.env.jobName }}
          value: {{ include "ddpjob.fullname" . | quote }}
        - name: {{ $names.env.metricsPort }}
          value: {{ .Values.metrics.port | int | toString | quote }}
        - name: {{ $names.env.metricsDir }}
          value: {{ include "ddpjob.metricsDir" . | quote }}
        # The ddpjob that rendered training.yaml: an older trainer that refuses its keys names both versions.
        - name: {{ $names.env.renderedBy }}
          value: {{ .Chart.AppVersion | quote }}
        # The root filesystem is read-only: every cache goes to the bounded scratch volume.
        - name: HOME
          value: {{ include "ddpjob.home" . | quote }}
        - name: XDG_CACHE_HOME
          value: {{ printf "%s/.cache" (include "ddpjob.home" .) | quote }}
        - name: HF_HOME
          value: {{ printf "%s/.cache/huggingface" (include "ddpjob.home" .) | quote }}
        {{- $compileCache := printf "%s/.cache" (include "ddpjob.home" .) }}
        {{- if include "ddpjob.compileCacheOnVolume" . }}
        # torch.compile's caches in the run directory on the volume, a folder per pod: a recreated pod finds what
        # it compiled before, where its scratch volume is new (compiling again: a minute or more on a GPU).
        - name: {{ $names.env.podKey }}
          valueFrom:
            fieldRef:
              fieldPath: {{ (include "ddpjob.kindNames" . | fromJson).podKeyField | quote }}
        {{- $compileCache = printf "%s/%s/$(%s)" (include "ddpjob.checkpointDir" .) $names.compileCacheDir $names.env.podKey }}
        {{- end }}
        {{- range $name, $folder := $names.compileCaches }}
        - name: {{ $name }}
          value: {{ printf "%s/%s" $compileCache $folder | quote }}
        {{- end }}
        - name: TMPDIR
          value: {{ $names.mounts.tmp }}
        {{- if include "ddpjob.setsThreads" . }}
        # The pod's CPU request shared by its processes: torch would start a thread per core of the node.
        - name: {{ $names.env.threads }}
          value: {{ include "ddpjob.threadsPerProcess" . | quote }}
        {{- end }}
        # After forwarding SIGTERM, torchrun waits this long for its workers to save and exit (torch's
        # default: 30 s, whatever the grace period); the last 5 s of the grace period are its own exit.
        - name: {{ $names.env.shutdownTimeout }}
          value: {{ max 0 (sub (int .Values.terminationGracePeriodSeconds) 5) | toString | quote }}
        {{- if include "ddpjob.isTrainJob" . }}
        # The operator v1 sets it; Trainer v2 does not, and a piped stdout would show the log in blocks.
        - name: PYTHONUNBUFFERED
          value: "1"
        {{- end }}
        {{- if .Values.prepare.enabled }}
        # The prepare Job (named here) tokenizes the data: the trainer waits for its manifest instead of preparing.
        - name: {{ $names.env.preparedByJob }}
          value: {{ include "ddpjob.prepareJobName" . }}
        {{- end }}
        {{- if .Values.elastic.enabled }}
        # A fresh rendezvous store every round: torchrun's shared store keeps the keys of the
        # previous round, and restarted workers can wait forever on peers that are gone.
        - name: {{ $names.env.freshRendezvousStore }}
          value: "1"
        {{- end }}
        {{- with include "ddpjob.ncclEnv" . | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "ddpjob.s3Env" . | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with .Values.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .Values.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      resources:
        {{- include "ddpjob.resources" . | nindent 8 }}
      securityContext:
        runAsNonRoot: true
        readOnlyRootFilesystem: true
        allowPrivilegeEscalation: false
        capabilities:
          drop: [ALL]
        seccompProfile:
          type: RuntimeDefault
      volumeMounts:
        - name: training-config
          mountPath: {{ include "ddpjob.configDir" . }}
          readOnly: true
        {{- if not .Values.storage.uri }}
        - name: checkpoints
          mountPath: {{ .Values.storage.mountPath | quote }}
        {{- end }}
        - name: dshm
          mountPath: {{ $names.mounts.shm }}
        - name: metrics
          mountPath: {{ include "ddpjob.metricsDir" . }}
        - name: scratch
          mountPath: {{ include "ddpjob.home" . }}
          subPath: home
        - name: scratch
          mountPath: {{ $names.mounts.tmp }}
          subPath: tmp
  volumes:
    - name: training-config
      configMap:
        name: {{ include "ddpjob.configMapName" . }}
    {{- if not .Values.storage.uri }}
    - name: checkpoints
      persistentVolumeClaim:
        claimName: {{ include "ddpjob.claimName" . | quote }}
    {{- end }}
    # NCCL and DataLoader workers share memory through /dev/shm; the runtime default is 64Mi.
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.resources.shm | quote }}
    # The metric files of the pod's trainer processes (a few MB); emptied by each new attempt.
    - name: metrics
      emptyDir:
        sizeLimit: 64Mi
    # HOME with its caches (Hugging Face, torch.compile, Triton) and /tmp: one bound for both; the kubelet
    # evicts a pod that writes more instead of filling the node's disk.
    - name: scratch
      emptyDir:
        sizeLimit: {{ .Values.resources.cache | quote }}
{{- end }}
