#!/usr/bin/env bash
# RabbitMQ 4 nodes beside the system's 3.10 one, for the tests that run on several brokers.
#
#   scripts/rabbitmq4.sh [--release 4.0|4.3] build   build the node's root once (a debootstrap
#                                directory with Debian's rabbitmq-server), kept outside the
#                                checkout so every clone and CI run on this machine reuses it
#   scripts/rabbitmq4.sh [--release R] start   start the node (idempotent), enable its plugins,
#                                              wait for it
#   scripts/rabbitmq4.sh [--release R] stop    stop it
#   scripts/rabbitmq4.sh [--release R] url     print its AMQP URL
#   scripts/rabbitmq4.sh [--release R] ctl ... rabbitmqctl against it
#
# The release (RM_RABBITMQ_RELEASE when --release is not given; 4.0 by default) picks the node:
#   4.0  Debian trixie's rabbitmq-server 4.0.5 with Erlang 27, node rmq4, AMQP port 5782
#   4.3  Debian sid's rabbitmq-server 4.3.x with Erlang 29, node rmq43, AMQP port 5783
# Each node has its own root, name, ports, epmd port, cookie and HOME, so both can run at once;
# neither touches the node on 5672. Their Erlang needs a newer libc than the host's, hence the
# chroots. Each node's rabbitmq user gets a uid that is free on the host, so that files it
# writes are never mistaken for the host's.
set -euo pipefail

set_node() {
    SUITE=$1
    ROOT="${RM_RABBITMQ4_ROOT:-/var/cache/reliable-messaging/$2}"
    NODE="${RM_RABBITMQ4_NODE:-$3@localhost}"
    AMQP_PORT="${RM_RABBITMQ4_PORT:-$4}"
    MGMT_PORT="${RM_RABBITMQ4_MANAGEMENT_PORT:-$5}"
    DIST_PORT="${RM_RABBITMQ4_DIST_PORT:-$6}"
    EPMD_PORT="${RM_RABBITMQ4_EPMD_PORT:-$7}"
    RABBIT_UID=$8
}

RELEASE="${RM_RABBITMQ_RELEASE:-4.0}"
if [[ "${1:-}" == "--release" ]]; then RELEASE="${2:-}"; shift 2 || true; fi
# One line per node: its Debian suite, root, node name, AMQP, management, distribution and epmd
# ports, and the uid of its rabbitmq user. RM_RABBITMQ4_* override the chosen node's values.
case "$RELEASE" in
4.0) set_node trixie rabbitmq4-trixie rmq4 5782 15782 25782 4382 2782 ;;
4.3) set_node sid rabbitmq43-sid rmq43 5783 15783 25783 4383 2783 ;;
*) echo "rabbitmq4: ERROR: --release ${RELEASE@Q}: expected 4.0 or 4.3" >&2; exit 2 ;;
esac
STAMP="$ROOT/.reliable-messaging-built"
BASE=/var/lib/rm-rabbitmq4   # inside the chroot: HOME, data, logs, config

die() { echo "rabbitmq4: ERROR: $*" >&2; exit 1; }

# The Debian mirror this machine's apt already uses (RM_DEBIAN_MIRROR overrides it), read from
# its sources: deb822 ".sources" files and one-line "deb" entries alike.
debian_mirror() {
    if [[ -n "${RM_DEBIAN_MIRROR:-}" ]]; then echo "${RM_DEBIAN_MIRROR%/}"; return; fi
    local uri
    uri=$( {
        sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | tr ' ' '\n'
        sed -nE 's/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' \
            /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null
    } | grep -E '/debian/?$' | head -n 1 || true)
    [[ -n "$uri" ]] || die "no Debian mirror in this machine's apt sources; set RM_DEBIAN_MIRROR"
    echo "${uri%/}"
}

build() {
    [[ -f "$STAMP" ]] && return 0
    command -v debootstrap >/dev/null || (apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap)
    exec 8>"${ROOT%/*}.build.lock" 2>/dev/null || { mkdir -p "${ROOT%/*}"; exec 8>"${ROOT%/*}.build.lock"; }
    flock -w 900 8 || die "another build holds ${ROOT%/*}.build.lock"
    [[ -f "$STAMP" ]] && return 0
    echo "rabbitmq4: building $ROOT (debootstrap $SUITE + rabbitmq-server, about 3 minutes)"
    umount_all
    rm -rf "$ROOT"
    mkdir -p "$ROOT"
    # debootstrap checks the Release file's signature (gpgv, ignoring time conflicts) but not its
    # Valid-Until, so a mirror whose sid Release has lapsed still bootstraps, signatures checked.
    debootstrap --variant=minbase "$SUITE" "$ROOT" "$(debian_mirror)" >"$ROOT.debootstrap.log" 2>&1 ||
        die "debootstrap failed; see $ROOT.debootstrap.log"
    # apt does check Valid-Until, and sid's Release on a mirror that is not refreshed every few
    # days is past it; the signature is still checked.
    echo 'Acquire::Check-Valid-Until "false";' >"$ROOT/etc/apt/apt.conf.d/90reliable-messaging"
    printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
    chmod +x "$ROOT/usr/sbin/policy-rc.d"
    chroot "$ROOT" groupadd --system --gid "$RABBIT_UID" rabbitmq
    chroot "$ROOT" useradd --system --uid "$RABBIT_UID" --gid "$RABBIT_UID" \
        --home-dir /var/lib/rabbitmq --shell /usr/sbin/nologin rabbitmq
    mount_all
    chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        rabbitmq-server >"$ROOT.install.log" 2>&1 || { umount_all; die "installing rabbitmq-server failed; see $ROOT.install.log"; }
    umount_all
    chroot "$ROOT" dpkg-query -W rabbitmq-server >"$STAMP"
    echo "rabbitmq4: built $(cat "$STAMP")"
}

mount_all() {
    mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
    mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
}

umount_all() {
    [[ -d "$ROOT" ]] || return 0
    mountpoint -q "$ROOT/dev" && umount -l "$ROOT/dev" || true
    mountpoint -q "$ROOT/proc" && umount -l "$ROOT/proc" || true
}

in_root() {
    chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
        HOME="$BASE" ERL_EPMD_PORT="$EPMD_PORT" RABBITMQ_NODENAME="$NODE" \
        RABBITMQ_NODE_PORT="$AMQP_PORT" RABBITMQ_DIST_PORT="$DIST_PORT" \
        RABBITMQ_CONFIG_FILE="$BASE/rabbitmq.conf" RABBITMQ_ADVANCED_CONFIG_FILE="$BASE/advanced.config" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$BASE/enabled_plugins" \
        RABBITMQ_MNESIA_BASE="$BASE/mnesia" RABBITMQ_LOG_BASE="$BASE/log" \
        RABBITMQ_PID_FILE="$BASE/rabbit.pid" "$@"
}

# The CLI's Erlang VM with one scheduler that sleeps when idle (tests/support.py, LEAN_CLI_ERL_ARGS).
ctl() {
    in_root RABBITMQ_CTL_ERL_ARGS="+S 1:1 +sbwt none +sbwtdcpu none +sbwtdio none" \
        rabbitmqctl -n "$NODE" "$@"
}

start() {
    build
    mount_all
    cp /etc/hosts "$ROOT/etc/hosts"
    mkdir -p "$ROOT$BASE/log" "$ROOT$BASE/mnesia"
    if ! ctl -q status >/dev/null 2>&1; then
        [[ -f "$ROOT$BASE/.erlang.cookie" ]] ||
            head -c 24 /dev/urandom | base64 | tr -dc A-Za-z0-9 >"$ROOT$BASE/.erlang.cookie"
        chmod 400 "$ROOT$BASE/.erlang.cookie"
        cat >"$ROOT$BASE/rabbitmq.conf" <<CONF
listeners.tcp.default = $AMQP_PORT
management.tcp.port = $MGMT_PORT
management.tcp.ip = 127.0.0.1
loopback_users = none
vm_memory_high_watermark.relative = 0.3
disk_free_limit.absolute = 50000000
collect_statistics_interval = 1000
CONF
        # Statistics every second, not every 5 s (above; and a quorum queue's tick, which
        # publishes its figures and applied policy, in advanced.config): tests that wait for the
        # management API to show a policy wait that much less; no test depends on the interval.
        echo "[{rabbit, [{quorum_tick_interval, 1000}]}]." >"$ROOT$BASE/advanced.config"
        echo "[rabbitmq_management,rabbitmq_consistent_hash_exchange]." >"$ROOT$BASE/enabled_plugins"
        chown -R "$RABBIT_UID:$RABBIT_UID" "$ROOT$BASE"
        # The node runs as the chroot's rabbitmq user (the server script switches to it).
        in_root setsid rabbitmq-server -detached 9>&- 8>&- >/dev/null 2>&1 || true
        echo "rabbitmq4: starting $NODE on 127.0.0.1:$AMQP_PORT"
    fi
    for _ in $(seq 1 90); do
        if ctl -q await_startup --timeout 2 >/dev/null 2>&1; then
            # The configured memory watermark again: a memory-alarm test that was killed
            # leaves its 1 MB one, and every publisher on the node blocked.
            ctl -q set_vm_memory_high_watermark 0.3 >/dev/null 2>&1 || true
            # Channels check their consumers' timeouts every channel_tick_interval (60 s by
            # default; set here for the channels opened from now on): the tests that wait for
            # 4.0 to take a late delivery back wait seconds, not a minute.
            ctl -q eval 'application:set_env(rabbit, channel_tick_interval, 5000).' \
                >/dev/null 2>&1 || true
            echo "rabbitmq4: up ($(cat "$STAMP"), amqp $AMQP_PORT, management $MGMT_PORT)"
            return 0
        fi
        sleep 1
    done
    die "$NODE did not start within 90 s; see $ROOT$BASE/log"
}

stop() {
    [[ -f "$STAMP" ]] || return 0
    ctl -q stop >/dev/null 2>&1 || true
}

case "${1:-}" in
build) build ;;
start) start ;;
stop) stop ;;
url) echo "amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2F" ;;
ctl) shift; ctl "$@" ;;
*) die "usage: $0 [--release 4.0|4.3] build|start|stop|url|ctl ..." ;;
esac
