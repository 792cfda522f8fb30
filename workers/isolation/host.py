"""What the host must offer for eBPF isolation: Linux, the capabilities, the compiled programs, cgroup v2."""

from __future__ import annotations

from pathlib import Path

from reflow.cgroups import OPT_OUT, IsolationUnavailable, cgroup2_root

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OBJECT = REPO_ROOT / "build" / "bpf" / "isolation.bpf.o"
CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_BPF = 12, 21, 39


def check_host(object_path: Path) -> None:
    """IsolationUnavailable naming the first thing the host lacks."""
    if not Path("/proc/self/status").is_file():
        raise IsolationUnavailable(f"eBPF isolation needs Linux; {OPT_OUT}")
    held = effective_capabilities()
    missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not held >> bit & 1]  # fmt: skip
    if not (held >> CAP_BPF & 1 or held >> CAP_SYS_ADMIN & 1):  # before Linux 5.8: SYS_ADMIN
        missing.insert(0, "CAP_BPF")
    if missing:
        raise IsolationUnavailable(
            f"eBPF isolation needs {', '.join(missing)} (run the worker as root or grant them); {OPT_OUT}"
        )
    if not object_path.is_file():
        raise IsolationUnavailable(
            f"{object_path} not found: build it with `make bpf` (needs clang and libbpf-dev); {OPT_OUT}"
        )
    cgroup2_root()


def effective_capabilities() -> int:
    """This process's effective capability set, as a bit mask (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0
