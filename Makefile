# Build / CI entry points for reliable_messaging.
#   make test   - create/refresh .venv, ensure PostgreSQL/Redis/RabbitMQ are up, run pytest
#   make demo   - same prerequisites, then run the end-to-end demo (SQLite unless DATABASE_URL is set)
# Pass extra pytest arguments with: make test PYTEST_ARGS="-x -k outbox"

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
MATRIX ?= 1
TEST_WORKERS ?= 4
# worksteal: a worker that runs out takes tests from the others, so the part does not end on one
# worker running alone (xdist's default schedule left one alone for its last 100 to 150 s).
WORKERS = -n $(TEST_WORKERS) --dist worksteal
# The parts that run beside another lane (PGBOUNCER_TESTS, RABBITMQ40_TESTS) in three: a fourth
# worker saved them little (64 to 72 s against 77 to 85; 86 to 97 s against 88 to 102) and
# loaded the lane beside them, where a consumer took 2 s to start and handle one message.
LANE_TEST_WORKERS ?= 3
LANE_WORKERS = -n $(LANE_TEST_WORKERS) --dist worksteal
# Run once more through a transaction-pooling PgBouncer (tests/conftest.py, RM_TEST_PGBOUNCER):
# a representative part of the e2e and publishing slices: consume's life and faults, a replay,
# publish -> relay -> consume -> publish, the relay, the wake-ups, scheduled rows and their
# cancelling, where features meet in one consume process (retries, the breaker, expiry,
# replays, ordered keys: about 40 s), and the django.tasks backend's enqueue, runs, results,
# replays and retention (about 15 s). All of both slices would add about 8 minutes.
PGBOUNCER_TESTS ?= tests/e2e/test_consume_command.py tests/e2e/test_replay_end_to_end.py \
	tests/integration/consuming/test_features_meet.py \
	tests/integration/publishing/test_publish_in_handler.py \
	tests/integration/publishing/test_relay.py tests/integration/publishing/test_wake_after_commit.py \
	tests/integration/publishing/test_scheduled_rows.py \
	tests/integration/tasks/test_task_backend.py tests/integration/tasks/test_batched_results.py \
	tests/integration/tasks/test_start_attempts.py tests/integration/tasks/test_consume_runs_tasks.py \
	tests/integration/tasks/test_task_result_retention.py

# Run once more against RabbitMQ 4.3.6 (scripts/rabbitmq4.sh --release 4.3, RM_TEST_BROKER=
# rabbitmq43), the newest release line, beside the 3.10.8 of the rest, where broker versions
# differ: consume end to end, ordered partitions (single active consumer, the consistent-hash
# exchange), poison messages and the crash guard, quorum queues and their `.dead`, the broker
# closing and cancelling channels, topology, the relay with its refusals and reconnects and the
# consumers' topology it declares, replay, foreign producers, the management API's figures, delay
# queues that hand a retry on at least once, the breaker where it meets ordered partitions, quorum
# delivery limits and the crash guard, features meeting in one process, a row the broker
# closes the connection on, and the order of tasks by priority. Earlier, RABBITMQ4_SERIAL_TESTS,
# the serial tests that stop, alarm or act inside that node, run beside the serial tests of the
# 3.10 node and PgBouncer's: none of those uses the 4.x nodes, and none of these stops PostgreSQL
# or touches the 3.10 node. After them, in the same lane, RABBITMQ40_TESTS against RabbitMQ 4.0.5
# (scripts/rabbitmq4.sh, RM_TEST_BROKER=rabbitmq4), the 4.x line's oldest end: the files whose
# behaviour differs between 4.0 and 4.3 (what counts toward a quorum queue's delivery limit, the
# count a dead-lettered message keeps, poison messages and the crash guard, the frame a row
# closes the connection on, the order a quorum queue hands out tasks of different priorities).
# The tests that name the brokers themselves (test_broker_versions.py, test_inspection.py,
# test_relay_broker_limits.py) run in the first stage, on all three.
RABBITMQ4_TESTS ?= tests/e2e/test_consume_command.py tests/e2e/test_ordering.py \
	tests/e2e/test_replay_end_to_end.py tests/faults/test_poison_pills.py \
	tests/faults/test_broker_closes.py tests/faults/test_foreign_producers.py \
	tests/faults/test_bad_input_corpus.py \
	tests/integration/broker/test_cluster_ready.py tests/integration/broker/test_leftovers.py \
	tests/integration/broker/test_pika_logs.py tests/integration/broker/test_topology_errors.py \
	tests/integration/broker/test_write_coalescing.py \
	tests/integration/consuming/test_consumer_service.py \
	tests/integration/consuming/test_retry_rows.py \
	tests/integration/consuming/test_consumer_outcomes.py \
	tests/integration/consuming/test_ordered_outcomes.py tests/integration/consuming/test_batching.py \
	tests/integration/publishing/test_relay.py tests/integration/publishing/test_relay_faults.py \
	tests/integration/publishing/test_relay_edges.py \
	tests/integration/publishing/test_relay_robustness.py \
	tests/integration/publishing/test_publish_in_handler.py \
	tests/integration/ops/test_messaging_status.py tests/integration/ops/test_consume_ops.py \
	tests/integration/ops/test_health.py tests/e2e/test_relay_declares_topology.py \
	tests/e2e/test_breaker_meets.py tests/e2e/test_features_meet.py \
	tests/integration/consuming/test_features_meet.py \
	tests/integration/publishing/test_relay_row_isolation.py \
	tests/integration/tasks/test_task_priorities.py
RABBITMQ40_TESTS ?= tests/faults/test_poison_pills.py tests/faults/test_broker_closes.py \
	tests/e2e/test_features_meet.py tests/integration/consuming/test_features_meet.py \
	tests/integration/publishing/test_relay_row_isolation.py \
	tests/integration/tasks/test_task_priorities.py
RABBITMQ4_SERIAL_TESTS ?= \
	tests/faults/test_broker_closes.py::test_a_channel_the_broker_closes_mid_handler_is_noticed_and_nothing_is_lost \
	tests/faults/test_broker_closes.py::test_healthz_is_unhealthy_while_the_broker_keeps_the_consumer_off \
	tests/faults/test_pipeline_under_faults.py::test_broker_restarted_twice_everyone_reconnects_by_themselves \
	tests/faults/test_pipeline_under_faults.py::test_publishers_blocked_by_a_memory_alarm_then_released \
	tests/integration/ops/test_relay_broker_faults.py::test_relay_healthz_fails_while_the_broker_is_stopped \
	tests/integration/ops/test_relay_broker_faults.py::test_blocked_relay_claims_nothing_and_resumes_by_itself \
	tests/integration/ops/test_consume_ops.py::test_consumer_healthz_fails_while_the_broker_is_stopped \
	tests/e2e/test_ordering.py::test_keys_keep_publish_order_across_a_restart_of_the_node \
	tests/integration/publishing/test_relay_broker_limits.py::test_a_limit_the_operator_raises_is_taken_without_a_restart

# This machine's environment sets PYTHONDONTWRITEBYTECODE=1. Without bytecode files every pytest
# process rewrites every test module's asserts again (about 9 s of CPU per collection of the
# suite), and every manage.py process a test starts compiles the package again: the targets
# write them, in __pycache__ directories git ignores.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help venv .venv services test matrix demo docs lint format bench dist clean

help:
	@echo "Targets:"
	@echo "  venv      create .venv and install requirements + the package (editable)"
	@echo "  services  make sure PostgreSQL, Redis and RabbitMQ are running"
	@echo "  test      run the test suite (PYTEST_ARGS=... to pass options), then the matrix's ends"
	@echo "  matrix    the version-sensitive slice on every (Python, Django) pair, and lowest versions"
	@echo "  demo      run the end-to-end demo (manage.py run_demo)"
	@echo "  lint      ruff format --check, ruff check, mypy"
	@echo "  format    ruff format + ruff check --fix"
	@echo "  bench     run every bench/*.py script"
	@echo "  dist      build the sdist and the wheel into dist/"
	@echo "  docs      build the documentation site into site/ (warnings are errors)"
	@echo "  clean     remove .venv and caches"

# The stamp is refreshed whenever the dependency/packaging files change, so that
# `make venv` is a no-op (fast) when nothing changed.
venv .venv: $(STAMP)

$(STAMP): requirements.txt setup.cfg pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip \
		|| echo "warning: could not upgrade pip, continuing with $$($(BIN)/python -m pip --version)"
	$(BIN)/python -m pip install -r requirements.txt
	$(BIN)/python -m pip install -e . --no-deps
	@touch $@

services:
	@scripts/ensure-services.sh

test: venv services
	@# What the tests need from Debian, installed in one apt-get run when missing: chromium (the
	@# browser tests drive it through Playwright, never `playwright install`), nftables (the
	@# cluster tests cut a consumer off in a network namespace), haproxy (a cluster test reaches
	@# the nodes through it), pgbouncer (the PgBouncer tests run their own; Debian puts it in
	@# /usr/sbin, its service is not used) and debootstrap (the RabbitMQ 4.0 and 4.3 nodes are
	@# Debian trixie's and sid's packages in debootstrap roots: scripts/rabbitmq4.sh).
	@missing=(); \
	command -v chromium >/dev/null || missing+=(chromium); \
	command -v nft >/dev/null || missing+=(nftables); \
	command -v haproxy >/dev/null || missing+=(haproxy); \
	command -v pgbouncer >/dev/null || test -x /usr/sbin/pgbouncer || missing+=(pgbouncer); \
	command -v debootstrap >/dev/null || missing+=(debootstrap); \
	(( $${#missing[@]} == 0 )) || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$${missing[@]}"; }
	@# 1. The tests that share nothing, in $(TEST_WORKERS) parallel workers.
	@# 2. Those that stop PostgreSQL or Redis (serial and stops_storage, tests/conftest.py), alone.
	@#    The version matrix's two ends (noxfile.py: the newest Python and Django, and the lowest
	@#    versions setup.cfg admits) install their virtualenvs meanwhile.
	@# 3. The serial tests that stop or alarm the node on 5672 (serial and stops_broker); then
	@#    PGBOUNCER_TESTS, every connection through a PgBouncer in transaction mode. Beside them,
	@#    RABBITMQ4_SERIAL_TESTS acting on the RabbitMQ 4.3 node (built the first time, about 3
	@#    minutes; started if it is down), on their own database, then RABBITMQ40_TESTS against
	@#    the 4.0 node (built the first time, about 3 minutes), on another: neither side touches
	@#    the other's node, and both mostly wait on a broker's own timeouts.
	@# 4. The cluster tests on their own cluster (serial and cluster), alone: beside the matrix
	@#    their liveness checks failed on a slower machine (the consumers starved of CPU while
	@#    three nodes restarted, a healthy consumer idle past a heartbeat).
	@# 5. The matrix's two ends on the version-sensitive slice: they use only the node on 5672
	@#    and their own databases (MATRIX=0 skips them; `make matrix` runs every pair).
	@# 6. RABBITMQ4_TESTS against the 4.3 node.
	@# Every part always runs; exit code 5 ("no tests selected", e.g. with -k) is not a failure.
	@run() { local s=0; "$$@" || s=$$?; (( s == 5 )) && s=0; return $$s; }; \
	db=$${RM_TEST_DB_NAME:-test_reliable_messaging}; \
	logs=$$(mktemp -d "$${TMPDIR:-/tmp}/rm-make-test.XXXXXX"); \
	timed() { local part=$$1 t0=$$SECONDS s=0; shift; "$$@" || s=$$?; \
		printf '%-44s %5d s  exit %d\n' "$$part" $$((SECONDS - t0)) $$s >>"$$logs/times"; return $$s; }; \
	on_broker() { local broker=$$1; shift; RM_TEST_DB_NAME=$${db}_$$broker RM_TEST_BROKER=$$broker run "$$@"; }; \
	broker_lane() { \
		local s=0; \
		timed "serial, the node on 5672" run $(BIN)/pytest -m "serial and stops_broker" \
			$(PYTEST_ARGS) || s=$$?; \
		RM_TEST_PGBOUNCER=1 timed "PGBOUNCER_TESTS" run $(BIN)/pytest $(LANE_WORKERS) -m "not serial" \
			$(PYTEST_ARGS) $(PGBOUNCER_TESTS) || s=$$?; \
		return $$s; \
	}; \
	rabbitmq43_slice() { \
		scripts/rabbitmq4.sh --release 4.3 start || return 99; \
		timed "RABBITMQ4_TESTS on 4.3" on_broker rabbitmq43 $(BIN)/pytest $(WORKERS) \
			-m "not serial" $(PYTEST_ARGS) $(RABBITMQ4_TESTS); \
	}; \
	show() { echo "==================== $$1 (exit $$2) ===================="; cat "$$logs/$$1.log"; }; \
	rc=0; timed "parallel" run $(BIN)/pytest $(WORKERS) -m "not serial" --durations=25 \
		$(PYTEST_ARGS) || rc=$$?; \
	nox_install_pid=; [[ "$(MATRIX)" == 0 ]] || { \
		$(BIN)/nox -s ci --install-only >"$$logs/nox-install.log" 2>&1 & nox_install_pid=$$!; }; \
	rc2=0; timed "serial, PostgreSQL and Redis" run $(BIN)/pytest -m "serial and stops_storage" \
		$(PYTEST_ARGS) || rc2=$$?; \
	rc3=0; rc4=0; rc5=0; rc6=0; rc7=0; \
	rabbitmq4_lane() { \
		local s=0; \
		scripts/rabbitmq4.sh --release 4.3 start || return 99; \
		timed "RABBITMQ4_SERIAL_TESTS on 4.3, beside" on_broker rabbitmq43 $(BIN)/pytest -m serial \
			$(PYTEST_ARGS) $(RABBITMQ4_SERIAL_TESTS) || s=$$?; \
		scripts/rabbitmq4.sh start || return 99; \
		timed "RABBITMQ40_TESTS on 4.0, beside" on_broker rabbitmq4 $(BIN)/pytest $(LANE_WORKERS) \
			-m "not serial" $(PYTEST_ARGS) $(RABBITMQ40_TESTS) || s=$$?; \
		return $$s; \
	}; \
	rabbitmq4_lane >"$$logs/rabbitmq4.log" 2>&1 & rabbitmq4_pid=$$!; \
	echo "make test: the 4.3 node's serial tests, then the 4.0 node's slice, run beside the" \
		"5672 node's serial tests and PgBouncer's; their output follows them"; \
	broker_lane || rc3=$$?; \
	wait $$rabbitmq4_pid || rc7=$$?; show rabbitmq4 $$rc7; \
	RM_TEST_DB_NAME=$${db}_cluster timed "serial, the cluster" run $(BIN)/pytest \
		-m "serial and cluster" $(PYTEST_ARGS) || rc4=$$?; \
	if [[ "$(MATRIX)" != 0 ]]; then \
		if wait $$nox_install_pid; then \
			timed "the matrix's two ends (nox -s ci)" $(BIN)/nox -R -s ci || rc6=$$?; \
		else cat "$$logs/nox-install.log"; rc6=1; fi; \
	fi; \
	rabbitmq43_slice || rc5=$$?; \
	echo "make test: the time of each part"; cat "$$logs/times"; rm -rf "$$logs"; \
	for code in $$rc $$rc2 $$rc3 $$rc4 $$rc5 $$rc6 $$rc7; do \
		(( code == 0 )) || exit $$code; \
	done

# Every (Python, Django) pair supported, and the lowest versions (noxfile.py).
matrix: venv services
	$(BIN)/nox

demo: venv services
	$(BIN)/python manage.py run_demo

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy reliable_messaging demo_project tests

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Runs every bench/*.py script (helpers named _*.py are skipped).
bench: venv services
	@shopt -s nullglob; \
	scripts=(bench/[!_]*.py); \
	if (( $${#scripts[@]} == 0 )); then echo "bench: no bench/*.py scripts"; exit 0; fi; \
	for f in "$${scripts[@]}"; do \
		echo "==> $(BIN)/python $$f"; \
		$(BIN)/python "$$f"; \
	done

# The documentation site (mkdocs.yml, pages in docs/), warnings as errors.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The sdist and the wheel (pip install dist/reliable_messaging-*.whl), built as a package
# index would build them; `python -m build` fails on any error in the package's metadata.
dist: venv
	rm -rf dist build
	$(BIN)/python -m build --outdir dist .

clean:
	rm -rf $(VENV) .nox site .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist *.egg-info .coverage htmlcov
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
