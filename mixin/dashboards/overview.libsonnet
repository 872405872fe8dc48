// nettap / Overview: is it up, is it capturing everything, and what does it cost.
local lib = import 'lib.libsonnet';

{
  grafanaDashboards+:: {
    local cfg = $._config {
      sel: 'job=~"$job", instance=~"$instance"',
      // nettap ingest is its own scrape job, on its own port: its own instance variable.
      ingestSel: '%s, instance=~"$ingest_instance"' % $._config.nettapIngestSelector,
    },
    local q(expr) = expr % cfg,

    'nettap-overview.json': lib.dashboard(
      cfg,
      uid='nettap-overview',
      title='nettap / Overview',
      description='nettap health, capture pipeline, ingest to NATS JetStream, cost (user and kernel CPU, memory) and cgroup resources.',
      variables=[
        lib.queryVariable('job', 'Job', q('label_values(nettap_build_info{%(nettapSelector)s}, job)')),
        lib.queryVariable('instance', 'Instance', q('label_values(nettap_build_info{job=~"$job"}, instance)'), multi=true),
        lib.queryVariable('ingest_instance', 'Ingest instance', q('label_values(nettap_build_info{%(nettapIngestSelector)s}, instance)'), multi=true),
      ],
      rows=[
        {
          title: 'Health',
          panels: [
            lib.stat('Targets', 'none', [
              lib.target(q('sum(up{%(sel)s})'), 'up', instant=true),
              lib.target(q('count(up{%(sel)s}) - sum(up{%(sel)s})'), 'down', instant=true),
            ], description='nettap targets Prometheus scrapes successfully, and those it cannot.', h=6),
            lib.stat('BPF run-time stats', 'none', [
              lib.target(q('nettap_bpf_stats_enabled{%(sel)s}'), '{{instance}}', instant=true),
            ], description='Kernel BPF run-time statistics (diagnostics.bpfStats.enabled). Cheap but not free, on every BPF program of the node: turn off when done measuring.', h=6, mappings=lib.boolMapping('off', 'green', 'on', 'orange')),
            lib.stat('Config reload', 'none', [
              lib.target(q('nettap_config_last_reload_successful{%(sel)s}'), '{{instance}}', instant=true),
            ], description='Whether the last configuration (re)load succeeded. A refused file leaves the previous one in force.', h=6, mappings=lib.boolMapping('failed', 'red', 'ok', 'green')),
            lib.stat('Since last good config', 's', [
              lib.target(q('time() - nettap_config_last_reload_success_timestamp_seconds{%(sel)s}'), '{{instance}}', instant=true),
            ], description='Time since the configuration last loaded successfully: at start, or the last edit nettap accepted.', h=6),
            lib.table('Probe attach mechanisms', 'none', [
              lib.target(q('nettap_probe_attached{%(sel)s}'), instant=true, format='table'),
            ], description='How each probe is attached (fentry, kprobe, tracepoint); "none" means it failed and captures nothing.', w=8, h=6, hide=['job', 'Value']),
          ],
        },
        {
          title: 'Capture pipeline',
          panels: [
            lib.timeseries('Probe calls vs. chunks published', 'ops', [
              lib.target(q('sum by (probe) (rate(nettap_probe_calls_total{%(sel)s}[$__rate_interval]))'), '{{probe}} calls'),
              lib.target(q('sum by (probe) (rate(nettap_probe_chunks_published_total{%(sel)s}[$__rate_interval]))'), '{{probe}} chunks'),
            ], description='If calls keep climbing while chunks published flattens, the pipeline is falling behind.'),
            lib.timeseries('Bytes processed', 'Bps', [
              lib.target(q('sum by (probe) (rate(nettap_probe_bytes_processed_total{%(sel)s}[$__rate_interval]))'), '{{probe}}'),
            ], description='Bytes the captured sockets sent and received through each probed call (plaintext for the TLS probes).'),
            lib.timeseries('Ring buffer drops', 'ops', [
              lib.target(q('sum by (instance, ring) (rate(nettap_ringbuf_drops_total{%(sel)s}[$__rate_interval]))'), '{{instance}} {{ring}}'),
            ], description='Records dropped because a ring-buffer reserve failed. Drops on capture_chunks are lost captured data.', w=8),
            lib.timeseries('Ring buffer fill', 'percentunit', [
              lib.target(q('nettap_ringbuf_pending_bytes{%(sel)s} / nettap_ringbuf_capacity_bytes{%(sel)s}'), '{{instance}} {{ring}}'),
            ], description='Bytes produced but not yet consumed, over the ring size. Reserves fail when it reaches 100%.', w=8, max=1),
            lib.timeseries('Records drained', 'ops', [
              lib.target(q('sum by (ring, kind) (rate(nettap_ringbuf_records_drained_by_kind_total{%(sel)s}[$__rate_interval]))'), '{{ring}} {{kind}}'),
            ], description='Records user space reads from each ring, by kind. obs_events carries twelve: state, reset, owner, error, destroy, tls_handshake, retransmit, synack_retransmit, timer, probe, timewait and request; every other ring one of its own: chunk (capture_chunks), eof (capture_eof), log (logs), dlopen (the libssl files processes map while capture.tls is on), segment (segments) and dns (dns).', w=8),
            lib.timeseries('Records lost after the ring', 'ops', [
              lib.target(q('sum by (instance, stage) (rate(nettap_records_lost_total{%(sel)s}[$__rate_interval]))'), '{{instance}} {{stage}}'),
            ], description='queue: user-space queue full; sink: sink write failed; decode: record failed to decode.'),
            lib.timeseries('Sink records written', 'ops', [
              lib.target(q('sum by (sink) (rate(nettap_sink_records_written_total{%(sel)s}[$__rate_interval]))'), '{{sink}} written'),
              lib.target(q('sum by (sink) (rate(nettap_sink_errors_total{%(sel)s}[$__rate_interval]))'), '{{sink}} errors'),
            ], description='Records each sink wrote, and its failed writes: their records are lost (stage sink of Records lost after the ring).'),
          ],
        },
        {
          title: 'Ingest (NATS JetStream)',
          panels: [
            lib.stat('Ingest targets', 'none', [
              lib.target(q('sum(up{%(ingestSel)s})'), 'up', instant=true),
              lib.target(q('count(up{%(ingestSel)s}) - sum(up{%(ingestSel)s})'), 'down', instant=true),
            ], description='nettap ingest targets Prometheus scrapes successfully, and those it cannot.', h=8),
            lib.stat('Connected to the engine', 'none', [
              lib.target(q('nettap_ingest_connected{%(ingestSel)s}'), '{{instance}}', instant=true),
            ], description='Whether each nettap ingest is connected to a NATS server of ingest.servers. While it is not, the backlog grows.', h=8, mappings=lib.boolMapping('disconnected', 'red', 'connected', 'green')),
            lib.timeseries('Records written vs. acknowledged', 'ops', [
              lib.target(q('sum(rate(nettap_sink_records_written_total{%(sel)s, sink="jsonl"}[$__rate_interval]))'), 'written by the capture'),
              lib.target(q('sum(rate(nettap_ingest_records_published_total{%(ingestSel)s}[$__rate_interval]))'), 'published (resends included)'),
              lib.target(q('sum(rate(nettap_ingest_records_acked_total{%(ingestSel)s}[$__rate_interval]))'), 'acknowledged by the engine'),
            ], description="Lines the capture writes to its files, lines nettap ingest publishes, and lines the engine acknowledges as newly stored (duplicates of a resend not counted), over the instances selected in both pickers. In steady state written and acknowledged are equal; acknowledged above written is a backlog draining.", w=16),
            lib.timeseries('Backlog', 'bytes', [
              lib.target(q('nettap_ingest_backlog_bytes{%(ingestSel)s}'), '{{instance}}'),
            ], description="Bytes in the capture's files not yet acknowledged by the engine. The files (output.backups files of output.max_bytes) are the only buffer: past them the oldest is rotated away unsent. After an outage it drains back to about zero."),
            lib.timeseries('Backlog age', 's', [
              lib.target(q('nettap_ingest_backlog_seconds{%(ingestSel)s}'), '{{instance}}'),
            ], description='Age of the oldest line not yet acknowledged (0 when caught up). It climbs one second a second while nothing is acknowledged and falls as the backlog drains. NettapIngestBacklogGrowing fires when it stays above %(ingestBacklogSeconds)d s without shrinking.' % cfg),
            lib.timeseries('Publish errors', 'ops', [
              lib.target(q('sum by (instance, reason) (rate(nettap_ingest_publish_errors_total{%(ingestSel)s}[$__rate_interval]))'), '{{instance}} {{reason}}'),
            ], description='Failed publishes: timeout, no_responders (no stream for the subject) and disconnected are resent with the same id; rejected (the engine refused the message) loses its lines.', w=8),
            lib.timeseries('Connect errors', 'ops', [
              lib.target(q('sum by (instance, reason) (rate(nettap_ingest_connect_errors_total{%(ingestSel)s}[$__rate_interval]))'), '{{instance}} {{reason}}'),
            ], description='Failed connection attempts to the NATS servers. auth and tls are a configuration or credential problem; refused and other, the network or the servers.', w=8),
            lib.timeseries('Records lost in ingest', 'ops', [
              lib.target(q('sum by (instance, reason) (rate(nettap_ingest_records_lost_total{%(ingestSel)s}[$__rate_interval]))'), '{{instance}} {{reason}}'),
            ], description='Lines that will never reach the engine: rotated (the capture rotated their file away before the engine acknowledged them), too_large (a line larger than the server accepts), rejected (the engine refused them).', w=8),
            lib.timeseries('Ingest process CPU (cores)', 'short', [
              lib.target(q('rate(process_cpu_seconds_total{%(ingestSel)s}[$__rate_interval])'), '{{instance}}'),
            ], description="nettap ingest's own CPU (its container's own requests and limits). It rises while a backlog drains."),
            lib.timeseries('Ingest RSS vs. limit', 'bytes', [
              lib.target(q('process_resident_memory_bytes{%(ingestSel)s}'), '{{instance}} RSS'),
              lib.target(q('nettap_cgroup_memory_limit_bytes{%(ingestSel)s}'), '{{instance}} limit'),
            ], description="Resident memory of nettap ingest, and the memory limit of its own cgroup (no limit line when unlimited): NettapIngestMemoryNearLimit fires above %(ingestMemoryNearLimitRatio)g of it. The lines in flight to the engine are bounded by ingest.max_in_flight_bytes." % cfg),
          ],
        },
        {
          title: "Captured workloads' connections",
          panels: [
            lib.timeseries('Connections opened and closed', 'ops', [
              lib.target(q('sum(rate(nettap_tcp_state_changes_total{%(sel)s, from="CLOSE", to="SYN_SENT"}[$__rate_interval]))'), 'connects'),
              lib.target(q('sum(rate(nettap_tcp_state_changes_total{%(sel)s, from="LISTEN", to="SYN_RECV"}[$__rate_interval]))'), 'accepts'),
              lib.target(q('sum(rate(nettap_tcp_state_changes_total{%(sel)s, to="CLOSE"}[$__rate_interval]))'), 'closes'),
            ], description='TCP state changes of the captured sockets, counted in the kernel: connects (CLOSE to SYN_SENT), accepted connections (LISTEN to SYN_RECV), closes (to CLOSE).', w=8),
            lib.timeseries('Resets', 'ops', [
              lib.target(q('sum by (instance, direction) (rate(nettap_tcp_resets_total{%(sel)s}[$__rate_interval]))'), '{{instance}} {{direction}}'),
            ], description='Resets the captured sockets sent (an abort, a close with unread data) and received (a refused connect, a peer that aborted).', w=8),
            lib.timeseries('Socket errors', 'ops', [
              lib.target(q('sum by (instance, errno) (rate(nettap_tcp_socket_errors_total{%(sel)s}[$__rate_interval]))'), '{{instance}} {{errno}}'),
            ], description='Errors the captured sockets reported (ECONNREFUSED, ECONNRESET, ETIMEDOUT, ...); Linux 5.14+ (probe tcp_sk_error).', w=8),
            lib.timeseries('Retransmissions', 'ops', [
              lib.target(q('sum by (instance, kind) (rate(nettap_tcp_retransmits_total{%(sel)s}[$__rate_interval]))'), '{{instance}} {{kind}}'),
            ], description='Segments the captured sockets sent again, by the recovery that sent them: rto (the retransmission timer fired: a stall of 200 ms or more; tcp_retries2 in a row abort the connection), tlp (a tail loss probe), fast (recovery on ACKs); synack: SYN-ACKs a listener sent again.', w=8),
            lib.timeseries('Timers fired late (p99)', 'short', [
              lib.target(q('histogram_quantile(0.99, sum by (instance, timer, le) (rate(nettap_tcp_timer_behind_jiffies_bucket{%(sel)s}[$__rate_interval])))'), '{{instance}} {{timer}}'),
            ], description="Jiffies from a captured socket's retransmit or keepalive timer's slot on the timer wheel to when its CPU fired it, 99th percentile: a CPU late to run its wheel (a vCPU the host stopped, a softirq storm) delays retransmissions and keepalives by that much. Empty unless capture.records asks for timer (not in the default: its program runs on every timer of the node).", w=8),
            lib.timeseries('Zero-window and keepalive probes', 'ops', [
              lib.target(q('sum by (instance, probe) (rate(nettap_tcp_probes_total{%(sel)s}[$__rate_interval]))'), '{{instance}} {{probe}}'),
            ], description="Probes the captured sockets' timers sent: window, zero-window probes to a peer that advertised no room (a reader that stopped reading: the sender waits); keepalive, keepalive probes to an idle peer (each unanswered one brings the connection nearer its end). Empty unless capture.records asks for probe (not in the default).", w=8),
          ],
        },
        {
          title: "Captured workloads' DNS",
          panels: [
            lib.timeseries('DNS queries by response code', 'ops', [
              lib.target(q('sum by (instance, rcode) (rate(nettap_dns_queries_total{%(sel)s}[$__rate_interval]))'), '{{instance}} {{rcode}}'),
            ], description='DNS queries the captured workloads sent over UDP or TCP to port 53 (capture.dns), counted when their answer came, by its response code: NOERROR, NXDOMAIN (no such name: an answer, often a search list walked), SERVFAIL (the resolver failed), REFUSED, ...; timeout, no answer within 5 s. NettapCapturedDnsFailures fires when SERVFAIL and timeout together exceed %g%% of them.' % (100 * cfg.capturedDnsFailuresRatio)),
            lib.timeseries('DNS latency p99', 's', [
              lib.target(q('histogram_quantile(0.99, sum by (instance, le) (rate(nettap_dns_latency_seconds_bucket{%(sel)s}[$__rate_interval])))'), '{{instance}}'),
            ], description="Seconds from a captured workload's DNS query to its answer, 99th percentile (answered queries only: timeouts are in the panel beside). A node-local cache answers in well under a millisecond, a resolver across the network in milliseconds to tens of them."),
          ],
        },
        {
          title: 'Cost',
          panels: [
            lib.timeseries('nettap process CPU (cores)', 'short', [
              lib.target(q('rate(process_cpu_seconds_total{%(sel)s}[$__rate_interval])'), '{{instance}}'),
            ], description="The exporter process's own CPU: what container CPU accounting and kubectl top see.", w=8),
            lib.timeseries('nettap RSS', 'bytes', [
              lib.target(q('process_resident_memory_bytes{%(sel)s}'), '{{instance}}'),
            ], description="Resident memory of the capture's process (nettap ingest's is in the Ingest row). BPF maps are kernel memory (BPF map memory): only the ring pages nettap has read from count here.", w=8),
            lib.timeseries('Kernel BPF CPU (cores)', 'short', [
              lib.target(q('sum by (instance) (rate(nettap_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval]))'), '{{instance}}'),
            ], description="Kernel time in nettap's BPF programs, charged to whichever process made the syscall, not to nettap. Needs bpfStats on.", w=8),
            lib.timeseries('Kernel time per run', 's', [
              // The seed's query: `> 0` keeps programs that never fired from dividing by zero.
              lib.target(q(|||
                sum by (program) (rate(nettap_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval]))
                  / (sum by (program) (rate(nettap_bpf_program_runs_total{%(sel)s}[$__rate_interval])) > 0)
              |||), '{{program}}'),
            ], description='Average kernel time per execution, by program. Needs bpfStats on.', w=8),
            lib.timeseries('Kernel BPF time vs. process CPU', 'percentunit', [
              lib.target(q(|||
                sum by (instance) (rate(nettap_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval]))
                  / (sum by (instance) (rate(process_cpu_seconds_total{%(sel)s}[$__rate_interval])) > 0)
              |||), '{{instance}}'),
            ], description="Kernel time in nettap's BPF programs over its own process CPU: how much container accounting under-reports nettap's cost.", w=8),
            lib.timeseries('Total cost: process + kernel BPF (cores)', 'short', [
              lib.target(q(|||
                sum by (instance) (rate(process_cpu_seconds_total{%(sel)s}[$__rate_interval]))
                  + sum by (instance) (rate(nettap_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval]))
              |||), '{{instance}}'),
            ], description='What running nettap costs the node, in cores. Absent while bpfStats is off (the kernel part is unknown then).', w=8),
            lib.timeseries('BPF map memory', 'bytes', [
              lib.target(q('sum by (map) (nettap_bpf_map_memory_bytes{%(sel)s})'), '{{map}}'),
            ], description="Kernel memory of each of nettap's BPF maps, rings included, charged to nettap's cgroup (Linux 5.11+). Of it, nettap's RSS counts only the ring pages it has read from.", stack=true),
            lib.timeseries('BPF map fill', 'percentunit', [
              lib.target(q('nettap_bpf_map_entries{%(sel)s} / (nettap_bpf_map_max_entries{%(sel)s} > 0)'), '{{instance}} {{map}}'),
            ], description='Entries in use over the most a hash map holds. At 100% inserts fail and what they follow is not captured (NettapBPFMapFull).', max=1),
          ],
        },
        {
          title: 'Resources (cgroup)',
          panels: [
            lib.timeseries('CPU throttling', 'percentunit', [
              lib.target(q(|||
                rate(nettap_cgroup_cpu_throttled_periods_total{%(sel)s}[$__rate_interval])
                  / (rate(nettap_cgroup_cpu_periods_total{%(sel)s}[$__rate_interval]) > 0)
              |||), '{{instance}}'),
            ], description='Throttled CFS periods over all periods. Throttling precedes ring-buffer drops.', w=8, max=1),
            lib.timeseries('Memory vs. limit', 'bytes', [
              lib.target(q('nettap_cgroup_memory_usage_bytes{%(sel)s}'), '{{instance}} usage'),
              lib.target(q('nettap_cgroup_memory_limit_bytes{%(sel)s}'), '{{instance}} limit'),
            ], description='cgroup memory usage and limit (no limit line when unlimited).', w=8),
            lib.timeseries('OOM kills', 'short', [
              lib.target(q('sum by (instance) (increase(nettap_cgroup_memory_oom_kills_total{%(sel)s}[$__rate_interval]))'), '{{instance}} kills'),
              lib.target(q('sum by (instance) (increase(nettap_cgroup_memory_oom_events_total{%(sel)s}[$__rate_interval]))'), '{{instance}} OOM events'),
            ], description="OOM-killer invocations and kills in nettap's cgroup.", w=8),
            lib.table('Collectors', 'none', [
              lib.target(q('nettap_scrape_collector_success{%(sel)s}'), instant=true, format='table'),
              lib.target(q('nettap_scrape_collector_duration_seconds{%(sel)s}'), instant=true, format='table'),
            ], columns=[{ name: 'success', unit: 'none' }, { name: 'duration', unit: 's' }], description='Each collector reports whether it succeeded this scrape, and how long it took.', hide=['job'], h=6),
          ],
        },
      ],
    ),
  },
}
