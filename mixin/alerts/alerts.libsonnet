// nettap's alerts. Thresholds, windows and selectors come from config.libsonnet; every alert
// links to its section of docs/runbook.md (anchor = lowercased alert name).
//
// Where a condition can be seen from two sources (nettap's own cgroup counters, and
// cAdvisor / kube-state-metrics on Kubernetes) the alert has one rule per source under the
// same name, told apart by a static `source` label (nettap | kubernetes): either fires when
// only its source is scraped, and promtool's duplicate-rule lint stays quiet.
{
  local cfg = $._config {
    kubeLabels: std.join(', ', $._config.kubeContainerLabels),

    // Descriptions that read other series with the `query` template function (Go templates:
    // the PromQL is a raw `...` string; %q quotes the alert's instance).
    local ingestSeries(metric, more='') =
      '%s{%s, instance=%%q%s}' % [metric, $._config.nettapIngestSelector, more],
    local failingWith(more) =
      '{{ with printf `increase(%s[%s]) > 0` $labels.instance | query }}' % [
        ingestSeries('nettap_ingest_connect_errors_total', more),
        $._config.rateInterval,
      ]
      + '; its connection attempts fail with {{ range $i, $s := . }}{{ if $i }} and {{ end }}{{ $s.Labels.reason }}{{ end }} errors',
    ingestBacklogDescription:
      'The oldest line nettap ingest on {{ $labels.instance }} has not had acknowledged was written {{ $value | humanizeDuration }} ago, and its backlog'
      + '{{ with printf `%s` $labels.instance | query }} ({{ . | first | value | humanize1024 }}B){{ end }}' % ingestSeries('nettap_ingest_backlog_bytes')
      + " is not shrinking: once it outgrows the capture's rotated files (output.backups files of output.max_bytes), the oldest one is rotated away unsent.",
    ingestDisconnectedDescription:
      'nettap ingest on {{ $labels.instance }} has not been connected to the engine (NATS) for %s' % $._config.ingestDisconnectedFor
      + failingWith(', reason=~"auth|tls"')
      + ': a configuration or credential problem (ingest credentials or ingest.tls), not the network'
      + '{{ else }}' + failingWith('') + '{{ end }}{{ end }}.',
  },

  // Adds the runbook link every alert carries.
  local withRunbook(rule) = rule {
    annotations+: { runbook_url: cfg.runbookURLPattern % std.asciiLower(rule.alert) },
  },
  local group(name, rules) = { name: name, rules: std.map(withRunbook, rules) },

  prometheusAlerts+:: {
    groups+: [
      group('nettap-capture', [
        {
          alert: 'NettapRingBufferDrops',
          expr: |||
            rate(nettap_ringbuf_drops_total{%(nettapSelector)s, ring=~"%(dataLossRingsRegex)s"}[%(rateInterval)s]) > 0
          ||| % cfg,
          'for': cfg.ringBufferDropsFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'Captured data is being lost: a nettap ring buffer reserve is failing.',
            description: 'nettap on {{ $labels.instance }} dropped {{ printf "%%.2f" $value }} records/s from ring {{ $labels.ring }} over the last %(rateInterval)s: captured payload is being lost.' % cfg,
          },
        },
        {
          alert: 'NettapRingBufferDrops',
          expr: |||
            rate(nettap_ringbuf_drops_total{%(nettapSelector)s, ring!~"%(dataLossRingsRegex)s"}[%(rateInterval)s]) > 0
          ||| % cfg,
          'for': cfg.ringBufferDropsFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'Events are being dropped: a nettap ring buffer reserve is failing.',
            description: 'nettap on {{ $labels.instance }} dropped {{ printf "%%.2f" $value }} records/s from ring {{ $labels.ring }} over the last %(rateInterval)s.' % cfg,
          },
        },
        {
          alert: 'NettapRingBufferFillHigh',
          expr: |||
            avg_over_time(nettap_ringbuf_pending_bytes{%(nettapSelector)s}[%(rateInterval)s])
              / (nettap_ringbuf_capacity_bytes{%(nettapSelector)s} > 0)
            > %(ringBufferFillRatio)g
          ||| % cfg,
          'for': cfg.ringBufferFillFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'A nettap ring buffer is filling up; drops follow when it is full.',
            description: 'Ring {{ $labels.ring }} of nettap on {{ $labels.instance }} is {{ $value | humanizePercentage }} full on average over the last %(rateInterval)s.' % cfg,
          },
        },
        {
          // Chunks published (kernel side) vs. records drained (user side) from capture_chunks:
          // equal in steady state. The seed's "calls climb while chunks flatten" is the kernel
          // side of the same story and shows as NettapRingBufferDrops.
          alert: 'NettapPipelineFallingBehind',
          expr: |||
            (
              sum without (ring) (rate(nettap_ringbuf_records_drained_total{%(nettapSelector)s, ring="capture_chunks"}[%(rateInterval)s]))
                /
              (sum without (probe) (rate(nettap_probe_chunks_published_total{%(nettapSelector)s}[%(rateInterval)s])) > 0)
            ) < %(pipelineDrainedRatio)g
          ||| % cfg,
          'for': cfg.pipelineFallingBehindFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'The user space of nettap is not keeping up with the chunks its probes publish.',
            description: 'nettap on {{ $labels.instance }} drained only {{ $value | humanizePercentage }} of the chunks its probes published over the last %(rateInterval)s.' % cfg,
          },
        },
        {
          alert: 'NettapRecordsLost',
          expr: |||
            rate(nettap_records_lost_total{%(nettapSelector)s}[%(rateInterval)s]) > 0
          ||| % cfg,
          'for': cfg.recordsLostFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'Captured records are lost after nettap read them from the ring.',
            description: 'nettap on {{ $labels.instance }} lost {{ printf "%%.2f" $value }} records/s at stage {{ $labels.stage }} over the last %(rateInterval)s.' % cfg,
          },
        },
        {
          // A map whose entries capture follows (tls_calls: a TLS call from its entry to its
          // return) refused an insert: what that entry was for is not captured. A burst still
          // fires, increase() staying above zero for the whole window.
          alert: 'NettapBPFMapFull',
          expr: |||
            increase(nettap_bpf_map_insert_failures_total{%(nettapSelector)s}[%(rateInterval)s]) > 0
          ||| % cfg,
          'for': cfg.mapInsertFailuresFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'A nettap BPF map is full: what its entries follow is not captured.',
            description: 'Map {{ $labels.map }} of nettap on {{ $labels.instance }} refused {{ printf "%%.0f" $value }} inserts over the last %(rateInterval)s.' % cfg,
          },
        },
        {
          // A probe that no mechanism attached is reported as mechanism="none" (value 0 in
          // exporter/metrics/collectors.py). Match that series whatever its value, unless the same
          // probe is also attached by a real mechanism.
          alert: 'NettapProbeAttachFailed',
          expr: |||
            nettap_probe_attached{%(nettapSelector)s, mechanism="none"}
              unless ignoring (mechanism)
            (nettap_probe_attached{%(nettapSelector)s, mechanism!="none"} == 1)
          ||| % cfg,
          'for': cfg.probeAttachFailedFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'A nettap probe is not attached and captures nothing.',
            description: 'Probe {{ $labels.probe }} of nettap on {{ $labels.instance }} failed to attach with fentry, kprobe and tracepoint.',
          },
        },
        {
          alert: 'NettapTlsFilesRefused',
          expr: |||
            sum without (reason) (
              increase(nettap_tls_files_refused_total{%(nettapSelector)s, reason=~"limit|user_limit|fds"}[%(rateInterval)s])
            ) > 0
          ||| % cfg,
          'for': cfg.tlsFilesRefusedFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'Some libssl files are left unattached: their TLS plaintext is not captured.',
            description: 'nettap on {{ $labels.instance }} refused {{ printf "%%.0f" $value }} libssl files over the last %(rateInterval)s for a bound (files attached at once, files of one user, or fds kept for reloads): processes using them have no TLS capture.' % cfg,
          },
        },
      ]),

      // nettap ingest: the capture's files to NATS JetStream. Publish errors have no alert of
      // their own: those retried (timeout, no_responders, disconnected) show as a backlog that
      // does not shrink, and a rejected publish loses its lines, counted as records lost.
      group('nettap-ingest', [
        {
          alert: 'NettapIngestDown',
          expr: |||
            up{%(nettapIngestSelector)s} == 0
          ||| % cfg,
          'for': cfg.ingestDownFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: "The nettap ingest cannot be scraped: its node's records may not be reaching the engine.",
            description: "Prometheus has failed to scrape nettap ingest on {{ $labels.instance }} for %(ingestDownFor)s; the capture's files are its only buffer until it is back." % cfg,
          },
        },
        {
          alert: 'NettapIngestRecordsLost',
          expr: |||
            increase(nettap_ingest_records_lost_total{%(nettapIngestSelector)s}[%(rateInterval)s]) > 0
          ||| % cfg,
          'for': cfg.ingestRecordsLostFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'The nettap ingest is losing records: they will never reach the engine.',
            description: 'nettap ingest on {{ $labels.instance }} lost about {{ printf "%%.0f" $value }} records for reason {{ $labels.reason }} over the last %(rateInterval)s.' % cfg,
          },
        },
        {
          // The age alone would also fire through the drain that follows a reconnect, which
          // needs no one: only a backlog that is not shrinking alerts.
          alert: 'NettapIngestBacklogGrowing',
          expr: |||
            nettap_ingest_backlog_seconds{%(nettapIngestSelector)s} > %(ingestBacklogSeconds)g
              unless
            deriv(nettap_ingest_backlog_seconds{%(nettapIngestSelector)s}[%(rateInterval)s]) < 0
          ||| % cfg,
          'for': cfg.ingestBacklogFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: "The nettap ingest is falling behind; the capture's oldest file will be rotated away unsent.",
            description: cfg.ingestBacklogDescription,
          },
        },
        {
          alert: 'NettapIngestDisconnected',
          expr: |||
            nettap_ingest_connected{%(nettapIngestSelector)s} == 0
          ||| % cfg,
          'for': cfg.ingestDisconnectedFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'The nettap ingest is not connected to the engine (NATS); its backlog grows.',
            description: cfg.ingestDisconnectedDescription,
          },
        },
        {
          // From the ingest's own series, so that it fires without cAdvisor (compose, the
          // local demo, systemd): NettapMemoryNearLimit's source="kubernetes" rule sees the
          // ingest container too, its source="nettap" rule only the capture.
          alert: 'NettapIngestMemoryNearLimit',
          expr: |||
            process_resident_memory_bytes{%(nettapIngestSelector)s}
              / (nettap_cgroup_memory_limit_bytes{%(nettapIngestSelector)s} > 0)
            > %(ingestMemoryNearLimitRatio)g
          ||| % cfg,
          'for': cfg.ingestMemoryNearLimitFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'The nettap ingest is close to its memory limit; the OOM killer is next.',
            description: 'The resident memory of nettap ingest on {{ $labels.instance }} is {{ $value | humanizePercentage }} of its memory limit.',
          },
        },
      ]),

      group('nettap-workloads', [
        {
          // About the captured services, not nettap: their connections end in resets.
          alert: 'NettapCapturedResetsHigh',
          expr: |||
            (
              sum by (instance) (rate(nettap_tcp_resets_total{%(nettapSelector)s}[%(rateInterval)s]))
                / (sum by (instance) (rate(nettap_tcp_state_changes_total{%(nettapSelector)s, to="CLOSE"}[%(rateInterval)s])) > 0)
              > %(capturedResetsRatio)g
            )
            and
            sum by (instance) (rate(nettap_tcp_resets_total{%(nettapSelector)s}[%(rateInterval)s])) > %(capturedResetsMinRate)g
          ||| % cfg,
          'for': cfg.capturedResetsFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'Connections of the captured workloads end in resets.',
            description: 'The sockets nettap captures on {{ $labels.instance }} sent or received {{ $value | humanizePercentage }} resets per connection closed over the last %(rateInterval)s.' % cfg,
          },
        },
        {
          // About the captured services, not nettap: their segments go unacknowledged
          // for a whole retransmission timeout (a lossy path, a peer that stopped answering).
          alert: 'NettapCapturedRetransmitTimeouts',
          expr: |||
            sum by (instance) (rate(nettap_tcp_retransmits_total{%(nettapSelector)s, kind="rto"}[%(rateInterval)s]))
              > %(capturedRtoRate)g
          ||| % cfg,
          'for': cfg.capturedRtoFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'Captured workloads keep retransmitting on timeouts.',
            description: 'The sockets nettap captures on {{ $labels.instance }} sent {{ $value | humanize }} segments a second again on retransmission timeouts (RTOs) over the last %(rateInterval)s: each waited a whole RTO (200 ms or more) for an acknowledgement.' % cfg,
          },
        },
        {
          // About the captured workloads' resolvers, not nettap: their DNS queries, over UDP or
          // TCP (docs/capture.md, DNS), end in SERVFAIL or go unanswered for 5 s
          // (rcode="timeout"). NXDOMAIN is the resolver's answer about the name, not a failure
          // of the resolver.
          alert: 'NettapCapturedDnsFailures',
          expr: |||
            (
              sum by (instance) (rate(nettap_dns_queries_total{%(nettapSelector)s, rcode=~"SERVFAIL|timeout"}[%(rateInterval)s]))
                / (sum by (instance) (rate(nettap_dns_queries_total{%(nettapSelector)s}[%(rateInterval)s])) > 0)
              > %(capturedDnsFailuresRatio)g
            )
            and
            sum by (instance) (rate(nettap_dns_queries_total{%(nettapSelector)s, rcode=~"SERVFAIL|timeout"}[%(rateInterval)s])) > %(capturedDnsFailuresMinRate)g
          ||| % cfg,
          'for': cfg.capturedDnsFailuresFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'DNS queries of captured workloads fail: their resolver answers SERVFAIL or nothing.',
            description: '{{ $value | humanizePercentage }} of the DNS queries the workloads nettap captures on {{ $labels.instance }} sent over the last %(rateInterval)s ended in SERVFAIL or got no answer within 5 s.' % cfg,
          },
        },
      ]),

      group('nettap-exporter', [
        {
          alert: 'NettapExporterDown',
          expr: |||
            up{%(nettapSelector)s} == 0
          ||| % cfg,
          'for': cfg.exporterDownFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'Prometheus cannot scrape nettap: nothing is captured or measured on its node.',
            description: 'Prometheus has failed to scrape nettap on {{ $labels.instance }} for %(exporterDownFor)s.' % cfg,
          },
        },
        {
          alert: 'NettapExporterDown',
          expr: |||
            absent(up{%(nettapSelector)s})
          ||| % cfg,
          'for': cfg.exporterAbsentFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'Prometheus has no nettap target at all.',
            // absent() only carries the selector's equality matchers: degrade gracefully.
            description: 'Prometheus has discovered no nettap target{{ with $labels.job }} of job {{ . }}{{ end }} for %(exporterAbsentFor)s.' % cfg,
          },
        },
        {
          alert: 'NettapRestarting',
          expr: |||
            changes(process_start_time_seconds{%(nettapSelector)s}[%(restartsWindow)s]) >= %(restartsThreshold)g
          ||| % cfg,
          'for': cfg.restartingFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'The nettap process keeps restarting; captures are lost at every restart.',
            description: 'nettap on {{ $labels.instance }} restarted {{ $value }} times in the last %(restartsWindow)s.' % cfg,
          },
        },
        {
          alert: 'NettapConfigReloadFailed',
          expr: |||
            nettap_config_last_reload_successful{%(nettapSelector)s} == 0
          ||| % cfg,
          'for': cfg.configReloadFailedFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'A configuration of nettap was refused; the previous one is still in force.',
            description: 'The last configuration reload of nettap on {{ $labels.instance }} failed.',
          },
        },
        {
          alert: 'NettapScrapeCollectorFailed',
          expr: |||
            nettap_scrape_collector_success{%(nettapSelector)s} == 0
          ||| % cfg,
          'for': cfg.collectorFailedFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'A nettap collector keeps failing; its series are missing.',
            description: 'Collector {{ $labels.collector }} of nettap on {{ $labels.instance }} has failed every scrape for %(collectorFailedFor)s.' % cfg,
          },
        },
      ]),

      group('nettap-cost', [
        {
          alert: 'NettapBPFStatsLeftOn',
          expr: |||
            nettap_bpf_stats_enabled{%(nettapSelector)s} == 1
          ||| % cfg,
          'for': cfg.bpfStatsLeftOnFor,
          labels: { severity: 'info' },
          annotations: {
            summary: 'Kernel BPF run-time statistics are left on; they cost on every BPF program of the node.',
            description: 'BPF run-time statistics have been on for more than %(bpfStatsLeftOnFor)s on {{ $labels.instance }}; set diagnostics.bpfStats.enabled to false when done measuring.' % cfg,
          },
        },
        {
          alert: 'NettapKernelBPFCPUHigh',
          expr: |||
            sum without (program) (rate(nettap_bpf_program_run_time_seconds_total{%(nettapSelector)s}[%(rateInterval)s])) > %(kernelBPFCPUCores)g
          ||| % cfg,
          'for': cfg.kernelBPFCPUFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: "The BPF programs of nettap use more kernel CPU than budgeted.",
            description: "nettap's BPF programs on {{ $labels.instance }} use {{ printf \"%.2f\" $value }} cores of kernel time, charged to the processes making the syscalls, not to nettap's cgroup.",
          },
        },
      ]),

      group('nettap-resources', [
        {
          alert: 'NettapCPUThrottlingHigh',
          expr: |||
            rate(nettap_cgroup_cpu_throttled_periods_total{%(nettapSelector)s}[%(rateInterval)s])
              / (rate(nettap_cgroup_cpu_periods_total{%(nettapSelector)s}[%(rateInterval)s]) > 0)
            > %(cpuThrottlingRatio)g
          ||| % cfg,
          'for': cfg.cpuThrottlingFor,
          labels: { severity: 'warning', source: 'nettap' },
          annotations: {
            summary: 'The nettap process is CPU-throttled; throttling precedes ring-buffer drops.',
            description: '{{ $value | humanizePercentage }} of the CFS periods of nettap on {{ $labels.instance }} were throttled over the last %(rateInterval)s.' % cfg,
          },
        },
        {
          alert: 'NettapCPUThrottlingHigh',
          expr: |||
            sum by (%(kubeLabels)s) (rate(container_cpu_cfs_throttled_periods_total{%(cadvisorSelector)s, %(nettapContainerSelector)s}[%(rateInterval)s]))
              / (sum by (%(kubeLabels)s) (rate(container_cpu_cfs_periods_total{%(cadvisorSelector)s, %(nettapContainerSelector)s}[%(rateInterval)s])) > 0)
            > %(cpuThrottlingRatio)g
          ||| % cfg,
          'for': cfg.cpuThrottlingFor,
          labels: { severity: 'warning', source: 'kubernetes' },
          annotations: {
            summary: 'The nettap process is CPU-throttled; throttling precedes ring-buffer drops.',
            description: '{{ $value | humanizePercentage }} of the CFS periods of container {{ $labels.container }} in pod {{ $labels.namespace }}/{{ $labels.pod }} were throttled over the last %(rateInterval)s.' % cfg,
          },
        },
        {
          alert: 'NettapMemoryNearLimit',
          expr: |||
            nettap_cgroup_memory_usage_bytes{%(nettapSelector)s}
              / (nettap_cgroup_memory_limit_bytes{%(nettapSelector)s} > 0)
            > %(memoryNearLimitRatio)g
          ||| % cfg,
          'for': cfg.memoryNearLimitFor,
          labels: { severity: 'warning', source: 'nettap' },
          annotations: {
            summary: 'The memory of nettap is close to its limit; the OOM killer is next.',
            description: 'The cgroup of nettap on {{ $labels.instance }} uses {{ $value | humanizePercentage }} of its memory limit.',
          },
        },
        {
          alert: 'NettapMemoryNearLimit',
          expr: |||
            max by (%(kubeLabels)s) (container_memory_working_set_bytes{%(cadvisorSelector)s, %(nettapContainerSelector)s})
              / on (%(kubeLabels)s)
            max by (%(kubeLabels)s) (kube_pod_container_resource_limits{%(kubeStateMetricsSelector)s, %(nettapContainerSelector)s, resource="memory"})
            > %(memoryNearLimitRatio)g
          ||| % cfg,
          'for': cfg.memoryNearLimitFor,
          labels: { severity: 'warning', source: 'kubernetes' },
          annotations: {
            summary: 'The memory of nettap is close to its limit; the OOM killer is next.',
            description: 'Container {{ $labels.container }} in pod {{ $labels.namespace }}/{{ $labels.pod }} has a working set of {{ $value | humanizePercentage }} of its memory limit.',
          },
        },
        {
          // A new container gets a new cgroup, so this catches kills that did not take the
          // whole container down (or deployments outside Kubernetes); the next rule catches
          // the container's own death.
          alert: 'NettapOOMKilled',
          expr: |||
            increase(nettap_cgroup_memory_oom_kills_total{%(nettapSelector)s}[%(oomWindow)s]) > 0
          ||| % cfg,
          'for': cfg.oomKilledFor,
          labels: { severity: 'warning', source: 'nettap' },
          annotations: {
            summary: 'The OOM killer killed a process of nettap.',
            description: 'A process in the cgroup of nettap on {{ $labels.instance }} was OOM-killed in the last %(oomWindow)s.' % cfg,
          },
        },
        {
          // cAdvisor's OOM events, or kube-state-metrics' last termination reason joined with
          // a recent restart (the reason alone stays OOMKilled until the next termination, so
          // it would fire forever). One rule, so one alert per container when both report it.
          alert: 'NettapOOMKilled',
          expr: |||
            (
              sum by (%(kubeLabels)s) (increase(container_oom_events_total{%(cadvisorSelector)s, %(nettapContainerSelector)s}[%(oomWindow)s])) > 0
            )
            or
            (
              max by (%(kubeLabels)s) (kube_pod_container_status_last_terminated_reason{%(kubeStateMetricsSelector)s, %(nettapContainerSelector)s, reason="OOMKilled"}) == 1
              and on (%(kubeLabels)s)
              sum by (%(kubeLabels)s) (increase(kube_pod_container_status_restarts_total{%(kubeStateMetricsSelector)s, %(nettapContainerSelector)s}[%(oomWindow)s])) > 0
            )
          ||| % cfg,
          'for': cfg.oomKilledFor,
          labels: { severity: 'warning', source: 'kubernetes' },
          annotations: {
            summary: 'The OOM killer killed a process of nettap.',
            description: 'Container {{ $labels.container }} in pod {{ $labels.namespace }}/{{ $labels.pod }} was OOM-killed in the last %(oomWindow)s.' % cfg,
          },
        },
        {
          alert: 'NettapMemoryRequestBelowUsage',
          expr: |||
            max by (%(kubeLabels)s) (container_memory_working_set_bytes{%(cadvisorSelector)s, %(nettapContainerSelector)s})
              > on (%(kubeLabels)s)
            max by (%(kubeLabels)s) (kube_pod_container_resource_requests{%(kubeStateMetricsSelector)s, %(nettapContainerSelector)s, resource="memory"})
          ||| % cfg,
          'for': cfg.memoryRequestBelowUsageFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'A nettap container uses more memory than it requests: an early eviction candidate.',
            description: 'Container {{ $labels.container }} in pod {{ $labels.namespace }}/{{ $labels.pod }} has a working set of {{ $value | humanize1024 }}B, above its memory request; set the request to at least the working set (%(memoryRequestMinimum)s minimum).' % cfg,
          },
        },
      ]),
    ],
  },
}
