"""Compile ``p4src/v1model/netagg.p4`` with p4c's BMv2 backend (when it is installed)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from netagg import dataplane as dp


class P4CompileError(RuntimeError):
    """p4c failed, or warned (the program must compile cleanly)."""


def p4c_available() -> bool:
    return shutil.which("p4c-bm2-ss") is not None


def compile_program(out_dir: Path, allow_warnings: bool = False) -> tuple[Path, Path]:
    """Compile to ``out_dir``; returns (BMv2 JSON, P4Info text). Warnings are errors by default."""
    if not p4c_available():
        raise P4CompileError("p4c-bm2-ss is not on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, p4info_path = out_dir / "netagg.json", out_dir / "netagg.p4info.txtpb"
    cmd = ["p4c-bm2-ss", "--std", "p4-16", "--arch", "v1model", "-I", str(dp.P4SRC_DIR),
           "--p4runtime-files", str(p4info_path), "-o", str(json_path), str(dp.P4_PROGRAM)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        raise P4CompileError(f"p4c-bm2-ss failed:\n{output}")
    if output and not allow_warnings and "warning" in output.lower():
        raise P4CompileError(f"p4c-bm2-ss warned (the program must compile cleanly):\n{output}")
    return json_path, p4info_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=dp.BUILD_DIR)
    parser.add_argument("--update-p4info", action="store_true",
                        help="also copy the generated P4Info over the committed one")
    args = parser.parse_args(argv)
    if not p4c_available():
        print("make build: p4c-bm2-ss is not on PATH; skipped compiling. The software target uses the "
              f"committed {dp.P4INFO_PATH.relative_to(dp.REPO_ROOT)}.")
        return 0
    try:
        json_path, p4info_path = compile_program(args.out)
    except P4CompileError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"compiled {dp.P4_PROGRAM.name}: {json_path}, {p4info_path}")
    if p4info_path.read_text() != dp.P4INFO_PATH.read_text():
        if args.update_p4info:
            shutil.copyfile(p4info_path, dp.P4INFO_PATH)
            print(f"updated {dp.P4INFO_PATH}")
        else:
            print(f"note: {p4info_path} differs from the committed {dp.P4INFO_PATH}; "
                  "run `make p4info` to update it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
