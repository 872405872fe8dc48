# Shortcuts for the README's two commands (scripts/run.sh, scripts/test.sh),
# which need no make on a fresh machine.
#   make run    run nettap with its built-in default config (ARGS="--config FILE" to pass flags)
#   make test   run the whole test suite (unit, kernel, end-to-end), as root
ARGS ?=
PYTEST_ARGS ?=
# make image: the image's name (push it where your nodes pull from: IMAGE=<registry>/nettap)
IMAGE ?= nettap
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

run:
	scripts/run.sh $(ARGS)

test:
	scripts/test.sh $(PYTEST_ARGS)

# Developer targets
bpf:
	$(MAKE) -C bpf

render:
	.venv/bin/python mixin/render.py
	.venv/bin/python deploy/kubernetes/render.py

demo:
	@scripts/setup.sh test
	.venv/bin/python scripts/demo.py

# The Dockerfile's image, tagged with nettap's version and carrying the commit it was built
# from; then docker push $(IMAGE):$(VERSION), and point the Helm chart's image.repository
# (or kustomization.yaml's images:) at it.
image:
	docker build --build-arg NETTAP_REVISION=$$(git rev-parse HEAD) -t $(IMAGE):$(VERSION) .

# The same image for x86-64 and arm64 nodes (Graviton, Ampere) in one manifest list, pushed:
# docker buildx with a builder that runs arm64 (qemu-user's binfmt, or an arm64 node). The image
# carries both architectures' BPF objects; nettap loads the running machine's.
PLATFORMS ?= linux/amd64,linux/arm64
image-multiarch:
	docker buildx build --platform $(PLATFORMS) --build-arg NETTAP_REVISION=$$(git rev-parse HEAD) \
	  -t $(IMAGE):$(VERSION) --push .

bench:
	@scripts/setup.sh test
	.venv/bin/python bench/storm.py
	.venv/bin/python bench/probe_cost.py

.PHONY: run test bpf render demo image image-multiarch bench
