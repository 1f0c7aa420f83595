//! The one-GPU profiles' copies against a timeline recorded on a GPU: the H100 bench of
//! 6581ea8 drew gemm_rs `ring_accumulate` at D = 8 with an event around every op
//! (docs/gpu-runs/2026-11-26-h100/, each op's start and end in its SVG's titles), its copies
//! left to the driver. Beside the GEMMs those copies moved, all together, the share of the
//! driver's one rate that the calibration pair gives a copy beside compute: neither
//! constant was set from this timeline, which is why it can test how they combine.

use cmm_sim::Profile;

/// One op of the timeline: its title's first word, its text, start and end in µs.
struct TimedOp {
    kind: String,
    text: String,
    start_us: f64,
    end_us: f64,
}

/// Every op of a timeline SVG, from titles of the form `copy … — 141.15..344.86 µs (203.71 µs)`.
fn timed_ops(svg: &str) -> Vec<TimedOp> {
    svg.split("<title>")
        .skip(1)
        .filter_map(|rest| {
            let title = &rest[..rest.find("</title>")?];
            let (text, times) = title.rsplit_once(" — ")?;
            let (span, _) = times.split_once(" µs")?;
            let (start, end) = span.split_once("..")?;
            let kind = text.split_whitespace().next()?.to_string();
            Some(TimedOp { kind, text: text.to_string(), start_us: start.parse().ok()?, end_us: end.parse().ok()? })
        })
        .collect()
}

/// Rows of a copy's source, from `copy send[0..1024] -> …`.
fn rows_of(text: &str) -> usize {
    let (_, rest) = text.split_once('[').expect("a copy names its rows");
    let (span, _) = rest.split_once(']').expect("a closed range");
    let (a, b) = span.split_once("..").expect("a range");
    b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap()
}

/// Microseconds in which at least one of `ops` ran, and of those, in which one of `beside` ran too.
fn busy_us(ops: &[&TimedOp], beside: &[&TimedOp]) -> (f64, f64) {
    let end = ops.iter().map(|o| o.end_us).fold(0.0, f64::max);
    let step = 0.05;
    let (mut busy, mut both) = (0.0, 0.0);
    let mut t = 0.0;
    while t < end {
        if ops.iter().any(|o| o.start_us <= t && t < o.end_us) {
            busy += step;
            if beside.iter().any(|o| o.start_us <= t && t < o.end_us) {
                both += step;
            }
        }
        t += step;
    }
    (busy, both)
}

#[test]
fn the_drivers_copies_beside_gemms_move_the_share_of_its_rate_the_calibration_gives() {
    let path =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/gpu-runs/2026-11-26-h100/gemm_rs-ring_accumulate-d8-plain.svg");
    let svg = std::fs::read_to_string(path).unwrap();
    assert!(svg.contains("gemm_rs/ring_accumulate D=8 M=8192 N=4096 K=32768 plain on NVIDIA H100"), "{path}");
    let ops = timed_ops(&svg);
    let copies: Vec<&TimedOp> = ops.iter().filter(|o| o.kind == "copy").collect();
    let gemms: Vec<&TimedOp> = ops.iter().filter(|o| o.kind == "gemm").collect();
    assert_eq!((copies.len(), gemms.len()), (56, 64), "{path}");
    // Each copy is a block of f32 partial sums, N = 4096 columns.
    let bytes: f64 = copies.iter().map(|c| (rows_of(&c.text) * 4096 * 4) as f64).sum();
    let (busy, beside_gemms) = busy_us(&copies, &gemms);
    assert!(beside_gemms > 0.99 * busy, "the copies ran beside GEMMs: {beside_gemms} of {busy} µs");
    let measured_gbps = bytes / busy / 1e3;
    let profile = Profile::load("h100-one-gpu").unwrap();
    let driver = profile.copy.driver_gbps.unwrap();
    let modelled_gbps = driver * profile.copy.rate_beside_compute;
    // 229 GB/s in all, 0.29 of the driver's 782; the model's 0.30 of it, 235.
    assert!((modelled_gbps / measured_gbps - 1.0).abs() < 0.05, "{measured_gbps} GB/s against {modelled_gbps}");
    // Each copy alone would have taken 22 µs; they took 176 to 258.
    let shortest = copies.iter().map(|c| c.end_us - c.start_us).fold(f64::INFINITY, f64::min);
    assert!(shortest > 5.0 * (1024 * 4096 * 4) as f64 / driver / 1e3, "{shortest}");
}
