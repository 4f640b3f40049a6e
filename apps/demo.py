"""``make demo``: train a small MLP with 4 workers whose every gradient is summed by the switch.

Starts the software target (loopback UDP), the controller and a parameter server;
creates a 4-worker job through the ``netagg`` CLI; runs 4 worker processes of
``examples/mlp_digits.py`` and, beside them, the same training in one process with
float32 gradients; shows progress per step; checks that netagg reaches the
reference's test accuracy within ``--tolerance``; stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.deployment import Deployment, DeploymentError, LocalDeployment

EXAMPLE = dp.REPO_ROOT / "examples" / "mlp_digits.py"
#: The example's learning rate, which the PS applies in ps mode.
LEARNING_RATE = 0.1


@dataclass
class DemoResult:
    """What the demo measured."""

    steps: int
    workers: list[dict] = field(default_factory=list)
    reference: dict = field(default_factory=dict)
    job: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    #: Over a tree of switches: each switch's counters for the job (``counters`` is their sum).
    switch_counters: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.workers[0]["test_accuracy"]

    @property
    def workers_agree(self) -> bool:
        """All ranks ended with bit-identical parameters (same aggregate every step)."""
        return len({w["param_checksum"] for w in self.workers}) == 1


def _progress(line: str, steps: int, started: float, width: int) -> None:
    record = json.loads(line)
    if "step" not in record:
        return
    step = record["step"] + 1
    megabytes = record["packets_sent"] * width * wire.VALUE_BYTES / 1e6
    print(f"  step {step:4d}/{steps}  loss {record['loss']:.4f}  aggregated {megabytes:7.2f} MB  "
          f"packets {record['packets_sent']:7d}  retransmissions {record['retransmissions']:4d}  "
          f"{time.monotonic() - started:5.1f} s", flush=True)


def _deployment(workdir: Path, target: str, num_workers: int, racks: int = 1) -> Deployment:
    """The embedded default (software target, loopback UDP), BMv2 in the namespace topology, or (``racks`` > 1)
    an emulated tree of switches: the workers spread over the racks, one controller over every switch."""
    if racks > 1:
        from netagg.bmv2.cluster import EmulatedTreeCluster

        return EmulatedTreeCluster(workdir, racks=racks, workers_per_rack=-(-num_workers // racks), target=target)
    if target in ("soft", "soft-ref"):
        return LocalDeployment(workdir, switch=target)
    from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster

    return EmulatedCluster(workdir, ClusterSpec.load(num_workers=num_workers, target=target, rate_mbit=None))


def run_demo(workdir: Path, num_workers: int = 4, steps: int = 150, slots: int | None = None,
             mode: str = "allreduce", report_every: int = 10, quiet: bool = False, target: str = "soft",
             racks: int = 1) -> DemoResult:
    """The whole demo; raises DeploymentError when a process fails. ``racks`` > 1: over a tree of switches.
    ``slots``: the job's (None: the controller chooses them from the hosts' links)."""
    result = DemoResult(steps=steps)
    started = time.monotonic()
    say = (lambda *_: None) if quiet else print
    with _deployment(workdir, target, num_workers, racks) as deployment:
        say(f"switch: {deployment.describe()}; controller up")
        created = deployment.create_job(deployment.worker_hosts[:num_workers], slots, mode=mode, name="mlp-digits")
        result.job = created["job"]
        job_id = result.job["job_id"]
        width = int(result.job.get("width", wire.K))
        chosen_by = result.job.get("slots_chosen_by", "asked")
        how = "asked" if chosen_by == "asked" else f"chosen by the controller: {chosen_by}"
        say(f"job {job_id}: {num_workers} workers, mode {result.job['mode']}, {result.job['slot_count']} slots "
            f"of {width} values ({how}; admission {created['admission']})")
        if result.job["mode"] in ("ps", "fallback"):
            deployment.start_ps(created["config_paths"][0], deployment.ps_host,
                                handle="sgd" if result.job["mode"] == "ps" else "sum", lr=LEARNING_RATE)
            say(f"parameter server up ({result.job['mode']} mode)")
        reference = subprocess.Popen([sys.executable, str(EXAMPLE), "--reference", str(num_workers),
                                      "--steps", str(steps)], stdout=subprocess.PIPE, text=True, cwd=dp.REPO_ROOT)
        workers = [deployment.spawn(f"worker{rank}", deployment.host_command(host, [
            sys.executable, str(EXAMPLE), "--config", str(path), "--steps", str(steps),
            "--report-every", str(report_every)]), stdout=subprocess.PIPE)
            for rank, (host, path) in enumerate(zip(deployment.worker_hosts, created["config_paths"]))]
        for line in workers[0].stdout:
            if line.startswith('{"final"'):
                result.workers.append(json.loads(line)["final"])
            elif not quiet:
                _progress(line, steps, started, width)
        for rank, worker in enumerate(workers[1:], start=1):
            out, _ = worker.communicate(timeout=300)
            finals = [json.loads(line)["final"] for line in out.splitlines() if line.startswith('{"final"')]
            if worker.returncode != 0 or not finals:
                raise DeploymentError(f"worker {rank} failed:\n{deployment.log_tail(f'worker{rank}')}")
            result.workers.append(finals[0])
        if workers[0].wait(timeout=60) != 0 or not result.workers or result.workers[0]["rank"] != 0:
            raise DeploymentError(f"worker 0 failed:\n{deployment.log_tail('worker0')}")
        out, _ = reference.communicate(timeout=300)
        result.reference = json.loads(out.strip().splitlines()[-1])["reference"]
        shown = json.loads(deployment.cli("--json", "job", "show", str(job_id)))
        result.counters = shown.get("counters", {})
        result.switch_counters = shown.get("switch_counters", {})
        deployment.cli("job", "delete", str(job_id))
    result.seconds = time.monotonic() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--mode", choices=("allreduce", "ps"), default="allreduce")
    parser.add_argument("--slots", type=int,
                        help="slots asked for the job (packets in flight per worker); default: the controller "
                             "chooses them from the hosts' links (docs/controller.md)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="largest allowed drop in test accuracy vs the float32 reference (default 0.02)")
    parser.add_argument("--workdir", type=Path, help="keep logs and configs here (default: a temporary folder)")
    parser.add_argument("--target", choices=("soft", "soft-ref", "bmv2"), default="soft",
                        help="soft: the embedded default (loopback UDP); soft-ref: the same on the software "
                             "target's reference model; bmv2: simple_switch_grpc in the namespace topology of "
                             "configs/cluster.yaml (root, p4c and BMv2 installed)")
    parser.add_argument("--racks", type=int, default=1,
                        help="above 1: the workers in that many racks, each under its own switch (of --target), the "
                             "racks under a root switch, one controller over all of them (namespaces: needs root)")
    args = parser.parse_args(argv)
    if args.racks < 1:
        parser.error("--racks: at least 1")
    print(f"netagg demo: {args.workers} workers train an MLP on scikit-learn's digits for {args.steps} steps; "
          "every gradient is summed in the switch")
    try:
        with tempfile.TemporaryDirectory(prefix="netagg-demo-") as tmp:
            workdir = args.workdir or Path(tmp)
            result = run_demo(workdir, args.workers, args.steps, slots=args.slots, mode=args.mode, target=args.target,
                              racks=args.racks)
    except (DeploymentError, KeyboardInterrupt) as err:
        print(f"demo failed: {err}", file=sys.stderr)
        return 1
    ref_acc = result.reference["test_accuracy"]
    ok = result.accuracy >= ref_acc - args.tolerance and result.workers_agree
    rank0 = result.workers[0]
    print("\nsummary")
    print(f"  test accuracy: netagg {result.accuracy:.4f}, single-process float32 {ref_acc:.4f} "
          f"(tolerance {args.tolerance:.2f}) -> {'OK' if ok else 'FAILED'}")
    print(f"  test loss: netagg {rank0['test_loss']:.4f}, reference {result.reference['test_loss']:.4f}")
    print(f"  workers hold identical parameters: {result.workers_agree}")
    print(f"  per worker: {rank0['packets_sent']} packets, {rank0['retransmissions']} retransmissions, "
          f"{rank0['packets_sent'] * int(result.job.get('width', wire.K)) * wire.VALUE_BYTES / 1e6:.2f} MB of "
          "gradients")
    if result.switch_counters:  # a tree: each switch's own
        for switch, counters in result.switch_counters.items():
            print(f"  switch {switch} counters for the job: " + ", ".join(f"{k}={v}" for k, v in counters.items()))
    else:
        print("  switch counters for the job: " + ", ".join(f"{k}={v}" for k, v in result.counters.items()))
    print(f"  wall time {result.seconds:.1f} s; every process stopped")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
