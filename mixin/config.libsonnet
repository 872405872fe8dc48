// Every selector, threshold and duration the nettap mixin uses. Override any of them with
//   (import 'mixin.libsonnet') + { _config+:: { nettapSelector: 'job="my-nettap"' } }
{
  _config+:: {
    // --- Selectors ---------------------------------------------------------------------

    // nettap's own scrape job: every nettap_*, process_* and up series it produces.
    nettapSelector: 'job="nettap"',
    // `nettap ingest`'s scrape job (:42425): its nettap_ingest_*, process_* and up series. Keep
    // it apart from nettapSelector's: the capture's alerts and panels would count the ingest's
    // process_* and up series as the capture's.
    nettapIngestSelector: 'job="nettap-ingest"',
    // cAdvisor, as scraped from the kubelet (/metrics/cadvisor) or standalone.
    cadvisorSelector: 'job="cadvisor"',
    // kube-state-metrics, for the requests, limits, restarts and termination reasons in force.
    kubeStateMetricsSelector: 'job="kube-state-metrics"',
    // node_exporter, only used to count the node's CPUs.
    nodeExporterSelector: 'job="node"',
    // nettap's containers in cAdvisor and kube-state-metrics series (the DaemonSet's
    // containers are named nettap, nettap-capture, ...).
    nettapContainerSelector: 'container=~"nettap.*"',
    // Labels that name one container in both cAdvisor and kube-state-metrics series; add
    // 'cluster' when one Prometheus holds several clusters.
    kubeContainerLabels: ['namespace', 'pod', 'container'],

    // --- Joining nettap with node_exporter ---------------------------------------------
    // nettap and node_exporter run on the same node but are scraped on different ports, so
    // their `instance` labels differ. Both sides get `nodeJoinLabel`, copied from
    // `nodeJoinSourceLabel` through `nodeJoinRegex` (default: the host part of instance).
    // On Kubernetes, where both jobs usually carry a `node` target label, set
    // nodeJoinSourceLabel: 'node' and nodeJoinRegex: '(.*)'.
    nodeJoinLabel: 'node',
    nodeJoinSourceLabel: 'instance',
    nodeJoinRegex: '(.+?)(?::[0-9]+)?',
    // The node's CPU count, with the labels nodeJoinSourceLabel needs.
    nodeCPUCountQuery: 'count without (cpu, mode) (node_cpu_seconds_total{%(nodeExporterSelector)s, mode="idle"})' % self,

    // --- Windows -----------------------------------------------------------------------

    // Window of every rate() in alerts and recording rules: at least four scrapes at the
    // usual 15s-1m intervals. Recording rule names carry it (…:rate5m).
    rateInterval: '5m',

    // --- Capture pipeline --------------------------------------------------------------

    // Rings whose drops lose captured payload (critical); drops on other rings are warnings.
    dataLossRingsRegex: 'capture_chunks',
    // Any drop is data loss; 2m keeps one scrape's jitter from paging, and a single burst
    // still fires because rate() stays above zero for the whole window.
    ringBufferDropsFor: '2m',
    // Fill (pending / capacity, averaged over rateInterval) that warns before reserves fail.
    ringBufferFillRatio: 0.5,
    ringBufferFillFor: '5m',
    // User space falls behind when it drains less than this fraction of the chunks the
    // kernel published into capture_chunks.
    pipelineDrainedRatio: 0.9,
    pipelineFallingBehindFor: '10m',
    // Records lost after the ring (queue, sink, decode) are data loss too.
    recordsLostFor: '2m',
    // An insert a map of the capture refused (nettap_bpf_map_insert_failures_total: the map
    // full) loses capture, as recordsLostFor.
    mapInsertFailuresFor: '2m',
    // A probe that failed to attach (mechanism="none") captures nothing until fixed.
    probeAttachFailedFor: '5m',
    // libssl files refused for a bound (capture.tls): processes whose TLS is not captured.
    tlsFilesRefusedFor: '15m',

    // --- Ingest (nettap ingest -> NATS JetStream) ------------------------------------------

    // The capture's rotated files (output.path, .1 .. .backups) are the ingest's buffer:
    // what the engine has not acknowledged when the oldest file is rotated away is lost.
    // Lost lines (reason rotated, too_large, rejected) never reach the engine: as
    // recordsLostFor, a single burst still fires because increase() stays above zero for
    // the whole window.
    ingestRecordsLostFor: '2m',
    // Age of the oldest line not yet acknowledged (0 when caught up), while it is not
    // shrinking: the drain after a reconnect is not an alert. It fires ingestBacklogSeconds +
    // ingestBacklogFor (15m) after acknowledgements stop: size the buffer, output.max_bytes x
    // output.backups (300 MiB by default), to hold more than that at the busiest node's write
    // rate (nettap_sink_bytes_written_total), or lower these.
    ingestBacklogSeconds: 300,
    ingestBacklogFor: '10m',
    // Not connected to any server of ingest.servers. Connection attempts failing with
    // reason auth or tls are a configuration or credential problem: the description says so.
    ingestDisconnectedFor: '5m',
    // The ingest target cannot be scraped. No absent() rule: the ingest is optional (a node
    // may keep the capture's files for itself), so having no ingest target is not an alert.
    ingestDownFor: '5m',
    // The ingest's resident memory (process_resident_memory_bytes) over the memory limit of its
    // own cgroup (nettap_cgroup_memory_limit_bytes), both from its own /metrics: the alert
    // needs no cAdvisor, and stays silent where the ingest runs without a limit. RSS, not the
    // cgroup's usage: the ingest reads the capture's files, whose page cache the usage counts
    // and the kernel reclaims before it kills. Its RSS is bounded by design (30-40 MB, plus
    // ~2.5 MB per MiB of ingest.max_in_flight_bytes): near the limit, a limit too low or a leak.
    ingestMemoryNearLimitRatio: 0.9,
    ingestMemoryNearLimitFor: '15m',

    // --- Exporter health ---------------------------------------------------------------

    exporterDownFor: '5m',
    // No nettap target at all: more often service discovery than a crash, so slower.
    exporterAbsentFor: '15m',
    // Restarts (process_start_time_seconds changes) within restartsWindow that alert.
    restartsThreshold: 2,
    restartsWindow: '30m',
    restartingFor: '1m',
    // Same semantics as Prometheus' own PrometheusConfigReloadFailed.
    configReloadFailedFor: '10m',
    // A collector failing every scrape hides part of the cost picture.
    collectorFailedFor: '15m',

    // --- Captured workloads ---------------------------------------------------------------

    // Resets (sent and received) of the captured sockets per connection closed, over
    // rateInterval, above this ratio while at least capturedResetsMinRate resets/s happen:
    // a captured service refusing, aborting or being aborted (not nettap's own health).
    capturedResetsRatio: 0.1,
    capturedResetsMinRate: 0.1,
    capturedResetsFor: '15m',
    // Retransmissions of the captured sockets on retransmission timeouts (kind="rto": the
    // timer fired, not a tail loss probe or fast recovery), per second above this: each
    // stalled its connection for an RTO (>= 200 ms); tcp_retries2 of them in a row abort it.
    capturedRtoRate: 0.5,
    capturedRtoFor: '15m',
    // DNS queries of the captured workloads (capture.dns) that end in SERVFAIL or get no answer
    // within 5 s (rcode="timeout"), per query answered or timed out, over rateInterval, above
    // this ratio while at least capturedDnsFailuresMinRate of them fail a second (a node that
    // resolves a name a minute is not judged on one lost query): their resolver fails them.
    // NXDOMAIN and the other rcodes are answers about the name, not failures.
    capturedDnsFailuresRatio: 0.05,
    capturedDnsFailuresMinRate: 0.05,
    capturedDnsFailuresFor: '10m',

    // --- Cost --------------------------------------------------------------------------

    // bpfStats costs on every BPF program of the node (the seed: "cheap but not free"):
    // turn it on to measure, then off. Left on this long, say so.
    bpfStatsLeftOnFor: '3h',
    // Kernel CPU spent in nettap's BPF programs, in cores (not charged to nettap's cgroup,
    // so the CPU limit does not cap it). 0.5 = the seed's whole default CPU limit.
    kernelBPFCPUCores: 0.5,
    kernelBPFCPUFor: '30m',

    // --- Resources ---------------------------------------------------------------------

    // Fraction of CFS periods throttled (kubernetes-mixin's CPUThrottlingHigh uses 25%).
    // The seed: throttling on the capture container precedes data loss.
    cpuThrottlingRatio: 0.25,
    cpuThrottlingFor: '15m',
    // Memory usage (nettap's cgroup) or working set (cAdvisor) over the limit.
    memoryNearLimitRatio: 0.9,
    memoryNearLimitFor: '15m',
    // OOM kills counted within this window (and kube restarts joined over it).
    oomWindow: '10m',
    oomKilledFor: '1m',
    // Working set above the memory request: an early eviction candidate under node memory
    // pressure. The advice: request at least the working set. The floor quoted in the alert is
    // deploy/kubernetes' request: nettap's idle RSS measures 31.5-31.8 MB (bench/storm.py
    // --idle, docs/benchmarks.md); the reference collector of the seed needed 512Mi.
    memoryRequestBelowUsageFor: '30m',
    memoryRequestMinimum: '128Mi',

    // --- Links and dashboards ----------------------------------------------------------

    // %s is the lowercased alert name: the anchor of its section in docs/runbook.md.
    runbookURLPattern: 'https://github.com/nettap/nettap/blob/main/docs/runbook.md#%s',
    dashboardTags: ['nettap'],
    dashboardRefresh: '30s',
    dashboardTimeFrom: 'now-1h',
    dashboardTimezone: 'utc',
  },
}
