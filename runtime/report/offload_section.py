"""The report's offloading section (storage.offload=cpu|ssd): bytes moved into each tier and read from or written
to the SSD store per step, bytes each tier holds, the LFU cache's hit rate and the time compute waited for fetches.
The numbers are rank 0's offloaded experts (metrics.jsonl's offload/* fields)."""

from __future__ import annotations

from runtime.report.charts import Line, VMark, line_chart
from runtime.report.page import Page
from runtime.report.run_data import RunData

MOVED = {"offload/device_in_bytes": "into device", "offload/host_in_bytes": "into host (CPU cache)",
         "offload/ssd_in_bytes": "into SSD tier", "offload/ssd_read_bytes": "read from SSD store",
         "offload/ssd_write_bytes": "written to SSD store"}
HELD = {"offload/device_used_bytes": "device", "offload/host_used_bytes": "host (CPU cache)",
        "offload/ssd_used_bytes": "SSD"}


def _lines(run: RunData, names: dict[str, str]) -> list[Line]:
    return [Line(label, *run.series(key)) for key, label in names.items() if run.has(key)]


def add_offload(page: Page, run: RunData, marks: list[VMark]) -> None:
    if not any(k.startswith("offload/") for s in run.steps for k in s):
        return
    sec = page.section("offload", "Offloaded experts")
    moved = _lines(run, MOVED)
    if moved:
        sec.figure("fig-offload-bytes", line_chart("Bytes moved per step, per tier", moved, "bytes per step",
                                                   marks=marks, byte_axis=True),
                   "bytes moved per step into each tier and to and from the SSD store",
                   "Rank 0's experts: what each step moved into each tier, and the SSD store's reads and writes.")
    held = _lines(run, HELD)
    if held:
        sec.figure("fig-offload-held", line_chart("Bytes held per tier", held, "bytes", marks=marks,
                                                  byte_axis=True),
                   "bytes held in each tier over steps", "Rank 0's expert states in each tier at the end of a step.")
    if run.has("offload/cache_hit_rate"):
        lines = [Line("hit rate", *run.series("offload/cache_hit_rate"))]
        sec.figure("fig-cache-hit-rate", line_chart("CPU cache hit rate (Algorithm 2)", lines, "hits / requests",
                                                    marks=marks),
                   "expert cache hit rate over steps", "Share of expert requests the LFU CPU cache served.")
    if run.has("offload/fetch_stall_s"):
        steps, stall = run.series("offload/fetch_stall_s")
        sec.figure("fig-fetch-stall", line_chart("Fetch stall", [Line("stall", steps, [s * 1e3 for s in stall])],
                                                 "ms per step", marks=marks),
                   "time compute waited for expert fetches per step",
                   "Time the forward pass waited for experts still being fetched.")
