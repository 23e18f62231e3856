"""`python -m qerl_exp.sweep dashboard SPEC.yaml [storage=URL] [port=8080] [host=127.0.0.1]`.

Serves `optuna-dashboard` (history, importances, parallel coordinates, every trial's parameters
and attributes, live while the study runs) on the study that SPEC.yaml names, read from the same
storage the sweep writes: the spec's or the command line's `storage=` (SQLite or PostgreSQL), or
the default `SWEEP_DIR/study.db`. It prints the study's address and serves until Ctrl-C.

`port=0` picks a free port (the printed address has it). `host=0.0.0.0` serves other machines
too; the dashboard can edit studies (notes, tells), so keep it on loopback unless the network is
trusted, or reach it through an SSH tunnel (`ssh -L 8080:127.0.0.1:8080 HOST`).
"""

from __future__ import annotations

import socketserver
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from qerl_exp.run.console import UsageError, fail
from qerl_exp.sweep.spec import load_plan
from qerl_exp.sweep.storage import open_storage, shown, storage_url

USAGE = """usage: python -m qerl_exp.sweep dashboard SPEC.yaml [storage=URL] [study_name=NAME] [port=8080] [host=127.0.0.1]

Serves optuna-dashboard on the study SPEC.yaml names, from its storage (see docs/sweeps.md)."""
# The dashboard's own settings; the rest (storage, study_name, sweep_dir) locate the study.
OPTIONS = {"port": "8080", "host": "127.0.0.1"}


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a browser's open connections do not keep Ctrl-C waiting


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass  # one line per request would bury the address; errors still reach the browser


def main(argv: list[str]) -> int:
    """Serve the dashboard until interrupted; returns the exit status.

    Args:
        argv: `[SPEC.yaml, key=value, ...]`: `port`, `host`, and the sweep settings that locate
            the study (`storage`, `study_name`, `sweep_dir`).

    Returns:
        0 after Ctrl-C (or SIGTERM, which the sweep command turns into one); a bad spec, a missing study or a busy port exit with status 2
        and one line saying what to change.
    """
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    try:
        options, rest = _options(argv[1:])
        server, url = _serve(Path(argv[0]), rest, options)
    except UsageError as e:
        fail(str(e))
    print(url, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    options, rest = dict(OPTIONS), []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in OPTIONS:
            options[key] = value
        else:
            rest.append(arg)
    port = options["port"]
    if not port.isdigit() or int(port) > 65535:
        raise UsageError(f"port={port!r} must be a port number (0-65535; 0 picks a free one)")
    return options, rest


def _serve(spec_path: Path, rest: list[str], options: dict[str, str]):
    """Open the study's storage and bind the server; returns it and the study's address line."""
    try:  # an optional extra: pip install 'qerl-exp[dashboards]'
        import optuna_dashboard
    except ImportError:
        raise UsageError("optuna-dashboard is not installed; pip install 'qerl-exp[dashboards]' (or optuna-dashboard)") from None
    # The trial budget does not matter here, and a spec may leave it to the sweep's command line.
    plan = load_plan(spec_path, [*rest, "n_trials=1"], check_config=False)
    url = storage_url(plan)
    if url.startswith("sqlite") and not Path(url.split("///", 1)[1]).is_file():
        raise UsageError(f"no study '{plan.study_name}' yet: {shown(plan.storage)} does not exist; "
                         f"start it with python -m qerl_exp.sweep {spec_path}")
    storage = open_storage(plan)
    try:
        study_id = storage.get_study_id_from_name(plan.study_name)
    except KeyError:
        names = ", ".join(s.study_name for s in storage.get_all_studies()) or "none"
        raise UsageError(f"no study '{plan.study_name}' in {shown(plan.storage)} (studies there: {names}); "
                         "give study_name= or storage=") from None
    trials = len(storage.get_all_trials(study_id, deepcopy=False))
    host, port = options["host"], int(options["port"])
    try:
        server = make_server(host, port, optuna_dashboard.wsgi(storage), server_class=_Server, handler_class=_QuietHandler)
    except OSError as e:
        raise UsageError(f"cannot serve on {host}:{port}: {e.strerror or e}; choose another port=N (0 picks a free one)") from None
    shown_host = f"[{host}]" if ":" in host else host
    address = f"http://{shown_host}:{server.server_port}/dashboard/studies/{study_id}"
    return server, (f"optuna-dashboard: study '{plan.study_name}' ({trials} trials, {shown(plan.storage)}) "
                    f"at {address}  (Ctrl-C stops it)")
