"""Compile ``p4src/tna/netagg.p4`` with the open-source Tofino compiler (when it is installed).

``bf-p4c`` (p4lang/p4c's ``tofino`` backend) must be on PATH. The compiler's own resource
report (``pipe/logs/resources.json`` and ``metrics.json``, written with ``--verbose 1``) is
summarised by :class:`ResourceReport`; ``make build-tofino`` prints it. The compiled parsers must
hold every state of the program's (:func:`missing_parser_states`).

Without ``bf-p4c``, p4c's front and mid end (``p4test``) still check the program against the
Tofino architecture (``tna.p4`` from p4c's Tofino backend, installed in p4c's include directory):
syntax, types, and every warning, but no stage, ALU or PHV allocation (:func:`check_front_end`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from netagg import dataplane as dp

#: Tofino 1 has 12 MAU stages (shared by ingress and egress) with 4 stateful ALUs each.
TOFINO1_STAGES = 12
TOFINO1_STATEFUL_ALUS_PER_STAGE = 4
#: The compiler pads every Tofino 1 egress parser path to the 65-byte minimum parse depth
#: with a loop it generates itself and announces with this line; even a one-table program
#: gets it, so it is a note about the target, not about the program.
#: The assembler (bfas) then reports, on the generated .bfa, where the compiler gave tables of one stage
#: compatible definitions of the same input-crossbar hash group: it merges them ("mergeable"; an
#: incompatible one is an error) and, for the tables that share the merged group, finds no hash table of
#: their own under the other's number. Which tables share depends on placement (moving the value pairs'
#: tables to ternary moves it to the jobs table); notes about generated assembly, not the program.
COMPILER_NOTES = (
    re.compile(r"^warning: Parser state min_parse_depth_accept_loop will be unrolled"),
    re.compile(r"\.bfa:\d+: warning: Input xbar hash group \d+ mergeable conflict in stage \d+$"),
    re.compile(r"\.bfa:\d+: warning: conflicting hash group definition here$"),
    re.compile(r"\.bfa:\d+: warning: exact hashtable \d+ does not exist in table [\w.$]+$"),
)


#: The program's parsers (p4src/tna/parser.p4) and the .bfa sections the compiler writes them into.
PARSERS = {"NetaggIngressParser": "ingress", "NetaggEgressParser": "egress"}


def program_parser_states(source: str) -> dict[str, set[str]]:
    """Each parser's states in the P4 source, by gress (``start`` aside: the compiler renames it)."""
    states: dict[str, set[str]] = {}
    blocks = re.split(r"^parser (\w+)\(", source, flags=re.M)
    for name, body in zip(blocks[1::2], blocks[2::2]):
        if name in PARSERS:
            body = body.split("\ncontrol ", 1)[0]
            states[PARSERS[name]] = set(re.findall(r"^\s*state (\w+) \{", body, re.M)) - {"start"}
    return states


def compiled_parser_states(bfa: str) -> dict[str, set[str]]:
    """Each parser's states in the assembly, by gress: a state split over several (``s.$split_2``) is ``s``."""
    states: dict[str, set[str]] = {}
    for gress, body in re.findall(r"^parser (\w+):\n(.*?)(?=^\S)", bfa, re.M | re.S):
        names = re.findall(r"^    ([^\s:][^:]*):$", body, re.M)
        states.setdefault(gress, set()).update(n.split(".$")[0] for n in names)
    return states


def missing_parser_states(program: str, bfa: str) -> list[str]:
    """``gress: state`` for every state of the program that its compiled parser lacks. A compiler that
    drops a select's match registers (p4lang/p4c#5753: Tofino 1 kept only scratch registers, so every
    transition but a select's first was lost) passes placement and assembly; this finds the states it cut off."""
    compiled = compiled_parser_states(bfa)
    return sorted(f"{gress}: {state}" for gress, states in program_parser_states(program).items()
                  for state in states - compiled.get(gress, set()))


class TofinoCompileError(RuntimeError):
    """bf-p4c failed, or warned (the program must compile cleanly)."""


def compiler_available() -> bool:
    return shutil.which("bf-p4c") is not None


def front_end_missing() -> str | None:
    """Why :func:`check_front_end` cannot run here (None: it can): ``p4test`` on PATH, and the Tofino
    architecture's ``tna.p4`` in its include directory (``<prefix>/share/p4c/p4include``)."""
    p4test = shutil.which("p4test")
    if p4test is None:
        return "p4test (p4lang/p4c) is not on PATH"
    include = Path(p4test).resolve().parent.parent / "share" / "p4c" / "p4include"
    if not (include / "tna.p4").exists():
        return (f"no tna.p4 in {include}: install p4c's Tofino backend includes "
                "(backends/tofino/bf-p4c/p4include) there")
    return None


def check_front_end(program: Path = dp.TNA_PROGRAM, include: Path = dp.P4SRC_DIR, timeout: float = 300) -> None:
    """Run p4c's front and mid end (``p4test``) over the TNA program (``include``: the directory its
    ``#include "shared/..."`` lines are relative to) for Tofino 1; any error or warning raises
    :class:`TofinoCompileError`. No Tofino resources are checked: that needs bf-p4c."""
    missing = front_end_missing()
    if missing is not None:
        raise TofinoCompileError(missing)
    cmd = ["p4test", "-D__TARGET_TOFINO__=1", "-I", str(include), str(program)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0 or output:
        raise TofinoCompileError(f"p4test (front and mid end) on {program.name}:\n{output}")


@dataclass(frozen=True)
class ResourceReport:
    """What the compiler allocated, from its resources.json and metrics.json."""

    target: str
    stages_used: int
    stateful_alus: int
    stateful_alus_by_stage: tuple[int, ...]
    srams: int
    tcams: int
    logical_tables: int
    phv_bits: int
    compiler_version: str

    @classmethod
    def from_logs(cls, logs: Path) -> ResourceReport:
        """From ``metrics.json`` where the compiler wrote one (its packaged builds do); p4lang's open
        build writes none, so the same totals are counted from ``resources.json`` and ``phv.json``."""
        resources = json.loads((logs / "resources.json").read_text())["resources"]["mau"]
        stages = resources["mau_stages"]
        by_stage = tuple(len(stage["meter_alus"].get("meters", [])) for stage in stages)
        used = max((stage["stage_number"] + 1 for stage in stages if stage["logical_tables"].get("ids")), default=0)
        if (logs / "metrics.json").exists():
            metrics = json.loads((logs / "metrics.json").read_text())
            target, version, mau = metrics["target"], metrics["compiler_version"], metrics["mau"]
            srams, tcams, logical_tables = mau["srams"], mau["tcams"], mau["logical_tables"]
            phv_bits = sum(c["bits_occupied"] for kind in ("normal", "tagalong") for c in metrics["phv"][kind])
        else:
            phv = json.loads((logs / "phv.json").read_text())
            target, version = phv["target"], phv["compiler_version"]
            srams = sum(len(stage["rams"].get("srams", [])) for stage in stages)
            tcams = sum(len(stage["tcams"].get("tcams", [])) for stage in stages)
            logical_tables = sum(len(stage["logical_tables"].get("ids", [])) for stage in stages)
            phv_bits = sum(len({bit for s in container["slices"]
                                for bit in range(s["slice_info"]["lsb"], s["slice_info"]["msb"] + 1)})
                           for container in phv["containers"])
        return cls(target=target, stages_used=used, stateful_alus=sum(by_stage), stateful_alus_by_stage=by_stage,
                   srams=srams, tcams=tcams, logical_tables=logical_tables, phv_bits=phv_bits,
                   compiler_version=version)

    def summary(self) -> str:
        per_stage = " ".join(str(n) for n in self.stateful_alus_by_stage[: self.stages_used])
        return (f"{self.target} (bf-p4c {self.compiler_version}): {self.stages_used} of {TOFINO1_STAGES} stages, "
                f"{self.stateful_alus} stateful ALUs (per stage: {per_stage}), {self.logical_tables} logical "
                f"tables, {self.srams} SRAM blocks, {self.tcams} TCAM blocks, {self.phv_bits} PHV bits")


@dataclass(frozen=True)
class TofinoBuild:
    out_dir: Path
    report: ResourceReport
    notes: tuple[str, ...]


def compiler_warnings(output: str) -> tuple[list[str], list[str]]:
    """Split the compiler's warning lines into (warnings, known target notes)."""
    warnings, notes = [], []
    for line in output.splitlines():
        if "warning" not in line.lower() or re.search(r"\b0 errors?, \d+ warnings?", line):
            continue
        (notes if any(p.search(line) for p in COMPILER_NOTES) else warnings).append(line)
    return warnings, notes


def compile_tna(out_dir: Path, allow_warnings: bool = False, timeout: float = 1800) -> TofinoBuild:
    """Compile for Tofino 1 into ``out_dir``; warnings (other than target notes) are errors."""
    if not compiler_available():
        raise TofinoCompileError("bf-p4c is not on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["bf-p4c", "--target", "tofino", "--arch", "tna", "--verbose", "1", "-I", str(dp.P4SRC_DIR),
           "-o", str(out_dir), str(dp.TNA_PROGRAM)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        logs = out_dir / "pipe" / "logs"
        if (logs / "resources.json").exists() and (logs / "phv.json").exists():
            output += "\nresources as placed: " + ResourceReport.from_logs(logs).summary()
        raise TofinoCompileError(f"bf-p4c failed:\n{output}")
    warnings, notes = compiler_warnings(output)
    if warnings and not allow_warnings:
        raise TofinoCompileError("bf-p4c warned (the program must compile cleanly):\n" + "\n".join(warnings))
    missing = missing_parser_states((dp.TNA_PROGRAM.parent / "parser.p4").read_text(),
                                    (out_dir / "pipe" / f"{dp.TNA_PROGRAM.stem}.bfa").read_text())
    if missing:
        raise TofinoCompileError("the compiled parsers lack states of the program (a compiler that drops select "
                                 "transitions, e.g. before p4lang/p4c#5753): " + ", ".join(missing))
    return TofinoBuild(out_dir, ResourceReport.from_logs(out_dir / "pipe" / "logs"), tuple(notes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=dp.BUILD_DIR / "tofino")
    args = parser.parse_args(argv)
    program = dp.TNA_PROGRAM.relative_to(dp.REPO_ROOT)
    if not compiler_available():
        missing = front_end_missing()
        if missing is not None:
            print(f"make build-tofino: bf-p4c (p4c's Tofino backend) is not on PATH and {missing}; skipped "
                  f"{program}. See docs/tofino.md.")
            return 0
        try:
            check_front_end()
        except (TofinoCompileError, subprocess.TimeoutExpired) as err:
            print(err, file=sys.stderr)
            return 1
        print(f"{program}: p4c's front and mid end (p4test, Tofino 1) pass without a warning; bf-p4c is not on "
              "PATH, so no resources were allocated. See docs/tofino.md.")
        return 0
    try:
        build = compile_tna(args.out)
    except (TofinoCompileError, subprocess.TimeoutExpired) as err:
        print(err, file=sys.stderr)
        return 1
    print(f"compiled {dp.TNA_PROGRAM.relative_to(dp.REPO_ROOT)} into {build.out_dir}")
    print(build.report.summary())
    for note in build.notes:
        print(f"compiler note (target, not program): {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
