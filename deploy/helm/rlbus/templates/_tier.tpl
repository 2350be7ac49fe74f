{{/*
The pod template of one tier: (dict "root" $ "tier" "rollout"). Deployments (rollout,
inference, reward) and the learner's StatefulSet share it.
*/}}
{{- define "rlbus.tierPod" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $t := index $v .tier -}}
metadata:
  labels:
    {{- include "rlbus.selectorLabels" (dict "root" $root "part" .tier) | nindent 4 }}
  {{- with $v.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- include "rlbus.podCommon" $root | nindent 2 }}
  # SIGTERM starts the drain (stop fetching, finish or hand back in-flight work, commit);
  # the kubelet's SIGKILL must not come before drain_timeout_s is over.
  terminationGracePeriodSeconds: {{ include "rlbus.gracePeriod" . }}
  {{- with (include "rlbus.initContainers" .) }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .tier }}
      image: {{ include "rlbus.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- if and (eq .tier "learner") (gt (int $t.nprocPerNode) 1) }}
      command: ["torchrun", "--standalone", "--nproc_per_node", {{ $t.nprocPerNode | quote }}, "-m", "rlbus.learner"]
      {{- else }}
      args: ["run", {{ .tier | quote }}]
      {{- end }}
      env:
        {{- include "rlbus.env" . | nindent 8 }}
        {{- if eq .tier "learner" }}
        - name: RLBUS_WEIGHTS_DIR
          value: {{ $v.weights.mountPath | quote }}
        - name: RLBUS_CHECKPOINT_DIR
          value: {{ printf "%s/checkpoint" $t.checkpoint.mountPath | quote }}
        - name: RLBUS_METRICS_FILE
          value: {{ printf "%s/metrics.jsonl" $t.checkpoint.mountPath | quote }}
        {{- end }}
      {{- with (include "rlbus.envFrom" .) }}
      envFrom:
        {{- . | nindent 8 }}
      {{- end }}
      {{- if eq $v.probes.mode "http" }}
      ports:
        - name: health
          containerPort: {{ $v.probes.port }}
      {{- end }}
      {{- include "rlbus.probes" $root | nindent 6 }}
      resources:
        {{- include "rlbus.resources" (dict "root" $root "t" $t) | nindent 8 }}
      {{- with $t.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "rlbus.volumeMounts" .) }}
      volumeMounts:
        {{- . | nindent 8 }}
      {{- end }}
  {{- with (include "rlbus.volumes" .) }}
  volumes:
    {{- . | nindent 4 }}
  {{- end }}
{{- end -}}
