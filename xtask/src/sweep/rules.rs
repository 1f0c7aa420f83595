//! The engine's rules set against the sweep's own rows: for each shape the sweep times,
//! whether the choice the rule makes there ran fastest in this run. The rules live in
//! `cmm_core::engines` (the tile rule, and when gathered rows are staged) and in the
//! engine's default epilogue (stores from registers rather than by TMA). Each was set
//! from earlier runs or from arithmetic; these lines say, after a run, which of them the
//! run supports and which it argues against, so that a rule moves with its evidence.

use anyhow::{Context, Result};
use cmm_core::engines::{grouped_engine, hopper_rule, EngineSupport, GemmEngine, GemmFacts, GroupedFacts};
use cmm_core::{DType, MoeOp};
use cmm_cuda::{GemmSpec, HopperTile, HopperVariant};
use serde::Serialize;

use super::{grouped, variant_name, Grouped, Row, STAGED_MARK};

/// Two rates of one run closer than this share count as a tie: the sweep's medians of
/// 20 runs differ by a few tenths of a per cent between kernels that differ only in a
/// flag the GEMM never reads, so 2 % is well past that noise.
pub(super) const TIE: f64 = 0.02;

/// Where a rule was asked in the run: a shape and dtype whose rows are named with
/// `suffix` ("", " dense", " grouped"), the tile the rule takes there, and for a
/// grouped GEMM over gathered rows whether the engine stages them.
#[derive(Clone, Debug)]
pub(super) struct Asked {
    pub shape: String,
    pub input: String,
    pub suffix: &'static str,
    /// The tile rule's choice (`None`: the engine cannot run the shape).
    pub tile: Option<HopperTile>,
    /// Gathered rows: `Some(staged)`, the engine's way, and the tile the rule gives rows
    /// arriving the other way.
    pub gathered: Option<(bool, Option<HopperTile>)>,
}

impl Asked {
    /// A plain GEMM of `spec`'s shape, dense and aligned, whose rows carry `suffix`.
    pub fn plain(shape: &str, spec: &GemmSpec, suffix: &'static str, sms: u32) -> Asked {
        let facts = GemmFacts::dense(spec.m, spec.n, spec.k, spec.input, spec.output);
        Asked {
            shape: shape.into(),
            input: spec.input.to_string(),
            suffix,
            tile: hopper_rule(&facts, sms).ok(),
            gathered: None,
        }
    }

    /// A grouped GEMM of `facts` (rows " grouped"): the engine's tile, and where its rows
    /// are gathered, the tile the rule gives them arriving the other way.
    pub fn grouped(shape: &str, input: DType, facts: &GroupedFacts, sms: u32) -> Asked {
        let support = EngineSupport { cublas: true, hopper_sms: Some(sms), ..Default::default() };
        let tile = |f: &GroupedFacts| grouped_engine(GemmEngine::Auto, &support, f).ok().flatten();
        Asked {
            shape: shape.into(),
            input: input.to_string(),
            suffix: " grouped",
            tile: tile(facts),
            gathered: facts.gathered.then(|| (facts.staged, tile(&GroupedFacts { staged: !facts.staged, ..*facts }))),
        }
    }
}

/// Where the sweep's rows ask the rules, from the rows alone (so that a recorded sweep is
/// judged as the live one is): each plain shape (`MxNxK`) as a dense GEMM writing its
/// input's dtype; each MoE shape (`op MxNxK E<experts>`, `→dtype` where the rows are
/// written in another) as the sweep's grouped GEMM of that op ([`super::GROUPED`] divided
/// by `shrink`): its dense rows, and its grouped rows with the engine's way with gathered
/// rows. A shape the sweep's constants no longer make is left out.
pub(super) fn asked_of(rows: &[Row], shrink: usize, sms: u32) -> Result<Vec<Asked>> {
    let mut out: Vec<Asked> = Vec::new();
    for r in rows {
        if out.iter().any(|a| a.shape == r.shape && a.input == r.input) {
            continue;
        }
        let input: DType = r.input.parse().map_err(anyhow::Error::msg).context("a row's dtype")?;
        let mut words = r.shape.split_whitespace();
        let (first, second) = (words.next().unwrap_or_default(), words.next());
        if let Some([m, n, k]) = mnk(first) {
            let spec = GemmSpec { m, n, k, input, output: input, trans_a: false, trans_b: false, accumulate: false };
            out.push(Asked::plain(&r.shape, &spec, "", sms));
            continue;
        }
        let op = match first {
            "ag_moe" => MoeOp::AgMoe,
            "moe_rs" => MoeOp::MoeRs,
            _ => continue,
        };
        let Grouped { plan, site, spec } = grouped(op, input, shrink)?;
        if second.and_then(mnk) != Some([spec.m, spec.n, spec.k]) {
            continue;
        }
        let output = match r.shape.split_once('→') {
            Some((_, dtype)) => dtype.trim().parse().map_err(anyhow::Error::msg).context("a row's output dtype")?,
            None => input,
        };
        out.push(Asked::plain(&r.shape, &GemmSpec { output, ..spec }, " dense", sms));
        let mut facts = plan
            .ops()
            .find_map(|(at, op)| (at == site).then(|| GroupedFacts::of(&plan, op)).flatten())
            .context("the sweep's MoE plan has a grouped GEMM")?;
        // The way the engine's own rows ran, as their checks say, not the way it would run
        // them now: the tile rule is judged against what was timed.
        facts.staged = facts.gathered
            && rows.iter().any(|x| x.shape == r.shape && x.input == r.input && x.check.contains(STAGED_MARK));
        out.push(Asked::grouped(&r.shape, input, &facts, sms));
    }
    Ok(out)
}

/// `MxNxK` as its three numbers.
fn mnk(text: &str) -> Option<[usize; 3]> {
    let mut parts = text.split('x').map(|p| p.parse::<usize>().ok());
    let dims = [parts.next()??, parts.next()??, parts.next()??];
    parts.next().is_none().then_some(dims)
}

/// What the run says of one rule at one shape.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(super) struct Verdict {
    /// "tile", "staging" or "tma-store".
    pub rule: &'static str,
    pub shape: String,
    pub input: String,
    /// The rows compared, their rates of cuBLAS's, and the reading.
    pub finding: String,
    /// `Some(true)`: the rule's choice ran fastest, or within [`TIE`] of the other;
    /// `Some(false)`: the other ran faster by more; `None`: a row did not run.
    pub holds: Option<bool>,
}

/// Every verdict of the run, in the order the rules were asked.
pub(super) fn verdicts(rows: &[Row], asked: &[Asked]) -> Vec<Verdict> {
    let mut out = Vec::new();
    for a in asked {
        let row = |engine: &str| rows.iter().find(|r| r.shape == a.shape && r.input == a.input && r.engine == engine);
        let rate = |engine: &str| row(engine).and_then(|r| r.of_cublas);
        let name = |tile: HopperTile, variant: HopperVariant| format!("{}{}", variant_name((tile, variant)), a.suffix);
        let verdict = |rule, chosen: String, other: String| {
            let whose = if rule == "tma-store" { "the default" } else { "the rule's" };
            let (finding, holds) = compare(whose, (&chosen, rate(&chosen)), (&other, rate(&other)));
            Verdict { rule, shape: a.shape.clone(), input: a.input.clone(), finding, holds }
        };
        // A comparison none of whose rows the sweep made (a recorded sweep's shape that had
        // no such rows) says nothing; one whose rows failed says so.
        let made = |x: &str, y: &str| row(x).is_some() || row(y).is_some();
        if let Some(tile) = a.tile {
            let other = HopperTile::ALL.into_iter().find(|&t| t != tile).unwrap_or(tile);
            let (chosen, other) = (name(tile, HopperVariant::Engine), name(other, HopperVariant::Engine));
            if made(&chosen, &other) {
                out.push(verdict("tile", chosen, other));
            }
        }
        if let (Some(tile), Some((staged, Some(other_tile)))) = (a.tile, a.gathered) {
            // The engine's own rows (its way, on its tile) against the variant that takes
            // the other way, on the tile the rule gives that way: judged only where the
            // sweep timed that variant (a recorded sweep's own rows ran whichever way
            // they ran then).
            let other_way = if staged { HopperVariant::InKernelGather } else { HopperVariant::StagedGather };
            let (chosen, other) = (name(tile, HopperVariant::Engine), name(other_tile, other_way));
            if row(&other).is_some() {
                out.push(verdict("staging", chosen, other));
            }
        }
        for tile in HopperTile::ALL {
            let (plain, stored) = (name(tile, HopperVariant::Engine), name(tile, HopperVariant::TmaStore));
            // Only where the sweep had the TMA-store kernels run (or fail) at this shape.
            if row(&stored).is_some() {
                out.push(verdict("tma-store", plain, stored));
            }
        }
    }
    out
}

/// The chosen row (`whose`: "the rule's", "the default") against the other: the finding
/// in words and whether the choice holds.
fn compare(whose: &str, (chosen, a): (&str, Option<f64>), (other, b): (&str, Option<f64>)) -> (String, Option<bool>) {
    match (a, b) {
        (Some(a), Some(b)) => {
            let gain = b / a - 1.0;
            if gain > TIE {
                (
                    format!("{other} {b:.2} against {whose} {chosen} {a:.2} (+{:.0} %): against it", 100.0 * gain),
                    Some(false),
                )
            } else if gain >= -TIE {
                (format!("{whose} {chosen} {a:.2}, {other} {b:.2}: a tie (within {:.0} %)", 100.0 * TIE), Some(true))
            } else {
                (format!("{whose} {chosen} {a:.2} against {other} {b:.2}: holds"), Some(true))
            }
        }
        _ => {
            let missing: Vec<&str> =
                [(chosen, a), (other, b)].iter().filter(|(_, r)| r.is_none()).map(|(n, _)| *n).collect();
            (format!("not judged: {} did not run", missing.join(" and ")), None)
        }
    }
}

/// The lines the sweep prints: every tile and staging verdict, the TMA-store rows where
/// they ran faster, and a count per rule.
pub(super) fn lines(verdicts: &[Verdict]) -> Vec<String> {
    let mut out =
        vec![format!("the engine's rules against this run (rates of cuBLAS's; within {:.0} % is a tie):", 100.0 * TIE)];
    for v in verdicts.iter().filter(|v| v.rule != "tma-store" || v.holds == Some(false)) {
        out.push(format!("{:<9} {:<30} {:<5} {}", v.rule, v.shape, v.input, v.finding));
    }
    for rule in ["tile", "staging", "tma-store"] {
        let of: Vec<&Verdict> = verdicts.iter().filter(|v| v.rule == rule).collect();
        let count = |h: Option<bool>| of.iter().filter(|v| v.holds == h).count();
        let what = match rule {
            "tile" => "the tile rule (cmm_core::engines::hopper_rule, grouped_engine)",
            "staging" => "staging gathered rows from STAGED_GATHER_MIN_COLUMNS",
            _ => "the epilogue from registers against TMA stores",
        };
        out.push(format!(
            "{what}: holds on {} of {}, against on {}, not judged on {}",
            count(Some(true)),
            of.len(),
            count(Some(false)),
            count(None)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(shape: &str, engine: &str, of_cublas: Option<f64>) -> Row {
        Row {
            shape: shape.into(),
            input: "bf16".into(),
            engine: engine.into(),
            us: of_cublas.map(|r| 100.0 / r),
            tflops: None,
            of_cublas,
            check: String::new(),
        }
    }

    /// Rows of one shape, each an engine and its rate of cuBLAS's.
    fn rows_of(shape: &str, rates: &[(&str, f64)]) -> Vec<Row> {
        rates.iter().map(|&(engine, rate)| row(shape, engine, Some(rate))).collect()
    }

    fn asked(
        shape: &str,
        suffix: &'static str,
        tile: HopperTile,
        gathered: Option<(bool, Option<HopperTile>)>,
    ) -> Asked {
        Asked { shape: shape.into(), input: "bf16".into(), suffix, tile: Some(tile), gathered }
    }

    #[test]
    fn the_tile_rule_holds_where_its_tile_ran_fastest_or_tied_and_not_where_the_other_won() {
        let rows = [
            row("1024x4096x4096", "hopper 128x256", Some(0.76)),
            row("1024x4096x4096", "hopper 128x128", Some(0.80)),
            row("4096x4096x6144", "hopper 128x256", Some(0.84)),
            row("4096x4096x6144", "hopper 128x128", Some(0.78)),
            row("8192x8192x8192", "hopper 128x256", Some(0.81)),
            row("8192x8192x8192", "hopper 128x128", Some(0.80)),
            // Its rows made but failed: not judged.
            row("512x512x512", "hopper 128x256", None),
            row("512x512x512", "hopper 128x128", None),
        ];
        let asked = [
            asked("1024x4096x4096", "", HopperTile::Narrow, None),
            asked("4096x4096x6144", "", HopperTile::Narrow, None),
            asked("8192x8192x8192", "", HopperTile::Wide, None),
            asked("512x512x512", "", HopperTile::Wide, None),
            // No rows of this shape at all: no verdict.
            asked("missing", "", HopperTile::Wide, None),
        ];
        let v = verdicts(&rows, &asked);
        let tiles: Vec<Option<bool>> = v.iter().filter(|v| v.rule == "tile").map(|v| v.holds).collect();
        assert_eq!(tiles, [Some(true), Some(false), Some(true), None]);
        let against = v.iter().find(|v| v.holds == Some(false)).unwrap();
        assert!(
            against.finding.contains("hopper 128x256 0.84 against the rule's hopper 128x128 0.78 (+8 %): against it"),
            "{against:?}"
        );
        assert!(v[2].finding.contains("a tie"), "0.81 against 0.80: {:?}", v[2]);
        assert!(v[3].finding.contains("hopper 128x256 and hopper 128x128 did not run"), "{:?}", v[3]);
        // No TMA-store rows ran, so no TMA-store verdict.
        assert!(v.iter().all(|v| v.rule == "tile"));
        let printed = lines(&v);
        assert!(printed
            .iter()
            .any(|l| l.contains("the tile rule") && l.contains("holds on 2 of 4, against on 1, not judged on 1")));
    }

    /// Every sweep recorded under docs/gpu-runs, judged by the tile rule as it is now: the
    /// rule must hold (or tie) wherever both tiles were timed, so that its constants
    /// (`HOPPER_WIDE_MIN_K`, the gathered rows' exception) move only with measurements.
    #[test]
    fn the_tile_rule_holds_on_every_recorded_sweep() {
        let mut judged = 0;
        for (path, text) in cmm_sim::validate::recorded_gemm_sweeps().unwrap() {
            let report: super::super::Report = serde_json::from_str(&text).unwrap();
            for v in report.judged().unwrap().iter().filter(|v| v.rule == "tile") {
                assert_eq!(v.holds, Some(true), "{}: {} {} {}", path.display(), v.shape, v.input, v.finding);
                judged += 1;
            }
        }
        // Five sweeps (an H100's, four H200's) with both tiles on 42 shapes and dtypes.
        assert!(judged >= 42, "{judged} tile verdicts");
    }

    #[test]
    fn staging_is_judged_against_the_other_way_on_the_tile_the_rule_gives_that_way() {
        let shape = "ag_moe 8192x1792x4096 E8";
        let rows = rows_of(
            shape,
            &[
                ("hopper 128x128 grouped", 0.61),
                ("hopper 128x256 grouped", 0.55),
                ("hopper 128x256 in-kernel gather grouped", 0.42),
                ("hopper 128x128 in-kernel gather grouped", 0.66),
            ],
        );
        // Staged on 128×128 (K decides); copied rows would take 128×256: 0.61 against 0.42.
        let v = verdicts(&rows, &[asked(shape, " grouped", HopperTile::Narrow, Some((true, Some(HopperTile::Wide))))]);
        let staging: Vec<&Verdict> = v.iter().filter(|v| v.rule == "staging").collect();
        assert_eq!(staging.len(), 1);
        assert_eq!(staging[0].holds, Some(true));
        assert!(staging[0]
            .finding
            .contains("the rule's hopper 128x128 grouped 0.61 against hopper 128x256 in-kernel gather grouped 0.42"));
        // Below the threshold the engine copies, and the staged rows are the variant's.
        let rows = rows_of(shape, &[("hopper 128x256 grouped", 0.40), ("hopper 128x128 staged gather grouped", 0.50)]);
        let v = verdicts(&rows, &[asked(shape, " grouped", HopperTile::Wide, Some((false, Some(HopperTile::Narrow))))]);
        let staging = v.iter().find(|v| v.rule == "staging").unwrap();
        assert_eq!(staging.holds, Some(false), "{staging:?}");
    }

    #[test]
    fn tma_stores_are_reported_where_they_beat_the_register_epilogue() {
        let shape = "8192x8192x8192";
        // Each tile's rate from registers, then by TMA stores.
        let rows: Vec<Row> = [("128x256", 0.81, 0.86), ("128x128", 0.72, 0.71)]
            .iter()
            .flat_map(|&(tile, plain, stored)| {
                rows_of(shape, &[(&format!("hopper {tile}"), plain), (&format!("hopper {tile} tma store"), stored)])
            })
            .collect();
        let v = verdicts(&rows, &[asked(shape, "", HopperTile::Wide, None)]);
        let stores: Vec<Option<bool>> = v.iter().filter(|v| v.rule == "tma-store").map(|v| v.holds).collect();
        assert_eq!(stores, [Some(false), Some(true)], "128×256: +6 %; 128×128: a tie");
        let printed = lines(&v);
        // Only the TMA-store rows that argue for a change are printed one by one.
        assert_eq!(printed.iter().filter(|l| l.starts_with("tma-store")).count(), 1);
        assert!(printed.iter().any(|l| l.contains("against TMA stores: holds on 1 of 2, against on 1")));
    }
}
