{{/*
Names. Everything is named <fullname>-<part>; <fullname> is the release name, with "-rlbus"
appended unless it already says rlbus.
*/}}
{{- define "rlbus.fullname" -}}
{{- if contains "rlbus" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-rlbus" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rlbus.labels" -}}
app.kubernetes.io/name: rlbus
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one part: (dict "root" $ "part" "rollout") */}}
{{- define "rlbus.selectorLabels" -}}
app.kubernetes.io/name: rlbus
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .part }}
{{- end -}}

{{/*
The topic catalogue and consumer groups, by the rules of the code: a topic is
<prefix>.<name> (rlbus.topics.Topics), a tier's group <prefix>.<tier> (rlbus.acl.group_name).
`rlbus k8s names` prints what the code makes of a prefix; tests/k8s/test_chart.py holds the
rendered ScaledObjects and RLBUS_GROUP variables to it.
*/}}
{{- define "rlbus.inputTopic" -}}
{{- $inputs := dict "rollout" "prompts" "inference" "steps" "reward" "trajectories" "learner" "trajectories.scored" -}}
{{- printf "%s.%s" .root.Values.topics.prefix (get $inputs .tier) -}}
{{- end -}}

{{- define "rlbus.group" -}}
{{- printf "%s.%s" .root.Values.topics.prefix .tier -}}
{{- end -}}

{{- define "rlbus.bootstrap" -}}
{{- if .Values.kafka.bundled.enabled -}}
{{- if .Values.hostNetwork -}}
{{- printf "127.0.0.1:%v" .Values.kafka.bundled.port -}}
{{- else -}}
{{- printf "%s-kafka.%s.svc:%v" (include "rlbus.fullname" .) .Release.Namespace .Values.kafka.bundled.port -}}
{{- end -}}
{{- else -}}
{{- required "kafka.bootstrap is required (or kafka.bundled.enabled=true)" .Values.kafka.bootstrap -}}
{{- end -}}
{{- end -}}

{{- define "rlbus.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- end -}}

{{/* How long a pod may take to stop: the tier's drain time plus a margin (seconds, int). */}}
{{- define "rlbus.gracePeriod" -}}
{{- $v := index .root.Values .tier -}}
{{- $extra := 15 -}}
{{- if eq .tier "learner" }}{{ $extra = add $extra $v.checkpointGraceS }}{{ end -}}
{{- add (ceil $v.drainTimeoutS | int) $extra -}}
{{- end -}}

{{/* Variables every rlbus container gets: (dict "root" $ "tier" "rollout") */}}
{{- define "rlbus.env" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
- name: RLBUS_INSTANCE  # the pod's name: each member's own (on the host network HOSTNAME is the node's)
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: RLBUS_KAFKA__BOOTSTRAP
  value: {{ include "rlbus.bootstrap" $root | quote }}
- name: RLBUS_KAFKA__SECURITY_PROTOCOL
  value: {{ $v.kafka.securityProtocol | quote }}
{{- with $v.kafka.saslMechanism }}
- name: RLBUS_KAFKA__SASL_MECHANISM
  value: {{ . | quote }}
{{- end }}
{{- with $v.kafka.tls.secretName }}
- name: RLBUS_KAFKA__SSL_CAFILE
  value: /etc/rlbus/kafka-tls/{{ $v.kafka.tls.caKey }}
{{- with $v.kafka.tls.certKey }}
- name: RLBUS_KAFKA__SSL_CERTFILE
  value: /etc/rlbus/kafka-tls/{{ . }}
{{- end }}
{{- with $v.kafka.tls.keyKey }}
- name: RLBUS_KAFKA__SSL_KEYFILE
  value: /etc/rlbus/kafka-tls/{{ . }}
{{- end }}
{{- end }}
- name: RLBUS_TOPICS__PREFIX
  value: {{ $v.topics.prefix | quote }}
- name: RLBUS_TOPICS__PARTITIONS
  value: {{ $v.topics.partitions | quote }}
- name: RLBUS_TOPICS__RESULT_PARTITIONS
  value: {{ $v.topics.resultPartitions | quote }}
- name: RLBUS_TOPICS__REPLICATION
  value: {{ $v.topics.replication | quote }}
- name: RLBUS_TOPICS__MIN_INSYNC_REPLICAS
  value: {{ $v.topics.minInsyncReplicas | quote }}
{{- if .tier }}
{{- $t := index $v .tier }}
- name: RLBUS_GROUP
  value: {{ include "rlbus.group" . | quote }}
- name: RLBUS_DRAIN_TIMEOUT_S
  value: {{ $t.drainTimeoutS | quote }}
{{- if eq $v.probes.mode "http" }}
- name: RLBUS_HEALTH_PORT
  value: {{ $v.probes.port | quote }}
{{- else }}
- name: RLBUS_HEALTH_SOCKET
  value: /tmp/rlbus-health.sock
{{- end }}
{{- if include "rlbus.needsModel" .tier }}
- name: RLBUS_MODEL_PATH
  value: {{ $v.model.path | quote }}
{{- end }}
- name: HF_HUB_OFFLINE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
- name: OTEL_SERVICE_NAME
  value: rlbus-{{ .tier }}
{{- range $name, $value := $v.env }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- range $name, $value := $t.env }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Secrets as variables: the shared Kafka one, then the tier's own. */}}
{{- define "rlbus.envFrom" -}}
{{- $v := .root.Values -}}
{{- with $v.kafka.secretName }}
- secretRef:
    name: {{ . }}
{{- end }}
{{- if .tier }}
{{- range (index $v .tier).envFromSecrets }}
- secretRef:
    name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Probes from the service's own state (rlbus.health). */}}
{{- define "rlbus.probes" -}}
{{- $p := .Values.probes -}}
{{- if and .Values.hostNetwork (eq $p.mode "http") -}}
{{- fail "probes.mode=http with hostNetwork=true: replicas on one node would share the port; use probes.mode=exec" -}}
{{- end -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  {{- if eq $p.mode "http" }}
  httpGet:
    path: {{ if eq $kind "readiness" }}/ready{{ else }}/live{{ end }}
    port: health
  {{- else if eq $p.mode "exec" }}
  exec:
    command: ["python", "-m", "rlbus.health", {{ if eq $kind "readiness" }}"ready"{{ else }}"live"{{ end }}]
  {{- else }}
  {{- fail "probes.mode must be http or exec" }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  {{- if eq $kind "startup" }}
  failureThreshold: {{ $p.startupFailureThreshold }}
  {{- else if eq $kind "liveness" }}
  failureThreshold: 3
  {{- end }}
{{- end }}
{{- end -}}

{{/* Requests and limits, with the GPU extended resource when asked for and named. */}}
{{- define "rlbus.resources" -}}
{{- $r := deepCopy (.t.resources | default dict) -}}
{{- if and (gt (int .t.gpus) 0) .root.Values.gpu.resourceName -}}
{{- $limits := $r.limits | default dict -}}
{{- $_ := set $limits .root.Values.gpu.resourceName (int .t.gpus) -}}
{{- $_ := set $r "limits" $limits -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* "true" for the tiers that load the model (reward reads no model), else "". */}}
{{- define "rlbus.needsModel" -}}
{{- if has . (list "rollout" "inference" "learner") }}true{{ end -}}
{{- end -}}

{{/* Init containers: the tiny model (model.init=tiny), the topics with a bundled broker.
(dict "root" $ "tier" t) */}}
{{- define "rlbus.initContainers" -}}
{{- $v := .root.Values -}}
{{- $root := .root -}}
{{- if not (has $v.model.init (list "tiny" "none")) }}
{{- fail "model.init must be tiny or none" }}
{{- end }}
{{- if and (eq $v.model.init "tiny") (include "rlbus.needsModel" .tier) }}
- name: model-init
  image: {{ include "rlbus.image" $root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["sh", "-ec"]
  args:
    - |
      # Seeded: every pod builds the same model. Built aside and renamed, so a pod
      # restarted mid-build never takes a half-written folder for a model.
      P={{ $v.model.path }}
      if [ ! -f "$P/config.json" ]; then
        rm -rf "$P.tmp"
        python -c "import sys; from rlbus.learner.tiny_model import build_tiny_model; build_tiny_model(sys.argv[1])" "$P.tmp"
        mv -T "$P.tmp" "$P"
      fi
  env:
    - name: HF_HUB_OFFLINE
      value: "1"
  volumeMounts:
    - name: model
      mountPath: {{ $v.model.mountPath }}
{{- end }}
{{- if and $v.kafka.bundled.enabled $v.topics.create }}
- name: topics
  image: {{ include "rlbus.image" $root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  args: ["topics", "create"]
  env:
    {{- include "rlbus.env" (dict "root" $root) | nindent 4 }}
  {{- with (include "rlbus.envFrom" (dict "root" $root)) }}
  envFrom:
    {{- . | nindent 4 }}
  {{- end }}
  {{- include "rlbus.tlsMount" $root | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "rlbus.tlsMount" -}}
{{- if .Values.kafka.tls.secretName }}
volumeMounts:
  - name: kafka-tls
    mountPath: /etc/rlbus/kafka-tls
    readOnly: true
{{- end }}
{{- end -}}

{{/* Pod-level settings every rlbus pod shares. */}}
{{- define "rlbus.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Volumes: the model, the weight store, the Kafka TLS secret. (dict "root" $ "tier" t) */}}
{{- define "rlbus.volumes" -}}
{{- $v := .root.Values -}}
{{- if include "rlbus.needsModel" .tier }}
- name: model
  {{- if $v.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $v.model.existingClaim }}
    readOnly: true
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- if has .tier (list "inference" "learner") }}
- name: weights
  persistentVolumeClaim:
    claimName: {{ include "rlbus.weightsClaim" .root }}
{{- end }}
{{- with $v.kafka.tls.secretName }}
- name: kafka-tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- if and (eq .tier "learner") (gt (int $v.learner.nprocPerNode) 1) }}
- name: shm  # torch.distributed's tensors between local ranks
  emptyDir:
    medium: Memory
{{- end }}
{{- end -}}

{{- define "rlbus.volumeMounts" -}}
{{- $v := .root.Values -}}
{{- if include "rlbus.needsModel" .tier }}
- name: model
  mountPath: {{ $v.model.mountPath }}
  readOnly: {{ if $v.model.existingClaim }}true{{ else }}false{{ end }}
{{- end }}
{{- if has .tier (list "inference" "learner") }}
- name: weights
  mountPath: {{ $v.weights.mountPath }}
  readOnly: {{ eq .tier "inference" }}
{{- end }}
{{- if $v.kafka.tls.secretName }}
- name: kafka-tls
  mountPath: /etc/rlbus/kafka-tls
  readOnly: true
{{- end }}
{{- if eq .tier "learner" }}
- name: checkpoint
  mountPath: {{ $v.learner.checkpoint.mountPath }}
{{- if gt (int $v.learner.nprocPerNode) 1 }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- end }}
{{- end -}}

{{- define "rlbus.weightsClaim" -}}
{{- .Values.weights.existingClaim | default (printf "%s-weights" (include "rlbus.fullname" .)) -}}
{{- end -}}
