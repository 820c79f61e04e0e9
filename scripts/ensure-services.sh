#!/usr/bin/env bash
# Make sure the local services used by the tests and the demo are up:
# PostgreSQL (127.0.0.1:5432), Redis (127.0.0.1:6379) and RabbitMQ (127.0.0.1:5672).
#
# Idempotent and quick when everything already runs; starts (heals) whatever is
# down. Prints one line per service, e.g. "postgresql: up" or "redis: started".
# Exits non-zero with a clear message when a service cannot be brought up.
set -euo pipefail

WAIT_TIMEOUT="${ENSURE_SERVICES_TIMEOUT:-60}"
RABBIT_PLUGINS=(rabbitmq_management rabbitmq_consistent_hash_exchange)
RABBIT_WATERMARK="0.4"
RABBIT_DISK_FREE_LIMIT="50000000"

die() {
    echo "ensure-services: ERROR: $*" >&2
    exit 1
}

# Serialise concurrent runs (e.g. `make -j test demo`) so that two of them never
# try to start the same service at once. Every command that starts a daemon gets
# `9>&-` so the daemon does not inherit (and hold forever) the lock descriptor.
LOCK_FILE="${TMPDIR:-/tmp}/reliable-messaging-ensure-services.lock"
exec 9>"$LOCK_FILE"
flock -w 300 9 || die "could not acquire $LOCK_FILE"

# wait_for NAME CHECK_FUNCTION [TIMEOUT]: poll CHECK_FUNCTION once a second,
# up to TIMEOUT (default WAIT_TIMEOUT) seconds; exit 1 with a message if it never passes.
wait_for() {
    local name="$1" check="$2" limit="${3:-$WAIT_TIMEOUT}" waited=0
    until "$check"; do
        if ((waited >= limit)); then
            die "$name did not come up within ${limit}s"
        fi
        sleep 1
        waited=$((waited + 1))
    done
}

# --------------------------------------------------------------------------- PostgreSQL

pg_up() {
    pg_isready -q -t 2 -h 127.0.0.1 -p 5432 >/dev/null 2>&1
}

pg_query_ok() {
    [[ "$(psql -w -X -A -t -q -h 127.0.0.1 -p 5432 -U postgres -d postgres -c 'select 1' 2>/dev/null)" == "1" ]]
}

ensure_postgresql() {
    local state="up"
    if ! pg_up; then
        state="started"
        # "Cluster is already running" (a restart under way) is not a failure: the wait decides.
        # shellcheck disable=SC2046
        pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start 9>&- ||
            echo "postgresql: start command failed; waiting to see whether it comes up" >&2
        wait_for postgresql pg_up
    fi
    # The server may accept connections a moment before queries succeed.
    wait_for "postgresql (psql -U postgres 'select 1')" pg_query_ok
    echo "postgresql: $state"
}

# --------------------------------------------------------------------------- Redis

redis_up() {
    [[ "$(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" == "PONG" ]]
}

ensure_redis() {
    local state="up"
    if ! redis_up; then
        state="started"
        redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
            --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log 9>&- ||
            die "redis: redis-server failed to start (see /var/log/redis/ci.log)"
        wait_for redis redis_up
    fi
    echo "redis: $state"
}

# --------------------------------------------------------------------------- RabbitMQ

RABBIT_STATUS=""

# Succeeds (and stores the JSON in RABBIT_STATUS) only when the Erlang node runs
# AND the rabbit application is started: `status` fails when the app is stopped.
rabbit_status() {
    RABBIT_STATUS="$(rabbitmqctl -q status --formatter json 2>/dev/null)" && [[ -n "$RABBIT_STATUS" ]]
}

rabbit_node_up() {
    rabbitmq-diagnostics -q ping >/dev/null 2>&1
}

rabbit_await_startup() {
    timeout 120 rabbitmqctl -q await_startup >/dev/null ||
        die "rabbitmq: node did not finish booting (see /var/log/rabbitmq/)"
}

# Print "KEY=VALUE" facts extracted from the status JSON.
rabbit_facts() {
    python3 - "$RABBIT_STATUS" <<'PY'
import json, sys
d = json.loads(sys.argv[1])
print("plugins=" + " ".join(d.get("active_plugins") or []))
wm = d.get("vm_memory_high_watermark_setting") or {}
print("watermark=" + str(wm.get("relative", "")))
print("disk_free_limit=" + str(d.get("disk_free_limit", "")))
PY
}

ensure_rabbitmq() {
    local state="up" notes=()
    if ! rabbit_status; then
        if rabbit_node_up; then
            if rabbitmqctl -q await_startup --timeout 5 >/dev/null 2>&1; then
                # The node was still booting and has just finished.
                state="up (was booting)"
            else
                # Erlang node alive but the app was stopped (`rabbitmqctl stop_app`).
                state="started (app was stopped)"
                rabbitmqctl -q start_app >/dev/null 9>&- ||
                    die "rabbitmq: 'rabbitmqctl start_app' failed"
            fi
        else
            state="started"
            rabbitmq-server -detached 9>&- || die "rabbitmq: 'rabbitmq-server -detached' failed"
        fi
        # The CLI cannot reach a node that has not registered with epmd yet
        # (await_startup then fails at once), so first wait for the node to answer.
        wait_for "rabbitmq node" rabbit_node_up 120
        rabbit_await_startup
        wait_for rabbitmq rabbit_status
    fi

    local facts plugins watermark disk_limit
    facts="$(rabbit_facts)" || die "rabbitmq: could not parse 'rabbitmqctl status' output"
    plugins=" $(sed -n 's/^plugins=//p' <<<"$facts") "
    watermark="$(sed -n 's/^watermark=//p' <<<"$facts")"
    disk_limit="$(sed -n 's/^disk_free_limit=//p' <<<"$facts")"

    # Reset resource limits a test may have left changed (clears memory/disk alarms).
    if [[ "$watermark" != "$RABBIT_WATERMARK" ]]; then
        rabbitmqctl -q set_vm_memory_high_watermark "$RABBIT_WATERMARK" >/dev/null ||
            die "rabbitmq: could not reset vm_memory_high_watermark"
        notes+=("memory watermark reset to $RABBIT_WATERMARK")
    fi
    if [[ "$disk_limit" != "$RABBIT_DISK_FREE_LIMIT" ]]; then
        rabbitmqctl -q set_disk_free_limit "$RABBIT_DISK_FREE_LIMIT" >/dev/null ||
            die "rabbitmq: could not reset disk_free_limit"
        notes+=("disk_free_limit reset")
    fi

    # Plugins: the fast path looks at the plugins active on the node (taken from the
    # status above, so no extra CLI round-trip). Only when one is missing do we ask
    # `rabbitmq-plugins list -e -m` and enable what is not enabled yet. Enabling on a
    # running node is online (no restart); it also synchronises the node with the
    # enabled-plugins file, so plugins enabled but not yet running get activated.
    local missing=() p enabled to_enable=()
    for p in "${RABBIT_PLUGINS[@]}"; do
        [[ "$plugins" == *" $p "* ]] || missing+=("$p")
    done
    if ((${#missing[@]})); then
        enabled=" $(rabbitmq-plugins list -q -e -m 2>/dev/null | tr '\n' ' ') "
        for p in "${missing[@]}"; do
            [[ "$enabled" == *" $p "* ]] || to_enable+=("$p")
        done
        # Nothing left to add means enabled-but-inactive: re-run enable to activate them.
        ((${#to_enable[@]})) || to_enable=("${missing[@]}")
        rabbitmq-plugins enable --quiet "${to_enable[@]}" >/dev/null 9>&- ||
            die "rabbitmq: could not enable plugins: ${to_enable[*]}"
        notes+=("enabled plugins: ${missing[*]}")
    fi

    if ((${#notes[@]})); then
        local joined
        joined="$(printf '%s; ' "${notes[@]}")"
        echo "rabbitmq: $state (${joined%; })"
    else
        echo "rabbitmq: $state"
    fi
}

ensure_postgresql
ensure_redis
ensure_rabbitmq
