//! Inputs from hostile or unlucky users, each of which once did harm: a case name that
//! led outside `--out`, outputs that were devices or FIFOs, a bf16 output that passed
//! without its rounding, a report that overwrote the goldens, and messages that said
//! the wrong thing.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{cmm, text, Scratch};

/// One small case, `name`, with outputs in `output` and family `family`.
fn case(name: &str, output: &str, family: &str) -> String {
    format!(
        r#"[[case]]
name = "{name}"
op = "ag_gemm"
devices = 2
algorithm = "ring"
m = 8
n = 4
k = 6
input = "bf16"
output = "{output}"
family = "{family}"
seed = 3
"#
    )
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn a_case_name_never_leads_outside_out_or_onto_the_exports_own_files() {
    for name in ["..", ".", "a/b", "index.json", "golden", "Golden", "-x", "", "é"] {
        let s = Scratch::new("names");
        std::fs::create_dir_all(s.0.join("inside")).unwrap();
        std::fs::write(s.0.join("inside/c.toml"), case(name, "bf16", "exact")).unwrap();
        let o = cmm(&s.0.join("inside"), &["golden", "--backend", "cpu", "--cases", "c.toml", "--out", "out"]);
        assert!(!o.status.success(), "{name:?}: {}", text(&o));
        assert!(
            text(&o).contains("a name is 1 to 128 ASCII letters") || text(&o).contains("export's own"),
            "{name:?}: {}",
            text(&o)
        );
        let written: Vec<_> = files_under(&s.0).into_iter().filter(|p| !p.ends_with("inside/c.toml")).collect();
        assert!(written.is_empty(), "{name:?} wrote {written:?}");
    }
}

/// Writes goldens of one exact bf16 case into `s/g` (the CPU twin) and the right
/// outputs into `s/mine`; returns the check command's arguments.
fn golden_and_right_outputs(s: &Scratch) -> [&'static str; 7] {
    std::fs::write(s.0.join("c.toml"), case("c", "bf16", "exact")).unwrap();
    let o = cmm(&s.0, &["golden", "--backend", "cpu", "--cases", "c.toml", "--out", "g"]);
    assert!(o.status.success(), "{}", text(&o));
    s.right_outputs("c", 2);
    let check = ["check", "--cases", "c.toml", "--golden", "g", "--outputs", "mine"];
    let o = cmm(&s.0, &check);
    assert!(o.status.success(), "{}", text(&o));
    check
}

/// Runs `cmm` and kills it if it has not finished within `limit`.
fn cmm_within(dir: &Path, args: &[&str], limit: Duration) -> (bool, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cmm"))
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("cmm {args:?} still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    (o.status.success(), text(&o))
}

#[cfg(unix)]
#[test]
fn outputs_that_are_devices_or_fifos_are_refused_unread() {
    let s = Scratch::new("devices");
    let check = golden_and_right_outputs(&s);
    let output = s.0.join("mine/c/d0_C.npy");
    std::fs::remove_file(&output).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &output).unwrap();
    let (ok, out) = cmm_within(&s.0, &check, Duration::from_secs(60));
    assert!(!ok && out.contains("d0_C.npy: is not a regular file"), "{out}");
    std::fs::remove_file(&output).unwrap();
    let made = Command::new("mkfifo").arg(&output).status();
    if made.is_ok_and(|m| m.success()) {
        let (ok, out) = cmm_within(&s.0, &check, Duration::from_secs(60));
        assert!(!ok && out.contains("d0_C.npy: is not a regular file"), "{out}");
    }
}

#[test]
fn an_output_larger_than_its_header_says_is_refused_before_it_is_read() {
    let s = Scratch::new("large");
    let check = golden_and_right_outputs(&s);
    let output = s.0.join("mine/c/d1_C.npy");
    let len = std::fs::metadata(&output).unwrap().len();
    // 64 GiB, sparse: reading it would take the machine's memory.
    std::fs::File::options().write(true).open(&output).unwrap().set_len(1 << 36).unwrap();
    let (ok, out) = cmm_within(&s.0, &check, Duration::from_secs(60));
    assert!(!ok, "{out}");
    assert!(
        out.contains(&format!("d1_C.npy: is 68719476736 bytes; its header and the output's elements make {len}")),
        "{out}"
    );
}

/// A bf16 output written as f32 without its bf16 rounding does not pass bit for bit.
#[test]
fn a_bf16_output_without_its_rounding_fails_and_names_the_element() {
    let s = Scratch::new("bf16");
    let check = golden_and_right_outputs(&s);
    let output = s.0.join("mine/c/d1_C.npy");
    let mut bytes = std::fs::read(&output).unwrap();
    let header = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let at = 10 + header + 4 * 5;
    let v = f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    // A value bf16 cannot hold, within bf16's rounding of the right one.
    let off = f32::from_bits(v.to_bits() + 1);
    bytes[at..at + 4].copy_from_slice(&off.to_le_bytes());
    std::fs::write(&output, bytes).unwrap();
    let o = cmm(&s.0, &check);
    assert!(!o.status.success());
    assert!(text(&o).contains(&format!("element 5 (row-major) is {off}, not a bf16 value")), "{}", text(&o));
}

#[test]
fn a_report_never_overwrites_the_cases_the_goldens_or_the_outputs() {
    let s = Scratch::new("report");
    let check = golden_and_right_outputs(&s);
    let index = std::fs::read(s.0.join("g/index.json")).unwrap();
    for report in ["g/index.json", "g/new.json", "mine/c/r.xml", "./g/../g/index.json"] {
        let o = cmm(&s.0, &[&check[..], &["--report", report]].concat());
        assert!(!o.status.success(), "{report}: {}", text(&o));
        assert!(text(&o).contains("choose a path outside it"), "{report}: {}", text(&o));
    }
    assert_eq!(std::fs::read(s.0.join("g/index.json")).unwrap(), index);
    assert!(!s.0.join("g/new.json").exists());
    // Beside them it is written, whole.
    let o = cmm(&s.0, &[&check[..], &["--report", "r.xml"]].concat());
    assert!(o.status.success(), "{}", text(&o));
    let report = std::fs::read_to_string(s.0.join("r.xml")).unwrap();
    assert!(report.contains(r#"<testsuites name="cmm check""#), "{report}");
    assert!(!report.contains("-0.000000"), "{report}");
}

#[test]
fn a_golden_mismatch_in_check_blames_the_outputs_not_the_goldens() {
    let s = Scratch::new("advice");
    let check = golden_and_right_outputs(&s);
    let output = s.0.join("mine/c/d0_C.npy");
    let mut bytes = std::fs::read(&output).unwrap();
    let header = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let at = 10 + header;
    bytes[at..at + 4].copy_from_slice(&100.0f32.to_le_bytes());
    std::fs::write(&output, bytes).unwrap();
    let out = text(&cmm(&s.0, &check));
    assert!(out.contains("the outputs given differ from the golden"), "{out}");
    assert!(!out.contains("--bless"), "{out}");
}

#[test]
fn flags_are_named_as_given_and_zero_schedules_is_refused() {
    let s = Scratch::new("flags");
    let out = text(&cmm(&s.0, &["simulate", "--mesh", "abc"]));
    assert!(out.contains("--mesh abc: expected e.g. 4x4") && !out.contains("--torus"), "{out}");
    let o = cmm(&s.0, &["verify", "--schedules", "0", "plan.json"]);
    assert!(!o.status.success() && text(&o).contains("0 is not in 1..=100000"), "{}", text(&o));
    // 10^9 would replay for hours and hold a line each before saying anything.
    let o = cmm(&s.0, &["verify", "--schedules", "1000000000", "plan.json"]);
    assert!(!o.status.success() && text(&o).contains("1000000000 is not in 1..=100000"), "{}", text(&o));
}

/// The hierarchical plans' node size: taken from a profile with a network (or given),
/// required without one, refused where it does not divide D or for another algorithm;
/// each in the algorithm's words.
#[test]
fn a_hierarchical_plan_without_whole_nodes_is_refused_in_its_words() {
    let s = Scratch::new("nodes");
    let sim = |args: &[&str]| {
        let problem = ["simulate", "--algorithm", "hierarchical", "-m", "4096", "-n", "4096", "-k", "4096"];
        cmm(&s.0, &[&problem[..], args].concat())
    };
    let o = sim(&["--op", "ag_gemm", "-d", "16", "--profile", "h100-ib"]);
    assert!(o.status.success() && text(&o).contains("ag_gemm/hierarchical(node=8) D=16"), "{}", text(&o));
    let o = sim(&["--op", "ag_gemm", "-d", "4", "--profile", "h100-nvlink"]);
    assert!(!o.status.success() && text(&o).contains("needs the parameter `node`"), "{}", text(&o));
    let o = sim(&["--op", "ag_gemm", "-d", "4", "--node", "3"]);
    assert!(!o.status.success() && text(&o).contains("nodes of 3 GPUs do not divide the D=4 devices"), "{}", text(&o));
    let o = sim(&["--op", "gemm_rs", "-d", "16", "--profile", "h100-ib", "--node", "4"]);
    assert!(o.status.success() && text(&o).contains("gemm_rs/hierarchical(node=4) D=16"), "{}", text(&o));
    let o = cmm(&s.0, &["simulate", "--op", "ag_gemm", "-d", "4", "-m", "64", "-n", "64", "-k", "64", "--node", "2"]);
    assert!(!o.status.success() && text(&o).contains("ring takes no parameter `node`"), "{}", text(&o));
    // A node size that would be ignored is refused: a plan file's, or --compare's (which
    // takes the profile's).
    let o = sim(&["--op", "ag_gemm", "-d", "16", "--profile", "h100-ib", "--node", "8", "--compare"]);
    assert!(!o.status.success() && text(&o).contains("<NODE>' cannot be used with '--compare'"), "{}", text(&o));
}

/// Numbers that once came out as `inf µs` or as a ranking of wrapped counts: a profile
/// in other units, a latency of 10^308 µs, a 2D GEMM whose matrices no buffer holds, a
/// batch whose tokens overflow, and a batch of none. Each is refused with what is wrong,
/// and nothing ranked.
#[test]
fn a_prediction_from_numbers_no_hardware_has_is_refused_not_ranked() {
    let s = Scratch::new("units");
    let profile = include_str!("../../sim/profiles/h100-nvlink.toml");
    let tune = ["tune", "--op", "ag_gemm", "-d", "4", "-m", "4096", "-n", "4096", "-k", "4096", "--profile"];
    for (from, to, said) in [
        ("hbm_gbps = 3350.0", "hbm_gbps = 3.35e12", "`memory.hbm_gbps` = 3.35e12: is in GB/s"),
        ("launch_us = 2.0", "launch_us = 1e308", "`compute.launch_us` = 1e308: is in µs"),
    ] {
        std::fs::write(s.0.join("p.toml"), profile.replacen(from, to, 1)).unwrap();
        let o = cmm(&s.0, &[&tune[..], &["p.toml"]].concat());
        assert!(!o.status.success() && text(&o).contains(said), "{}", text(&o));
        assert!(!text(&o).contains("winner") && !text(&o).contains("inf"), "{}", text(&o));
    }
    let mesh = ["tune", "--profile", "tpuv4-torus", "--chips", "256"];
    let o = cmm(&s.0, &[&mesh[..], &["-m", "1099511627776", "-n", "4096", "-k", "1099511627776"]].concat());
    assert!(!o.status.success() && text(&o).contains("A is 1099511627776×1099511627776"), "{}", text(&o));
    let o = cmm(&s.0, &[&mesh[..], &["--llm", "gpt3-175b", "--batch", "18446744073709551615"]].concat());
    assert!(!o.status.success() && text(&o).contains("overflow a count of tokens"), "{}", text(&o));
    // No tokens at all: refused before any phase is printed.
    let o = cmm(&s.0, &[&mesh[..], &["--llm", "gpt3-175b", "--batch", "0"]].concat());
    assert!(!o.status.success() && text(&o).contains("--batch 0: a step needs at least one sequence"), "{}", text(&o));
    assert!(!text(&o).contains("phase 1"), "{}", text(&o));
}

/// An OS error is said once, and a headless run of the reference prints no Wayland
/// complaint.
#[test]
fn errors_are_said_once_and_lavapipe_runs_quietly() {
    let s = Scratch::new("quiet");
    std::fs::write(s.0.join("c.toml"), case("c", "bf16", "exact")).unwrap();
    let o = cmm(&s.0, &["golden", "--backend", "cpu", "--cases", "c.toml", "--out", "/proc/cmm-cannot-write-here"]);
    let out = text(&o);
    assert!(!o.status.success());
    assert_eq!(out.matches("(os error").count(), 1, "{out}");
    let o = Command::new(env!("CARGO_BIN_EXE_cmm"))
        .args(["golden", "--cases", "c.toml", "--out", "g"])
        .current_dir(&s.0)
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("WAYLAND_DISPLAY")
        .output()
        .unwrap();
    if !o.status.success() && text(&o).contains("cannot start the wgpu reference") && std::env::var_os("CI").is_none() {
        eprintln!("SKIPPED the quiet-lavapipe half: no wgpu adapter");
        return;
    }
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("XDG_RUNTIME_DIR"), "{}", text(&o));
}
