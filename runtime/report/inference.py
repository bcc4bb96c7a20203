"""The report of one `moesys infer --json` result: speed and memory, where each MoE layer's experts were (the
per-layer policy), the bytes a token read and copied, and the copy/compute timeline of the last decoded token
(the result's `timeline`: spans in seconds from the start of that token's forward)."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.errors import UserError
from runtime.host.io import atomic_write_text
from runtime.report.charts import categories_strip, grouped_bars, human_bytes, timeline
from runtime.report.page import Page

REQUIRED = ("placement", "decode_tokens_per_s", "store_bytes_per_token")
PER_TOKEN = {"store_bytes_per_token": "store read", "disk_read_bytes_per_token": "from disk",
             "page_cache_bytes_per_token": "from page cache", "copied_bytes_per_token": "copied to device"}


NUMBERS = ("decode_tokens_per_s", "store_bytes_per_token", "prefill_tokens_per_s", "peak_rss_anon_bytes",
           "copy_hidden_share", "copy_s", *PER_TOKEN)
"""Fields drawn as numbers; each may be absent or null except the REQUIRED ones."""


def is_inference_result(data: object) -> bool:
    return isinstance(data, dict) and all(k in data for k in REQUIRED)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _spans(value: object) -> bool:
    """A timeline kind's spans: [[start, end], ...] in seconds."""
    return isinstance(value, list) and all(isinstance(s, list) and len(s) == 2 and all(map(_number, s))
                                           for s in value)


def check_inference_result(r: dict, source: str) -> None:
    """A UserError naming the first field whose type is not what `moesys infer --json` writes."""
    def bad(key: str, want: str) -> UserError:
        return UserError(f"{source or 'the input'}: field {key!r} is {json.dumps(r[key])[:40]}, not {want}; "
                         "pass the unmodified output of moesys infer --json")

    for key in NUMBERS:
        if (r.get(key) is not None and not _number(r[key])) or (key in REQUIRED[1:] and r[key] is None):
            raise bad(key, "a number")
    if not isinstance(r["placement"], list):
        raise bad("placement", "a list of per-layer policies")
    for key, kind in (("peak_bytes", dict), ("experts_computed", dict), ("timeline", dict)):
        if r.get(key) is not None and not isinstance(r[key], kind):
            raise bad(key, "an object")
    if any(not _spans(v) for v in (r.get("timeline") or {}).values()):
        raise bad("timeline", "lists of [start, end] spans")
    device = (r.get("peak_bytes") or {}).get("device")
    if device is not None and not (isinstance(device, dict) and all(map(_number, device.values()))):
        raise bad("peak_bytes", "byte counts per device part")


def _summary(page: Page, r: dict) -> None:
    sec = page.section("summary", "Summary")
    dev = (r.get("peak_bytes") or {}).get("device") or {}
    hidden = r.get("copy_hidden_share")
    budget = f"K={r['ring_slots']} of N={r.get('moe_layers')} MoE layers" if r.get("ring_slots") else \
        f"N={r.get('moe_layers')} MoE layers"
    rows = [("checkpoint", f"{r.get('checkpoint', '-')} ({r.get('kind', '?')})"), ("device", r.get("device", "-")),
            ("offload", f"{r.get('offload', '-')}, {budget}"),
            ("prefill", f"{r.get('prefill_tokens_per_s', 0):.1f} tokens/s ({r.get('prefill_tokens', 0)} tokens)"),
            ("decode", f"{r['decode_tokens_per_s']:.1f} tokens/s ({r.get('decode_tokens', 0)} tokens)")]
    if dev:
        rows.append(("device peak", f"{human_bytes(dev.get('total', 0))} (dense {human_bytes(dev.get('dense', 0))}, "
                                    f"experts {human_bytes(dev.get('experts', 0))}, KV cache "
                                    f"{human_bytes(dev.get('kv_cache', 0))})"))
    if "peak_rss_anon_bytes" in r:
        rows.append(("process memory peak", f"{human_bytes(r['peak_rss_anon_bytes'])} anonymous"))
    rows.append(("copy time hidden", "no copies" if hidden is None else
                 f"{100 * hidden:.0f}% of {1e3 * r.get('copy_s', 0):.1f} ms"))
    for name, count in (r.get("experts_computed") or {}).items():
        rows.append((name.replace("_", " "), count))
    sec.table("summary-table", (), rows)


def inference_page(r: dict, title: str) -> Page:
    page = Page(title, f"moesys infer --offload {r.get('offload', '?')} on {r.get('device', '?')}: "
                       f"{r['decode_tokens_per_s']:.1f} decode tokens/s")
    _summary(page, r)
    sec = page.section("placement", "Experts per MoE layer")
    layers = [str(p) for p in r["placement"]]
    if layers:
        sec.figure("fig-placement", categories_strip("Policy per MoE layer", layers),
                   "policy of each MoE layer's experts",
                   "resident: on the device; ring/ondemand: streamed through device slots; inplace: computed where "
                   "they lie (mapped file); hybrid: computed on the CPU or fetched, per expert.")
        sec.table("placement-table", ("MoE layer", "policy"), list(enumerate(layers)))
    sec = page.section("bytes", "Bytes per token")
    names = [k for k in PER_TOKEN if isinstance(r.get(k), (int, float))]
    sec.figure("fig-bytes-per-token", grouped_bars("Bytes per generated token", [PER_TOKEN[k] for k in names],
                                                   {"bytes/token": [r[k] for k in names]}, "bytes", byte_axis=True),
               "bytes read and copied per generated token",
               "Expert-store bytes a token read (split into disk reads and page-cache hits) and bytes copied to "
               "device slots.")
    sec = page.section("timeline", "Copy/compute timeline of one token")
    spans = r.get("timeline") or {}
    if spans.get("compute"):
        copies, waits = spans.get("copy") or [], spans.get("wait") or []
        sec.figure("fig-timeline", timeline("Last decoded token", spans), "copy and compute timeline of one token",
                   f"The last decoded token's forward ({1e3 * (spans['compute'][-1][1] - spans['compute'][-1][0]):.2f} "
                   f"ms), {len(copies)} copies overlapping it and {len(waits)} waits of compute for a copy.")
    else:
        sec.note("This result has no timeline (written by a moesys infer without it).")
    page.section("json", "Result").collapsible("result-json", "moesys infer --json", json.dumps(r, indent=2))
    return page


def write_inference_report(result: dict, out: str | Path, source: str = "") -> dict:
    """Write the page of one inference result; the `moesys report --json` summary."""
    if not is_inference_result(result):
        raise UserError(f"{source or 'the input'} is not a moesys infer --json result (it lacks "
                        f"{', '.join(k for k in REQUIRED if k not in (result if isinstance(result, dict) else {}))})")
    check_inference_result(result, source)
    name = Path(source).name if source else Path(str(result.get("checkpoint", "inference"))).name
    page = inference_page(result, f"moesys report: inference of {name}")
    out = Path(out)
    atomic_write_text(out, page.html())
    return {"kind": "inference", "source": source, "out": str(out.resolve()),
            "sections": [s.id for s in page.sections], "figures": page.figure_ids}
