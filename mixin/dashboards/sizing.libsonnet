// nettap / Sizing: peak CPU and memory over the time range, per node and for the busiest
// node, against the requests and limits in force. The DaemonSet applies the same requests
// and limits everywhere, so the busiest node sets the requirement.
local lib = import 'lib.libsonnet';

{
  grafanaDashboards+:: {
    local cfg = $._config {
      sel: 'job=~"$job", instance=~"$instance"',
      ksm: '%(kubeStateMetricsSelector)s, %(nettapContainerSelector)s' % $._config,
      cadvisor: '%(cadvisorSelector)s, %(nettapContainerSelector)s' % $._config,
      kubeLabels: std.join(', ', $._config.kubeContainerLabels),
    },
    local q(expr) = expr % cfg,

    // Peaks over the dashboard's range: subqueries over rates, plain max_over_time over gauges.
    local peakCPU = 'max_over_time(rate(process_cpu_seconds_total{%(sel)s}[$__rate_interval])[$__range:])',
    local peakKernel = 'max_over_time(sum by (instance) (rate(nettap_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval]))[$__range:])',
    local peakRSS = 'max_over_time(process_resident_memory_bytes{%(sel)s}[$__range])',
    local peakCgroup = 'max_over_time(nettap_cgroup_memory_usage_bytes{%(sel)s}[$__range])',
    // sizing.md links the runbook's section as published; a runbookURLPattern of one's own
    // (a wiki) replaces that link too.
    local guidance = std.strReplace(
      importstr 'sizing.md',
      'https://github.com/nettap/nettap/blob/main/docs/runbook.md#sizing-nettap',
      $._config.runbookURLPattern % 'sizing-nettap'
    ),

    'nettap-sizing.json': lib.dashboard(
      cfg,
      uid='nettap-sizing',
      title='nettap / Sizing',
      description='Peak CPU and memory over the time range against the requests and limits in force, with sizing guidance. Pick a range that covers your busiest period.',
      variables=[
        lib.queryVariable('job', 'Job', q('label_values(nettap_build_info{%(nettapSelector)s}, job)')),
        lib.queryVariable('instance', 'Instance', q('label_values(nettap_build_info{job=~"$job"}, instance)'), multi=true),
      ],
      rows=[
        {
          title: 'Busiest node over the range',
          panels: [
            lib.stat('Peak process CPU (cores)', 'short', [
              lib.target(q('max(%s)' % peakCPU), 'peak', instant=true),
            ], description="nettap's own CPU: what the CPU request and limit apply to."),
            lib.stat('Peak kernel BPF CPU (cores)', 'short', [
              lib.target(q('max(%s)' % peakKernel), 'peak', instant=true),
            ], description="Kernel time in nettap's BPF programs: charged to the processes making syscalls, so no nettap limit caps it. Needs bpfStats on."),
            lib.stat('CPU request / limit', 'short', [
              lib.target(q('max(kube_pod_container_resource_requests{%(ksm)s, resource="cpu"})'), 'request', instant=true),
              lib.target(q('max(kube_pod_container_resource_limits{%(ksm)s, resource="cpu"})'), 'limit', instant=true),
            ], description='In force now (kube-state-metrics).'),
            lib.stat('Peak RSS', 'bytes', [
              lib.target(q('max(%s)' % peakRSS), 'RSS', instant=true),
              lib.target(q('max(%s)' % peakCgroup), 'cgroup', instant=true),
            ], description="nettap's resident memory, and its whole cgroup's usage (page cache included)."),
            lib.stat('Memory request / limit', 'bytes', [
              lib.target(q('max(kube_pod_container_resource_requests{%(ksm)s, resource="memory"})'), 'request', instant=true),
              lib.target(q('max(kube_pod_container_resource_limits{%(ksm)s, resource="memory"})'), 'limit', instant=true),
              lib.target(q('max(nettap_cgroup_memory_limit_bytes{%(sel)s})'), 'cgroup limit', instant=true),
            ], description='Requests and limits in force (kube-state-metrics), and the memory limit nettap reads from its own cgroup.'),
            lib.stat('Peak working set / request', 'percentunit', [
              lib.target(q(|||
                max(
                  max by (%(kubeLabels)s) (max_over_time(container_memory_working_set_bytes{%(cadvisor)s}[$__range]))
                    / on (%(kubeLabels)s)
                  max by (%(kubeLabels)s) (kube_pod_container_resource_requests{%(ksm)s, resource="memory"})
                )
              |||), 'peak', instant=true),
            ], description='Above 100%, nettap is in the Burstable class with usage over its request: among the first pods evicted under node memory pressure.'),
          ],
        },
        {
          title: 'Per node',
          panels: [
            lib.table('Peak per node over the range', 'short', [
              lib.target(q('max by (instance) (%s)' % peakCPU), instant=true, format='table'),
              lib.target(q('max by (instance) (%s)' % peakKernel), instant=true, format='table'),
              lib.target(q('max by (instance) (%s)' % peakRSS), instant=true, format='table'),
              lib.target(q('max by (instance) (%s)' % peakCgroup), instant=true, format='table'),
              lib.target(q('max by (instance) (nettap_cgroup_memory_limit_bytes{%(sel)s})'), instant=true, format='table'),
            ], columns=[
              { name: 'peak process CPU (cores)', unit: 'short' },
              { name: 'peak kernel BPF CPU (cores)', unit: 'short' },
              { name: 'peak RSS', unit: 'bytes' },
              { name: 'peak cgroup memory', unit: 'bytes' },
              { name: 'cgroup memory limit', unit: 'bytes' },
            ], description="Each node's peaks over the range, the busiest by process CPU first, with the memory limit nettap reads from its own cgroup.", sortBy='peak process CPU (cores)'),
            lib.table('Requests and limits in force, per container', 'short', [
              lib.target(q('max by (%(kubeLabels)s) (max_over_time(rate(container_cpu_usage_seconds_total{%(cadvisor)s}[$__rate_interval])[$__range:]))'), instant=true, format='table'),
              lib.target(q('max by (%(kubeLabels)s) (kube_pod_container_resource_requests{%(ksm)s, resource="cpu"})'), instant=true, format='table'),
              lib.target(q('max by (%(kubeLabels)s) (kube_pod_container_resource_limits{%(ksm)s, resource="cpu"})'), instant=true, format='table'),
              lib.target(q('max by (%(kubeLabels)s) (max_over_time(container_memory_working_set_bytes{%(cadvisor)s}[$__range]))'), instant=true, format='table'),
              lib.target(q('max by (%(kubeLabels)s) (kube_pod_container_resource_requests{%(ksm)s, resource="memory"})'), instant=true, format='table'),
              lib.target(q('max by (%(kubeLabels)s) (kube_pod_container_resource_limits{%(ksm)s, resource="memory"})'), instant=true, format='table'),
            ], columns=[
              { name: 'peak CPU (cores)', unit: 'short' },
              { name: 'CPU request', unit: 'short' },
              { name: 'CPU limit', unit: 'short' },
              { name: 'peak working set', unit: 'bytes' },
              { name: 'memory request', unit: 'bytes' },
              { name: 'memory limit', unit: 'bytes' },
            ], description='cAdvisor peaks and kube-state-metrics requests and limits of the nettap containers.', sortBy='peak working set'),
          ],
        },
        {
          title: 'Over time',
          panels: [
            lib.timeseries('CPU vs. request and limit (cores)', 'short', [
              lib.target(q('rate(process_cpu_seconds_total{%(sel)s}[$__rate_interval])'), '{{instance}}'),
              lib.target(q('max(kube_pod_container_resource_requests{%(ksm)s, resource="cpu"})'), 'request'),
              lib.target(q('max(kube_pod_container_resource_limits{%(ksm)s, resource="cpu"})'), 'limit'),
            ], description="nettap's process CPU per node against the CPU request and limit in force (kube-state-metrics, dashed).") + lib.dashed(['request', 'limit']),
            lib.timeseries('Memory vs. request and limit', 'bytes', [
              lib.target(q('process_resident_memory_bytes{%(sel)s}'), '{{instance}} RSS'),
              lib.target(q('max(kube_pod_container_resource_requests{%(ksm)s, resource="memory"})'), 'request'),
              lib.target(q('max(kube_pod_container_resource_limits{%(ksm)s, resource="memory"})'), 'limit'),
              lib.target(q('max(nettap_cgroup_memory_limit_bytes{%(sel)s})'), 'cgroup limit'),
            ], description="nettap's RSS per node against the memory request and limit in force (kube-state-metrics) and the limit of its own cgroup (dashed).") + lib.dashed(['request', 'limit', 'cgroup limit']),
          ],
        },
        {
          title: 'Guidance',
          panels: [
            lib.text('Sizing nettap', guidance, description='How to set the requests and limits from the panels above.', h=16),
          ],
        },
      ],
    ),
  },
}
