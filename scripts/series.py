#!/usr/bin/env python3
"""Command line of the patch-series tools; build.sh and the Makefile call it.

  series.py fetch {sdist,wheel}   print the cached, verified path (downloads once)
  series.py apply                 build vllm-src/ = pinned release + patches/series
  series.py export                write vllm-src/'s commits back to patches/
  series.py version               the wheel version: <release>+dsa.sm120.<series digest>
  series.py sections              the series by section (area and upstream fate), each
                                  patch with its Upstream-Status
  series.py jobs                  MAX_JOBS NVCC_THREADS for BUILD_MODE=source
  series.py pin KEY               one value of vllm-pin.txt
  series.py rebase [--write]      carry patches/ onto VLLM_VERSION=<release|newest>, or onto
                                  VLLM_SRC=<git checkout> VLLM_REF=<commit>, in vllm-rebase/;
                                  print one row per patch. --write (or WRITE=1): rewrite
                                  patches/ and vllm-pin.txt when nothing conflicts.
                                  Exit status 0: the series carried over; 3: it did not.
  series.py rebase --finish       after resolving conflicts in vllm-rebase/ by hand
                                  (git am --continue): write patches/ and vllm-pin.txt
  series.py compat [VERSION...]   docs/compatibility.md: the series on each release
  series.py lint                  vLLM's ruff rules (check and format) on the .py files
                                  that the series adds or changes, in vllm-src/, with this
                                  Python's ruff; exit status 1 on a finding
  series.py llama-cpp wheel DIR   the llama-cpp-python wheel from llama-cpp-pin.txt's sdist
                                  (CPU build, portable), into DIR (make wheelhouse)
  series.py llama-cpp converter FILE
                                  llama.cpp's converter from that sdist, as the archive
                                  FILE (.tar.gz) that E2E_LLAMA_CPP takes (make wheelhouse)
  series.py llama-cpp source FILE llama.cpp's source from that sdist, trimmed, as the
                                  archive FILE (.tar.gz) that LLAMA_CPP_SRC takes
                                  (make wheelhouse)
  series.py llama-cpp tools       build llama-quantize, llama-imatrix and llama-gguf-split
                                  (CPU) from that source once, into the download cache
                                  (the end-to-end test models' low-bit and split files);
                                  print their folder
  series.py wheelhouse-split REPORT SKIP KEEP LEFT
                                  split pip's --report of the wheelhouse's requirements by
                                  SKIP's patterns (make wheelhouse WHEELHOUSE_SKIP=...): the
                                  pins to download into KEEP, those left out into LEFT
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from patchseries import (
    REPO_ROOT,
    SeriesError,
    compat,
    lint,
    llama_cpp_sdist,
    llama_cpp_tools,
    rebase,
    wheelhouse,
)
from patchseries.fetch import fetch_file
from patchseries.jobs import jobs_from_environment
from patchseries.patchfile import format_sections, read_series, series_digest, version_label
from patchseries.pin import load_pin
from patchseries.release import checkout_target, release_target
from patchseries.tree import apply_series, export_series

LOCAL_LABEL = "dsa.sm120"


def wheel_version(pin, patches) -> str:
    return f"{pin.version}+{LOCAL_LABEL}.{version_label(series_digest(patches)[:8])}"


def rebase_command(pin, write: bool) -> int:
    version, src, ref = (os.environ.get(k) for k in ("VLLM_VERSION", "VLLM_SRC", "VLLM_REF"))
    if bool(version) == bool(src) or bool(src) != bool(ref):
        raise SeriesError("give VLLM_VERSION=<release|newest>, or VLLM_SRC=<git checkout> "
                          "with VLLM_REF=<commit>")
    target = (release_target(version) if version
              else checkout_target(Path(src).resolve(), ref))
    if target.pin:
        print(f"target vLLM {target.pin.version}: commit {target.pin.commit}, "
              f"torch {target.pin.torch}\n  {target.pin.sdist} sha256 {target.pin.sdist_sha256}"
              f"\n  {target.pin.wheel} sha256 {target.pin.wheel_sha256}")
    try:
        outcome = rebase.rebase(target, pin, write=write)
    except KeyboardInterrupt:
        print(f"\ninterrupted: patches/ and vllm-pin.txt are unchanged; the partial work is in "
              f"{rebase.REBASE_TREE.name}/", file=sys.stderr)
        return 130
    print(f"\n{target.describe()}:\n{rebase.format_table(outcome.results)}")
    if not outcome.carried:
        print(rebase.instructions(rebase.REBASE_TREE, outcome))
        return 3
    if outcome.written:
        dropped = [r.name for r in outcome.results if r.status == rebase.OBSOLETE]
        print(f"\nThe series carried over: patches/ and vllm-pin.txt now target vLLM "
              f"{target.version}"
              + (f"; dropped as obsolete: {', '.join(dropped)}" if dropped else "")
              + ". Run `make apply` to refresh vllm-src/.")
    else:
        print(f"\nThe series carried over (branch main of {rebase.REBASE_TREE.name}/). "
              + ("`python3 scripts/series.py rebase --finish` writes it (with any commits "
                 "you add there) to patches/ and vllm-pin.txt; so does a re-run with WRITE=1."
                 if target.pin else "It is no release on the index: vllm-pin.txt cannot name it."))
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, args = argv[0], argv[1:]
    pin = load_pin()
    if command == "fetch" and args in (["sdist"], ["wheel"]):
        name, sha = ((pin.sdist, pin.sdist_sha256) if args[0] == "sdist"
                     else (pin.wheel, pin.wheel_sha256))
        print(fetch_file("vllm", name, sha))
    elif command == "apply" and not args:
        src = os.environ.get("VLLM_SRC")
        apply_series(pin, src=Path(src).resolve() if src else None)
    elif command == "export" and not args:
        export_series(pin=pin)
    elif command == "version" and not args:
        print(wheel_version(pin, read_series()))
    elif command == "sections" and not args:
        print(format_sections())
    elif command == "jobs" and not args:
        print(*jobs_from_environment())
    elif command == "pin" and len(args) == 1 and hasattr(pin, args[0]):
        print(getattr(pin, args[0]))
    elif command == "rebase" and args == ["--finish"]:
        written = rebase.finish()
        print(f"wrote {len(written)} patches to patches/ and vllm-pin.txt")
    elif command == "rebase" and args in ([], ["--write"]):
        write = bool(args) or os.environ.get("WRITE", "") in ("1", "yes", "true")
        return rebase_command(pin, write)
    elif command == "llama-cpp" and len(args) == 2 and args[0] == "wheel":
        llama_cpp_sdist.build_wheel(Path(args[1]))
    elif command == "llama-cpp" and len(args) == 2 and args[0] == "converter":
        llama_cpp_sdist.write_converter_archive(Path(args[1]))
    elif command == "llama-cpp" and len(args) == 2 and args[0] == "source":
        llama_cpp_tools.pack_source(Path(args[1]))
    elif command == "llama-cpp" and args == ["tools"]:
        print(llama_cpp_tools.cpu_tools())
    elif command == "wheelhouse-split" and len(args) == 4:
        keep, left = wheelhouse.write_split(Path(args[0]), args[1], Path(args[2]), Path(args[3]))
        print(f"{keep} to download, {left} left out")
    elif command == "lint" and not args:
        return 1 if lint.lint(sys.executable) else 0
    elif command == "compat":
        compat.compat(args or None)
        print(f"wrote {compat.COMPAT_DOC.relative_to(REPO_ROOT)}")
    else:
        print(f"series.py: bad command {' '.join(argv)!r}\n{__doc__}", file=sys.stderr)
        return 2
    return 0


def _interrupted(signum: int, frame: object) -> None:
    """SIGINT or SIGTERM: unwind as KeyboardInterrupt so that cleanups run
    (partial downloads, temporary trees); a second signal does not cut them short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        sys.exit(main(sys.argv[1:]))
    except SeriesError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
