{{/*
What differs between the two job APIs (`apiKind`): the Kubeflow training operator v1's PyTorchJob and
Kubeflow Trainer v2.3's TrainJob (JobSet). Everything else the pods get is one pod template, "ddpjob.podTemplate".
*/}}

{{/*
True (non-empty) when the job is a Trainer v2 TrainJob.
*/}}
{{- define "ddpjob.isTrainJob" -}}
{{- if eq .Values.apiKind "TrainJob" }}true{{ end -}}
{{- end }}

{{/*
This kind's names (its entry of the generated _names.tpl, from ctl/kinds) as JSON: read them as
`(include "ddpjob.kindNames" . | fromJson).container`.
*/}}
{{- define "ddpjob.kindNames" -}}
{{- index (include "ddpjob.names" . | fromJson) "kinds" .Values.apiKind | toJson -}}
{{- end }}

{{/*
The trainer container's name: the operator v1 needs `pytorch`; Trainer v2's torch plugin injects its env
into the container named `node` of the replicated job labelled as the trainer.
*/}}
{{- define "ddpjob.containerName" -}}
{{- (include "ddpjob.kindNames" . | fromJson).container -}}
{{- end }}

{{/*
The longest pod hostname the operator derives; the spec model (JobSpec.longest_pod_name) computes the same.
PyTorchJob: <name>-master-0 or <name>-worker-<last>. TrainJob: <name>-node-0-<last>, the Indexed Job pods of
the JobSet's replicated job `node`.
*/}}
{{- define "ddpjob.longestPodName" -}}
{{- $name := .Values.name -}}
{{- $pods := (include "ddpjob.kindNames" . | fromJson).podNames -}}
{{- if include "ddpjob.isTrainJob" . -}}
{{- printf "%s-%s-%d" $name $pods.node (sub (int .Values.nodes) 1) -}}
{{- else -}}
{{- $workers := ternary (int .Values.elastic.maxNodes) (sub (int .Values.nodes) 1) .Values.elastic.enabled -}}
{{- ternary (printf "%s-%s-%d" $name $pods.worker (sub $workers 1)) (printf "%s-%s-0" $name $pods.master) (gt $workers 0) -}}
{{- end -}}
{{- end }}

{{/*
The pod label naming the job (the PodMonitor's jobLabel: Prometheus' `job` label is the job's name).
*/}}
{{- define "ddpjob.jobNameLabel" -}}
{{- (include "ddpjob.kindNames" . | fromJson).jobLabel -}}
{{- end }}

{{/*
Pod labels telling a job's pods apart (the PodMonitor's podTargetLabels).
*/}}
{{- define "ddpjob.podIndexLabels" -}}
{{- toYaml (include "ddpjob.kindNames" . | fromJson).indexLabels -}}
{{- end }}

{{/*
Kueue labels on the job object (Kueue admits PyTorchJobs and TrainJobs by them).
*/}}
{{- define "ddpjob.queueLabels" -}}
{{- $labels := (include "ddpjob.names" . | fromJson).kueueLabels -}}
{{- with .Values.queue.kueue }}
{{ $labels.queue }}: {{ . | quote }}
{{- end }}
{{- with .Values.queue.kueuePriorityClass }}
{{ $labels.priorityClass }}: {{ . | quote }}
{{- end }}
{{- with .Values.queue.kueueMaxExecutionSeconds }}
{{ $labels.maxExecutionSeconds }}: {{ . | int64 | toString | quote }}
{{- end }}
{{- end }}

{{/*
The pods' own restartPolicy: none for PyTorchJob (the operator sets it per replica); for the Job pods of a
TrainJob, Never where Job's podFailurePolicy must see every exit code (restartPolicy ExitCode), else the spec's.
*/}}
{{- define "ddpjob.podRestartPolicy" -}}
{{- if include "ddpjob.isTrainJob" . -}}
{{- ternary "Never" .Values.restartPolicy (eq .Values.restartPolicy "ExitCode") -}}
{{- end -}}
{{- end }}

{{/*
kubectl's kind name of the job object (kubectl get/describe).
*/}}
{{- define "ddpjob.kubectlKind" -}}
{{- (include "ddpjob.kindNames" . | fromJson).kubectlKind -}}
{{- end }}

{{/*
`kubectl logs` arguments naming node 0's trainer container: a pod name (PyTorchJob) or, for the Job pods of a
TrainJob (whose names end in a random suffix), a label selector.
*/}}
{{- define "ddpjob.nodeZeroLogArgs" -}}
{{- $name := include "ddpjob.fullname" . -}}
{{- $kind := include "ddpjob.kindNames" . | fromJson -}}
{{- if include "ddpjob.isTrainJob" . -}}
{{- printf "-l %s=%s,%s=0 -c %s" $kind.jobLabel $name (first $kind.indexLabels) $kind.container -}}
{{- else -}}
{{- $first := ternary $kind.podNames.worker $kind.podNames.master .Values.elastic.enabled -}}
{{- printf "%s-%s-0 -c %s" $name $first $kind.container -}}
{{- end -}}
{{- end }}
