"""The wheel as users install it: built from this tree, installed into a fresh virtual environment,
imported from there (not from the source tree), and its CPU kernels built from the installed sources."""

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]

pytestmark = pytest.mark.slow

CHECK = textwrap.dedent("""
    import json, sys, torch
    import toolkit
    # One import package: every room is under toolkit., nothing of ours at the top of site-packages.
    from toolkit.attention import paged_attention
    from toolkit.scheduling import Scheduler
    from toolkit.speculative import RejectionSampler
    from toolkit.parallel import setup_parallel
    from toolkit.moe import moe_experts
    from toolkit.parallel.expert_parallel import ExpertParallel
    from toolkit.cli.main import app
    from toolkit.backends.cpu import build, kernels
    assert "site-packages" in toolkit.__file__, toolkit.__file__
    unavailable = kernels.load()
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    panels = torch.empty(2, 40, 16)
    torch.ops.toolkit.pack_panels(w, panels)
    y = torch.ops.toolkit.linear_cpu(x, panels, None, None, 24, 1 << 62)
    print(json.dumps({"toolkit": toolkit.__file__, "unavailable": unavailable,
                      "sources": [str(p) for p in kernels.SOURCES.values()],
                      "error": (y - x @ w.T).abs().max().item()}))
""")


def source_copy(tmp_path: Path) -> Path:
    # A copy of the tree without build outputs: setuptools would reuse a stale build/ in place.
    skip = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")
    return Path(shutil.copytree(REPO, tmp_path / "src", ignore=lambda folder, names: skip(folder, names) | (
        {n for n in names if n.startswith("out")} if Path(folder) == REPO else set())))


def test_the_wheel_builds_without_warnings_and_ships_every_data_file(tmp_path):
    """`make run` installs the package: a data folder missing from `packages` gave a "Package would be
    ignored" warning block each (toolkit.default_model.draft among them)."""
    import zipfile

    source = source_copy(tmp_path)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    output = built.stdout + built.stderr
    assert "would be ignored" not in output and "absent from the `packages`" not in output, output[-5000:]
    (wheel,) = (tmp_path / "dist").glob("toolkit-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    data = [p for folder in ("toolkit/default_model", "toolkit/backends/cpu/csrc")
            for p in (REPO / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert data and {str(p.relative_to(REPO)) for p in data} <= shipped


def test_installed_wheel_ships_and_builds_its_kernels(tmp_path):
    source = source_copy(tmp_path)
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("toolkit-*.whl")
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    # torch and the other dependencies come from the test's environment, after the fresh one's own
    # site-packages (a path listed in a .pth file: that environment's editable install is not seen).
    fresh_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                                "--target", str(fresh_site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    run = subprocess.run([str(python), "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "TOOLKIT_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["toolkit"].startswith(str(fresh_site)), report
    assert report["unavailable"] == {}, report["unavailable"]
    assert all(source.startswith(str(fresh_site)) for source in report["sources"])
    assert report["error"] < 1e-4
    # bin/ holds the `toolkit` console script that pip --target writes.
    tops = {p.name for p in fresh_site.iterdir()} - {"deps.pth", "__pycache__", "bin"}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"toolkit"}, tops
