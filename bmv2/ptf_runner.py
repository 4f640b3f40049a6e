"""Run the PTF suite against a target on veth pairs in a private namespace.

``python -m netagg.bmv2.ptf_runner --target soft|bmv2 [test ...]`` builds a
namespace with 8 veth pairs, starts the target on one end of each, runs PTF on
the other ends, and removes everything afterwards, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from netagg import dataplane as dp
from netagg.bmv2.netns import VethRig, can_create_namespaces, ns_exec
from netagg.bmv2.p4build import P4CompileError, compile_program
from netagg.bmv2.targets import TARGETS, TargetError, bmv2_missing, start_target
from netagg.shutdown import sigterm_as_interrupt

PTF_DIR = dp.REPO_ROOT / "ptf-tests"
NUM_PORTS = 8
GRPC_ADDRESS = "127.0.0.1:9559"
#: Exit status meaning "skipped" (as automake's test driver uses it).
EXIT_SKIPPED = 77


def skip_reason(target: str) -> str | None:
    """Why the suite cannot run against ``target`` here, or None."""
    ok, why = can_create_namespaces()
    if not ok:
        return why
    if target == "bmv2":
        return bmv2_missing()
    if target == "soft-sharded":
        from netagg.softswitch import fastpath

        return fastpath.unavailable()
    return None


def run_suite(target: str, tests: list[str], log_dir: Path, prefix: str) -> int:
    """Build the rig, start the target, run PTF; returns PTF's exit status."""
    config = ""
    if target == "bmv2":
        json_path, _ = compile_program(log_dir / "p4c")
        config = str(json_path)
    with sigterm_as_interrupt(), VethRig(prefix, NUM_PORTS) as rig:
        switch = start_target(target, rig.switch_interfaces(), log_dir / f"{target}-switch.log",
                              grpc_address=GRPC_ADDRESS, namespace=rig.namespace)
        try:
            interfaces = [arg for port, ifname in rig.test_interfaces().items() for arg in ("-i", f"{port}@{ifname}")]
            # PTF evaluates each value as a Python literal, hence the quotes.
            params = f"grpcaddr='{GRPC_ADDRESS}';p4info='{dp.P4INFO_PATH}';config='{config}';target='{target}'"
            cmd = ns_exec(rig.namespace, [
                str(Path(sys.executable).with_name("ptf")), "--test-dir", str(PTF_DIR), *interfaces,
                "--test-params", params, "--log-file", str(log_dir / f"ptf-{target}.log"),
                "--pypath", str(PTF_DIR), *tests,
            ])
            return subprocess.run(cmd, cwd=dp.REPO_ROOT, timeout=1800).returncode
        finally:
            switch.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=TARGETS, default="soft")
    parser.add_argument("--log-dir", type=Path, default=dp.BUILD_DIR / "ptf")
    parser.add_argument("--prefix", default=f"np{os.getpid() % 100000}", help="namespace/interface name prefix")
    parser.add_argument("tests", nargs="*", help="PTF test names or groups (default: all)")
    args = parser.parse_args(argv)
    reason = skip_reason(args.target)
    if reason:
        print(f"SKIPPED: PTF suite on {args.target}: {reason}")
        return EXIT_SKIPPED
    args.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        return run_suite(args.target, args.tests, args.log_dir, args.prefix)
    except (TargetError, P4CompileError) as err:
        print(f"PTF suite on {args.target}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
