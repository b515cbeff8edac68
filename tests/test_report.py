"""report.html: one self-contained page per run, checked as a file and, where Chromium is installed (always in
CI: .ci/run installs it), in a real headless browser: every image loads and the table has a row per engine."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINES = ["vllm", "sglang", "tgi"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    r = subprocess.run([sys.executable, "-m", "simengine", "run", "prefix_heavy_rag", "--engines", ",".join(ENGINES),
                        "--set", "horizon_s=15", "--set", "name=rag", "--out", str(root / "results"),
                        "--plots", str(root / "plots")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return root


def test_every_run_writes_a_self_contained_report(run):
    html = (run / "results" / "rag" / "report.html").read_text()
    rows = re.findall(r"<tr><td>([^<]+)</td>", html.split('id="side-by-side"')[1].split("</table>")[0])
    assert rows == ENGINES                       # the scenario's order
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(images) == 1 + 2 * len(ENGINES)
    assert all(base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n" for data in images)
    assert "src=\"http" not in html and "<script" not in html      # nothing fetched, nothing run
    assert "What the runs show" in html and "prefix hit rate" in html
    assert "shared_prefix_tokens" in html                          # the resolved configuration
    validated = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td>", html.split('id="accuracy"')[1].split("</table>")[0])
    assert {e for e, _ in validated} == set(ENGINES) and ("vllm", "TTFT") in validated   # the error on measurements


def test_report_command_remakes_it_and_refuses_a_wrong_folder(run, tmp_path):
    page = run / "results" / "rag" / "report.html"
    page.unlink()
    r = subprocess.run([sys.executable, "-m", "simengine", "report", str(run / "results" / "rag"), "--plots",
                        str(run / "plots" / "rag")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert page.exists() and page.read_text().count("data:image/png") == 1 + 2 * len(ENGINES)
    bad = subprocess.run([sys.executable, "-m", "simengine", "report", str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "DIR" in bad.stderr


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None and os.environ.get("SIMENGINE_CI") == "1":
        pytest.fail("CI must test the report in Chromium: .ci/run installs it")
    return found


CHECK = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const div = document.createElement("div");
  div.id = "check";
  div.textContent = `images=${imgs.length} loaded=${imgs.filter(i => i.complete && i.naturalWidth > 0).length} ` +
                    `rows=${document.querySelectorAll("#side-by-side tbody tr").length}`;
  document.body.appendChild(div);
});
</script>"""


def test_the_report_renders_in_a_headless_browser(run, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium here (CI installs it)")
    page = (run / "results" / "rag" / "report.html").read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", CHECK + "</body>"))   # the check runs in a copy; the report has no JS
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tempfile.mkdtemp()}", "--window-size=1400,3000"]
    dom = subprocess.run([*flags, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()], capture_output=True,
                         text=True, timeout=120).stdout
    found = re.search(r'<div id="check">images=(\d+) loaded=(\d+) rows=(\d+)</div>', dom)
    assert found, dom[-2000:]
    images, loaded, rows = map(int, found.groups())
    assert images == loaded == 1 + 2 * len(ENGINES) and rows == len(ENGINES)
    shot = tmp_path / "report.png"
    subprocess.run([*flags, f"--screenshot={shot}", (run / "results" / "rag" / "report.html").as_uri()],
                   capture_output=True, timeout=120)
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
