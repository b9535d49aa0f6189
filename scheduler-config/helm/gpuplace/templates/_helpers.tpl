{{/*
Shared pieces of the gpuplace chart. Names are the plain manifests' (scheduler-config/), fixed, so
that the default rendering is those manifests; namespace-scoped objects go to .Release.Namespace.
*/}}

{{/* The extender's Service name as kube-scheduler and the TLS certificate see it. */}}
{{- define "gpuplace.extenderHost" -}}
gpuplace-extender.{{ .Release.Namespace }}.svc
{{- end }}

{{/* Whether kube-scheduler talks to the extender over HTTPS with a client certificate: "true" or "". */}}
{{- define "gpuplace.tls" -}}
{{- if ne .Values.extender.tls.mode "off" }}true{{ end }}
{{- end }}

{{/* kube-scheduler's urlPrefix: scheduler.extenderURL, else the Service, port 8888 (`gpuplace serve`
default --listen) and the default --prefix /gpuplace; http:// with extender.tls.mode=off. */}}
{{- define "gpuplace.extenderURL" -}}
{{- if .Values.scheduler.extenderURL -}}
{{ .Values.scheduler.extenderURL }}
{{- else -}}
{{ ternary "https" "http" (eq (include "gpuplace.tls" .) "true") }}://{{ include "gpuplace.extenderHost" . }}:8888/gpuplace
{{- end }}
{{- end }}

{{/* Where the device plugins' utilization ConfigMaps are. */}}
{{- define "gpuplace.utilizationNamespace" -}}
{{ .Values.utilizationNamespace | default .Release.Namespace }}
{{- end }}

{{/* The namespace of the assignment key Secret. */}}
{{- define "gpuplace.keySecretNamespace" -}}
{{ .Values.extender.assignmentKeySecret.namespace | default .Release.Namespace }}
{{- end }}

{{/* An image reference from {repository, tag}. */}}
{{- define "gpuplace.image" -}}
{{ .repository }}:{{ .tag }}
{{- end }}

{{/* Values that cannot work together; the schema checks types and enums. */}}
{{- define "gpuplace.validate" -}}
{{- if hasKey .Values.extender.tls "enabled" }}
{{- fail "extender.tls.enabled is gone: TLS is on by default (extender.tls.mode=selfIssued); use extender.tls.mode=secret for your own certificates, off for plain HTTP" }}
{{- end }}
{{- if and (not .Values.extender.leaderElect) (gt (int .Values.extender.replicas) 1) }}
{{- fail "extender.leaderElect=false runs one replica: set extender.replicas=1" }}
{{- end }}
{{- if and .Values.extender.policy.fixedMix .Values.extender.policy.mixState.enabled }}
{{- fail "extender.policy.fixedMix turns learning off: it cannot go with extender.policy.mixState.enabled" }}
{{- end }}
{{- if and .Values.extender.policy.fixedMix (not (kindIs "invalid" .Values.extender.policy.mixHalfLife)) }}
{{- fail "extender.policy.fixedMix turns learning off: it cannot go with extender.policy.mixHalfLife" }}
{{- end }}
{{- if and .Values.extender.placementLogEveryCall (not .Values.extender.placementLog) }}
{{- fail "extender.placementLogEveryCall needs extender.placementLog" }}
{{- end }}
{{- if and .Values.extender.placementLogEveryCall (not (kindIs "invalid" .Values.extender.placementLogRestateSeconds)) }}
{{- fail "extender.placementLogEveryCall writes every call: it cannot go with extender.placementLogRestateSeconds" }}
{{- end }}
{{- $dp := .Values.devicePlugin }}
{{- if $dp.dra.enabled }}
{{- /* kubelet dials the driver's sockets by their host paths; a Unix socket path holds 107 bytes */}}
{{- $reg := printf "%s/plugins_registry/%s-reg.sock" $dp.kubeletRootDir $dp.dra.driver }}
{{- $svc := printf "%s/plugins/%s/dra.sock" $dp.kubeletRootDir $dp.dra.driver }}
{{- range list $reg $svc }}
{{- if gt (len .) 107 }}
{{- fail (printf "devicePlugin.kubeletRootDir and devicePlugin.dra.driver make the DRA socket path %s %d bytes long: a Unix socket path holds at most 107, and kubelet could not dial it" . (len .)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
