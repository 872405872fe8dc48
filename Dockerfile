# nettap: a lean eBPF TCP collector.
#
#   docker build -t nettap:0.1.0 .
#   docker buildx build --platform linux/amd64,linux/arm64 -t <registry>/nettap:0.1.0 --push .
#                                   (x86-64 and arm64 nodes: `make image-multiarch`; each stage
#                                   runs on its platform, so the C modules are built natively)
#   docker compose up -d            (the whole demo stack: docker-compose.yml)
#
# The image holds Debian's libbpf and Python, a virtualenv with nettap and its Python
# dependencies, and the precompiled CO-RE BPF objects (bpf/<arch>/*.bpf.o, committed to the
# repository, shipped inside the package). No compiler, no kernel headers at run time: the object is relocated against
# the running kernel's BTF (/sys/kernel/btf/vmlinux) when nettap loads it. The build stage
# compiles the ring scan and JSON-lines writer (exporter/capture/*.c) and ingest's line split
# (exporter/ingest/_split.c) into the virtualenv, and fails if they did not build (the
# pure-Python fallback is 20-50x slower).

# ---- build stage: the virtualenv ------------------------------------------------------
FROM debian:12.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# README.md is the package's long description (pyproject.toml's readme); the glob keeps
# the build working in a tree that has none yet.
COPY pyproject.toml setup.py README.m[d] LICENSE ./
COPY LICENSES ./LICENSES
COPY exporter ./exporter
# setup.py ships the BPF objects inside the package (exporter/bpf), and writes the revision
# and branch into exporter/_revision.py (nettap --version): the context has no .git, so pass them:
#   docker build --build-arg NETTAP_REVISION=$(git rev-parse HEAD) \
#     --build-arg NETTAP_BRANCH=$(git rev-parse --abbrev-ref HEAD) ...  (else "unknown")
COPY bpf/ ./bpf/
ARG NETTAP_REVISION=unknown
ARG NETTAP_BRANCH=unknown
ENV NETTAP_REVISION=$NETTAP_REVISION NETTAP_BRANCH=$NETTAP_BRANCH
RUN test -f README.md || echo "nettap" > README.md \
 && python3 -m venv /opt/nettap/venv \
 && /opt/nettap/venv/bin/pip install --no-cache-dir --disable-pip-version-check . \
 && /opt/nettap/venv/bin/python -c "from exporter.capture import _jsonl; from exporter.ingest import _split" \
 && /opt/nettap/venv/bin/pip uninstall -y -q pip

# ---- runtime stage ---------------------------------------------------------------------
FROM debian:12.11-slim
# libbpf1: the system libbpf (libbpf.so.1) nettap drives through ctypes.
# python3: the interpreter the virtualenv points at (same path as in the build stage).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libbpf1 python3 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/nettap/venv /opt/nettap/venv
ENV PATH=/opt/nettap/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

# nettap runs as root. The image cannot grant privileges; whoever runs it must, and
# docker-compose.yml and deploy/kubernetes/daemonset.yaml do, line by line:
#   --pid=host                 see host processes: pid capture targets, and the
#                              node-wide view of who holds which BPF program
#   --cap-add BPF              bpf(): load programs, create maps (kernel >= 5.8)
#   --cap-add PERFMON          perf_event_open(): attach to tracepoints (kernel >= 5.8)
#   --cap-add SYS_ADMIN        BPF_ENABLE_STATS (diagnostics.bpfStats), iterating every
#                              BPF program id (bpfStats scope node), mounting tracefs when
#                              it is not mounted; on kernels < 5.8 it replaces BPF+PERFMON
#   --cap-add SYS_PTRACE       read other processes' /proc/PID/fdinfo (node-wide view)
#   --cap-add SYS_RESOURCE     raise RLIMIT_MEMLOCK for BPF maps (kernels < 5.11 only)
#   (DAC_READ_SEARCH or DAC_OVERRIDE, in Docker's default set: read tracefs, mode 0700;
#   a non-root user needs DAC_READ_SEARCH granted, README "Privileges")
#   -v /sys/kernel/btf:/sys/kernel/btf:ro           kernel BTF, for CO-RE relocation
#   -v /sys/kernel/tracing:/sys/kernel/tracing      tracefs: tracepoint ids
#   -v /sys/fs/cgroup:/sys/fs/cgroup:ro --cgroupns=host
#                                                   cgroup capture targets by host path,
#                                                   and nettap's own cgroup footprint
USER root
EXPOSE 42424
ENTRYPOINT ["/opt/nettap/venv/bin/nettap"]
CMD ["--web.listen-address", ":42424"]

LABEL org.opencontainers.image.title="nettap" \
      org.opencontainers.image.description="A lean eBPF TCP collector that tells exactly what running it costs" \
      org.opencontainers.image.licenses="Apache-2.0 AND (LGPL-2.1 OR BSD-2-Clause)" \
      org.opencontainers.image.version="0.1.0"
