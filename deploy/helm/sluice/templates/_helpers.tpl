{{/* The prefix of every object's name: the release's name, with the chart's unless it has it. */}}
{{- define "sluice.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object (40 characters of prefix leave room for the longest suffix). */}}
{{- define "sluice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: sluice
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* A component's labels: the chart's and its name, (dict "root" $ "component" "gateway"). */}}
{{- define "sluice.componentLabels" -}}
{{ include "sluice.labels" .root }}
app.kubernetes.io/name: sluice-{{ .component }}
{{- end -}}

{{/* A component's selector: (dict "root" $ "component" "gateway"). */}}
{{- define "sluice.selector" -}}
app.kubernetes.io/name: sluice-{{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "sluice.workerImage" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if eq .Values.worker.device "cuda" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-cuda" $tag) .Values.image.cudaTag) -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "sluice.gatewayImage" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "sluice.redisSecret" -}}
{{- default (printf "%s-redis" (include "sluice.fullname" .)) .Values.redis.existingSecret -}}
{{- end -}}

{{/* The variable a gateway's or a worker's Redis URL is made from (its password, or the whole URL). */}}
{{- define "sluice.redisEnv" -}}
{{- if .Values.redis.enabled -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "sluice.redisSecret" . }}, key: password}
{{- else -}}
- name: REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ required "redis.external.existingSecret: the Secret with your Redis's URL (or redis.enabled: true)" .Values.redis.external.existingSecret }}, key: {{ .Values.redis.external.key }}}
{{- end -}}
{{- end -}}

{{- define "sluice.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://:$(REDIS_PASSWORD)@{{ include "sluice.fullname" . }}-redis:6379/0
{{- else -}}
$(REDIS_URL)
{{- end -}}
{{- end -}}

{{- define "sluice.securityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/* nodeSelector, tolerations and affinity of a component's values. */}}
{{- define "sluice.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "sluice.tenantsSecret" -}}
{{- default (printf "%s-tenants" (include "sluice.fullname" .)) .Values.tenants.existingSecret -}}
{{- end -}}

{{- define "sluice.jobsSecret" -}}
{{- default (printf "%s-jobs-db" (include "sluice.fullname" .)) .Values.jobs.database.existingSecret -}}
{{- end -}}
