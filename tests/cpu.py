"""The flags of this machine's CPU (/proc/cpuinfo), for tests whose expectations depend on its kernels."""

from pathlib import Path


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    for line in (cpuinfo.read_text() if cpuinfo.exists() else "").splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# the greedy head's int8 pass on AVX512-VNNI (native/greedy_head.cpp), which takes a plain step's row too
GREEDY_VNNI = {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags()
