"""`moesys report` and `train.tensorboard=true` on one real tiny run (2 CPU processes, EP 2) that resumed in the
middle: the page has every expected figure and opens in a real headless Chromium (screenshot, no page error); the
TensorBoard event files, read with TensorBoard's own reader, hold the values of metrics.jsonl; `moesys infer
--report` draws the run's inference."""

from __future__ import annotations

import base64
import html
import json
import math
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moesys_cli.app import app
from tests.cli.conftest import FAST_TINY, run_moesys

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
FIRST, LAST = 3, 5
EXPECTED_FIGURES = ["fig-loss", "fig-router-loss", "fig-lr", "fig-grad-norm", "fig-tokens-per-s", "fig-step-time",
                    *(f"fig-expert-load-layer{i}" for i in range(4)), "fig-memory-ram", "fig-memory-plan"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """FIRST steps, then a resume to LAST steps in the same run directory, with TensorBoard event files."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    args = [*FAST_TINY, "train.tensorboard=true", f"train.run_dir={run_dir}", "--json"]
    for steps in (FIRST, LAST):
        done = run_moesys("train", *args, f"train.max_steps={steps}")
        assert done.returncode == 0, done.stderr
    return run_dir


class _Elements(HTMLParser):
    """Every element's tag and attributes, with the id of the figure it sits in."""

    def __init__(self):
        super().__init__()
        self.elements: list[tuple[str, dict, str | None]] = []
        self._figure: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self._figure = attrs.get("id")
        self.elements.append((tag, attrs, self._figure))

    def handle_endtag(self, tag):
        if tag == "figure":
            self._figure = None


def _chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=120)


CHECK = """<script>
window.__errors = [];
addEventListener('error', e => __errors.push(e.message || ('failed: ' + (e.target.src || e.target.tagName))), true);
addEventListener('securitypolicyviolation', e => __errors.push('blocked: ' + e.blockedURI));
const consoleError = console.error;
console.error = (...a) => { __errors.push(a.join(' ')); consoleError(...a); };
addEventListener('load', () => {
  const images = [...document.images];
  const out = {figures: [...document.querySelectorAll('figure[id]')].map(f => f.id), images: images.length,
               broken: images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt), errors: __errors};
  const pre = document.createElement('pre'); pre.id = 'moesys-check'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def test_the_report_of_a_resumed_run_has_every_figure_and_opens_in_chromium(run_dir, tmp_path):
    done = run_moesys("report", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    page = run_dir / "report.html"
    assert summary["out"] == str(page) and summary["status"] == f"finished: step {LAST} of {LAST}"
    assert summary["starts"] == [{"step": FIRST + 1, "resumed_from": FIRST, "restart": 0}]
    assert summary["figures"] == EXPECTED_FIGURES
    text = page.read_text()
    parser = _Elements()
    parser.feed(text)
    images = {fig: attrs for tag, attrs, fig in parser.elements if tag == "img"}
    assert list(images) == EXPECTED_FIGURES
    for fig, attrs in images.items():  # an embedded PNG with a description in every figure
        assert attrs["alt"] and attrs["src"].startswith("data:image/png;base64,"), fig
        assert base64.b64decode(attrs["src"].split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n", fig
    links = [v for _, attrs, _ in parser.elements for k, v in attrs.items() if k in ("src", "href")]
    assert all(v.startswith(("data:", "#")) for v in links)  # nothing to fetch: the page is self-contained
    assert not [tag for tag, _, _ in parser.elements if tag in ("script", "link", "iframe")]
    assert {a.get("id") for tag, a, _ in parser.elements if tag == "details"} == {"config-yaml", "plan-json"}
    assert "resumed from step 3" in text and "tensorboard: true" in text  # the mark and the config

    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (Debian: apt-get install chromium); the page's structure was checked")
    shot = tmp_path / "report.png"
    opened = _chromium(tmp_path / "profile-shot", "--enable-logging=stderr", "--v=0", f"--screenshot={shot}",
                       "--window-size=1100,3000", page.as_uri())
    assert opened.returncode == 0, opened.stderr[-2000:]
    assert not [line for line in opened.stderr.splitlines() if ":CONSOLE" in line]  # the page logged nothing
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1100, 3000)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colours) > 200  # charts, not a blank or error page
    assert max(count for count, _ in colours) < 0.9 * 1100 * 3000

    # The same page with a checking script: every image decoded, every figure there, no error of any kind.
    checked = tmp_path / "checked.html"
    checked.write_text(text.replace("default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';", 1)
                       .replace("<head>", "<head>" + CHECK, 1))
    dom = _chromium(tmp_path / "profile-dom", "--dump-dom", checked.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = re.search(r'<pre id="moesys-check">(.*?)</pre>', dom.stdout, re.S)
    assert found, dom.stdout[-2000:]
    result = json.loads(html.unescape(found.group(1)))
    assert result == {"figures": EXPECTED_FIGURES, "images": len(EXPECTED_FIGURES), "broken": [], "errors": []}


def test_tensorboard_event_files_hold_the_metrics_values(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from runtime.train.tensorboard import scalars

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, LAST + 1))
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    expected_tags = set().union(*(scalars(r) for r in records))
    assert set(tags["scalars"]) == expected_tags
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "z_loss", "gate_entropy/layer3",
                "memory/peak_rss_anon/rank1", "memory_bytes_per_rank/rank0"):
        assert tag in expected_tags, tag
    for tag in expected_tags:
        logged = {e.step: e.value for e in events.Scalars(tag)}
        wanted = {r["step"]: scalars(r)[tag] for r in records if tag in scalars(r)}
        assert logged.keys() == wanted.keys(), tag
        for step, value in wanted.items():  # TensorBoard keeps float32
            assert logged[step] == pytest.approx(value, rel=1e-6) or math.isnan(value) and math.isnan(logged[step])
    assert sorted(tags["histograms"]) == sorted(f"{k}/layer{i}" for k in ("expert_fraction", "expert_load")
                                                for i in range(4))
    for layer in range(4):
        histograms = events.Histograms(f"expert_load/layer{layer}")
        assert [h.step for h in histograms] == list(range(1, LAST + 1))
        for h, record in zip(histograms, records):
            assert list(h.histogram_value.bucket) == record["expert_load"][layer]  # one bucket per expert
            assert list(h.histogram_value.bucket_limit) == [e + 0.5 for e in range(len(record["expert_load"][0]))]


def test_infer_report_draws_the_placement_bytes_and_a_token_timeline(run_dir, tmp_path):
    out = tmp_path / "infer.html"
    done = CliRunner().invoke(app, ["infer", f"checkpoint={run_dir}", "prompt_ids=[1,2,3]", "infer.max_new_tokens=4",
                                    "infer.ring_slots=2", "--offload", "ring", "--report", str(out), "--json"])
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    spans = result["timeline"]
    assert len(spans["compute"]) == 1 and spans["compute"][0][0] == 0.0  # the last token's forward
    assert spans["copy"], "the ring copies layers while the token computes"
    assert all(e > 0 and s < spans["compute"][0][1] for s, e in spans["copy"])
    text = out.read_text()
    for fig in ("fig-placement", "fig-bytes-per-token", "fig-timeline"):
        assert f'<figure id="{fig}"><img src="data:image/png;base64,' in text
    # The saved --json result gives the same page through moesys report FILE.json.
    saved = tmp_path / "result.json"
    saved.write_text(done.stdout)
    again = CliRunner().invoke(app, ["report", str(saved), "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["figures"] == ["fig-placement", "fig-bytes-per-token", "fig-timeline"]
    assert (tmp_path / "result.html").exists()
