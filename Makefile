# netagg — `make demo` and `make test` work on a fresh machine (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.demo-stamp
TARGET ?= soft
PYTEST_ARGS ?=

.PHONY: setup build build-tofino p4info test check ptf demo demo-tree bench bench-switch bench-tenants bench-shares bench-sparse bench-tree chaos soak-mlfabric lint clean

$(VENV)/.created:
	@scripts/setup-system.sh
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@touch $@

# The demo needs netagg, scikit-learn and numba (the software target's fast path); the tests and
# benchmarks add their tools. The fast path's kernels are compiled once here, into numba's cache.
$(DEMO_STAMP): pyproject.toml $(VENV)/.created
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[demo,fast]'
	$(BIN)/python -m netagg.apps.warmup
	@touch $@

$(STAMP): pyproject.toml $(VENV)/.created
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,demo,bench,fast]'
	$(BIN)/python -m netagg.apps.warmup
	@touch $(STAMP) $(DEMO_STAMP)

## setup: create .venv and install netagg with its test and benchmark tools
setup: $(STAMP)

## build: compile p4src/v1model/netagg.p4 with p4c-bm2-ss into build/ (skips, saying so, without p4c)
build: setup
	$(BIN)/python -m netagg.bmv2.p4build

## build-tofino: compile p4src/tna/netagg.p4 for Tofino 1 with bf-p4c into build/tofino and print the
## compiler's resource summary (skips, saying so, without bf-p4c)
build-tofino: setup
	$(BIN)/python -m netagg.bmv2.tna_build

## p4info: regenerate the committed P4Info from p4c's output
p4info: setup
	$(BIN)/python -m netagg.bmv2.p4build --update-p4info

## test: the whole suite (unit, P4Runtime, PTF on the software target, BMv2 where installed)
test: build
	$(BIN)/python -m pytest -rs $(PYTEST_ARGS)

## check: the everyday tier (3.5 minutes on a 2-core machine): every test not marked slow (unit,
## differential, loopback end to end), one short emulation over veths and PTF's aggregation
## group on the software target (both need root). `make test` runs everything; CI runs `make test`.
check: build
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not netns and not bmv2 and not tofino" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_raw_segmentation.py
	$(BIN)/python -m netagg.bmv2.ptf_runner --target soft aggregation

## ptf: the PTF suite against TARGET=soft|bmv2 (needs root for namespaces)
ptf: build
	$(BIN)/python -m netagg.bmv2.ptf_runner --target $(TARGET)

## demo: switch + controller + 4 workers train an MLP through the switch (TARGET=soft: embedded default; bmv2)
demo: $(DEMO_STAMP)
	$(BIN)/python -m netagg.apps.demo --target $(TARGET)

## demo-tree: the same over two racks: a switch per rack under a root, each its own TARGET (soft, or bmv2) in
## a namespace, one controller over all three (needs root)
demo-tree: $(DEMO_STAMP)
	$(BIN)/python -m netagg.apps.demo --racks 2 --target $(TARGET)

## bench-switch: aggregated packets/s of the software target (and BMv2 where installed)
bench-switch: build
	$(BIN)/python -m benchmarks.switch_throughput

## bench: allreduce on the emulated cluster: netagg vs PS fallback vs Gloo ring (root; torch optional)
bench: setup
	$(BIN)/python -m benchmarks.cluster_allreduce

## bench-tree: a job over two racks through a tree of switches vs one switch vs Gloo's ring across the racks (root)
bench-tree: setup
	$(BIN)/python -m benchmarks.tree_allreduce $(TREE_ARGS)

## bench-sparse: Libra: a sparse model's embedding table aggregated all-PS, Libra (hot rows in the switch), dense (root)
bench-sparse: setup
	$(BIN)/python -m benchmarks.sparse_training

## bench-tenants: two tenant jobs sharing the emulated cluster's links, with and without congestion control (root)
bench-tenants: setup
	$(BIN)/python -m benchmarks.cluster_tenants --rate-mbit 2

## bench-shares: three tenants arriving on a switch too small for them: fair shares that move vs first come vs all-PS (root)
bench-shares: setup
	$(BIN)/python -m benchmarks.cluster_shares

## chaos: kill -9 the switch (briefly, and past the failover bound), the controller with it, and PS chain nodes
## at random times while training (160 s in all); prints every injection and what was lost (nothing), exit 1 if anything was. CHAOS_ARGS: e.g.
## CHAOS_ARGS='--seconds 300 --seed 7 --scenarios switch,chain' (docs/operations.md, "make chaos")
chaos: setup
	$(BIN)/python -m benchmarks.chaos $(CHAOS_ARGS)

## soak-mlfabric: MLfabric runs (async, mlfabric, mlfabric-switch) back to back in the dynamic emulated cluster for
## 30 minutes, every failure reported and classified; exit 1 if any (root). SOAK_ARGS: e.g. SOAK_ARGS='--minutes 5'
soak-mlfabric: setup
	$(BIN)/python -m benchmarks.soak_mlfabric $(SOAK_ARGS)

## lint: ruff
lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf build results .pytest_cache .ruff_cache
