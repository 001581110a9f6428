"""Commands that serve: ``serve`` (OTLP into a store, optionally with the live dashboard) and
``dashboard`` (a store browsed read-only).

``serve --dashboard`` is a composition the CLI owns: the receiver owns the file and the
dashboard reads through a cursor of its writer's connection. Every port is bound before the
store is opened, so a start that cannot listen leaves the file untouched; SIGINT and SIGTERM stop
both the way they stop plain ``serve`` (:func:`kvscope.serving.stop_signals`): the dashboard
stops, then the receiver stops its listeners, writes everything acknowledged, ends its run and
closes the store.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvscope import settings
from kvscope.cli.options import Command, add_setting, add_store, required, resolved, store_source
from kvscope.serving import bind, close_all, stop_signals

__all__ = ["COMMANDS", "serve", "serve_with_dashboard"]


def _configure_serve(parser: argparse.ArgumentParser) -> None:
    add_setting(parser, "db")
    add_setting(parser, "host")
    add_setting(parser, "port")
    add_setting(parser, "grpc_port")
    add_setting(parser, "run_label")
    parser.add_argument("--dashboard", action="store_true",
                        help="also serve the live dashboard from the same store")
    parser.add_argument("--dashboard-port", type=int, default=None,
                        help="port of the dashboard (default 8050)")


def _run_serve(args: argparse.Namespace) -> int:
    db, host, port = required(args, "db"), resolved(args, "host"), resolved(args, "port")
    grpc_port = resolved(args, "grpc_port")
    label = getattr(args, "run_label", None)
    if label:
        # The receiver records its run under the run_label setting: the flag wins over the
        # environment, as every setting's flag does.
        os.environ[settings.SETTINGS["run_label"].env_var] = str(label)
    if args.dashboard:
        return serve_with_dashboard(db, host, port, grpc_port, args.dashboard_port)
    return serve(db, host, port, grpc_port)


def serve(db: str, host: str, port: int, grpc_port: int | None) -> int:
    """Receive OTLP/HTTP on ``port`` and OTLP/gRPC on ``grpc_port`` into ``db`` until stopped.

    Store errors (locked, foreign or newer file) and a port in use propagate as
    :class:`~kvscope.errors.KvscopeError`, printed as one line by :func:`kvscope.cli.main`.
    """
    from kvscope.analysis.live_metrics import metrics_source
    from kvscope.analysis.live_queries import answer_source
    from kvscope.collector.receiver import Listening, run_receiver

    def ready(listening: Listening) -> None:
        print(f"kvscope serve: receiving OTLP/HTTP on {listening.http_url}, OTLP/gRPC on "
              f"{listening.grpc_url}, writing {db}; Prometheus metrics on "
              f"{listening.http_url}/metrics; read it meanwhile with kvscope analyze --live "
              f"{listening.http_url} NAME", file=sys.stderr, flush=True)

    run_receiver(db, host, port, grpc_port=grpc_port, on_ready=ready, metrics=metrics_source,
                 queries=answer_source)
    print("kvscope serve: stopped; everything acknowledged is written", file=sys.stderr,
          flush=True)
    return 0


def serve_with_dashboard(db: str, host: str, port: int, grpc_port: int | None,
                         dashboard_port: int | None) -> int:
    """The receiver and the live dashboard on one store, stopped in order (module doc)."""
    from werkzeug.serving import select_address_family

    from kvscope.analysis.live_metrics import metrics_source
    from kvscope.analysis.live_queries import answer_source
    from kvscope.collector.receiver import Receiver
    from kvscope.dashboards.app import DEFAULT_PORT, DashboardServer, create_app

    with stop_signals() as wait_for_stop:
        dashboard_sockets = bind(host, DEFAULT_PORT if dashboard_port is None
                                 else dashboard_port)
        try:
            receiver = Receiver(db, host, port, grpc_port=grpc_port, record_run=True,
                                metrics=metrics_source, queries=answer_source).start()
        except BaseException:
            close_all(dashboard_sockets)
            raise
        try:
            # The WSGI server serves one address: the one it would have bound itself.
            family = select_address_family(host, 0)
            served = next((s for s in dashboard_sockets if s.family == family),
                          dashboard_sockets[0])
            close_all([s for s in dashboard_sockets if s is not served])
            server = DashboardServer(create_app(receiver.writer), host, sock=served).start()
            try:
                print(f"kvscope serve: receiving OTLP/HTTP on {receiver.url}, OTLP/gRPC on "
                      f"{receiver.grpc_url}, writing {db}; Prometheus metrics on "
                      f"{receiver.url}/metrics; dashboard on {server.url}",
                      file=sys.stderr, flush=True)
                wait_for_stop()
            finally:
                server.stop()
        finally:
            receiver.stop(timeout=None)
    print("kvscope serve: stopped; everything acknowledged is written", file=sys.stderr,
          flush=True)
    return 0


def _configure_dashboard(parser: argparse.ArgumentParser) -> None:
    add_store(parser)
    add_setting(parser, "host")
    parser.add_argument("--port", type=int, default=None, help="dashboard port (default 8050)")


def _run_dashboard(args: argparse.Namespace) -> int:
    """Browse a store read-only until SIGINT or SIGTERM."""
    from kvscope.dashboards.app import DEFAULT_PORT, DashboardServer, create_app
    from kvscope.store.source import open_reader

    source = store_source(args)
    open_reader(source).close()  # refuse a missing, locked or foreign store first
    # Signals are caught before the app starts warming its pages: a SIGTERM then stops it
    # cleanly (DashboardServer.stop() interrupts the warming) instead of killing it.
    with stop_signals() as wait_for_stop:
        app = create_app(source)
        try:
            server = DashboardServer(app, resolved(args, "host"),
                                     DEFAULT_PORT if args.port is None else args.port)
        except BaseException:
            app.server.config["kvscope_data"].close()
            raise
        server.start()
        try:
            print(f"kvscope dashboard: {server.url} (read-only: {source}); Ctrl-C stops",
                  file=sys.stderr, flush=True)
            wait_for_stop()
        finally:
            server.stop()
    return 0


def _configure_grafana(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--out", default=None,
                        help="file to write (default: print it to stdout)")


def _write_rendered(args: argparse.Namespace, text: str, what: str) -> int:
    """Print ``text``, or write it to ``--out`` and say so."""
    if args.out is None:
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {what} to {args.out}", file=sys.stderr)
    return 0


def _run_grafana(args: argparse.Namespace) -> int:
    from kvscope.dashboards.grafana_dashboard import render

    return _write_rendered(args, render(), "the Grafana dashboard")


def _run_alerts(args: argparse.Namespace) -> int:
    from kvscope.dashboards.prometheus_alerts import render

    return _write_rendered(args, render(), "the Prometheus alert rules")


COMMANDS = [
    Command("serve", "receive OTLP/HTTP and OTLP/gRPC traces and metrics into a store",
            _configure_serve, _run_serve),
    Command("dashboard", "browse a store in the Dash dashboard (read-only)",
            _configure_dashboard, _run_dashboard),
    Command("grafana", "print (or write) the Grafana dashboard for kvscope serve's /metrics",
            _configure_grafana, _run_grafana),
    Command("alerts", "print (or write) Prometheus alert rules for kvscope serve's and kvscope "
            "proxy's /metrics", _configure_grafana, _run_alerts),
]
