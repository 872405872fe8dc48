// nettap / BPF programs: every BPF program on the node (nettap's, the CNI's, anyone's) by
// kernel CPU, runs/s and time per run, from nettap_node_bpf_program_* (needs bpfStats on
// with scope node: diagnostics.bpfStats.scope: node).
local lib = import 'lib.libsonnet';

{
  grafanaDashboards+:: {
    local cfg = $._config { sel: 'job=~"$job", instance=~"$instance"' },
    local q(expr) = expr % cfg,
    local cpu = q('sum by (instance, program, type, owner) (rate(nettap_node_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval]))'),
    local runs = q('sum by (instance, program, type, owner) (rate(nettap_node_bpf_program_runs_total{%(sel)s}[$__rate_interval]))'),

    'nettap-bpf-programs.json': lib.dashboard(
      cfg,
      uid='nettap-bpf-programs',
      title='nettap / BPF programs',
      description='Every BPF program on the node by kernel CPU, runs/s and time per run, with its owner. Needs diagnostics.bpfStats.enabled: true and scope: node.',
      variables=[
        lib.queryVariable('job', 'Job', q('label_values(nettap_build_info{%(nettapSelector)s}, job)')),
        lib.queryVariable('instance', 'Instance', q('label_values(nettap_build_info{job=~"$job"}, instance)'), multi=true),
      ],
      rows=[
        {
          title: 'Programs on the node',
          panels: [
            lib.table('BPF programs by kernel CPU', 'short', [
              lib.target(cpu, instant=true, format='table'),
              lib.target(runs, instant=true, format='table'),
              lib.target('%s\n  / (%s > 0)' % [cpu, runs], instant=true, format='table'),
            ], columns=[
              { name: 'kernel CPU (cores)', unit: 'short' },
              { name: 'runs/s', unit: 'ops' },
              { name: 'time per run', unit: 's' },
            ], description='Programs with equal name, type and owner are summed. Programs that never ran show no time per run.', h=12, hide=['job'], sortBy='kernel CPU (cores)'),
          ],
        },
        {
          title: 'Over time',
          panels: [
            lib.timeseries('Kernel CPU by owner (cores)', 'short', [
              lib.target(q('sum by (owner) (rate(nettap_node_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval]))'), '{{owner}}'),
            ], description='Kernel time in BPF programs, by the process that loaded them.', stack=true),
            lib.timeseries("nettap's share of node BPF kernel time", 'percentunit', [
              lib.target(q(|||
                sum by (instance) (rate(nettap_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval]))
                  / (sum by (instance) (rate(nettap_node_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval])) > 0)
              |||), '{{instance}}'),
            ], description="Kernel time in nettap's BPF programs over that of every BPF program on the node: what watching costs next to what the node runs anyway.", max=1),
            lib.timeseries('Top 10 programs by kernel CPU (cores)', 'short', [
              lib.target(q('topk(10, sum by (program, owner) (rate(nettap_node_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval])))'), '{{owner}}/{{program}}'),
            ], description='The ten programs of the node, whoever loaded them, spending the most kernel time.'),
            lib.timeseries('Top 10 programs by runs', 'ops', [
              lib.target(q('topk(10, sum by (program, owner) (rate(nettap_node_bpf_program_runs_total{%(sel)s}[$__rate_interval])))'), '{{owner}}/{{program}}'),
            ], description='The ten programs of the node running most often: each run is paid by the process whose syscall or event triggered it.'),
            lib.timeseries('Top 10 programs by time per run', 's', [
              lib.target(q(|||
                topk(10,
                  sum by (program, owner) (rate(nettap_node_bpf_program_run_time_seconds_total{%(sel)s}[$__rate_interval]))
                    / (sum by (program, owner) (rate(nettap_node_bpf_program_runs_total{%(sel)s}[$__rate_interval])) > 0)
                )
              |||), '{{owner}}/{{program}}'),
            ], description='Expensive per run is cheap in total when the program rarely runs: read with runs/s.'),
            lib.timeseries('Programs loaded', 'short', [
              lib.target(q('sum by (owner, type) (nettap_node_bpf_programs{%(sel)s})'), '{{owner}} {{type}}'),
            ], description='BPF programs loaded on the node, by the process that loaded them and by program type.', stack=true),
          ],
        },
      ],
    ),
  },
}
