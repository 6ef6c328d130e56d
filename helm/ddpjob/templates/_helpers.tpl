{{/*
The chart name.
*/}}
{{- define "ddpjob.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The job's name: the spec's `name` (not the release name), so `ctl` and `helm install` name the
PyTorchJob alike and its pods are `<name>-master-0`, `<name>-worker-<i>`. The spec model keeps
those pod names within 63 characters; this check covers `helm install` with a values file ctl never saw.
*/}}
{{- define "ddpjob.fullname" -}}
{{- $name := required "name is required: the job's name (a DNS-1035 label)" .Values.name -}}
{{- $workers := ternary (int .Values.elastic.maxNodes) (sub (int .Values.nodes) 1) .Values.elastic.enabled -}}
{{- $longest := ternary (printf "%s-worker-%d" $name (sub $workers 1)) (printf "%s-master-0" $name) (gt $workers 0) -}}
{{- if gt (len $longest) 63 -}}
{{- fail (printf "name: too long: pod name %q would have %d characters (at most 63)" $longest (len $longest)) -}}
{{- end -}}
{{- $name -}}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "ddpjob.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
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
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
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
The run directory inside the pods: training.checkpoint.dir, or <storage.mountPath>/<name>.
*/}}
{{- define "ddpjob.checkpointDir" -}}
{{- $dir := dig "checkpoint" "dir" "" .Values.training -}}
{{- default (printf "%s/%s" (trimSuffix "/" .Values.storage.mountPath) (include "ddpjob.fullname" .)) $dir -}}
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
/etc/ddpjob
{{- end }}

{{/*
Where the trainer processes of a pod keep their metric files (prometheus_client's multiprocess mode).
*/}}
{{- define "ddpjob.metricsDir" -}}
/run/ddpjob-metrics
{{- end }}

{{/*
Labels of the job's pods (selectorLabels + component): the PodMonitor selects pods by them.
*/}}
{{- define "ddpjob.podSelectorLabels" -}}
{{ include "ddpjob.selectorLabels" . }}
app.kubernetes.io/component: trainer
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
Container resources: requests equal limits (extended resources such as GPUs require it); empty when none are set.
*/}}
{{- define "ddpjob.resources" -}}
{{- $r := dict -}}
{{- with .Values.resources.cpu }}{{ $_ := set $r "cpu" . }}{{ end -}}
{{- with .Values.resources.memory }}{{ $_ := set $r "memory" . }}{{ end -}}
{{- if gt (int .Values.resources.gpu) 0 }}{{ $_ := set $r "nvidia.com/gpu" (int .Values.resources.gpu) }}{{ end -}}
{{- if $r -}}
requests:
  {{- toYaml $r | nindent 2 }}
limits:
  {{- toYaml $r | nindent 2 }}
{{- end -}}
{{- end }}

{{/*
The pod template shared by Master and Worker replicas.
*/}}
{{- define "ddpjob.podTemplate" -}}
metadata:
  labels:
    {{- include "ddpjob.podSelectorLabels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    kubectl.kubernetes.io/default-container: pytorch
    {{- if .Values.metrics.annotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ .Values.metrics.port | int | toString | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "ddpjob.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  {{- if .Values.queue.volcano }}
  schedulerName: volcano
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
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ int .Values.security.runAsUser }}
    runAsGroup: {{ int .Values.security.runAsGroup }}
    fsGroup: {{ int .Values.security.fsGroup }}
    fsGroupChangePolicy: OnRootMismatch
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: pytorch
      image: {{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      # The operator injects PET_* (torchrun's flags), MASTER_*, RANK and WORLD_SIZE. trainer.launch
      # is torchrun that exits 128 + signal when stopped by one, so restartPolicy ExitCode retries it.
      command: [python, -m, trainer.launch, -m, trainer, --config, {{ printf "%s/training.yaml" (include "ddpjob.configDir" .) | quote }}]
      ports:
        - name: pytorchjob-port
          containerPort: {{ int .Values.masterPort }}
          protocol: TCP
        # Local rank 0 serves the metrics of all the pod's processes here.
        - name: metrics
          containerPort: {{ int .Values.metrics.port }}
          protocol: TCP
      env:
        - name: DDPJOB_JOB_NAME
          value: {{ include "ddpjob.fullname" . | quote }}
        - name: DDPJOB_METRICS_PORT
          value: {{ .Values.metrics.port | int | toString | quote }}
        - name: PROMETHEUS_MULTIPROC_DIR
          value: {{ include "ddpjob.metricsDir" . | quote }}
        # After forwarding SIGTERM, torchrun waits this long for its workers to save and exit (torch's
        # default: 30 s, whatever the grace period); the last 5 s of the grace period are its own exit.
        - name: TORCH_ELASTIC_SHUTDOWN_TIMEOUT
          value: {{ max 0 (sub (int .Values.terminationGracePeriodSeconds) 5) | toString | quote }}
        {{- if .Values.prepare.enabled }}
        # The prepare Job tokenizes the data: the trainer waits for its manifest instead of preparing.
        - name: DDPJOB_PREPARED_BY_JOB
          value: "1"
        {{- end }}
        {{- if .Values.elastic.enabled }}
        # A fresh rendezvous store every round: torchrun's shared store keeps the keys of the
        # previous round, and restarted workers can wait forever on peers that are gone.
        - name: TORCH_DISABLE_SHARE_RDZV_TCP_STORE
          value: "1"
        {{- end }}
        {{- with .Values.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .Values.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "ddpjob.resources" . }}
      resources:
        {{- . | nindent 8 }}
      {{- else }}
      resources: {}
      {{- end }}
      securityContext:
        runAsNonRoot: true
        allowPrivilegeEscalation: false
        capabilities:
          drop: [ALL]
        seccompProfile:
          type: RuntimeDefault
      volumeMounts:
        - name: training-config
          mountPath: {{ include "ddpjob.configDir" . }}
          readOnly: true
        - name: checkpoints
          mountPath: {{ .Values.storage.mountPath | quote }}
        - name: dshm
          mountPath: /dev/shm
        - name: metrics
          mountPath: {{ include "ddpjob.metricsDir" . }}
  volumes:
    - name: training-config
      configMap:
        name: {{ include "ddpjob.configMapName" . }}
    - name: checkpoints
      persistentVolumeClaim:
        claimName: {{ include "ddpjob.claimName" . }}
    # NCCL and DataLoader workers share memory through /dev/shm; the runtime default is 64Mi.
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.resources.shm | quote }}
    # The metric files of the pod's trainer processes (a few MB); emptied by each new attempt.
    - name: metrics
      emptyDir:
        sizeLimit: 64Mi
{{- end }}
