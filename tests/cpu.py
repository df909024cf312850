"""The flags of this machine's CPU (/proc/cpuinfo), for tests whose expectations depend on its kernels."""

from pathlib import Path


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    for line in (cpuinfo.read_text() if cpuinfo.exists() else "").splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
