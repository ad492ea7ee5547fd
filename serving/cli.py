"""`omnistage` command line: serve, ray-config, validate, schema, graph, bench."""

# Each subcommand imports its implementation when it runs, so `omnistage validate` stays fast.

from __future__ import annotations

import argparse
import sys

# the body limit's default, without importing the server (validate/schema stay fast)
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a value, e.g. --set stages.llm.pool.devices=[cuda:0]",
    )


def cpu_list(text: str) -> list[int]:
    from omnistage.graph.fields import parse_cpu_list
    from omnistage.runtime.cpu_affinity import check_cpus

    try:
        return sorted(check_cpus(parse_cpu_list(text)))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def port_number(text: str) -> int:
    """argparse type of a TCP port: 1..65535 (0 would pick a random one, and uvicorn reports
    the number it was given, not the port it got)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1..65535, got {port}")
    return port


def _add_ray_options(p: argparse.ArgumentParser, backend: bool = False) -> None:
    if backend:
        p.add_argument(
            "--backend",
            choices=["embedded", "ray"],
            default="embedded",
            help="embedded: worker processes on this machine; ray: Ray Serve deployments (RAY_ADDRESS or a local Ray)",
        )
    p.add_argument(
        "--ray-cpus-per-thread",
        type=float,
        default=None,
        metavar="F",
        help="Ray CPUs a stage replica reserves per pool thread (default 1; below 1 oversubscribes"
        + (
            "; a local Ray's default is lowered until every replica fits its CPUs); with --backend ray"
            if backend
            else ")"
        ),
    )
    p.add_argument(
        "--ingress-replicas",
        type=int,
        default=1,
        help="replicas of the HTTP ingress" + (" (with --backend ray)" if backend else ""),
    )


def _add_jobs_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--jobs-db",
        metavar="URL",
        help="postgresql://... : a job store shared by several servers (sets OMNISTAGE_JOBS_DB; docs/jobs.md)",
    )


def _apply_jobs_options(args: argparse.Namespace) -> None:
    import os

    if getattr(args, "jobs_db", None):  # read by every ingress process's jobs service
        os.environ["OMNISTAGE_JOBS_DB"] = args.jobs_db


def _add_ray_config_parser(sub) -> None:
    p = sub.add_parser(
        "ray-config", help="print the Ray Serve config (serve run / serve deploy / KubeRay) of pipelines"
    )
    p.add_argument("configs", nargs="+", help="pipeline YAML files or names under configs/")
    p.add_argument("--host", default="0.0.0.0", help="Serve's HTTP proxy address")
    p.add_argument("--port", type=port_number, default=8000, help="Serve's HTTP proxy port (default 8000)")
    _add_ray_options(p)
    _add_overrides(p)


def _ray_options(args: argparse.Namespace):
    import importlib

    # the Ray backend sits above serving (it hosts the app as its ingress): reached by name
    BackendOptions = importlib.import_module("omnistage.ray_serve.options").BackendOptions  # noqa: N806
    keys = list(getattr(args, "api_keys", []))
    drain = getattr(args, "drain_timeout", 30.0)
    cpus_per_thread = 1.0 if args.ray_cpus_per_thread is None else args.ray_cpus_per_thread
    return BackendOptions(cpus_per_thread, args.ingress_replicas, drain_timeout=drain, api_keys=keys)


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the HTTP server on one or more pipelines")
    p.add_argument(
        "configs",
        nargs="*",
        help="pipeline YAML files or names under configs/ (default: every configs/tiny-*.yaml)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests may still run (default 30)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds a pipeline may take to load before it is marked failed (default 600)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--cpus",
        type=cpu_list,
        default=None,
        metavar="LIST",
        help="CPUs of the server process itself, e.g. 0 or 0-1 (Linux; stage workers keep the rest "
        "unless their pool.cpus says otherwise; embedded runtime)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies are refused with 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    p.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host header value to answer besides loopback names (repeatable; *.example.com matches subdomains)",
    )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[],
        metavar="KEY",
        help="require Authorization: Bearer KEY (repeatable; also OMNISTAGE_API_KEYS, comma-separated)",
    )
    p.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=None,
        metavar="N",
        help="requests one API key may have in flight; more get 429 with Retry-After",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="[CONFIG:]PATH=VALUE",
        help="override a value in every config, or only in CONFIG (its file stem): "
        "--set tiny-llm:stages.llm.pool.threads=2",
    )

    _add_ray_options(p, backend=True)
    _add_jobs_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnistage",
        description="Serve multi-stage generative pipelines (YAML) over HTTP, check and draw them, benchmark them.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_serve_parser(sub)
    _add_ray_config_parser(sub)

    p = sub.add_parser("validate", help="check pipeline files; exit 0 if all are valid, 2 if not")
    p.add_argument(
        "files", nargs="+", metavar="file", help="pipeline YAML files, or names of ones under configs/ (e.g. tiny-llm)"
    )
    _add_overrides(p)

    sub.add_parser("schema", help="print the JSON Schema of the pipeline format")

    p = sub.add_parser("graph", help="draw a pipeline's DAG (mermaid, dot, or png)")
    p.add_argument("file", help="a pipeline YAML file, or the name of one under configs/ (e.g. tiny-omni)")
    p.add_argument("--format", choices=["mermaid", "dot", "png"], default="mermaid")
    p.add_argument("-o", "--output", help="output file (required for png)")
    _add_overrides(p)

    benches = "runtime ar ar_engine diffusion api omni omni_token2wav jobs soak realtime plot".split()
    p = sub.add_parser(
        "bench",
        help=f"run a benchmark ({', '.join(benches[:-1])}) or plot a result; `bench NAME --help` for its options",
    )
    p.add_argument("which", choices=benches)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark (--quick, --json FILE, ...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `omnistage` command. Ctrl+C before a command has set up its own handling (while a
    server imports its libraries, or during a benchmark) ends it with status 130 and no
    traceback, as a shell command's Ctrl+C does."""
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("omnistage: interrupted", file=sys.stderr)
        return 130


def _validate(files: list[str], overrides: list[str]) -> int:
    """Every file's problems (or `ok`); `--set CONFIG:PATH=VALUE` scoped as serve scopes it."""
    from omnistage.graph.loader import PipelineValidationError, load_pipeline
    from omnistage.serving.registry import overrides_per_config

    try:
        own = overrides_per_config(files, overrides)
    except ValueError as err:
        print(f"omnistage validate: {err}", file=sys.stderr)
        return 2
    status = 0
    for file, file_overrides in zip(files, own):
        try:
            spec = load_pipeline(file, overrides=file_overrides)
        except PipelineValidationError as err:
            for line in err.problems:
                print(line, file=sys.stderr)
            status = 2
            continue
        print(f"{file}: ok ({spec.name}: {len(spec.stages)} stages, {len(spec.edges)} edges)")
    return status


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":  # before its seconds of imports (the benches keep asyncio's own Ctrl+C)
        from omnistage.serving import interrupts

        interrupts.install()
    _apply_jobs_options(args)
    if args.command in ("serve", "ray-config") and (args.command == "ray-config" or args.backend == "ray"):
        import importlib

        # the Ray backend sits above serving (it hosts the app as its ingress): imported by name
        ray_cli = importlib.import_module("omnistage.ray_serve.cli")
        if args.command == "ray-config":
            return ray_cli.ray_config_command(args.configs, args.overrides, _ray_options(args), args.host, args.port)
        fit = args.ray_cpus_per_thread is None
        opts = _ray_options(args)
        return ray_cli.serve_on_ray(args.configs, args.host, args.port, args.overrides, opts, args.log_level, fit)
    if args.command == "serve":
        from omnistage.graph.paths import default_config_paths
        from omnistage.runtime.fork_server import start_for_files
        from omnistage.runtime.third_party_output import quiet_for_log_level

        # the workers' fork server imports its seconds of libraries while this process imports
        # its own (runtime/fork_server.py); it inherits the environment set here
        quiet_for_log_level(args.log_level)
        if args.cpus is not None:  # before the fork server, which passes the CPUs it had to workers
            from omnistage.runtime.cpu_affinity import pin_process

            pin_process(args.cpus)
        start_for_files(args.configs or default_config_paths(), args.overrides)
        from omnistage.serving.server import serve

        return (
            serve(
                args.configs,
                host=args.host,
                port=args.port,
                overrides=args.overrides,
                drain_timeout=args.drain_timeout,
                ready_timeout=args.ready_timeout,
                log_level=args.log_level,
                max_body_bytes=args.max_body_bytes,
                allowed_hosts=args.allowed_hosts,
                api_keys=args.api_keys,
                max_concurrent_per_key=args.max_concurrent_per_key,
            )
            or 0
        )
    if args.command == "validate":
        return _validate(args.files, args.overrides)
    if args.command == "schema":
        import json

        from omnistage.graph.schema import json_schema

        print(json.dumps(json_schema(), indent=2))
        return 0
    if args.command == "graph":
        from omnistage.graph.draw import draw_command

        return draw_command(args.file, args.format, args.output, args.overrides)
    if args.command == "bench":
        import importlib

        module = importlib.import_module(f"omnistage.bench.{args.which}")
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        return module.main(rest) or 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
