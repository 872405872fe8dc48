// nettap's recording rules: what running nettap costs, in cores, per program and per node.
// Names follow level:metric:operation. `program:` series keep every label of the scrape
// (job, instance, program, target labels); `instance:` series drop `program`.
//
// Kernel time exists only while bpfStats is on, so the kernel and total series are absent
// (not zero) while it is off: nettap's true cost is unknown then, and saying 0 would lie.
{
  local cfg = $._config {
    w: 'rate' + $._config.rateInterval,
    // Adds nodeJoinLabel to a vector, for dividing by the node's CPU count.
    nodeJoin(expr):: 'label_replace(%s, "%s", "$1", "%s", "%s")' % [
      expr,
      $._config.nodeJoinLabel,
      $._config.nodeJoinSourceLabel,
      $._config.nodeJoinRegex,
    ],
    nodeCPUs: 'max by (%s) (%s)' % [$._config.nodeJoinLabel, self.nodeJoin($._config.nodeCPUCountQuery)],
  },

  prometheusRules+:: {
    groups+: [
      {
        // One group: the cost series build on each other, and rules in a group are
        // evaluated in order at the same timestamp.
        name: 'nettap-cost.rules',
        rules: [
          {
            // Kernel CPU (cores) of each nettap BPF program.
            record: 'program:nettap_bpf_program_run_time_seconds:%(w)s' % cfg,
            expr: |||
              rate(nettap_bpf_program_run_time_seconds_total{%(nettapSelector)s}[%(rateInterval)s])
            ||| % cfg,
          },
          {
            record: 'program:nettap_bpf_program_runs:%(w)s' % cfg,
            expr: |||
              rate(nettap_bpf_program_runs_total{%(nettapSelector)s}[%(rateInterval)s])
            ||| % cfg,
          },
          {
            // Average kernel time per run (seconds). `> 0` keeps loaded programs that
            // never fired from dividing by zero (the seed's query does the same).
            record: 'program:nettap_bpf_program_run_time_seconds_per_run:%(w)s' % cfg,
            expr: |||
              program:nettap_bpf_program_run_time_seconds:%(w)s
                /
              (program:nettap_bpf_program_runs:%(w)s > 0)
            ||| % cfg,
          },
          {
            // Kernel CPU (cores) of all nettap BPF programs of a node.
            record: 'instance:nettap_bpf_program_run_time_seconds:%(w)s' % cfg,
            expr: |||
              sum without (program) (program:nettap_bpf_program_run_time_seconds:%(w)s)
            ||| % cfg,
          },
          {
            // Per program, as a fraction of the node's CPUs (node_exporter).
            record: 'program:nettap_bpf_cpu_utilisation:%(w)s' % cfg,
            expr: |||
              %(left)s
                / on (%(nodeJoinLabel)s) group_left ()
              %(nodeCPUs)s
            ||| % cfg { left: cfg.nodeJoin('program:nettap_bpf_program_run_time_seconds:%(w)s' % cfg) },
          },
          {
            // Per node, as a fraction of the node's CPUs.
            record: 'instance:nettap_bpf_cpu_utilisation:%(w)s' % cfg,
            expr: |||
              %(left)s
                / on (%(nodeJoinLabel)s) group_left ()
              %(nodeCPUs)s
            ||| % cfg { left: cfg.nodeJoin('instance:nettap_bpf_program_run_time_seconds:%(w)s' % cfg) },
          },
          {
            // nettap's own process CPU (cores): what container CPU accounting sees.
            record: 'instance:nettap_process_cpu_seconds:%(w)s' % cfg,
            expr: |||
              rate(process_cpu_seconds_total{%(nettapSelector)s}[%(rateInterval)s])
            ||| % cfg,
          },
          {
            // What running nettap costs (cores): its process plus its BPF programs' kernel
            // time, which the kernel charges to whichever process made the syscall.
            record: 'instance:nettap_cpu_total_cores:%(w)s' % cfg,
            expr: |||
              instance:nettap_process_cpu_seconds:%(w)s
                +
              instance:nettap_bpf_program_run_time_seconds:%(w)s
            ||| % cfg,
          },
        ],
      },
    ],
  },
}
