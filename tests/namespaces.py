"""Network namespaces for tests that listen on a port: a process started inside one with only
the loopback interface up cannot be reached from outside this machine."""

from __future__ import annotations

import subprocess

# run a command inside: ["unshare", "-n", "--", "sh", "-c", LOOPBACK_UP, program, *arguments]
LOOPBACK_UP = 'ip link set lo up && exec "$0" "$@"'


def loopback_only() -> str | None:
    """Why a loopback-only network namespace cannot be made here, or None."""
    try:
        made = subprocess.run(["unshare", "-n", "--", "sh", "-c", "ip link set lo up"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -n could not run: {exc}"
    return None if made.returncode == 0 else f"unshare -n failed: {made.stderr.strip()}"
