"""GPU capture: how fast baton gets a model + AdamW state off the device and onto the wire.

    python bench/gpu.py --state-gb 10 --runs 5          # on a machine with CUDA
    python bench/gpu.py --device cpu --state-gb 0.05    # same code path on the CPU (a smoke test)

Three measurements over the same ~state_gb of fp32 tensors on cuda:0 (params, exp_avg,
exp_avg_sq of 1-256 MB each, plus AdamW's scalar `step` tensors), each repeated `runs`
times and reported as {"median", "min", "max", "n"}:

  d2h_raw     one copy_ of a single device buffer of state_bytes into pinned host memory,
              torch.cuda.synchronize() before and after: the device-to-host ceiling.
  capture     baton.transfer.codec.encode() of the state dict, as a worker publishes it:
              each tensor copied with non_blocking=True into pinned host memory from
              torch's caching host allocator, one wait at the end, plus the JSON skeleton;
              synchronize before and after. The first run pins the memory, later ones
              reuse it: `capture_first_s` is the first, `capture_s` the rest.
  capture_sync  the same tensors each `.to("cpu")` synchronously into fresh pageable
              memory (what codec.encode did before 2026-11-28), in the same run.
  stream      the captured host state served by baton's TransferServer and pulled by
              fetch_state() in another process over loopback (chunked, xxh3-checked,
              HMAC-authenticated): the receiver's FetchStats.seconds, i.e. connect ->
              every chunk received and verified (what the ledger calls transfer_s).

Without CUDA, bench_gpu() returns {"skipped": ...} at once.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import median_range  # bench/ is on the path: run as a script or from run.py

SKIPPED = {"skipped": "no CUDA device on this machine (torch.cuda.is_available() is False)"}
MB = 1 << 20
# Parameter tensor sizes cycled through (MB); each param comes with two AdamW moments.
_PATTERN_MB = [256, 64, 128, 16, 4, 1, 32, 8, 256, 2]
REPO = Path(__file__).resolve().parent.parent


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def make_state(state_bytes: int, device: str) -> dict[str, Any]:
    """A model + AdamW state_dict-like tree of fp32 tensors on `device`, ~state_bytes in all."""
    import torch

    model: dict[str, torch.Tensor] = {}
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    remaining = state_bytes
    i = 0
    while remaining >= 3 * 4096:
        nbytes = min(_PATTERN_MB[i % len(_PATTERN_MB)] * MB, remaining // 3)
        n = nbytes // 4
        shape = (n // 1024, 1024) if n % 1024 == 0 else (n,)
        model[f"layers.{i}.weight"] = torch.empty(shape, dtype=torch.float32, device=device).normal_()
        opt_state[i] = {
            "step": torch.tensor(100.0),  # AdamW keeps `step` on the CPU unless capturable/fused
            "exp_avg": torch.empty(shape, dtype=torch.float32, device=device).normal_(),
            "exp_avg_sq": torch.empty(shape, dtype=torch.float32, device=device).uniform_(),
        }
        remaining -= 3 * n * 4
        i += 1
    _sync(device)
    return {"replicated": {"model": model,
                           "optimizer": {"state": opt_state,
                                         "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8,
                                                           "weight_decay": 0.01, "params": list(opt_state)}]}},
            "local": {"data": {"epoch": 0, "index": 0}, "step": 100}}


def _tensor_bytes(state: Any) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _d2h_raw(state_bytes: int, runs: int, device: str) -> list[float]:
    """Seconds per copy_ of one device buffer of state_bytes into pinned host memory."""
    import torch

    src = torch.empty(state_bytes // 4, dtype=torch.float32, device=device).normal_()
    pinned = device.startswith("cuda")
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=pinned)
    dst.fill_(0)  # pre-fault the host side
    out = []
    try:
        for _ in range(runs):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            _sync(device)
            out.append(time.perf_counter() - t0)
    finally:
        del src, dst
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


class _Receiver:
    """A long-lived process that pulls a published state with fetch_state() on request."""

    def __init__(self, token: str, python: str = sys.executable):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "BATON_BENCH_TOKEN": token,
               "CUDA_VISIBLE_DEVICES": ""}  # the receiver is a host process: keep it off the GPU
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--receiver"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()  # "ready" once torch and baton are imported

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"stream receiver exited (code {self.proc.wait()})")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"stream receiver: {msg['error']}")
        return msg

    def fetch(self, address: tuple[str, int], generation: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"address": list(address), "generation": generation}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def _receiver_main() -> None:
    from baton.transfer import fetch_state

    token = os.environ["BATON_BENCH_TOKEN"]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            flat, stats = fetch_state([tuple(req["address"])], int(req["generation"]), token, timeout=600)
            nbytes = flat.nbytes
            del flat  # free before the next run
            print(json.dumps({"seconds": stats.seconds, "bytes": stats.bytes, "state_bytes": nbytes,
                              "corrupt_chunks": stats.corrupt_chunks}), flush=True)
        except Exception as exc:  # noqa: BLE001 - report it to the driver, which raises
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)


def _check_capture_exact(device: str) -> str:
    """codec.encode's asynchronous copies equal synchronous ones, for contiguous and strided
    tensors, and a kernel queued after the capture does not reach what it captured."""
    import torch

    from baton.transfer import codec

    g = torch.Generator(device=device).manual_seed(0)
    state = {"a": torch.randn(1 << 22, generator=g, device=device),
             "t": torch.randn(512, 1024, generator=g, device=device).t(),  # not contiguous
             "h": torch.randn(4096, generator=g, device=device).half(), "step": torch.tensor(7.0, device=device)}
    expected = [t.detach().cpu().clone() for t in codec.tensors_in(state)]
    _, got = codec.encode(state)
    if device.startswith("cuda"):  # (on the CPU a contiguous tensor is captured by reference)
        for t in codec.tensors_in(state):
            t.mul_(3).add_(1)  # queued right after the capture
    bad = [i for i, (a, b) in enumerate(zip(expected, got)) if not torch.equal(a, b)]
    if bad:
        raise RuntimeError(f"capture differs from a synchronous copy in tensors {bad}")
    return f"ok ({len(got)} tensors, pinned: {[t.is_pinned() for t in got]})"


def bench_gpu(state_gb: float = 10, runs: int = 5, device: str = "cuda") -> dict:
    """Device-to-host ceiling, baton's capture, and baton's streaming of ~state_gb of model + AdamW
    state; see the module doc. `device` is for testing the same path on "cpu"."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return dict(SKIPPED)
    from baton.transfer import TransferServer
    from baton.transfer.protocol import FlatState
    from baton.transfer import codec

    if device == "cuda":
        device = "cuda:0"
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"
    target = int(state_gb * 1e9)
    print(f"gpu capture: ~{target / 1e9:.2f} GB of fp32 model + AdamW state on {device} ({name}), "
          f"{runs} runs", flush=True)

    raw = _d2h_raw(target, runs, device)
    for i, s in enumerate(raw):
        print(f"  d2h raw {i + 1}/{runs}: {s:.4f}s ({target / s / 1e9:.2f} GB/s)", flush=True)

    exact = _check_capture_exact(device)
    print(f"  capture exact: {exact}", flush=True)
    state = make_state(target, device)
    state_bytes = _tensor_bytes(state)
    capture: list[float] = []
    capture_sync: list[float] = []
    flat = None
    for i in range(runs + 1):  # the first capture pins its host memory: reported apart
        flat = None  # free the previous capture first
        _sync(device)
        t0 = time.perf_counter()
        flat = FlatState(*codec.encode(state))
        _sync(device)
        capture.append(time.perf_counter() - t0)
        print(f"  capture {i}/{runs}: {capture[-1]:.4f}s ({state_bytes / capture[-1] / 1e9:.2f} GB/s)",
              flush=True)
        if i == 0:
            continue
        _sync(device)
        t0 = time.perf_counter()
        pageable = [t.detach().to("cpu") for t in codec.tensors_in(state)]
        _sync(device)
        capture_sync.append(time.perf_counter() - t0)
        del pageable
        print(f"  capture_sync {i}/{runs}: {capture_sync[-1]:.4f}s "
              f"({state_bytes / capture_sync[-1] / 1e9:.2f} GB/s)", flush=True)
    assert flat is not None
    capture_first, capture = capture[0], capture[1:]
    del state  # the device copy is no longer needed: stream from the host capture
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    token = secrets.token_urlsafe(16)
    server = TransferServer(token)
    receiver = _Receiver(token)
    stream: list[float] = []
    try:
        for i in range(runs):
            server.publish(i + 1, flat)
            got = receiver.fetch(server.address, i + 1)
            if got["state_bytes"] != flat.nbytes:
                raise RuntimeError(f"receiver got {got['state_bytes']} bytes, {flat.nbytes} were published")
            stream.append(float(got["seconds"]))
            print(f"  stream {i + 1}/{runs}: {stream[-1]:.4f}s ({flat.nbytes / stream[-1] / 1e9:.2f} GB/s)",
                  flush=True)
    finally:
        receiver.close()
        server.close()

    raw_s = median_range(raw)
    cap_s = median_range(capture)
    return {"device": name, "state_bytes": state_bytes, "capture_exact": exact,
            "d2h_raw_s": raw_s, "d2h_raw_gbs": median_range([target / s / 1e9 for s in raw]),
            "capture_s": cap_s, "capture_gbs": median_range([state_bytes / s / 1e9 for s in capture]),
            "capture_over_raw": (cap_s["median"] / raw_s["median"]) * (target / state_bytes),
            "capture_first_s": capture_first,
            "capture_sync_s": median_range(capture_sync),
            "capture_sync_gbs": median_range([state_bytes / s / 1e9 for s in capture_sync]),
            "stream_s": median_range(stream),
            "stream_gbs": median_range([flat.nbytes / s / 1e9 for s in stream])}


README_BEGIN = "<!-- bench:gpu (generated by bench/gpu.py) -->"
README_END = "<!-- /bench:gpu -->"


def readme_sentence(result: dict, name: str) -> str:
    """What a device session's results file (bench/gpu_session.sh's output, gathered into one
    JSON: `gpu`, `probe`, optionally `before_change`) says, as one README paragraph."""
    g, probe = result["gpu"], result.get("probe", {})
    mr = lambda m, unit, f=".2f": f"{m['median']:{f}} {unit} ({m['min']:{f}}-{m['max']:{f}}, n={m['n']})"  # noqa: E731
    out = [f"On {g['device']} ({result.get('machine', '')}; `{name}`, {result.get('when', '')}): capturing "
           f"{g['state_bytes'] / 1e9:.1f} GB of model + AdamW state to the host takes {mr(g['capture_s'], 's', '.3f')}, "
           f"{mr(g['capture_gbs'], 'GB/s', '.1f')}, {g['capture_over_raw']:.2f}x a raw pinned device-to-host copy of "
           f"the same bytes ({mr(g['d2h_raw_gbs'], 'GB/s', '.1f')}); the first capture of a process pins its host "
           f"memory and took {g['capture_first_s']:.2f} s; a synchronous `.to(\"cpu\")` per tensor into pageable "
           f"memory, what baton did before, {mr(g['capture_sync_s'], 's', '.2f')} in the same run; the captured state "
           f"streamed to another process over loopback (chunked, checksummed) {mr(g['stream_gbs'], 'GB/s', '.2f')}."]
    v = probe.get("versions", {})
    if v:
        out.append(f"NCCL {v.get('nccl')} (torch {v.get('torch')})"
                   + (" has no `NCCL_IB_RESILIENCY_PORT_FAILOVER`" if v.get("knows_port_failover") is False else ""))
    e = probe.get("env_reread")
    if e:
        out.append(f"; a process that formed an NCCL communicator with `NCCL_SOCKET_IFNAME={e['asked'][0]}`, destroyed it "
                   f"and formed another with `NCCL_SOCKET_IFNAME={e['asked'][1]}` "
                   + ("chose its interfaces again" if e.get("rereads") else
                      "chose no interface again (NCCL's INFO log names one only for the first)") + "")
    if "two_ranks_nccl" in probe:
        out.append("; two NCCL ranks on one GPU are refused (`Duplicate GPU detected`), so no multi-rank NCCL "
                   "path ran" if not probe["two_ranks_nccl"].get("ok") else "; two NCCL ranks ran on one GPU")
    if probe.get("gloo_cuda", {}).get("ok"):
        out.append("; gloo all-reduced CUDA tensors between two processes (baton's live group)")
    r = probe.get("rng_cuda")
    if r:
        out.append("; baton's random-stream capture " + ("carried" if r.get("same_mask") else "did NOT carry")
                   + " the CUDA generator through its codec (the same dropout mask after restore)")
    n = probe.get("nvml", {}).get("reading")
    if n:
        out.append(f"; NVML through baton's reader: {n['temp_c']:.0f} C, ECC {n['ecc_uncorrected']} uncorrected, "
                   f"{n['ecc_corrected']} corrected")
    text = out[0] + " " + "".join(out[1:]) + "."
    c = result.get("cuda_test")
    if c:
        moves = ", ".join(f"{mv['kind']} {mv['downtime_s']:.3f} s" for mv in c["moves"])
        text += (f" `{c['test'].split('::')[0]}` {c['result']} there ({c['when']}): {c['script']}, a planned move, a "
                 f"taint and a kill -9 ({moves} of downtime in the ledger, steps lost "
                 f"{sum(mv['steps_lost'] for mv in c['moves'])}), every rank's state and the checkpoint "
                 + ("bit for bit equal to torchrun's" if c.get("bitwise_against_torchrun") else "NOT equal to torchrun's")
                 + (f" ({c['note']})" if c.get("note") else "")
                 + (f"; its first try {c['first_try']}" if c.get("first_try") else "") + ".")
    return text


def update_readme(results: Path, readme: Path = REPO / "README.md") -> bool:
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    body = readme_sentence(json.loads(results.read_text()), f"bench/results/{results.name}")
    readme.write_text(head + README_BEGIN + body + README_END + rest.split(README_END, 1)[1])
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--state-gb", type=float, default=10.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--readme", type=Path, metavar="RESULTS",
                   help="write the README's GPU paragraph from a device session's results file, and exit")
    args = p.parse_args()
    if args.readme:
        return 0 if update_readme(args.readme.resolve()) else 1
    if args.receiver:
        _receiver_main()
        return 0
    print(json.dumps(bench_gpu(args.state_gb, args.runs, args.device), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
