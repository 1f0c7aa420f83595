//! Timelines of plan runs, simulated or measured: one track per (device, lane), one span
//! per op. Written as Chrome/Perfetto trace JSON or as a hand-written SVG Gantt chart.

use cmm_core::names;
use std::fmt::Write as _;

use serde_json::json;

use crate::{OpClass, SimReport};
use cmm_core::plan::{Op, Plan};

/// What a span shows (its colour).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpanKind {
    /// A GEMM.
    Gemm,
    /// A copy to a peer.
    Copy,
    /// A copy within the device.
    LocalCopy,
    /// A reduction.
    Reduce,
    /// A semaphore increment on its way.
    Signal,
    /// The synchronisation cost of a satisfied Wait.
    Sync,
    /// A Wait blocked on its semaphore.
    Blocked,
}

// In legend order; the names are the trace categories.
names!(SpanKind, "span kind", {
    Gemm => "gemm",
    Copy => "copy",
    LocalCopy => "local copy",
    Reduce => "reduce",
    Signal => "signal",
    Sync => "sync",
    Blocked => "blocked",
});

impl SpanKind {
    fn colour(self) -> &'static str {
        match self {
            SpanKind::Gemm => "#4e79a7",
            SpanKind::Copy => "#f28e2b",
            SpanKind::LocalCopy => "#edc948",
            SpanKind::Reduce => "#59a14f",
            SpanKind::Signal => "#e15759",
            SpanKind::Sync => "#b07aa1",
            SpanKind::Blocked => "#d9d9d9",
        }
    }

    /// The kind of a plan op (a Wait counts as its sync cost).
    pub fn of_op(op: &Op, device: usize) -> SpanKind {
        match op {
            Op::Gemm { .. } | Op::Attend { .. } | Op::GroupedGemm { .. } => SpanKind::Gemm,
            Op::Copy { dst_device, .. } if *dst_device == device => SpanKind::LocalCopy,
            Op::Copy { .. } => SpanKind::Copy,
            Op::Reduce { .. }
            | Op::Pointwise { .. }
            | Op::AttnMerge { .. }
            | Op::AttnFinish { .. }
            | Op::Route { .. }
            | Op::Combine { .. } => SpanKind::Reduce,
            Op::Signal { .. } => SpanKind::Signal,
            Op::Wait { .. } => SpanKind::Sync,
        }
    }
}

/// One row of the chart: a lane of a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Track {
    /// Device.
    pub device: usize,
    /// Lane name.
    pub lane: String,
}

/// One op (or part of one) on a track.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// Index into [`Timeline::tracks`].
    pub track: usize,
    /// Start, µs.
    pub start_us: f64,
    /// Duration, µs.
    pub dur_us: f64,
    /// Kind.
    pub kind: SpanKind,
    /// The op's text.
    pub label: String,
}

/// A set of tracks and spans.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Shown above the chart.
    pub title: String,
    /// Rows, device by device, lane by lane.
    pub tracks: Vec<Track>,
    /// Spans in any order.
    pub spans: Vec<Span>,
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

impl Timeline {
    /// Empty tracks for every (device, lane) of a plan.
    pub fn for_plan(plan: &Plan, title: impl Into<String>) -> Timeline {
        let tracks = (0..plan.devices)
            .flat_map(|device| plan.lanes.iter().map(move |lane| Track { device, lane: lane.clone() }))
            .collect();
        Timeline { title: title.into(), tracks, spans: Vec::new() }
    }

    /// The track of `(device, lane index)` in a timeline made by [`Timeline::for_plan`].
    pub fn track_of(plan: &Plan, device: usize, lane: usize) -> usize {
        device * plan.lanes.len() + lane
    }

    /// The timeline of a simulation: blocked Waits in grey, then their sync cost.
    pub fn from_simulation(plan: &Plan, report: &SimReport) -> Timeline {
        let title = format!("{} on {} (simulated): {:.1} µs", plan.name, report.profile, report.makespan_s * 1e6);
        let mut t = Timeline::for_plan(plan, title);
        for r in report.ops() {
            let op = &plan.programs[r.site.device].lanes[r.site.lane][r.site.index];
            let track = Timeline::track_of(plan, r.site.device, r.site.lane);
            let label = plan.op_text(op);
            if r.class == OpClass::Wait && r.start_s > r.reached_s {
                t.spans.push(Span {
                    track,
                    start_us: r.reached_s * 1e6,
                    dur_us: (r.start_s - r.reached_s) * 1e6,
                    kind: SpanKind::Blocked,
                    label: format!("{label} (blocked)"),
                });
            }
            if r.end_s > r.start_s {
                t.spans.push(Span {
                    track,
                    start_us: r.start_s * 1e6,
                    dur_us: (r.end_s - r.start_s) * 1e6,
                    kind: SpanKind::of_op(op, r.site.device),
                    label,
                });
            }
        }
        t
    }

    /// The timeline of a measured run: `(site, start µs, duration µs)` per executed op.
    pub fn from_measured(
        plan: &Plan,
        title: impl Into<String>,
        ops: &[(cmm_core::plan::OpSite, f64, f64)],
    ) -> Timeline {
        let mut t = Timeline::for_plan(plan, title);
        for &(site, start_us, dur_us) in ops {
            let op = &plan.programs[site.device].lanes[site.lane][site.index];
            t.spans.push(Span {
                track: Timeline::track_of(plan, site.device, site.lane),
                start_us,
                dur_us,
                kind: SpanKind::of_op(op, site.device),
                label: plan.op_text(op),
            });
        }
        t
    }

    /// End of the last span, µs.
    pub fn end_us(&self) -> f64 {
        self.spans.iter().map(|s| s.start_us + s.dur_us).fold(0.0, f64::max)
    }

    /// Chrome trace event JSON (open in Perfetto or chrome://tracing): one process per
    /// device, one thread per lane, one complete event per span.
    pub fn chrome_trace_json(&self) -> String {
        let mut events = Vec::new();
        let mut devices: Vec<usize> = self.tracks.iter().map(|t| t.device).collect();
        devices.dedup();
        for d in devices {
            events.push(json!({
                "name": "process_name", "ph": "M", "pid": d, "tid": 0, "args": { "name": format!("device {d}") },
            }));
        }
        for (i, t) in self.tracks.iter().enumerate() {
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": t.device, "tid": i, "args": { "name": t.lane },
            }));
        }
        for s in &self.spans {
            let t = &self.tracks[s.track];
            events.push(json!({
                "name": s.label, "cat": s.kind.name(), "ph": "X", "ts": s.start_us, "dur": s.dur_us,
                "pid": t.device, "tid": s.track,
            }));
        }
        let trace = json!({ "displayTimeUnit": "ns", "otherData": { "title": self.title }, "traceEvents": events });
        format!("{trace}\n")
    }

    /// A Gantt chart: lanes as rows, ops coloured by kind, a time axis in µs, a legend.
    /// Every span has a tooltip with its op and times.
    pub fn svg(&self) -> String {
        const LABEL_W: f64 = 150.0;
        const PLOT_W: f64 = 900.0;
        const ROW_H: f64 = 18.0;
        const TOP: f64 = 40.0;
        let end = self.end_us().max(1e-9);
        let rows = self.tracks.len() as f64;
        let axis_y = TOP + rows * ROW_H + 4.0;
        let height = axis_y + 56.0;
        let width = LABEL_W + PLOT_W + 20.0;
        let x = |us: f64| LABEL_W + us / end * PLOT_W;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="11">"#
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ =
            writeln!(s, r#"<text x="8" y="18" font-size="13" font-weight="bold">{}</text>"#, xml_escape(&self.title));
        for (i, t) in self.tracks.iter().enumerate() {
            let y = TOP + i as f64 * ROW_H;
            if t.device % 2 == 1 {
                let _ = writeln!(s, r##"<rect x="0" y="{y:.1}" width="{width:.0}" height="{ROW_H}" fill="#f4f6f8"/>"##);
            }
            let _ =
                writeln!(s, r#"<text x="8" y="{:.1}">dev{} {}</text>"#, y + ROW_H * 0.7, t.device, xml_escape(&t.lane));
        }
        for sp in &self.spans {
            let y = TOP + sp.track as f64 * ROW_H + 2.0;
            let w = (sp.dur_us / end * PLOT_W).max(0.6);
            let _ = writeln!(
                s,
                r#"<rect x="{:.2}" y="{y:.1}" width="{w:.2}" height="{:.1}" fill="{}" stroke="white" stroke-width="0.4"><title>{} — {:.2}..{:.2} µs ({:.2} µs)</title></rect>"#,
                x(sp.start_us),
                ROW_H - 4.0,
                sp.kind.colour(),
                xml_escape(&sp.label),
                sp.start_us,
                sp.start_us + sp.dur_us,
                sp.dur_us
            );
        }
        // Time axis with about 8 round ticks.
        let raw = end / 8.0;
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|&v| v >= raw).unwrap_or(10.0 * mag);
        let _ = writeln!(
            s,
            r##"<line x1="{LABEL_W}" y1="{axis_y:.1}" x2="{:.1}" y2="{axis_y:.1}" stroke="#333"/>"##,
            LABEL_W + PLOT_W
        );
        let mut tick = 0.0;
        while tick <= end * (1.0 + 1e-9) {
            let tx = x(tick);
            let _ = writeln!(
                s,
                r##"<line x1="{tx:.1}" y1="{TOP}" x2="{tx:.1}" y2="{:.1}" stroke="#ccc" stroke-width="0.5"/><text x="{tx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                axis_y + 4.0,
                axis_y + 16.0,
                format_tick(tick)
            );
            tick += step;
        }
        let _ =
            writeln!(s, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">µs</text>"#, LABEL_W + PLOT_W, axis_y + 30.0);
        let mut lx = LABEL_W;
        let ly = axis_y + 42.0;
        for k in SpanKind::ALL {
            if self.spans.iter().any(|sp| sp.kind == k) {
                let _ = writeln!(
                    s,
                    r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="10" fill="{}"/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
                    ly - 9.0,
                    k.colour(),
                    lx + 16.0,
                    k.name()
                );
                lx += 30.0 + 7.0 * k.name().len() as f64;
            }
        }
        s.push_str("</svg>\n");
        s
    }
}

fn format_tick(us: f64) -> String {
    if us == 0.0 || us >= 10.0 {
        format!("{us:.0}")
    } else if us >= 1.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Timeline {
        Timeline {
            title: "t <1>".into(),
            tracks: vec![Track { device: 0, lane: "compute".into() }, Track { device: 1, lane: "comm \"x\"".into() }],
            spans: vec![
                Span { track: 0, start_us: 0.0, dur_us: 10.0, kind: SpanKind::Gemm, label: "gemm a".into() },
                Span { track: 1, start_us: 2.0, dur_us: 5.0, kind: SpanKind::Copy, label: "copy & go".into() },
            ],
        }
    }

    #[test]
    fn chrome_trace_has_names_and_complete_events() {
        let j = sample().chrome_trace_json();
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(complete.len(), 2, "{j}");
        assert_eq!((complete[1]["ts"].as_f64(), complete[1]["dur"].as_f64()), (Some(2.0), Some(5.0)));
        assert!(events.iter().any(|e| e["args"]["name"] == "comm \"x\""), "lane names survive: {j}");
        assert_eq!(v["otherData"]["title"], "t <1>");
    }

    #[test]
    fn svg_has_one_rect_per_span_and_escapes_text() {
        let s = sample().svg();
        assert_eq!(s.matches("<title>").count(), 2);
        assert!(s.contains("copy &amp; go") && s.contains("t &lt;1&gt;"), "{s}");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
    }
}
