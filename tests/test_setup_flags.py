"""scripts/setup.sh reuses llama.cpp (installed in a venv, or a wheel in .wheels/) only where it was built for this CPU.

llama.cpp is built with GGML_NATIVE (-march=native), so a build for another CPU can die of SIGILL. These tests run the
real setup.sh with SETUP_PLAN_ONLY=1, which takes the same decisions and prints them, then stops before any pip call,
in a fake project: a copy of the script, a real (pip-less) venv holding a tiny fake llama_cpp 0.3.36, fake wheels, and
a fake /proc/cpuinfo (DFLASH_CPUINFO). Nothing is built or installed.
"""

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup.sh"

# two CPUs: the first has AVX-512 and AMX, the second lacks them and has SHA instead (orders as /proc/cpuinfo has them)
CPU_A = "sse sse2 ssse3 fma avx avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_int8"
CPU_B = "sse sse2 ssse3 fma avx avx2 sha_ni"
WHEEL = "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
SYSTEM_INFO = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def flags_file(flags: str) -> str:
    """A cpu-flags file as setup.sh writes it: one flag a line, sorted (byte order), unique."""
    return "".join(f + "\n" for f in sorted(set(flags.split())))


@pytest.fixture
def project(tmp_path):
    """A project folder with scripts/setup.sh and .venv, a real venv without pip (so that a pip call would fail) with
    a fake llama_cpp 0.3.36 in its site-packages; no .wheels/ yet."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SETUP, tmp_path / "scripts" / "setup.sh")
    venv.create(tmp_path / ".venv", with_pip=False)
    site = tmp_path / ".venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    assert site.is_dir()
    (site / "llama_cpp").mkdir()
    (site / "llama_cpp" / "__init__.py").write_text(
        f'__version__ = "0.3.36"\n'
        f"def llama_print_system_info():\n    return {SYSTEM_INFO.encode()!r}\n"
        f"def llama_supports_rpc():\n    return True\n"
    )
    (site / "llama_cpp_python-0.3.36.dist-info").mkdir()
    (site / "llama_cpp_python-0.3.36.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.3.36\n"
    )
    return tmp_path


def plan(project: Path, cpu: str, cmake_args: str | None = None) -> tuple[str, str]:
    """Run setup.sh in plan mode on a CPU with these flags (and CMAKE_ARGS); (its one-line messages, its plan
    line)."""
    cpuinfo = project / "cpuinfo"
    # like /proc/cpuinfo: one block per processor; an "fpu : yes" line that is not the flags
    cpuinfo.write_text(
        "".join(
            f"processor\t: {i}\nvendor_id\t: GenuineIntel\nfpu\t\t: yes\nflags\t\t: {cpu}\nbugs\t\t: spectre_v1\n\n"
            for i in range(2)
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(VENV=".venv", SETUP_PLAN_ONLY="1", DFLASH_CPUINFO=str(cpuinfo))
    if cmake_args is not None:
        env["CMAKE_ARGS"] = cmake_args
    r = subprocess.run(
        ["bash", str(project / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("plan: "), r.stdout + r.stderr
    return "\n".join(lines[:-1]), lines[-1]


def built(project: Path, cpu: str) -> Path:
    """What a real run on this CPU leaves behind: the wheel folder setup.sh plans to build into, with a wheel and
    the CPU's flags, and the same flags recorded in the venv, as after installing that wheel."""
    _, line = plan(project, cpu)
    m = re.fullmatch(r"plan: build llama-cpp-python 0\.3\.36 into (\.wheels/llama-[0-9a-f]{12}-[0-9a-f]{8})", line)
    assert m, line
    wheels = project / m[1]
    wheels.mkdir(parents=True)
    (wheels / WHEEL).write_bytes(b"not a real wheel")
    (wheels / "cpu-flags").write_text(flags_file(cpu))
    (project / ".venv" / "llama-cpp-cpu-flags").write_text(flags_file(cpu))
    (project / ".venv" / "llama-cpp-wheel").write_text(m[1] + "\n")
    return wheels


def test_same_cpu_reuses_the_venv_and_the_wheel(project):
    wheels = built(project, CPU_A)
    # the flags in another order (another processor's line, say) are the same CPU
    assert plan(project, " ".join(reversed(CPU_A.split()))) == ("", "plan: reuse llama.cpp installed in .venv")
    # flags the kernel adds (mitigations, timers), which a kernel update or another VM host changes, are no other CPU
    assert plan(project, "fpu vme constant_tsc md_clear ibrs " + CPU_A) == (
        "", "plan: reuse llama.cpp installed in .venv")
    # a new venv (no llama.cpp in it yet) installs the wheel built on this CPU, without a word
    (project / ".venv" / "llama-cpp-cpu-flags").unlink()
    shutil.rmtree(next((project / ".venv" / "lib").glob("python*/site-packages/llama_cpp_python-*.dist-info")))
    assert plan(project, CPU_A) == ("", f"plan: install wheel {wheels.relative_to(project)}/{WHEEL}")


def test_another_cpu_rebuilds_and_names_the_flags(project):
    wheels_a = built(project, CPU_A)  # the project folder was made on CPU A and copied to B
    msgs, line = plan(project, CPU_B)
    assert (
        "llama.cpp in .venv was built for another CPU (this one lacks: amx_bf16 amx_int8 avx512_bf16 avx512_vnni "
        "avx512bw ...; has extra: sha_ni): replacing it"
    ) in msgs.splitlines()
    assert (
        f"the llama.cpp wheel in {wheels_a.relative_to(project)} was built for another CPU (this one lacks: "
        "amx_bf16 amx_int8 avx512_bf16 avx512_vnni avx512bw ...; has extra: sha_ni): building one for this CPU"
    ) in msgs.splitlines()
    # B's wheel goes into a folder of its own, next to A's
    m = re.fullmatch(r"plan: build llama-cpp-python 0\.3\.36 into (\.wheels/llama-[0-9a-f]{12}-[0-9a-f]{8})", line)
    assert m and m[1] != str(wheels_a.relative_to(project)), line
    assert m[1].split("-")[1] == wheels_a.name.split("-")[1]  # the same CMake arguments


def test_wheels_for_two_cpus_side_by_side(project):
    built(project, CPU_B)
    wheels_a = built(project, CPU_A)  # and the venv now records A
    msgs, line = plan(project, CPU_B)
    assert msgs == (
        "llama.cpp in .venv was built for another CPU (this one lacks: amx_bf16 amx_int8 avx512_bf16 avx512_vnni "
        "avx512bw ...; has extra: sha_ni): replacing it"
    )
    assert line.startswith("plan: install wheel .wheels/llama-") and str(wheels_a.relative_to(project)) not in line
    # only the flags that differ are named, and all of them when they are few
    (project / ".venv" / "llama-cpp-cpu-flags").write_text(flags_file(CPU_B + " avx512f"))
    assert plan(project, CPU_B)[0] == (
        "llama.cpp in .venv was built for another CPU (this one lacks: avx512f): replacing it"
    )


def test_a_wheel_recording_another_cpu_is_rebuilt(project):
    wheels = built(project, CPU_A)
    (wheels / "cpu-flags").write_text(flags_file(CPU_A.replace("amx_int8", "")))  # copied by hand, say
    msgs, line = plan(project, CPU_A)
    assert msgs == ""  # the venv is A's, and kept
    assert line == "plan: reuse llama.cpp installed in .venv"
    (project / ".venv" / "llama-cpp-cpu-flags").unlink()
    shutil.rmtree(next((project / ".venv" / "lib").glob("python*/site-packages/llama_cpp_python-*.dist-info")))
    msgs, line = plan(project, CPU_A)
    assert msgs == (
        f"the llama.cpp wheel in {wheels.relative_to(project)} was built for another CPU (this one has extra: "
        "amx_int8): rebuilding"
    )
    assert line == f"plan: build llama-cpp-python 0.3.36 into {wheels.relative_to(project)}"


def test_no_recorded_flags_rebuilds_once(project):
    """What an older setup.sh left: a wheel in .wheels/llama-<hash of CMake args>/ and a venv, neither recording
    flags. The wheel is not used (its CPU is unknown) and the venv's llama.cpp is replaced."""
    wheels = built(project, CPU_A)
    legacy = project / ".wheels" / wheels.name.rsplit("-", 1)[0]
    wheels.rename(legacy)
    (legacy / "cpu-flags").unlink()
    (project / ".venv" / "llama-cpp-cpu-flags").unlink()
    msgs, line = plan(project, CPU_A)
    assert msgs.splitlines() == [
        "llama.cpp in .venv has no recorded CPU flags (installed by an older setup.sh): replacing it",
        f"the llama.cpp wheel in {legacy.relative_to(project)} has no recorded CPU flags (made by an older "
        "setup.sh): building one for this CPU",
    ]
    assert line == f"plan: build llama-cpp-python 0.3.36 into {wheels.relative_to(project)}"
    # a wheel in the right folder but without its flags (a build cut short) is not trusted either
    wheels.mkdir()
    (wheels / WHEEL).write_bytes(b"not a real wheel")
    msgs, line = plan(project, CPU_A)
    assert msgs.splitlines()[-1] == (
        f"the llama.cpp wheel in {wheels.relative_to(project)} has no recorded CPU flags: rebuilding"
    )
    assert line == f"plan: build llama-cpp-python 0.3.36 into {wheels.relative_to(project)}"


def test_the_old_checks_still_apply(project):
    """Flags that match keep llama.cpp only if it is also built with llamafile as asked (on unless CMAKE_ARGS turns
    it off) and with RPC, as before."""
    wheels = built(project, CPU_A)
    init = next((project / ".venv" / "lib").glob("python*/site-packages/llama_cpp/__init__.py"))
    init.write_text(init.read_text().replace("LLAMAFILE = 1 | ", ""))
    assert plan(project, CPU_A) == ("", f"plan: install wheel {wheels.relative_to(project)}/{WHEEL}")
    # a venv records the wheel folder (CMake arguments, kernels) it was installed from: say it was built without
    said, line = plan(project, CPU_A, "-DGGML_LLAMAFILE=OFF")
    assert said == "llama.cpp in .venv was built with other CMake arguments or kernels: replacing it"
    (project / ".venv" / "llama-cpp-wheel").write_text(line.rsplit(" ", 1)[1] + "\n")
    assert plan(project, CPU_A, "-DGGML_LLAMAFILE=OFF") == ("", "plan: reuse llama.cpp installed in .venv")
    last_on = plan(project, CPU_A, "-DGGML_LLAMAFILE=off -DGGML_LLAMAFILE=ON")  # the last one counts
    assert last_on[1] != "plan: reuse llama.cpp installed in .venv"
