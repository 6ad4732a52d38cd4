"""Runtime subcommands: run, serve, warm, jobs, status, migrate, taint, untaint, events, demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from baton import torchrun_flags
from baton.rundir import RunDir, default_dir


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a training script with live migration (replaces torchrun)",
                       description="Start an embedded orchestrator, N ranks and K warm spares.")
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, required=True,
                   help="ranks per node (the world size on one node)")
    p.add_argument("--nodes", "--nnodes", type=torchrun_flags.nodes, default=None,
                   help="nodes holding ranks (Slurm): world size = nodes x nproc-per-node")
    p.add_argument("--spare-nodes", type=int, default=None,
                   help="nodes holding only warm spares, nproc-per-node each (Slurm; replaces --spares)")
    p.add_argument("--spares", type=int, default=1, help="warm spares kept ready (default 1)")
    p.add_argument("--scheduler", choices=("auto", "local", "slurm"), default="auto",
                   help="where workers run: this machine, or job steps of the Slurm allocation "
                        "(default: slurm inside an allocation, else local)")
    p.add_argument("--advertise-addr", default=None,
                   help="address workers reach this launcher at (default: 127.0.0.1 locally; on Slurm this "
                        "machine's address on the route to the first node)")
    p.add_argument("--slots", type=int, default=None,
                   help="slots on this machine (default: ranks + spares + 1, so a taint can be absorbed)")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default ./.baton or $BATON_RUN_DIR)")
    p.add_argument("--op-timeout", type=float, default=5.0,
                   help="seconds before a collective is declared failed (a hung peer), default 5")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="seconds without a heartbeat before a worker is declared hung, default 3")
    p.add_argument("--formation-timeout", type=float, default=120.0,
                   help="seconds to wait for a new process group to form, default 120")
    p.add_argument("--data-paths", default="", metavar="IF1,IF2|auto",
                   help="the network interfaces the ranks' collectives run over, the same names on every node "
                        "(rails, NICs): each collective uses one in turn, and one that goes down on a node is "
                        "routed around (the groups re-form over the others, no rank moved); 'auto': every "
                        "interface each node of the first generation has up with an IPv4 address, except "
                        "loopback, bridges, tunnels and the one towards the control plane; default: one path, "
                        "GLOO_SOCKET_IFNAME's first or the node's address")
    p.add_argument("--path-hold-down", type=float, default=5.0, metavar="S",
                   help="a data path that came back is used again once it has stayed up S seconds on every node "
                        "(at a planned boundary), default 5; a flapping one is damped")
    p.add_argument("--path-grace", type=float, default=60.0, metavar="S",
                   help="a node that has run with a data path down for S seconds is tainted and its ranks move "
                        "to spares elsewhere (--return-home brings them back once its paths are up), default 60")
    p.add_argument("--pre-copy", action="store_true",
                   help="a planned move's joiner copies the replicated state while training goes on and follows "
                        "the leaver's optimizer steps, so the pause moves only the rank's own state (DDP jobs); "
                        "it runs each optimizer step again beside training: worth it where the spare has its own "
                        "device, not on shared CPU cores")
    p.add_argument("--hot-spares", action="store_true",
                   help="each warm spare keeps a mirror of the replicated state current at every step (one rank "
                        "feeds it each step's gradients), so that a lost rank's replacement takes only the rank's "
                        "own state and not the whole model and optimizer (DDP jobs of a model-aware script); "
                        "costs the feeding rank a copy of its gradients a step, and each spare an optimizer step")
    p.add_argument("--return-home", action="store_true",
                   help="move ranks back to the node they started on once it is healthy again (untainted, "
                        "with warm spares), at a planned boundary")
    p.add_argument("--straggler-factor", type=float, default=0.0, metavar="F",
                   help="taint a rank's slot (and move the rank) when its own work per step stays above F "
                        "times the other ranks' median for --straggler-steps steps; 0 (default): off")
    p.add_argument("--straggler-steps", type=int, default=20, metavar="N")
    p.add_argument("--taint-gpu-temp", type=float, default=90.0, metavar="C",
                   help="NVML: taint a slot whose GPU reaches C degrees (0: off), default 90")
    p.add_argument("--taint-ecc-uncorrected", type=int, default=1, metavar="N",
                   help="NVML: taint a slot whose GPU has N uncorrected ECC errors (0: off), default 1")
    p.add_argument("--taint-ecc-corrected", type=int, default=0, metavar="N",
                   help="NVML: taint a slot whose GPU has N corrected ECC errors (0: off, the default)")
    p.add_argument("--borrow-spares", action="store_true",
                   help="Slurm: with no dedicated spare left, borrow a whole node from a lower-priority job "
                        "(Slurm preempts and requeues it) and give it back when done")
    p.add_argument("--borrow-partition", default=None, metavar="NAME",
                   help="the partition to borrow in (default: the allocation's)")
    p.add_argument("--spare-wait", type=float, default=600.0,
                   help="seconds a recovery waits for a spare before the job fails, default 600")
    p.add_argument("--verify-every", type=int, default=0, metavar="N",
                   help="also check every N steps that replicas hold identical state (catches silent "
                        "data corruption; 0: only after moves)")
    p.add_argument("--redundancy", type=int, default=2, metavar="N",
                   help="buddies holding each rank's own state, so N ranks lost at once are rebuilt "
                        "(default 2). In an FSDP2 job each buddy also holds a copy of the rank's shards "
                        "in host memory, refreshed every step; 0: no copies, a lost sharded rank ends the job")
    p.add_argument("--snapshot-transport", choices=("auto", "tcp"), default="auto",
                   help="how an FSDP2 rank's buddy gets its shard snapshots: auto (default) maps them from the "
                        "rank's shared memory when both run on one machine and pulls them over TCP otherwise; "
                        "tcp always pulls, as buddies on other nodes do")
    p.add_argument("--job-id", default="job")
    p.add_argument("--quiet", action="store_true", help="do not print events")
    p.add_argument("--server", default=None, metavar="URL[,URL]",
                   help="attach to a `baton serve` control plane instead of embedding one (several URLs: "
                        "servers sharing one store; the leader answers)")
    p.add_argument("--server-token-file", type=Path, default=None,
                   help="the server's admin token (default: $BATON_SERVER_TOKEN, else .baton-serve/token)")
    p.add_argument("--priority", type=int, default=0,
                   help="with --server: a job with no spare ready borrows an idle one of a lower-priority "
                        "job on its host; the highest priority is served first (default 0)")
    p.add_argument("--control-grace", type=float, default=600.0, metavar="S",
                   help="with --server: how long the job keeps training and retrying while the server is "
                        "unreachable (restart, failover), default 600")
    p.add_argument("--mode", choices=("auto", "model-aware", "no-code"), default="auto",
                   help="auto (default): model-aware if the script or a module of its directory imports baton, "
                        "else no code change; name it where the script loads baton some other way")
    p.add_argument("--no-migration", action="store_true",
                   help="a script that does not use baton: run it as torchrun would, with no moves; the first "
                        "failure ends the job promptly (restart from your own checkpoint)")
    p.add_argument("--no-tail-copies", action="store_true",
                   help="no code change: do not copy each step's parameters and gradient buckets (a rank lost "
                        "after its last collective of a step then stops the job instead of being replaced)")
    torchrun_flags.add_to(p)
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=cmd_run)

    from baton.transparent import explain

    explain.add_parser(sub)

    p = sub.add_parser("serve", help="run the control plane as a service for several jobs (`baton run --server`)",
                       description="Orchestrators for every attached job, state in SQLite or etcd; "
                                   "restart it (or run a standby) and it picks the jobs up again.")
    p.add_argument("--listen", default="127.0.0.1:8470", metavar="HOST:PORT",
                   help="where jobs and operators reach it (default 127.0.0.1:8470)")
    p.add_argument("--store", default="sqlite:.baton-serve", metavar="sqlite:DIR|etcd://HOST:PORT",
                   help="where state lives (default sqlite:.baton-serve); two servers on one store: one leads")
    p.add_argument("--token-file", type=Path, default=None,
                   help="admin token (made, mode 0600, if missing; default .baton-serve/token)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("warm", help="keep torch imported on this machine: each `baton run` with BATON_WARM set "
                                    "starts its workers without importing it again",
                       description="Import torch and baton's runtime once, then fork the zygote of each "
                                   "`baton run` on this machine that asks (BATON_WARM=SOCKET). A job this "
                                   "process cannot serve exactly (other startup environment, namespaces, "
                                   "python) starts its own zygote, with one line saying why.")
    p.add_argument("--socket", type=Path, default=None,
                   help="where launchers reach it (default $XDG_RUNTIME_DIR or the temp dir, "
                        "baton-warm-UID.sock); only this user can connect")
    p.set_defaults(func=cmd_warm)

    p = sub.add_parser("jobs", help="list the jobs a `baton serve` hosts")
    p.add_argument("--server", default="http://127.0.0.1:8470", metavar="URL")
    p.add_argument("--server-token-file", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("status", help="show the job, its ranks, spares, taints and YOCO ratio")
    _conn_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("events", help="list failures and migrations (the ledger)")
    _conn_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_events)

    p = sub.add_parser("migrate", help="move a rank to a spare at the next agreed step boundary")
    _conn_args(p)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--to", default=None, metavar="SLOT|NODE",
                   help="move it there (a warm spare there is used, or one is started on a free slot)")
    p.add_argument("--pre-copy", action=argparse.BooleanOptionalAction, default=None,
                   help="pre-copy this move or not (default: as the job was started, `baton run --pre-copy`)")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("taint", help="mark a slot or a whole node bad: move its ranks off (one move), "
                                     "schedule nothing new there; a node is drained in Slurm")
    _conn_args(p)
    p.add_argument("slot", help="slot name (local/2, n3/1) or node name (n3)")
    p.add_argument("--reason", required=True, help="why (ecc, thermal, maintenance, ...)")
    p.set_defaults(func=cmd_taint)

    p = sub.add_parser("untaint", help="return a slot or node to the pool (a node is resumed in Slurm)")
    _conn_args(p)
    p.add_argument("slot", help="slot or node name")
    p.set_defaults(func=cmd_untaint)

    p = sub.add_parser("demo", help="4 ranks + 1 spare on CPU: a planned move, a taint and a kill -9, "
                                    "checked bit for bit against an uninterrupted run")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--run-dir", type=Path, default=None)
    p.set_defaults(func=cmd_demo)


def _conn_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="orchestrator URL (default: read from the run directory)")
    p.add_argument("--token", help="job token (default: read from the run directory)")
    p.add_argument("--run-dir", type=Path, default=None)


def _client(args: argparse.Namespace):
    from baton.control.client import ApiClient

    if args.url and args.token:
        return ApiClient(args.url, args.token)
    url, token = RunDir(args.run_dir or default_dir()).read()
    return ApiClient(args.url or url, args.token or token)


def _fail(message: str, code: int = 2) -> int:
    print(f"baton: error: {message}", file=sys.stderr)
    return code


def _api(args: argparse.Namespace, call) -> Any:
    from baton.control.client import ApiError

    try:
        return call(_client(args))
    except FileNotFoundError as exc:
        raise SystemExit(_fail(str(exc)))
    except ApiError as exc:
        raise SystemExit(_fail(str(exc), 1))


def cmd_run(args: argparse.Namespace) -> int:
    from baton.health.gpu import GpuThresholds
    from baton.launcher import RunOptions, run

    script_args = list(args.script_args)
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    refused, notes = torchrun_flags.review(args)
    if refused is not None:
        return _fail(refused, 2)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    mode = _mode(args, script_args)
    if isinstance(mode, int):
        return mode
    if args.hot_spares and mode != "model-aware":
        return _fail(f"--hot-spares needs a model-aware script (one that calls baton.init()): {args.script} runs "
                     "with no code change, whose joiners take their state where the script's own loop is; run "
                     "it without --hot-spares (its spares are warm, and fetch the state when they take a rank)", 2)
    if args.hot_spares and args.spares < 1 and not args.spare_nodes:
        return _fail("--hot-spares needs spares to keep hot (--spares N)", 2)
    opts = RunOptions(mode=mode, tail_copies=not args.no_tail_copies, script=args.script, script_args=script_args, nproc=args.nproc, spares=args.spares,
                      slots=args.slots, run_dir=args.run_dir or default_dir(),
                      op_timeout_s=args.op_timeout, heartbeat_timeout_s=args.heartbeat_timeout,
                      formation_timeout_s=args.formation_timeout, verify_every=args.verify_every,
                      redundancy=args.redundancy, spare_wait_s=args.spare_wait, job_id=args.job_id, quiet=args.quiet,
                      scheduler=args.scheduler, nodes=args.nodes, spare_nodes=args.spare_nodes,
                      advertise_addr=args.advertise_addr, return_home=args.return_home, pre_copy=args.pre_copy,
                      hot_spares=args.hot_spares,
                      straggler_factor=args.straggler_factor, straggler_steps=args.straggler_steps,
                      borrow_spares=args.borrow_spares, borrow_partition=args.borrow_partition,
                      data_paths=tuple(p for p in args.data_paths.split(",") if p),
                      path_hold_down_s=args.path_hold_down, path_grace_s=args.path_grace,
                      env={"BATON_SNAPSHOT_TRANSPORT": args.snapshot_transport},
                      gpu_limits=GpuThresholds(temp_c=args.taint_gpu_temp, ecc_uncorrected=args.taint_ecc_uncorrected,
                                               ecc_corrected=args.taint_ecc_corrected))
    if args.server:
        from baton.agent import ServerOptions, run_attached

        return run_attached(opts, ServerOptions(urls=args.server, admin_token=_server_token(args.server_token_file),
                                                priority=args.priority, grace_s=args.control_grace))
    return run(opts)


def _mode(args: argparse.Namespace, script_args: list[str]) -> str | int:
    """The script's mode ("model-aware", "no-code"); with --no-migration, the exit code of its
    run as torchrun would run it (or of the refusal of bad options)."""
    from baton.transparent import no_migration
    from baton.transparent.mode import MODEL_AWARE, NO_CODE, mode_of

    if not Path(args.script).is_file():
        return MODEL_AWARE  # the launcher says so
    try:
        model_aware = mode_of(args.script) == MODEL_AWARE if args.mode == "auto" else args.mode == MODEL_AWARE
    except SyntaxError:
        return MODEL_AWARE  # its first worker shows the error with its traceback, and the job ends
    if not args.no_migration:
        return MODEL_AWARE if model_aware else NO_CODE
    if model_aware:
        return _fail(f"--no-migration runs scripts that do not use baton; {args.script} imports it (run it "
                     "without --no-migration)", 2)
    if args.server or args.scheduler == "slurm" or (args.nodes or 1) > 1:
        return _fail("--no-migration runs the ranks on this machine only (no --server, --scheduler slurm "
                     "or --nodes)", 2)
    if args.nproc < 1:
        return _fail("--nproc must be at least 1", 2)
    return no_migration.run(args.script, script_args, args.nproc)


_DEFAULT_SERVER_TOKEN = Path(".baton-serve/token")


def _server_token(path: Path | None) -> str:
    import os

    if path is None and os.environ.get("BATON_SERVER_TOKEN"):
        return os.environ["BATON_SERVER_TOKEN"]
    path = path or _DEFAULT_SERVER_TOKEN
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise SystemExit(f"baton: cannot read the server's admin token from {path}: {exc.strerror} "
                         "(--server-token-file, or $BATON_SERVER_TOKEN)") from None


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os
    import secrets
    import signal

    from baton.control.server import Backend, ControlServer

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        return _fail(f"--listen must be HOST:PORT, got {args.listen!r}")
    logging.basicConfig(level=os.environ.get("BATON_LOG", "WARNING"))
    backend = Backend(args.store)
    token_file = args.token_file or _DEFAULT_SERVER_TOKEN
    if not token_file.exists():
        token_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        print(f"[baton serve] admin token written to {token_file}", file=sys.stderr, flush=True)
    server = ControlServer(backend, _server_token(token_file), host=host, port=int(port))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    server.serve_forever()
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    from baton.schedulers import warm

    return warm.main(args.socket or warm.default_socket())


def cmd_jobs(args: argparse.Namespace) -> int:
    import httpx

    token = _server_token(args.server_token_file)
    try:
        resp = httpx.get(args.server.split(",")[0].rstrip("/") + "/v1/jobs",
                         headers={"Authorization": f"Bearer {token}"}, timeout=10)
    except httpx.TransportError as exc:
        return _fail(f"cannot reach {args.server}: {exc}", 1)
    data = resp.json()
    if resp.status_code >= 400:
        return _fail(data.get("error", resp.text), 1)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{'job':<16} {'priority':>8}  {'state':<8} {'ranks':>5} {'step':>6} {'gen':>4} {'spares':>6} "
          f"{'events':>6} {'restarts':>8}")
    for j in data["jobs"]:
        state = j["state"] + (f" ({j['exit_code']})" if j["exit_code"] is not None else "")
        print(f"{j['job_id']:<16} {j['priority']:>8}  {state:<8} {j['world_size']:>5} {j['step']:>6} "
              f"{j['generation']:>4} {j['spares_ready']:>6} {j['events']:>6} {j['lives']:>8}")
    print(f"leader {data['leader']}, state in {data['store']}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from baton.control.state import describe_cpu

    data = _api(args, lambda c: c.status())
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for job in data["jobs"]:
        yoco = "n/a (no events yet)" if job["yoco_ratio"] is None else f"{job['yoco_ratio']:.0%}"
        print(f"job {job['id']}: {job['state']}, world size {job['world_size']}, "
              f"generation {job['generation']}, YOCO ratio {yoco}")
        if job.get("mode") == "no-code":
            where = f", step loop at {job['step_loop']}" if job.get("step_loop") else ", step loop not found yet"
            print(f"  mode: no code change{where}")
        elif job.get("mode"):
            print(f"  mode: {job['mode']}")
        op = job.get("operation")
        if op:
            print(f"  in progress: {op['kind']} move of ranks {op['ranks']} ({op['phase']})"
                  + (f" - {op['message']}" if op.get("message") else ""))
        print(f"  {'rank':>4}  {'pid':>7}  {'slot':<10} {'step':>6}  {'state':<18} metrics")
        for r in job["ranks"]:
            metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(r.get("metrics", {}).items()))
            state = f"{r['state']}, off-step" if r.get("outside_steps") else r["state"]
            print(f"  {r['rank']:>4}  {r['pid'] or '-':>7}  {r['slot'] or '-':<10} {r['step']:>6}  "
                  f"{state:<18} {metrics}")
        spares = ", ".join(f"{s['slot']} ({s['state']}, pid {s['pid']}"
                           + (f", borrowed from {s['from']}" if s.get("kind") == "borrowed" else "")
                           + (f", hot: {_hot_text(s['hot'])})" if s.get("hot") else ")")
                           for s in job["spares"]) or "none"
        for r in job["ranks"]:
            if r.get("unheard_s") is not None:
                print(f"  rank {r['rank']} not heard from for {r['unheard_s']}s while the others train with it: "
                      "its control path is down")
        stuck = [r for r in job["ranks"] if r.get("unmovable")]
        if stuck:  # the same reason on every rank, usually: say it once
            print(f"  cannot move bit for bit: ranks {[r['rank'] for r in stuck]}: {stuck[0]['unmovable']}")
        print(f"  spares: {spares}")
        taints = ", ".join(f"{t['slot']} ({t['reason']})" for t in job["taints"]) or "none"
        print(f"  taints: {taints}")
        lent = ", ".join(f"{s['slot']} to job {s['lent_to']}" for s in job.get("slots", []) if s.get("lent_to"))
        if lent:
            print(f"  lent: {lent}")
        if len(job.get("nodes", [])) > 1 or any(n["state"] != "healthy" for n in job.get("nodes", [])):
            for n in job["nodes"]:
                print(f"  node {n['node']:<8} {n['state']:<8} ranks {n['ranks'] or '-'}  spares {n['spares']}"
                      + (f"  ({n['reason']})" if n.get("reason") else ""))
        paths = job.get("data_paths") or {}
        if paths.get("configured"):
            down = [f"{x['interface']} on {x['node']}" for x in paths.get("links", []) if not x["up"]]
            print(f"  data paths: {', '.join(paths['configured'])}; in use: {', '.join(paths['in_use']) or 'none'}"
                  + (f"; down: {', '.join(down)}" if down else ""))
        if job.get("cpu"):
            print(f"  CPU: {describe_cpu(job['cpu'])}")
    return 0


def _events_offline(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ended job's ledger: from state.db, or, where that cannot be read (damaged, or
    never written), from the copy in events.jsonl."""
    run_dir = RunDir(args.run_dir or default_dir())
    if args.url:
        return None
    from baton.control.state import yoco_ratio

    events = None
    if run_dir.db.exists():
        import sqlite3

        from baton.store.sqlite import SqliteStore

        try:
            store = SqliteStore(run_dir.db)
            try:
                events = store.events()
            finally:
                store.close()
        except sqlite3.DatabaseError as exc:
            print(f"baton: {run_dir.db} cannot be read ({exc}); the ledger below is the copy in events.jsonl",
                  file=sys.stderr)
    if events is None:
        events = _ledger_from_log(run_dir.path / "events.jsonl")
    if events is None:
        return None
    return {"events": events, "yoco_ratio": yoco_ratio(events)}


def _ledger_from_log(path: Path) -> list[dict[str, Any]] | None:
    """Each ledger entry as last written to events.jsonl (a torn last line is skipped)."""
    if not path.exists():
        return None
    latest: dict[int, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "ledger" and isinstance(record.get("data"), dict):
            latest[int(record["data"].get("id", 0))] = record["data"]
    return [latest[k] for k in sorted(latest)]


def cmd_events(args: argparse.Namespace) -> int:
    from baton.control.client import ApiError

    data = None
    try:
        if not args.url and not RunDir(args.run_dir or default_dir()).endpoint_file.exists():
            raise ApiError(0, "job not running")
        data = _client(args).events()
    except (ApiError, FileNotFoundError) as exc:
        data = _events_offline(args)  # the job has ended: read its ledger from SQLite
        if data is None:
            raise SystemExit(_fail(str(exc), 1 if isinstance(exc, ApiError) else 2))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_events(data["events"]))
    yoco = data.get("yoco_ratio")
    print(f"YOCO ratio: {'n/a' if yoco is None else f'{yoco:.0%}'}")
    return 0


def _hot_text(hot: dict[str, Any]) -> str:
    """A spare's mirror of the replicated state (--hot-spares), in a few words."""
    if hot["state"] == "ordinary":
        return f"ordinary ({hot.get('detail', '')})"
    if hot["state"] in ("current", "following"):
        return f"{hot['state']} since step {hot['since_step']}, {hot['base_mb']} MB, replay {hot['replay_s']:.3f}s a step"
    return hot["state"]


def format_events(events: list[dict[str, Any]]) -> str:
    head = f"{'id':>3}  {'kind':<12} {'rank':>4}  {'from':<9} {'to':<9} {'step':>5} {'downtime':>9} " \
           f"{'lost':>4} {'re-run':>6}  {'no rollback':<11} cause"
    lines = [head]
    for e in events:
        down = "-" if e.get("downtime_s") is None else f"{e['downtime_s']:.3f}s"
        ok = {True: "yes", False: "no", None: "-"}[e.get("resolved_without_rollback")]
        lines.append(f"{e['id']:>3}  {e['kind']:<12} {e['rank'] if e['rank'] is not None else '-':>4}  "
                     f"{e.get('from_slot') or '-':<9} {e.get('to_slot') or '-':<9} "
                     f"{e.get('step') if e.get('step') is not None else '-':>5} {down:>9} "
                     f"{e.get('steps_lost', 0):>4} {e.get('steps_rerun', 0):>6}  {ok:<11} {e['cause']}")
        if e.get("phases"):
            moved = f"{e['state_bytes'] / 1e6:.1f} MB moved; " if e.get("state_bytes") else ""
            after = f"; the next step waited {e['check_after_resume_s']:.3f}s for the state check" \
                if e.get("check_after_resume_s") is not None else ""
            lines.append(f"{'':>5}{moved}" + ", ".join(f"{k} {v:.3f}s" for k, v in e["phases"].items()) + after)
        hot = e.get("hot_spare")
        if hot:
            lines.append(f"{'':>5}hot spare: " + (f"the replicated state from its mirror ({hot['mirror_steps']} "
                                                  f"steps followed)" if hot["used"] else f"whole state: {hot['detail']}"))
        if e.get("note"):
            lines.append(f"{'':>5}note: {e['note']}")
    return "\n".join(lines)


def cmd_migrate(args: argparse.Namespace) -> int:
    data = _api(args, lambda c: c.migrate(args.rank, args.to, pre_copy=args.pre_copy))
    if data.get("queued"):
        print(data["note"])
    else:
        print(f"migrating rank {args.rank}" + (f" to {data['to']}" if data.get("to") else "")
              + f" (operation {data['op']})")
    return 0


def cmd_taint(args: argparse.Namespace) -> int:
    data = _api(args, lambda c: c.taint(args.slot, args.reason))
    moving = data.get("moving_ranks") or []
    print(f"tainted {args.slot} ({args.reason})" + (f"; moving ranks {moving}" if moving else ""))
    if data.get("note"):
        print(data["note"])
    return 0


def cmd_untaint(args: argparse.Namespace) -> int:
    _api(args, lambda c: c.untaint(args.slot))
    print(f"untainted {args.slot}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from baton.demo import main as demo_main

    return demo_main(steps=args.steps, run_dir=args.run_dir)
