{{/*
The KubeSchedulerConfiguration of option B (scheduler.mode=config): kube-scheduler-config.yaml, or
kube-scheduler-config-http.yaml with extender.tls.mode=off, comments included, the extender's URL from
the Service (scheduler.extenderURL overrides it). tests/helm_chart.rs holds both equal to the files.
*/}}
{{- define "gpuplace.kubeSchedulerConfig" -}}
{{- $tls := eq (include "gpuplace.tls" .) "true" -}}
{{- if $tls -}}
# kube-scheduler (v1.36) configuration with the gpuplace extender: the reference file, over HTTPS
# with a client certificate (mTLS, the default install).
#
# Used as-is by the default-profile option (default-profile/: the cluster's own kube-scheduler loads
# it with --config). The second-profile option (second-profile/gpuplace-scheduler.yaml) embeds the
# same extender stanza in a ConfigMap, under schedulerName gpuplace-scheduler.
# tests/scheduler_config.rs checks every KubeSchedulerConfiguration under scheduler-config/ against
# the code (resource names, port, prefix, verbs). docs/deploy.md walks through the install.
#
# kube-scheduler verifies the extender's serving certificate against caFile and presents
# certFile/keyFile, which the extender verifies before it answers any verb. The three files come
# from the Secret gpuplace-system/gpuplace-scheduler-tls (ca.crt, tls.crt, tls.key), which the
# extender writes and renews (docs/deploy.md, "TLS"): option A mounts it at
# /etc/kubernetes/gpuplace/tls, option B copies it there on every control-plane node.
# kube-scheduler reads them at start and does not start without them.
{{- else -}}
# kube-scheduler (v1.36) configuration with the gpuplace extender over plain HTTP, for an extender
# run without TLS (the chart's extender.tls.mode=off) only: nothing authenticates kube-scheduler,
# and anyone who reaches the extender's port drives the verbs, bind included (docs/deploy.md,
# "Security"). It is the reference file (kube-scheduler-config.yaml) with only urlPrefix,
# enableHTTPS and tlsConfig changed (tests/scheduler_config.rs holds everything else equal).
{{- end }}
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  # kubeadm's scheduler kubeconfig, as in the static pod manifest
  kubeconfig: /etc/kubernetes/scheduler.conf
leaderElection:
  # the control plane's usual lock: kube-system/kube-scheduler
  leaderElect: true
# GPU placement is a global choice (pack shares, keep multi-GPU sets on the best links): score every
# feasible node rather than stop after a sample. The extender answers 5,000 nodes in milliseconds
# (docs/performance.md).
percentageOfNodesToScore: 100
profiles:
- schedulerName: default-scheduler
extenders:
- # the extender's Service (extender/service.yaml), port 8888 (`gpuplace serve` default
{{- if $tls }}
  # --listen 0.0.0.0:8888) and the default --prefix /gpuplace, over HTTPS
{{- else }}
  # --listen 0.0.0.0:8888) and the default --prefix /gpuplace
{{- end }}
  urlPrefix: {{ include "gpuplace.extenderURL" . | quote }}
  filterVerb: filter
  prioritizeVerb: prioritize
  preemptVerb: preempt
  # the extender binds: it picks the exact GPUs, writes the gpuplace.io/assignment annotation and
  # creates the Binding itself (docs/contracts.md)
  bindVerb: bind
  # prioritize scores are 0..10; kube-scheduler multiplies them by weight and by 10 (100/10), so
  # weight 10 gives up to 1,000 points, about as much as all default score plugins together: among
  # nodes that fit, the GPU choice (packing, NVLink, fragmentation) decides
  weight: 10
{{- if $tls }}
  enableHTTPS: true
  tlsConfig:
    # the CA that signed the extender's serving certificate (the Secret's ca.crt)
    caFile: /etc/kubernetes/gpuplace/tls/ca.crt
    # kube-scheduler's client certificate and key (the Secret's tls.crt and tls.key), signed by
    # the CA the extender trusts: the extender answers no verb (/bind included) without them
    certFile: /etc/kubernetes/gpuplace/tls/kube-scheduler.crt
    keyFile: /etc/kubernetes/gpuplace/tls/kube-scheduler.key
    # the name verified in the extender's certificate, also when urlPrefix names the Service's
    # ClusterIP (option B on the host network cannot resolve the Service's name)
    serverName: {{ include "gpuplace.extenderHost" . }}
{{- else }}
  enableHTTPS: false
{{- end }}
  # names only in filter/prioritize: the extender keeps its own node cache (watchers). Full Node
  # lists also work (the extender reads GPU inventory from the nodes' annotations) but cost ~5 KiB a
  # node per request.
  nodeCacheCapable: true
  # a GPU pod must not be placed without gpuplace: if the extender is down, such pods stay Pending
  # (pods without gpuplace resources are never sent to it; see managedResources)
  ignorable: false
  httpTimeout: 5s
  # kube-scheduler calls the extender only for pods that request at least one of these.
  # ignoredByScheduler: whether kube-scheduler's own NodeResourcesFit leaves the resource out.
  managedResources:
  # Counted by kube-scheduler: the device plugin advertises it (K slots per GPU), kubelet admits
  # against it too, so the scheduler's count stays in step with kubelet's, and nodes without the
  # plugin are turned away before the extender is asked.
  - name: gpuplace.io/gpu
    ignoredByScheduler: false
  # Not counted by kube-scheduler. These are per-GPU quantities that only the extender can judge:
  # the scheduler would only compare a node-wide sum, which says nothing about whether one GPU has
  # room, and whole-GPU pods (gpu alone) take a GPU's memory and compute without requesting them.
  # Counting them would also make scheduling depend on the device plugin's node-status patch having
  # landed (a new node, or one whose extended capacity kubelet reset): the scheduler would refuse
  # with "Insufficient gpuplace.io/gpu-mem" nodes the extender knows fit. The device plugin still
  # publishes them as capacity (kubectl describe node, quotas); kubelet's admission checks the sum
  # when they are there, and the extender's placements never exceed it.
  - name: gpuplace.io/gpu-mem
    ignoredByScheduler: true
  - name: gpuplace.io/gpu-core
    ignoredByScheduler: true
{{- end }}
