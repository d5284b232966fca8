"""The ``pygmy`` command: run the cluster (up, serve, start, kill) and use it (search, lookup, buy, ...).

Settings for ``serve`` come, strongest first, from flags, ``PYGMY_*`` environment variables (what
the containers use), ``D/run/cluster.json`` written by ``pygmy up``, and the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import sys
from typing import Any

from pygmy.kit.config import MIN_KEY_WINDOW, SERVE_ONLY_ENV, ClusterConfig, link_map, parse_name


def _urls(value: str) -> list[str]:
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


def _links(value: str) -> dict[str, dict[str, str]]:
    try:
        return link_map(value)
    except ValueError as exc:  # json.JSONDecodeError is one
        raise argparse.ArgumentTypeError(str(exc)) from None


def id_from_hostname(hostname: str) -> int:
    """A StatefulSet's pod ordinal + 1: pod ``catalog-0`` is Pygmy's ``catalog-1``.

    Kubernetes numbers a StatefulSet's pods from 0 and names each ``<set>-<ordinal>`` (its host
    name too); Pygmy numbers replicas from 1 and maps ``catalog-K`` to the K-th URL of
    ``PYGMY_CATALOG_URLS``. One image and one pod template then serve every replica."""
    ordinal = hostname.split(".", 1)[0].rpartition("-")[2]
    if not ordinal.isdigit() or not ordinal.isascii():
        raise SystemExit(f"pygmy: --id-from-hostname: host name {hostname!r} does not end in -N "
                         "(a StatefulSet pod's ordinal)")
    return int(ordinal) + 1


def _bool(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


#: flag dest -> (config field, parser, environment variable)
SETTINGS: dict[str, tuple[str, Any, str]] = {
    "port_base": ("port_base", int, "PYGMY_PORT_BASE"),
    "bind": ("bind", str, "PYGMY_BIND"),
    "data_dir": ("data_dir", str, "PYGMY_DATA_DIR"),
    "catalog_replicas": ("catalog_replicas", int, "PYGMY_CATALOG_REPLICAS"),
    "order_replicas": ("order_replicas", int, "PYGMY_ORDER_REPLICAS"),
    "frontends": ("frontends", int, "PYGMY_FRONTENDS"),
    "frontend_workers": ("frontend_workers", int, "PYGMY_FRONTEND_WORKERS"),
    "cache": ("cache", _bool, "PYGMY_CACHE"),
    "cache_size": ("cache_size", int, "PYGMY_CACHE_SIZE"),
    "read_from": ("read_from", str, "PYGMY_READ_FROM"),
    "netns": ("netns", str, "PYGMY_NETNS"),
    "netns_subnet": ("netns_subnet", str, "PYGMY_NETNS_SUBNET"),
    "books": ("books", str, "PYGMY_BOOKS"),
    "restock_every": ("restock_every", float, "PYGMY_RESTOCK_EVERY"),
    "restock_amount": ("restock_amount", int, "PYGMY_RESTOCK_AMOUNT"),
    "backup_every": ("backup_every", float, "PYGMY_BACKUP_EVERY"),
    "backup_dir": ("backup_dir", str, "PYGMY_BACKUP_DIR"),
    "backup_keep": ("backup_keep", int, "PYGMY_BACKUP_KEEP"),
    "key_window": ("key_window", float, "PYGMY_KEY_WINDOW"),
    "catalog_urls": ("catalog_urls", _urls, "PYGMY_CATALOG_URLS"),
    "order_urls": ("order_urls", _urls, "PYGMY_ORDER_URLS"),
    "advertise_host": ("advertise_host", str, "PYGMY_ADVERTISE_HOST"),
    "port": ("port", int, "PYGMY_PORT"),
    "frontend_write_limit": ("frontend_write_limit", int, "PYGMY_FRONTEND_WRITE_LIMIT"),
    "frontend_read_limit": ("frontend_read_limit", int, "PYGMY_FRONTEND_READ_LIMIT"),
    "replica_write_limit": ("replica_write_limit", int, "PYGMY_REPLICA_WRITE_LIMIT"),
    "frontend_write_tolerance": ("frontend_write_tolerance", float, "PYGMY_FRONTEND_WRITE_TOLERANCE"),
    "frontend_buy_linger": ("frontend_buy_linger", float, "PYGMY_FRONTEND_BUY_LINGER"),
    "replica_read_limit": ("replica_read_limit", int, "PYGMY_REPLICA_READ_LIMIT"),
    "peer_addresses": ("peer_addresses", _links, "PYGMY_PEER_ADDRESSES"),
    "router_urls": ("router_urls", _links, "PYGMY_ROUTER_URLS"),
    "tls": ("tls", _bool, "PYGMY_TLS"),
    "certs_dir": ("certs_dir", str, "PYGMY_CERTS_DIR"),
}


def add_cluster_options(p: argparse.ArgumentParser, serve: bool = False) -> None:
    # Every default is None so that "not given" can fall back to env, cluster.json, then defaults.
    p.add_argument("--port-base", type=int, help="port base B: frontend B, catalog B+101.., order B+201..")
    p.add_argument("--data-dir", help="where state, logs and pid files live (default ./data)")
    p.add_argument("--catalog-replicas", type=int, help="catalog replicas (default 3)")
    p.add_argument("--order-replicas", type=int, help="order replicas (default 3)")
    p.add_argument("--frontends", type=int, help="frontend instances (default 1)")
    p.add_argument("--frontend-workers", type=int, help="Gunicorn workers per frontend (default 2)")
    p.add_argument("--no-cache", dest="cache", action="store_const", const=False, help="turn the frontend cache off")
    p.add_argument("--cache-size", type=int, help="cache capacity in entries (default 10000)")
    p.add_argument("--read-from", choices=("leader", "any"),
                   help="cache misses go to the leader first (default) or to any replica in turn")
    p.add_argument("--books", help="JSON file with the initial catalogue")
    p.add_argument("--restock-every", type=float, help="seconds between deliveries for sold-out books (off)")
    p.add_argument("--restock-amount", type=int, help="copies delivered per sold-out book")
    p.add_argument("--backup-every", type=float, help="pygmy up: back the store up every this many seconds (off)")
    p.add_argument("--backup-dir", help="where scheduled backups go (default D/backups)")
    p.add_argument("--backup-keep", type=int, help="scheduled backups kept, the newest (default 7)")
    p.add_argument("--key-window", type=float, help="seconds an idempotency key is remembered (default 86400)")
    p.add_argument("--bind", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--netns", help="run service NAME in network namespace NETNS-NAME (made beforehand; "
                                   "see pygmy/verify/nemesis.py), each at its own address")
    p.add_argument("--netns-subnet", help="first three octets of the namespaces' addresses (default 10.213.0)")
    p.add_argument("--frontend-write-limit", type=int,
                   help="buys and updates in flight per frontend, all its workers together; more get 503 + "
                        "Retry-After (default 48)")
    p.add_argument("--frontend-read-limit", type=int, help="reads in flight per frontend (default 64)")
    p.add_argument("--frontend-write-tolerance", type=float,
                   help="the write cap follows latency: cut while buys take more than this many times their "
                        "latency below the cap, e.g. 3 (default 0: a fixed cap)")
    p.add_argument("--frontend-buy-linger", type=float, metavar="SECONDS",
                   help="how long a frontend worker's next batch of buys waits for more while the one before "
                        "carried two or more (default 0.02; 0: never)")
    p.add_argument("--replica-write-limit", type=int, help="writes in flight per replica (default 64)")
    p.add_argument("--replica-read-limit", type=int, help="reads in flight per replica (default 48)")
    p.add_argument("--peer-addresses", type=_links, metavar="JSON",
                   help='where each replica dials each peer\'s peer transport, {"catalog-1": {"catalog-2": '
                        '"host:port"}, ...} (default: from the peer URLs; for proxies per link)')
    p.add_argument("--router-urls", type=_links, metavar="JSON",
                   help='the URL a frontend or order replica uses for a replica it routes to, {"frontend-1": '
                        '{"catalog-1": "http://host:port"}, ...} (default: the tier\'s URLs)')
    p.add_argument("--tls", action="store_const", const=True,
                   help="every hop over TLS, mutual between services (certificates from pygmy certs, made if missing)")
    p.add_argument("--certs-dir", help="where the certificates are (default D/certs)")
    if serve:
        p.add_argument("--port", type=int, help="listen on this port instead of the one the port base gives")
        p.add_argument("--catalog-urls", type=_urls, help="comma-separated catalog replica URLs, replica 1 first")
        p.add_argument("--order-urls", type=_urls, help="comma-separated order replica URLs")
        p.add_argument("--advertise-host", help="host name other services use to reach this one")


def resolve(args: argparse.Namespace, use_cluster_file: bool, serve: bool = False) -> ClusterConfig:
    data_dir = args.data_dir or os.environ.get("PYGMY_DATA_DIR") or "data"
    base: dict[str, Any] = ClusterConfig().to_dict()
    cluster_file = ClusterConfig(data_dir=data_dir).cluster_file()
    if use_cluster_file and cluster_file.exists():
        base.update(json.loads(cluster_file.read_text()))
    for dest, (field_name, parse, env) in SETTINGS.items():
        if env in SERVE_ONLY_ENV and not serve:
            continue  # one service's own port or peers: `up` gives each service its own
        if os.environ.get(env):
            try:
                base[field_name] = parse(os.environ[env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise SystemExit(f"pygmy: {env}: {exc}") from None
        given = getattr(args, dest, None)
        if given is not None:
            base[field_name] = given
    if serve:  # a replica joining its tier in a container: it names itself among the learners
        for tier in ("catalog", "order"):
            if learners := os.environ.get(f"PYGMY_{tier.upper()}_LEARNERS"):
                base["tier_learners"] = {**base.get("tier_learners", {}),
                                         tier: [n.strip() for n in learners.split(",") if n.strip()]}
    base["data_dir"] = data_dir
    return check_settings(ClusterConfig.from_dict(base))


def check_settings(config: ClusterConfig) -> ClusterConfig:
    """``config`` if its settings make a cluster (``pygmy up``'s, and a restore's); else SystemExit
    saying which does not."""
    for tier in ("catalog", "order"):
        if config.replicas(tier) < 1:
            raise SystemExit(f"pygmy: --{tier}-replicas must be at least 1")
    if config.frontends < 1 or config.frontend_workers < 1:
        raise SystemExit("pygmy: --frontends and --frontend-workers must be at least 1")
    if min(*config.limits("frontend").values(), *config.limits("catalog").values()) < 1:
        raise SystemExit("pygmy: every --*-limit must be at least 1")
    if not (config.frontend_write_tolerance == 0 or config.frontend_write_tolerance > 1):
        raise SystemExit("pygmy: --frontend-write-tolerance must be 0 (a fixed cap) or over 1")
    if not 0 <= config.frontend_buy_linger <= 1:  # NaN fails too
        raise SystemExit("pygmy: --frontend-buy-linger must be 0 to 1 s")
    bad_links = config.check_links()
    if bad_links:
        raise SystemExit("pygmy: " + "; ".join(bad_links))
    if config.backup_every < 0 or (config.backup_every and config.backup_keep < 1):
        raise SystemExit("pygmy: --backup-every must be at least 0, and --backup-keep at least 1")
    if not config.key_window >= MIN_KEY_WINDOW:
        raise SystemExit(f"pygmy: --key-window must be at least {MIN_KEY_WINDOW:g} s (longer than a buy may take)")
    return config


def verify(config: ClusterConfig) -> int:
    """``pygmy verify``: ask each replica to recompute its digest; compare within each tier."""
    import requests

    auth = {"Authorization": f"Bearer {config.secret()}"}
    bad = 0
    for tier in ("catalog", "order"):
        seen: dict[int, set[str]] = {}
        for name, url in config.peers(tier).items():
            try:
                r = requests.get(f"{url}/verify", headers=auth, timeout=(2, 600), **config.tool_tls())
                v = r.json() if r.status_code == 200 else None
            except (requests.RequestException, ValueError):
                v = None
            if v is None:
                print(f"{name:10} unreachable")
                bad += 1
                continue
            seen.setdefault(v["applied_index"], set()).add(v["recomputed"])
            verdict = "ok" if v["ok"] else f"MISMATCH: maintained {v['state_digest']}, rows give {v['recomputed']}"
            bad += not v["ok"]
            print(f"{name:10} applied {v['applied_index']:>8}  digest {v['recomputed']}  {verdict}")
        for index, digests in seen.items():
            if len(digests) > 1:
                print(f"{tier}: replicas at index {index} DIFFER: {sorted(digests)}")
                bad += 1
    return 1 if bad else 0


def run_backup(args: argparse.Namespace) -> int:
    """``pygmy backup DEST``, ``pygmy backup --verify ARCHIVE``, ``pygmy restore ARCHIVE``."""
    from pathlib import Path

    from pygmy.cluster import backup, launcher

    def say(line: str) -> None:
        print(f"pygmy {args.command}: {line}", file=sys.stderr, flush=True)

    try:
        if args.command == "backup":
            if bool(args.verify) == bool(args.dest):
                print("pygmy backup: name the archive to write (DEST) or the one to check (--verify ARCHIVE)",
                      file=sys.stderr)
                return 2
            if args.verify:
                backup.verify(Path(args.verify), say)
                return 0
            config = ClusterConfig.load(args.data_dir)
            config.data_dir = args.data_dir
            backup.backup(config, Path(args.dest), args.with_secrets, say)
            return 0
        overrides: dict[str, Any] = {}  # as for up: flags, then PYGMY_* variables, then (here) the archive's
        for dest, (field_name, parse, env) in SETTINGS.items():
            if dest == "data_dir" or env in SERVE_ONLY_ENV:
                continue
            if os.environ.get(env):
                try:
                    overrides[field_name] = parse(os.environ[env])
                except (ValueError, argparse.ArgumentTypeError) as exc:
                    raise SystemExit(f"pygmy: {env}: {exc}") from None
            if getattr(args, dest, None) is not None:
                overrides[field_name] = getattr(args, dest)
        with backup.opened(Path(args.archive)) as (folder, _):
            settings = json.loads((folder / "settings.json").read_text())
        config = check_settings(backup.restore_settings(
            settings, overrides, args.data_dir or os.environ.get("PYGMY_DATA_DIR") or "data"))
        backup.restore(Path(args.archive), config, args.force, say)
        say(f"wrote {config.root}; starting it (later: pygmy up --data-dir {config.data_dir})")
        return launcher.up(config)
    except (backup.BackupError, OSError, sqlite3.Error) as exc:  # (a path not writable, a full disk)
        print(f"pygmy {args.command}: {exc}", file=sys.stderr)
        return 1


def build_parser(serving: bool = False) -> argparse.ArgumentParser:
    """Every command; ``serving``: without the client's commands, whose module imports Requests,
    which a service process never uses (about a tenth of its start-up's CPU, in every process)."""
    parser = argparse.ArgumentParser(prog="pygmy", description="Pygmy, a replicated online bookstore")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="start the whole cluster locally, in the foreground")
    add_cluster_options(p)
    p.add_argument("--reset", action="store_true", help="start from an empty state")
    p = sub.add_parser("serve", help="run one service in the foreground under Gunicorn")
    p.add_argument("tier", choices=["frontend", "catalog", "order"])
    ident = p.add_mutually_exclusive_group()
    ident.add_argument("--id", type=int, default=1, help="replica or frontend number K (default 1)")
    ident.add_argument("--id-from-hostname", action="store_true",
                       help="K from this host's name: the number after its last '-', plus 1 (a Kubernetes "
                            "StatefulSet's pod catalog-0 runs as catalog-1)")
    add_cluster_options(p, serve=True)
    for cmd, text in (("kill", "SIGKILL one service's whole process group"),
                      ("start", "start one service again with the settings in cluster.json")):
        p = sub.add_parser(cmd, help=text)
        p.add_argument("name", help="e.g. catalog-2, order-1, frontend-1")
        p.add_argument("--data-dir", default=os.environ.get("PYGMY_DATA_DIR", "data"))
        if cmd == "start":
            p.add_argument("--url", help="a replica not yet in cluster.json (added to its tier elsewhere with "
                                         "pygmy member add): where it serves, http://host:port; it joins as a learner")
    p = sub.add_parser("certs", help="make the cluster's CA and a certificate for each service, clients and "
                                     "admins (for --tls); existing ones are kept")
    add_cluster_options(p)
    p.add_argument("--host", action="append", default=[],
                   help="a host name or address to put in every certificate too (repeatable)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="issue only this holder's (e.g. catalog-4 after pygmy member add; repeatable)")
    p.add_argument("--force", action="store_true", help="issue them anew (rotation: services reload them)")
    p = sub.add_parser("member", help="list or change a tier's replicas, one at a time: add a learner, promote "
                                      "it once caught up, remove a replica; or hand leadership to one (lead)")
    p.add_argument("action", choices=("list", "add", "promote", "remove", "lead"))
    p.add_argument("tier", help="catalog or order")
    p.add_argument("name", nargs="?", help="the replica, e.g. catalog-4 (not for list)")
    p.add_argument("url", nargs="?", help="add: where the new replica serves, e.g. http://10.0.0.4:8104")
    p.add_argument("--wait", type=float, default=0.0,
                   help="promote, lead: ask again for up to this many seconds while it catches up; "
                        "promote, remove, lead: give another change this long to settle (default 10 s)")
    p.add_argument("--json", action="store_true", help="print the JSON answer")
    p.add_argument("--data-dir", default=os.environ.get("PYGMY_DATA_DIR", "data"))
    p = sub.add_parser("verify", help="every replica's state digest against a full recompute, and replicas "
                                      "of a tier against each other (exit 1 on a mismatch)")
    p.add_argument("--data-dir", default=os.environ.get("PYGMY_DATA_DIR", "data"))
    p = sub.add_parser("backup", help="an online backup of both tiers at one cut, into one archive; or check one "
                                      "(--verify ARCHIVE)")
    p.add_argument("dest", nargs="?", help="the archive to write (a new file)")
    p.add_argument("--verify", metavar="ARCHIVE", help="check an archive instead: hashes, digests, no pending order, "
                                                       "one order per key, stock = initial + added - sold")
    p.add_argument("--with-secrets", action="store_true", help="put the internal secret and the admin token in "
                                                                "the archive too (default: left out)")
    p.add_argument("--data-dir", default=os.environ.get("PYGMY_DATA_DIR", "data"))
    p = sub.add_parser("restore", help="build a new cluster from a backup in an empty data dir, check it holds "
                                       "the archive's state, and run it in the foreground (as up)")
    p.add_argument("archive", help="an archive written by pygmy backup")
    add_cluster_options(p)
    p.add_argument("--force", action="store_true", help="delete the store the data dir holds first")
    if not serving:
        from pygmy.client import cli as client_cli

        client_cli.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serving = argv[:1] == ["serve"]
    args = build_parser(serving).parse_args(argv)
    if not serving:  # a service process never needs the launcher (nor the Requests it imports)
        from pygmy.cluster import launcher
    try:
        if args.command == "up":
            return launcher.up(resolve(args, use_cluster_file=False), reset_state=args.reset)
        if args.command == "certs":
            from pygmy.cluster import certs

            config = resolve(args, use_cluster_file=True)
            issued = certs.ensure(config, config.certs_path(), args.host, args.force, args.only)
            print(f"{config.certs_path()}: issued {', '.join(issued) or 'nothing (all there)'}")
            return 0
        if args.command == "serve":
            from pygmy.cluster.serve import serve

            if args.id_from_hostname:
                args.id = id_from_hostname(socket.gethostname())
            config = resolve(args, use_cluster_file=True, serve=True)
            if args.tier == "frontend" and not 1 <= args.id <= config.frontends:
                raise SystemExit(f"pygmy: --id must be 1..{config.frontends} for frontend")
            if args.tier != "frontend" and f"{args.tier}-{args.id}" not in config.peers(args.tier):
                raise SystemExit(f"pygmy: {args.tier}-{args.id} is not a {args.tier} replica: "
                                 f"{', '.join(config.peers(args.tier))} are (pygmy member add)")
            if args.tier != "frontend" and config.unfinished_restore():  # as ``up`` and ``start`` refuse it
                raise SystemExit(f"pygmy serve: a restore into {config.root} did not finish: run it again "
                                 "with --force (or start afresh with pygmy up --reset)")
            config.secret()  # fail early and clearly without one
            if args.tier == "frontend":
                config.admin_token()  # only the frontend needs it; refused if it equals the secret
            serve(args.tier, config, args.id)
            return 0
        if args.command in ("kill", "start"):
            parse_name(args.name)
            config = ClusterConfig.load(args.data_dir)
            config.data_dir = args.data_dir
            if args.command == "kill":
                print(f"killed {args.name} (process group {launcher.kill(config, args.name)})")
            else:
                from pygmy.cluster.backup import refuse_unfinished

                refuse_unfinished(config, reset_state=False)  # as ``up``: never on half a restored store
                if args.url:
                    launcher.join(config, args.name, args.url)
                print(f"started {args.name} (pid {launcher.start(config, args.name)})")
            return 0
        if args.command == "member":
            from pygmy.cluster import members

            if args.action != "list" and not args.name:
                raise SystemExit(f"pygmy member {args.action}: name the replica, e.g. {args.tier}-4")
            if ClusterConfig(data_dir=args.data_dir).cluster_file().exists() or not os.environ.get(
                    f"PYGMY_{args.tier.upper()}_URLS"):
                config = ClusterConfig.load(args.data_dir)
                config.data_dir = args.data_dir
                return members.run(config, args.action, args.tier, args.name, args.url, args.wait, args.json)
            # In a container (no cluster.json, the tier's URLs in the environment, as `pygmy serve` reads
            # them): the replicas to ask come from there, and nothing is recorded.
            config = resolve(argparse.Namespace(data_dir=args.data_dir), use_cluster_file=False, serve=True)
            return members.run(config, args.action, args.tier, args.name, args.url, args.wait, args.json,
                               record_changes=False)
        if args.command in ("backup", "restore"):
            return run_backup(args)
        if args.command == "verify":
            config = ClusterConfig.load(args.data_dir)
            config.data_dir = args.data_dir
            return verify(config)
        from pygmy.client import cli as client_cli

        return client_cli.run(args)
    except (RuntimeError, ValueError) as exc:  # launcher.LaunchError is a RuntimeError
        print(f"pygmy {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
