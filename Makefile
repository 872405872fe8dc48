# Shortcuts for the README's two commands (scripts/run.sh, scripts/test.sh),
# which need no make on a fresh machine.
#   make run    run nettap with its built-in default config (ARGS="--config FILE" to pass flags)
#   make test   run the whole test suite (unit, kernel, end-to-end), as root
ARGS ?=
PYTEST_ARGS ?=

run:
	scripts/run.sh $(ARGS)

test:
	scripts/test.sh $(PYTEST_ARGS)

# Developer targets
bpf:
	$(MAKE) -C bpf

render:
	.venv/bin/python alerts/render.py
	.venv/bin/python deploy/kubernetes/render.py

demo:
	@scripts/setup.sh test
	.venv/bin/python scripts/demo.py

bench:
	@scripts/setup.sh test
	.venv/bin/python bench/storm.py
	.venv/bin/python bench/probe_cost.py

.PHONY: run test bpf render demo bench
