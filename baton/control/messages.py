"""Every message into or out of the orchestrator, as pydantic models both sides share.

Reports go worker -> orchestrator (`POST /v1/workers/{id}/reports`), commands go
orchestrator -> worker (long-polled). Requests come from the CLI (`POST /v1/migrate`,
...), process exits from the scheduler and ticks from the launcher's clock: those are
the orchestrator's `Input`s. A message that does not validate is answered 4xx and
changes nothing. Positions are `[step, sub]`: the next step to run and how
many boundary functions before it are done.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from baton.health.alerts import AlertBatch
from baton.health.gpu import GpuReading
from pydantic import PositiveFloat, BaseModel, ConfigDict, Field, NonNegativeInt, TypeAdapter, model_validator

Pos = tuple[NonNegativeInt, NonNegativeInt]
Addr = tuple[Annotated[str, Field(min_length=1, max_length=255)], Annotated[int, Field(ge=1, le=65535)]]
Iface = Annotated[str, Field(min_length=1, max_length=15, pattern=r"^[A-Za-z0-9_.:@-]+$")]  # a Linux interface name
Text = Annotated[str, Field(max_length=64_000)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorText(_Msg):
    dtype: Annotated[str, Field(max_length=32)]
    shape: list[NonNegativeInt]
    data: Annotated[str, Field(max_length=64 << 20)]


class BundleText(_Msg):
    """A rank's own state (see baton.transfer.bundles.Bundle), base64 tensors in JSON."""

    rank: NonNegativeInt
    pos: Pos
    generation: int
    seq: int
    meta: Annotated[str, Field(max_length=16 << 20)]
    tensors: Annotated[list[TensorText], Field(max_length=100_000)]


class LoopInfo(_Msg):
    """The shape of the script's loop, as this rank computed it: ranks must agree."""

    style: Literal["steps", "epochs", "script"]  # "script": the script's own loop (no code change)
    total_steps: NonNegativeInt
    epochs: NonNegativeInt | None = None
    steps_per_epoch: NonNegativeInt | None = None
    start_step: NonNegativeInt = 0  # where the script's resume block started it (a joiner: its own start)
    sharded: list[str] = Field(default_factory=list)  # tracked objects holding FSDP2/DTensor shards
    step_loop: Annotated[str, Field(max_length=1000)] | None = None  # "script": where its step loop is (file:line)
    # "script": the loops from the outermost around the step loop to it (file:line:column each)
    nest: Annotated[list[Annotated[str, Field(max_length=1000)]], Field(max_length=64)] = Field(default_factory=list)


# ---------------------------------------------------------------- reports
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class CpuReport(_Msg):
    """A worker's CPU-seconds since its process started, and the part that was baton's own
    (see baton.selfcost): the job's overhead, measured on the job itself."""

    process_s: Seconds
    baton_s: Seconds


class Heartbeat(_Msg):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")  # a NaN loss stays NaN
    type: Literal["heartbeat"] = "heartbeat"
    step: NonNegativeInt | None = None
    step_time: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    # step end to step end: the step plus what the script does between steps (logging, a data
    # wait, a rank held at its boundary); the rate a rank's boundaries come at
    step_period: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    # how long before this beat the rank reached `step`: one stuck at a boundary (an
    # evaluation, a checkpoint) is not extrapolated onward at its step rate
    step_age: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    # the rank is outside its steps (a boundary function, the region after its step loop),
    # said the moment it enters: however young `step_age` is, it is not stepping
    outside_steps: bool = False
    busy_time: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None  # own work until the last bucket
    snapshot_mb: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None  # shard snapshots held (host memory)
    state_mb: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None  # the replicated state a joiner receives
    metrics: Annotated[dict[Annotated[str, Field(max_length=64)], float], Field(max_length=64)] = {}
    cpu: CpuReport | None = None
    gpu: GpuReading | None = None  # NVML readings of the slot's GPU, where there is one
    # Why this rank's state can no longer move bit for bit (worker/compile_watch.py), once it cannot.
    unmovable: Annotated[str, Field(max_length=2000)] | None = None


class BeatEnvelope(_Msg):
    """A heartbeat datagram's body (see baton.control.beats)."""

    worker_id: Annotated[str, Field(min_length=1, max_length=64)]
    seq: Annotated[int, Field(ge=1)]
    beat: Heartbeat


class Ready(_Msg):
    """The rank reached its step loop; its starting bundle is now durable here. A joiner's
    says only that it reached its place, with its loop's shape: its state there is what it
    takes over, not a start (and capturing it would lengthen the move's pause)."""

    type: Literal["ready"] = "ready"
    loop: LoopInfo
    bundle: BundleText | None = None
    joined: bool = False
    # What the collectives of the rank's setup (before its step loop) gave it: rank 0's goes
    # to each joiner with its assignment, whose own setup's collectives are answered from it;
    # another rank sends its own only where a result was its own (a scatter, a reduce).
    setup: BundleText | None = None

    @model_validator(mode="after")
    def _a_start_has_its_bundle(self) -> "Ready":
        if not self.joined and self.bundle is None:
            raise ValueError("a rank starting its step loop reports its bundle there")
        return self


class SetupDone(_Msg):
    """A no-code joiner ran its script's setup to the head of its step loop's outermost loop,
    where it waits for the Form naming its rank's place (and walks there from this head): a
    planned move pauses the ranks only now, so the pause does not wait for the setup."""

    type: Literal["setup_done"] = "setup_done"
    setup_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    # it walked ahead, inside its setup, to this iteration of the step loop (where its rank
    # stood a moment before): the pause walks only the items since
    walked_ahead: NonNegativeInt | None = None


class UnitDone(_Msg):
    """A boundary function finished on this rank; `bundle` describes `pos` (after it)."""

    type: Literal["unit_done"] = "unit_done"
    pos: Pos
    bundle: BundleText


class PauseAck(_Msg):
    type: Literal["pause_ack"] = "pause_ack"
    op: NonNegativeInt
    ok: bool
    next_step: NonNegativeInt


class _Dated(_Msg):
    """A report that dates a move's start or end. `queued_s`: how long it waited in the
    worker's outbox before it was sent (the reporter thread competes for the GIL with the
    training it resumed); the orchestrator dates the event that much before its arrival,
    on no clock but its own."""

    queued_s: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] = 0.0


class Paused(_Dated):
    type: Literal["paused"] = "paused"
    op: NonNegativeInt
    pos: Pos


class Recover(_Msg):
    """A peer was lost. `pos` is the boundary this rank's state is at; `in_step`: it abandoned
    the step starting there (so the step re-runs); `unit_reported`: it had reported the end
    of the boundary function at `pos` before the failure. `generation`: the newest generation
    this rank knew of when it reported (its group's, or a newer Abort's); a report from before
    the recovery's latest restart may describe a state the rank has since left."""

    type: Literal["recover"] = "recover"
    generation: int
    pos: Pos
    in_step: bool = False
    unit_reported: bool = False
    error: Text = ""
    # How long this rank had waited in the collective that failed (where the job stopped
    # progressing for it: a hung peer's downtime starts there, not at its last heartbeat).
    blocked_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    # Sharded jobs with redundancy: the boundaries this rank holds its own shard snapshot of,
    # and those it holds for its wards (rank -> boundaries).
    snapshots: list[Pos] = []
    held: dict[int, list[Pos]] = {}
    replicas: list[int] = []  # HSDP: the ranks holding this rank's very shards (other replica groups)


class HotUse(_Msg):
    """How a hot spare that took over a lost rank came by the replicated state."""

    used: bool  # from its mirror (only the rank's own and small state moved); else fetched whole
    detail: Text = ""  # why not
    mirror_steps: NonNegativeInt = 0  # optimizer steps it had applied since its base
    catch_up_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0  # its last steps, inside the recovery


class Formed(_Dated):
    type: Literal["formed"] = "formed"
    generation: int
    pos: Pos
    bytes: NonNegativeInt = 0
    seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    # A joiner: its script's own time from the rank's assignment to its step loop (building
    # the model, sharding it), part of the downtime when it was assigned at a failure.
    setup_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    # A no-code joiner: bytes of its setup's random initialisation it left out, as its rank's
    # arriving state overwrote them (baton.transparent.deferred_init).
    setup_left_out_bytes: NonNegativeInt = 0
    # How long the joiner's step loop waited for its state: less than `seconds` when the
    # fetch ran while the script was still setting up.
    fetch_wait_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    # A joiner: where its part of the move went, in seconds (fetch, load, form, verify).
    phases: dict[Annotated[str, Field(max_length=20)], Annotated[float, Field(ge=0, allow_inf_nan=False)]] = \
        Field(default_factory=dict, max_length=10)
    # A no-code successor that ran code of its rank again before it formed (the step its
    # predecessor was lost after, or the region after the step loop), and for how long.
    ran_again: Annotated[str, Field(max_length=300)] = ""
    # A hot spare's recovery: whether its mirror gave the replicated state, or why not.
    hot_spare: HotUse | None = None


class Verified(_Msg):
    """Result of the state check after a move (or every --verify-every steps)."""

    type: Literal["verified"] = "verified"
    generation: int
    pos: Pos
    ok: bool
    differing: Annotated[list[Annotated[str, Field(max_length=300)]], Field(max_length=200)] = []
    detail: Text = ""
    # A move's check deferred into the next step (state_check): how long that step waited for it.
    after_resume_s: float | None = Field(default=None, ge=0)


class Finished(_Msg):
    type: Literal["finished"] = "finished"
    pos: Pos
    cpu: CpuReport | None = None  # final figures: the last heartbeat may be a beat behind


class UserError(_Msg):
    """The script failed on its own: `phase` says where (its code, a baton usage rule, startup)."""

    type: Literal["user_error"] = "user_error"
    traceback: Text
    exit_code: int = 1
    phase: Literal["script", "usage", "startup"] = "script"


class Left(_Msg):
    type: Literal["left"] = "left"


class PathChanged(_Dated):
    """A data link of this worker's node went down or came back (dated as it was seen);
    `detail`: how it was found, when not from the link's state (a probe)."""

    type: Literal["path"] = "path"
    interface: Iface
    up: bool
    detail: Annotated[str, Field(max_length=500)] = ""
    down_now: list[Iface] = []  # every watched link of the node down as this was seen


class PathsReady(_Msg):
    """Where this worker answers probes on each data path (baton.net.probe)."""

    type: Literal["paths_ready"] = "paths_ready"
    addrs: dict[Iface, Addr]


class PathsFound(_Msg):
    """The interfaces of this worker's node that can be data paths (`--data-paths auto`,
    baton.net.discover), and what was left out and why."""

    type: Literal["paths_found"] = "paths_found"
    interfaces: list[Iface] = Field(default_factory=list, max_length=256)
    detail: Annotated[str, Field(max_length=2000)] = ""


class _Following(_Msg):
    """A process following a rank's fed optimizer steps (precopy.Feed): whether it can (`ok`,
    at `pos`) or why not, and what the copy took: its base, and the step records since."""

    op: NonNegativeInt
    ok: bool
    pos: Pos
    detail: Text = ""
    base_bytes: NonNegativeInt = 0
    base_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    steps: NonNegativeInt = 0  # optimizer steps followed so far
    step_bytes: NonNegativeInt = 0


class SetupWritten(_Msg):
    """A successor holds its rank's place: the files its setup wrote (not fenced: training had
    not touched them), for the next successor's fence, which would else take them for
    training's output (they changed after the step loop began) and keep its predecessor's."""

    type: Literal["setup_written"] = "setup_written"
    files: SetupFiles


class CaughtUp(_Following):
    """A pre-copying joiner (CatchUp): it follows the leaver within a step (`ok`), or it cannot
    (then the move takes the whole state in its pause, as without a pre-copy)."""

    type: Literal["caught_up"] = "caught_up"


class PreCopyCost(_Msg):
    """A leaver, as it pauses: what feeding a pre-copy cost its steps (the base's copy at one
    boundary; each step's gradients and small state captured)."""

    type: Literal["pre_copy_cost"] = "pre_copy_cost"
    op: NonNegativeInt
    base_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    steps: NonNegativeInt = 0
    capture_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0


class HotState(_Following):
    """A hot spare (Follow): its mirror of the replicated state keeps pace with the feeding
    rank (`ok`), or it cannot (the spare is an ordinary one until the next feed)."""

    type: Literal["hot_state"] = "hot_state"
    replay_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0  # its replay of a step (median of 3)
    bytes_per_step: NonNegativeInt = 0  # the records of one training step on the wire (median of 3)


Report = Annotated[Union[Heartbeat, Ready, SetupDone, UnitDone, PauseAck, Paused, Recover, Formed, Verified, Finished,
                         UserError, Left, PathChanged, PathsReady, PathsFound, CaughtUp, PreCopyCost, HotState,
                         SetupWritten],
                   Field(discriminator="type")]
REPORT = TypeAdapter(Report)


class Register(_Msg):
    pid: Annotated[int, Field(ge=1)]
    transfer_addr: Addr


class Registered(_Msg):
    worker_id: str
    world_size: int
    role: str
    op_timeout_s: float
    formation_timeout_s: float
    verify_every: int = 0
    redundancy: int = 2
    ranks_per_node: int = 0  # 0: every rank on one node
    heartbeat_timeout_s: float = 3.0
    heartbeat_addr: Addr | None = None  # where heartbeat datagrams go; None: POST them as reports
    # How long a worker keeps trying an unreachable control plane before it gives up: short
    # where the control plane is its own launcher (gone means the job is over), long under
    # `baton serve`, which may be restarting (reports wait in the worker meanwhile).
    control_grace_s: float = 10.0
    data_paths: list[Iface] = []  # the node's data links to watch (baton run --data-paths)
    discover_paths: bool = False  # --data-paths auto, not decided yet: report the node's (PathsFound)
    receive_mb: float = 0.0  # a spare: map this much receive memory ahead (baton.transfer.pool); 0: not yet known
    # --hot-spares: spares mirror the replicated state, and ranks that publish for a recovery
    # also serve the small rest apart (FETCH_OWN), which is all a hot spare takes
    hot_spares: bool = False


# ---------------------------------------------------------------- commands
# Files a successor's setup wrote, which training had not touched since the step loop began,
# each with its modification time once the setup was over (baton.worker.fence): at most this many.
SetupFiles = Annotated[dict[Annotated[str, Field(max_length=4096)], Annotated[float, Field(allow_inf_nan=False)]],
                       Field(max_length=256)]


class Assign(_Msg):
    type: Literal["assign"] = "assign"
    rank: NonNegativeInt
    world_size: NonNegativeInt
    generation: int
    joiner: bool
    loop: LoopInfo | None = None  # a joiner of a script with no code change: the loops to walk down to its place
    setup: BundleText | None = None  # a joiner: its rank's record of its setup's collectives, else rank 0's (Ready.setup)
    # a joiner: when the job's step loop began (the orchestrator's clock); files changed since
    # were written by training, and its setup leaves them alone (baton.worker.fence)
    training_since: float | None = None
    # a joiner: files earlier successors' setups wrote (path: their modification time then);
    # one still as its setup left it was not written by training, and this setup writes it again
    setup_files: SetupFiles = {}
    # a no-code joiner of a planned move: where its rank's latest records are held (its
    # buddies), to walk to the rank's place of now before its setup is reported done; the
    # pause then walks only the steps since (baton.transparent.controller)
    walk_from: Annotated[list[Addr], Field(max_length=16)] = []


class Pause(_Msg):
    """Stop at the boundary before step `at_step`; `leave`: this rank hands itself over there
    (it readies what it will serve while the others get there)."""

    type: Literal["pause"] = "pause"
    op: NonNegativeInt
    at_step: NonNegativeInt
    leave: bool = False


class Publish(_Msg):
    """Serve this rank's full state at `pos` (planned move); `leave`: then hand the rank over."""

    type: Literal["publish"] = "publish"
    generation: int
    pos: Pos
    leave: bool


class LostRank(_Msg):
    """Where a joiner finds the rank-local state of the rank it replaces after a loss."""

    buddies: list[Addr] = []  # live buddies that held its step bundles
    held: BundleText | None = None  # the orchestrator's latest (loop start / boundary ends)


class Form(_Msg):
    """Form `generation` at position `pos`. A survivor whose state is at `pos` re-runs from there
    (and serves its state when `publish`); one behind fetches from `fetch_from`; a joiner
    fetches from `fetch_from` (a planned leaver with `full_state`, or survivors plus `lost`)."""

    type: Literal["form"] = "form"
    generation: int
    pos: Pos
    publish: bool = False
    fetch_from: list[Addr] = []
    full_state: bool = False
    lost: LostRank | None = None
    buddies: list[Addr] = []  # where this rank pushes its bundles in the new generation
    # Sharded jobs: where this rank's wards (whose shard snapshots it holds) are, by rank;
    # `rewind`: go back to the own snapshot at `pos`; `snapshot`: a joiner fetches the lost
    # rank's snapshot at `pos` from `fetch_from` (its buddy) instead of a published state.
    wards: dict[int, Addr] = {}
    rewind: bool = False
    snapshot: bool = False
    # HSDP: the joiner's shards come from one of these ranks' own snapshots (by rank), the
    # rest of its state from `fetch_from` (its buddy's copy without shards).
    shards_from: dict[int, Addr] = {}
    verify: bool = True
    formation_timeout_s: PositiveFloat | None = None  # longer than configured on a retry
    # The data paths (interfaces, the same names on every node) the new generation's groups
    # use: those every node can use now. None given: the default device.
    paths: list[Iface] = []
    # Where the generation's other members answer probes on those paths (one dict per member).
    path_peers: list[dict[Iface, Addr]] = []


class Abort(_Msg):
    type: Literal["abort"] = "abort"
    op: NonNegativeInt
    generation: int


class Release(_Msg):
    type: Literal["release"] = "release"


class Stop(_Msg):
    type: Literal["stop"] = "stop"
    reason: str = ""


class Done(_Msg):
    """Every rank finished: job.finish() may return."""

    type: Literal["done"] = "done"


class PrepareReceive(_Msg):
    """To a spare: the state a joiner receives is this large now; map receive memory for it."""

    type: Literal["prepare_receive"] = "prepare_receive"
    receive_mb: Annotated[float, Field(gt=0, allow_inf_nan=False)]


class PreCopy(_Msg):
    """To a planned move's leaver: at the next boundary, serve a copy of the replicated state,
    then each step's gradients as its optimizers take them, for the joiner to follow."""

    type: Literal["pre_copy"] = "pre_copy"
    op: NonNegativeInt
    stop: bool = False  # the move was called off: stop serving


class CatchUp(_Msg):
    """To a planned move's joiner at its step loop: take the replicated state from the leaver
    while training goes on and follow its optimizer steps, so that the pause moves only the
    rank's own state."""

    type: Literal["catch_up"] = "catch_up"
    op: NonNegativeInt
    source: Addr


class HotFeed(_Msg):
    """To one rank (--hot-spares): at the next boundary, serve a copy of the replicated state,
    then each optimizer step's gradients and each step's small state, for the hot spares."""

    type: Literal["hot_feed"] = "hot_feed"
    op: NonNegativeInt
    stop: bool = False
    drop_base: bool = False  # every spare told to follow has its base: free that copy (the records go on)


class Follow(_Msg):
    """To a spare (--hot-spares): mirror the replicated state `feeder` serves from `source`
    and apply its optimizer steps as they come, until the spare takes a rank over."""

    type: Literal["follow"] = "follow"
    op: NonNegativeInt
    source: Addr
    feeder: NonNegativeInt


class WatchPaths(_Msg):
    """The job's data paths, once found (`--data-paths auto`): watch them on this node."""

    type: Literal["watch_paths"] = "watch_paths"
    names: list[Iface]


Command = Annotated[Union[Assign, Pause, Publish, Form, Abort, Release, Stop, Done, WatchPaths, PrepareReceive, PreCopy,
                          CatchUp, HotFeed, Follow],
                    Field(discriminator="type")]
COMMAND = TypeAdapter(Command)


# ---------------------------------------------------------------- other inputs
class _Request(_Msg):
    model_config = ConfigDict(strict=True)  # on top of _Msg's: "1" is not a rank


class MigrateRequest(_Request):
    """`baton migrate --rank R [--to SLOT|NODE]`: a planned move of the rank to a spare (one
    on the named slot or node, started there if needed)."""

    type: Literal["migrate"] = "migrate"
    rank: NonNegativeInt
    to: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    pre_copy: bool | None = None  # this move only: pre-copy or not (None: the job's --pre-copy decides)


class TaintRequest(_Request):
    """`baton taint SLOT|NODE`: the slot (or every slot of the node) will fail; move its ranks
    (pre-emptive, one move), keep no spare there; a node is drained in the scheduler."""

    type: Literal["taint"] = "taint"
    slot: Annotated[str, Field(min_length=1, max_length=200)]
    reason: Annotated[str, Field(min_length=1, max_length=200)]


class UntaintRequest(_Request):
    type: Literal["untaint"] = "untaint"
    slot: Annotated[str, Field(min_length=1, max_length=200)]


class WorkerExited(_Msg):
    """From the scheduler: a worker's process ended (`returncode` < 0: killed by that signal)."""

    type: Literal["worker_exited"] = "worker_exited"
    worker_id: str
    returncode: int


class Tick(_Msg):
    """From the launcher's clock, every TICK_S: deadlines and heartbeat silence are judged at `now`."""

    type: Literal["tick"] = "tick"
    now: float


class Interrupted(_Msg):
    """`baton run` itself got SIGINT or SIGTERM: end the job, stopping every worker."""

    type: Literal["interrupted"] = "interrupted"
    signum: int


class StoreFailed(_Msg):
    """The ledger's SQLite file refused a write (disk full, corrupt): reported, and survived."""

    type: Literal["store_failed"] = "store_failed"
    message: str


class NodeLinks(_Msg):
    """From the scheduler: the state of a node's data links, read on the node (no worker of
    the job runs there: it was tainted for its network)."""

    type: Literal["node_links"] = "node_links"
    node: str
    up: dict[str, bool] = {}  # interface -> up and running (absent: not read)
    detail: str = ""


class NodeProbed(_Msg):
    """From the scheduler: whether a suspect node still starts and runs processes."""

    type: Literal["node_probed"] = "node_probed"
    node: str
    ok: bool
    detail: str = ""


class NodeBorrowed(_Msg):
    """From the scheduler: the node it borrowed and from whom, or why it could not."""

    type: Literal["node_borrowed"] = "node_borrowed"
    node: str | None
    lender: str = ""
    detail: str = ""
    slots: list[str] = Field(default_factory=list)  # its slots, where the lender names them (else NODE/0..)


class LendSpare(_Msg):
    """From `baton serve`'s spare broker: stop an idle spare and lend its slot to a job of
    higher priority. Answers {"slot", "worker"}, or {} when no spare is idle any more."""

    type: Literal["lend_spare"] = "lend_spare"
    borrower: str
    borrower_priority: int


class TakeBack(_Msg):
    """From `baton serve`'s spare broker: a lent slot is free again (its borrower moved off)."""

    type: Literal["take_back"] = "take_back"
    slot: str
    borrower: str


class AgentSync(_Msg):
    """From a job's agent (`baton run --server`) whenever it reaches the control plane after
    losing it: which of the workers it started still run, and how the others ended."""

    type: Literal["agent_sync"] = "agent_sync"
    live: list[str] = Field(default_factory=list, max_length=100_000)
    exited: dict[str, int] = Field(default_factory=dict, max_length=100_000)


AgentReport = Annotated[Union[WorkerExited, NodeProbed, NodeLinks, NodeBorrowed, AgentSync, Interrupted],
                        Field(discriminator="type")]
AGENT_REPORT = TypeAdapter(AgentReport)


# ---------------------------------------------------------------- control plane -> a job's agent
class StartWorker(_Msg):
    type: Literal["start_worker"] = "start_worker"
    worker_id: str
    slot: str


class KillWorker(_Msg):
    type: Literal["kill_worker"] = "kill_worker"
    worker_id: str
    dump_stacks: bool = False


class ProbeNode(_Msg):
    type: Literal["probe_node"] = "probe_node"
    node: str


class ReadLinks(_Msg):
    """Read these data links on a node tainted for them; answered with NodeLinks."""

    type: Literal["read_links"] = "read_links"
    node: str
    names: list[str] = Field(max_length=64)


class DrainNode(_Msg):
    type: Literal["drain_node"] = "drain_node"
    node: str
    reason: str


class ResumeNode(_Msg):
    type: Literal["resume_node"] = "resume_node"
    node: str


class BorrowNode(_Msg):
    type: Literal["borrow_node"] = "borrow_node"


class ReleaseNode(_Msg):
    type: Literal["release_node"] = "release_node"
    node: str


class EndJob(_Msg):
    """The job is over: stop every worker and exit with `exit_code`."""

    type: Literal["end_job"] = "end_job"
    exit_code: int
    failure: str | None = None


AgentCommand = Annotated[Union[StartWorker, KillWorker, ProbeNode, ReadLinks, DrainNode, ResumeNode, BorrowNode, ReleaseNode,
                               EndJob], Field(discriminator="type")]
AGENT_COMMAND = TypeAdapter(AgentCommand)


JOB_ID = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class AttachJob(_Msg):
    """`baton run --server`: a job asks a `baton serve` to orchestrate it. The agent keeps the
    rendezvous store and the scheduler; the server decides."""

    job_id: JOB_ID
    world_size: Annotated[int, Field(ge=1, le=100_000)]
    spares: Annotated[int, Field(ge=0, le=100_000)]
    slots: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(min_length=1, max_length=100_000)]
    priority: int = 0  # higher wins a contested spare, and may borrow a lower one's idle spare
    host: str = ""  # where the agent runs: jobs on one host with the local scheduler lend each other spares
    features: list[Literal["nodes", "borrow"]] = Field(default_factory=list)  # what the agent's scheduler can do
    op_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    heartbeat_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 3.0
    formation_timeout_s: Annotated[float, Field(gt=0, le=36000)] = 120.0
    spare_wait_s: Annotated[float, Field(gt=0, le=360000)] = 600.0
    verify_every: Annotated[int, Field(ge=0)] = 0
    redundancy: Annotated[int, Field(ge=0, le=64)] = 2
    ranks_per_node: Annotated[int, Field(ge=0)] = 0
    return_home: bool = False
    pre_copy: bool = False
    hot_spares: bool = False
    straggler_factor: Annotated[float, Field(ge=0)] = 0.0
    straggler_steps: Annotated[int, Field(ge=1)] = 20
    borrow_spares: bool = False
    control_grace_s: Annotated[float, Field(gt=0, le=86400)] = 600.0
    mode: Literal["model-aware", "no-code"] = "model-aware"  # how the agent runs the script (`baton status`)
    data_paths: list[Iface] = []  # baton run --data-paths
    path_hold_down_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] = 5.0
    path_grace_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] = 60.0


Input = Union[MigrateRequest, TaintRequest, UntaintRequest, WorkerExited, Tick, Interrupted, StoreFailed,
              NodeProbed, NodeBorrowed, AlertBatch, AgentSync, LendSpare, TakeBack, NodeLinks]
