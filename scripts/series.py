#!/usr/bin/env python3
"""Command line of the patch-series tools; build.sh and the Makefile call it.

  series.py fetch {sdist,wheel}   print the cached, verified path (downloads once)
  series.py apply                 build vllm-src/ = pinned release + patches/series
  series.py export                write vllm-src/'s commits back to patches/
  series.py version               the wheel version: <release>+dsa.sm120.<series digest>
  series.py jobs                  MAX_JOBS NVCC_THREADS for BUILD_MODE=source
  series.py pin KEY               one value of vllm-pin.txt
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from patchseries import SeriesError  # noqa: E402
from patchseries.fetch import fetch_file  # noqa: E402
from patchseries.jobs import jobs_from_environment  # noqa: E402
from patchseries.pin import load_pin  # noqa: E402
from patchseries.tree import apply_series, export_series, read_series, series_digest  # noqa: E402

LOCAL_LABEL = "dsa.sm120"


def wheel_version(pin, patches) -> str:
    return f"{pin.version}+{LOCAL_LABEL}.{series_digest(patches)[:8]}"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, args = argv[0], argv[1:]
    pin = load_pin()
    if command == "fetch" and args in (["sdist"], ["wheel"]):
        name, sha = (pin.sdist, pin.sdist_sha256) if args[0] == "sdist" else (pin.wheel, pin.wheel_sha256)
        print(fetch_file("vllm", name, sha))
    elif command == "apply" and not args:
        src = os.environ.get("VLLM_SRC")
        apply_series(pin, src=Path(src).resolve() if src else None)
    elif command == "export" and not args:
        export_series()
    elif command == "version" and not args:
        print(wheel_version(pin, read_series()))
    elif command == "jobs" and not args:
        print(*jobs_from_environment())
    elif command == "pin" and len(args) == 1 and hasattr(pin, args[0]):
        print(getattr(pin, args[0]))
    else:
        print(f"series.py: bad command {' '.join(argv)!r}\n{__doc__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except SeriesError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
