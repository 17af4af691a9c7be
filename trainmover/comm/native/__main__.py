"""``python -m trainmover.comm.native``: build the forwarding backend (once per machine)."""
import sys

from trainmover.comm.native import NativeUnavailable, ensure_built

try:
    ensure_built()
except NativeUnavailable as exc:
    print(f"trainmover: {exc}", file=sys.stderr)
    sys.exit(1)
