# A throwaway PostgreSQL server for the multi-worker sweep tests (tests/runs/test_sweep_postgres.py).
#
# Sourced (by .ci/run):  source .ci/postgres.sh
#   installs Debian's postgresql if it is missing (apt-get), starts a server on a free local port
#   with its data and socket under /tmp, exports QERL_TEST_PG_URL (and QERL_TEST_PG_DIR), and
#   stops the server when the sourcing shell exits (an EXIT trap).
# Run:  bash .ci/postgres.sh start [--no-install]   prints QERL_TEST_PG_URL=... and QERL_TEST_PG_DIR=...
#       bash .ci/postgres.sh stop DIR                stops that server and removes DIR
#
# initdb and pg_ctl refuse to run as root, and everything here runs as root: as root they run as
# the `postgres` user that the Debian package creates. Debian keeps them in a versioned folder
# (/usr/lib/postgresql/15/bin), not on PATH.

_qerl_pg_bin() {
  local bin
  bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$bin" ] && [ -x "$bin/pg_ctl" ]; then
    echo "$bin"
  elif command -v pg_ctl >/dev/null 2>&1; then
    dirname "$(command -v pg_ctl)"
  fi
}

_qerl_pg_as_owner() {
  # Run a command as the server's owner: `postgres` when we are root, else ourselves.
  if [ "$(id -u)" = 0 ]; then
    su postgres -s /bin/sh -c "$1"
  else
    sh -c "$1"
  fi
}

_qerl_pg_start() {
  local install=${1:-install} bin dir port
  bin=$(_qerl_pg_bin)
  if [ -z "$bin" ] && [ "$install" = install ]; then
    echo "postgres.sh: installing Debian's postgresql" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2 || return 1
    bin=$(_qerl_pg_bin)
  fi
  if [ -z "$bin" ]; then
    echo "postgres.sh: no PostgreSQL server binaries (apt-get install postgresql)" >&2
    return 1
  fi
  dir=$(mktemp -d /tmp/qerl-pg.XXXXXX) || return 1
  chmod 755 "$dir"
  if [ "$(id -u)" = 0 ]; then chown postgres: "$dir" || return 1; fi
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') || return 1
  _qerl_pg_as_owner "'$bin/initdb' -D '$dir/data' -A trust -U postgres -E UTF8 >'$dir/initdb.log' 2>&1" || {
    echo "postgres.sh: initdb failed:" >&2; cat "$dir/initdb.log" >&2; return 1; }
  _qerl_pg_as_owner "'$bin/pg_ctl' -D '$dir/data' -l '$dir/server.log' -w -t 60 -o \"-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=100 -c fsync=off\" start >'$dir/pg_ctl.log' 2>&1" || {
    echo "postgres.sh: the server did not start:" >&2; cat "$dir/pg_ctl.log" "$dir/server.log" >&2; return 1; }
  QERL_TEST_PG_URL="postgresql://postgres@127.0.0.1:$port/postgres"
  QERL_TEST_PG_DIR=$dir
  QERL_TEST_PG_BIN=$bin
}

qerl_pg_stop() {
  local dir=${1:-${QERL_TEST_PG_DIR:-}} bin
  bin=${QERL_TEST_PG_BIN:-$(_qerl_pg_bin)}
  [ -n "$dir" ] && [ -d "$dir/data" ] || return 0
  _qerl_pg_as_owner "'$bin/pg_ctl' -D '$dir/data' -m immediate -w stop >/dev/null 2>&1" || true
  rm -rf "$dir"
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  # Sourced: start, export, stop at exit.
  if _qerl_pg_start install; then
    export QERL_TEST_PG_URL QERL_TEST_PG_DIR QERL_TEST_PG_BIN
    trap 'qerl_pg_stop' EXIT
    echo "postgres.sh: PostgreSQL at $QERL_TEST_PG_URL (data in $QERL_TEST_PG_DIR)" >&2
  else
    echo "postgres.sh: no PostgreSQL server; the postgres tests will fail under CI=true" >&2
  fi
else
  set -u
  case "${1:-start}" in
    start)
      mode=install
      [ "${2:-}" = "--no-install" ] && mode=no-install
      _qerl_pg_start "$mode" || exit 1
      echo "QERL_TEST_PG_URL=$QERL_TEST_PG_URL"
      echo "QERL_TEST_PG_DIR=$QERL_TEST_PG_DIR"
      ;;
    stop)
      qerl_pg_stop "${2:?usage: postgres.sh stop DIR}"
      ;;
    *)
      echo "usage: bash .ci/postgres.sh start [--no-install] | stop DIR" >&2
      exit 2
      ;;
  esac
fi
