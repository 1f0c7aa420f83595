//! The user's loop through the `cmm` binary, outside the repository: goldens for a case
//! file the user wrote, a check of outputs written elsewhere (one right, one with a
//! single wrong element), a plan file that verifies and one with a missing wait that
//! does not, and a simulation.

mod common;

use std::path::Path;
use std::process::Command;

use common::{bf16_round, cmm, text, Scratch};

const CASES: &str = r#"
[[case]]
name = "mine_ag_gemm"
op = "ag_gemm"
devices = 4
algorithm = "ring"
m = 64
n = 32
k = 48
input = "bf16"
output = "bf16"
family = "realistic"
seed = 7

[[case]]
name = "mine_moe"
op = "moe_rs"
devices = 2
algorithm = "ring"
experts = 8
topk = 2
routing = "skewed"
m = 16
n = 8
k = 12
input = "f16"
output = "f16"
family = "exact"
seed = 9
"#;

/// Adds `delta` to element (row, col) of an f32 `.npy` matrix of `cols` columns holding
/// bf16 values, rounding the sum to bf16 as a kernel's epilogue would.
fn nudge(path: &Path, row: usize, col: usize, cols: usize, delta: f32) {
    let mut bytes = std::fs::read(path).unwrap();
    let header = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let at = 10 + header + 4 * (row * cols + col);
    let v = bf16_round(f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) + delta);
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn golden_then_check_passes_right_outputs_and_names_the_wrong_element() {
    let s = Scratch::new("golden");
    std::fs::write(s.0.join("my.toml"), CASES).unwrap();
    let o = cmm(&s.0, &["golden", "--cases", "my.toml", "--out", "g", "--backend", "cpu"]);
    assert!(o.status.success(), "{}", text(&o));
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(s.0.join("g/index.json")).unwrap()).unwrap();
    let outputs = &index["cases"][0]["outputs"][0];
    assert_eq!(outputs["buffer"], "C");
    assert_eq!(outputs["rule"], "within");
    assert!(outputs["tolerance"]["accumulation"].as_f64().unwrap() > 0.0);
    assert!(outputs["layout"].as_str().unwrap().contains("device 3: rows 0..64, columns 24..32"), "{outputs}");
    assert_eq!(index["cases"][1]["outputs"][0]["rule"], "bits");

    // The user's kernel wrote exactly our outputs: they pass.
    for (case, devices) in [("mine_ag_gemm", 4), ("mine_moe", 2)] {
        std::fs::create_dir_all(s.0.join("mine").join(case)).unwrap();
        for d in 0..devices {
            let name = format!("d{d}_C.npy");
            std::fs::copy(s.0.join("g").join(case).join(&name), s.0.join("mine").join(case).join(&name)).unwrap();
        }
    }
    let check = ["check", "--cases", "my.toml", "--golden", "g", "--outputs", "mine", "--report", "r.xml"];
    let o = cmm(&s.0, &check);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("2 passed, 0 failed"), "{}", text(&o));
    assert!(std::fs::read_to_string(s.0.join("r.xml")).unwrap().contains("<testsuite"));

    // One element off by one: the check fails and names it.
    nudge(&s.0.join("mine/mine_ag_gemm/d2_C.npy"), 3, 5, 8, 1.0);
    let o = cmm(&s.0, &check);
    assert!(!o.status.success());
    let out = text(&o);
    // Device 2 holds columns 16..24 of the global C.
    assert!(out.contains("dev 2 (row 3, col 5 of its output; global row 3, col 21)"), "{out}");
    assert!(out.contains("1 of 2048 elements off"), "{out}");
    assert!(out.contains("1 passed, 1 failed"), "{out}");

    // A missing file is a failed case naming the path, not a crash.
    std::fs::remove_file(s.0.join("mine/mine_moe/d1_C.npy")).unwrap();
    let out = text(&cmm(&s.0, &check));
    assert!(out.contains("d1_C.npy"), "{out}");
}

/// M = 102 rows on 4 devices split as `torch.tensor_split` does (26, 26, 25, 25): each
/// device's `.npy` holds its own rows, `index.json` says so, `cmm check` reads them and
/// places a wrong element in the global C; a file of the wrong rows is refused by shape.
#[test]
fn uneven_shards_export_each_device_s_rows_and_check_reads_them() {
    let s = Scratch::new("uneven");
    let case = r#"
[[case]]
name = "mine_uneven"
op = "gemm_rs"
devices = 4
algorithm = "ring_chunked"
chunks = 2
m = 102
n = 16
k = 32
input = "bf16"
output = "bf16"
family = "realistic"
seed = 3
"#;
    std::fs::write(s.0.join("my.toml"), case).unwrap();
    let o = cmm(&s.0, &["golden", "--cases", "my.toml", "--out", "g", "--backend", "cpu"]);
    assert!(o.status.success(), "{}", text(&o));
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(s.0.join("g/index.json")).unwrap()).unwrap();
    let c = &index["cases"][0]["outputs"][0];
    assert_eq!(c["device_rows"], serde_json::json!([26, 26, 25, 25]), "{c}");
    assert!(c["layout"].as_str().unwrap().contains("device 3: rows 77..102, columns 0..16"), "{c}");
    let files = &index["cases"][0]["devices"][3]["files"];
    let shape =
        |buffer: &str| files.as_array().unwrap().iter().find(|f| f["buffer"] == buffer).unwrap()["shape"].clone();
    assert_eq!((shape("A"), shape("C")), (serde_json::json!([102, 8]), serde_json::json!([25, 16])), "{files}");
    let d3 = std::fs::read(s.0.join("g/mine_uneven/d3_C.npy")).unwrap();
    assert!(String::from_utf8_lossy(&d3[..128]).contains("'shape': (25, 16)"), "{}", String::from_utf8_lossy(&d3));

    s.right_outputs("mine_uneven", 4);
    let check = ["check", "--cases", "my.toml", "--golden", "g", "--outputs", "mine"];
    let o = cmm(&s.0, &check);
    assert!(o.status.success(), "{}", text(&o));
    nudge(&s.0.join("mine/mine_uneven/d3_C.npy"), 24, 3, 16, 1.0);
    let out = text(&cmm(&s.0, &check));
    assert!(out.contains("dev 3 (row 24, col 3 of its output; global row 101, col 3)"), "{out}");
    // Device 0's 26 rows where device 3's 25 belong: refused by its shape.
    std::fs::copy(s.0.join("g/mine_uneven/d0_C.npy"), s.0.join("mine/mine_uneven/d3_C.npy")).unwrap();
    let out = text(&cmm(&s.0, &check));
    assert!(out.contains("d3_C.npy") && out.contains("25"), "{out}");
}

/// Writes `cases` to `<stem>.toml` in `dir`, plans its `mine_ag_gemm` into `<stem>.json`
/// and verifies that; returns what `cmm verify` said, which must be a success.
fn plan_and_verify(dir: &Path, cases: &str, stem: &str) -> String {
    std::fs::write(dir.join(format!("{stem}.toml")), cases).unwrap();
    let (toml, json) = (format!("{stem}.toml"), format!("{stem}.json"));
    let o = cmm(dir, &["plan", "--cases", &toml, "--case", "mine_ag_gemm", "--out", &json]);
    assert!(o.status.success(), "{}", text(&o));
    let o = cmm(dir, &["verify", &json]);
    assert!(o.status.success(), "{}", text(&o));
    text(&o)
}

#[test]
fn plan_files_verify_and_a_missing_wait_is_a_finding_in_words() {
    let s = Scratch::new("verify");
    let verified = plan_and_verify(&s.0, CASES, "ring");
    assert!(verified.contains("no race, no deadlock"), "{verified}");

    let mut plan: serde_json::Value = serde_json::from_slice(&std::fs::read(s.0.join("ring.json")).unwrap()).unwrap();
    let compute = plan["plan"]["lanes"].as_array().unwrap().iter().position(|l| l == "compute").unwrap();
    let ops = plan["plan"]["programs"][1]["lanes"][compute].as_array_mut().unwrap();
    let wait = ops.iter().position(|op| op["op"] == "wait").unwrap();
    ops.remove(wait);
    std::fs::write(s.0.join("broken.json"), plan.to_string()).unwrap();
    let o = cmm(&s.0, &["verify", "broken.json", "--report", "v.json"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("reads device 1 S[0, 0] before anything wrote it"), "{}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(s.0.join("v.json")).unwrap()).unwrap();
    assert_eq!(report["cases"].as_array().unwrap().len(), 4, "one test case per interleaving");
    assert!(report["failed"].as_u64().unwrap() > 0);

    let o = cmm(&s.0, &["simulate", "ring.json", "--profile", "h100-nvlink", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(report["makespan_us"].as_f64().unwrap() > 0.0);

    // A reader that stops early (`cmm verify ring.json | head -1`) ends cmm quietly, by
    // SIGPIPE as any Unix filter, not with a panic about a failed print. cmm's stdout is
    // a pipe whose read end is closed before cmm starts, so its first line meets it
    // closed, however fast cmm runs.
    #[cfg(unix)]
    {
        use std::os::fd::{FromRawFd, OwnedFd};
        use std::os::unix::process::ExitStatusExt;
        let mut fds = [0; 2];
        // SAFETY: `pipe` fills the two descriptors of a new pipe; each is then owned by
        // exactly one OwnedFd, which closes it once.
        #[allow(unsafe_code)]
        let (read, write) = unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0, "pipe");
            (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
        };
        drop(read);
        let o = Command::new(env!("CARGO_BIN_EXE_cmm"))
            .args(["verify", "ring.json"])
            .current_dir(&s.0)
            .stdout(std::process::Stdio::from(write))
            .output()
            .unwrap();
        assert_eq!(o.status.signal(), Some(13), "{:?}: {}", o.status, text(&o));
        assert!(o.stderr.is_empty(), "{}", text(&o));
    }

    // A plan file at seed 000's size (671 million elements over 8 devices) verifies in
    // a few shadow cells.
    let big =
        CASES.replace("devices = 4", "devices = 8").replace("m = 64\nn = 32\nk = 48", "m = 8192\nn = 32768\nk = 4096");
    let verified = plan_and_verify(&s.0, &big, "big");
    assert!(verified.contains("its 671088640 buffer elements shadowed in 136 cells"), "{verified}");
    // Its 16 streams: safe in schedule order, not each lane enqueued whole on 8 queues.
    assert!(verified.contains("enqueued in schedule order, the plan cannot hang on any number"), "{verified}");
    assert!(verified.contains("(each lane whole, device by device): plan `ag_gemm/ring D=8"), "{verified}");
    assert!(verified.contains("hangs on 8 hardware queue(s)"), "{verified}");
    assert!(verified.contains("(each lane whole, device by device), it cannot hang on 32 queues"), "{verified}");

    std::fs::write(s.0.join("junk.json"), "{\"format\": \"cmm-plan\", \"version\": 7, \"plan\": {}}").unwrap();
    let o = cmm(&s.0, &["verify", "junk.json"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("not a plan file") || text(&o).contains("version"), "{}", text(&o));
}

/// The fenced block of `lang` that follows the line containing `after` in the guide.
fn guide_block(guide: &str, after: &str, lang: &str) -> String {
    let from = guide.find(after).unwrap_or_else(|| panic!("docs/guide.md has no `{after}`"));
    let fence = format!("```{lang}\n");
    let start = from + guide[from..].find(&fence).expect("a code block follows") + fence.len();
    let end = start + guide[start..].find("```").expect("the block ends");
    guide[start..end].to_string()
}

/// docs/guide.md's case file, NumPy script and commands, run as written (the reference
/// runs the goldens; CI installs lavapipe and numpy, elsewhere a missing one is said).
#[test]
fn the_guide_works_as_written() {
    let guide = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/guide.md")).unwrap();
    let numpy = Command::new("python3").args(["-c", "import numpy"]).status().is_ok_and(|s| s.success());
    if !numpy {
        assert!(std::env::var_os("CI").is_none(), "CI is set but python3 cannot import numpy (.ci/run installs it)");
        eprintln!("SKIPPED: python3 with numpy is not available here");
        return;
    }
    let s = Scratch::new("guide");
    std::fs::write(s.0.join("my.toml"), guide_block(&guide, "Write a case file anywhere", "toml")).unwrap();
    std::fs::write(s.0.join("outputs.py"), guide_block(&guide, "stands in for a kernel", "python")).unwrap();
    let o = cmm(&s.0, &["golden", "--cases", "my.toml", "--out", "g"]);
    if !o.status.success() && text(&o).contains("cannot start the wgpu reference") && std::env::var_os("CI").is_none() {
        eprintln!("SKIPPED: no wgpu adapter: {}", text(&o));
        return;
    }
    assert!(o.status.success(), "{}", text(&o));
    let index = std::fs::read_to_string(s.0.join("g/index.json")).unwrap();
    assert!(index.contains("device 3: rows 0..64, columns 24..32"), "the guide's layout example");
    let o = Command::new("python3").arg("outputs.py").current_dir(&s.0).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let right = cmm(&s.0, &["check", "--cases", "my.toml", "--golden", "g", "--outputs", "right"]);
    assert!(right.status.success() && text(&right).contains("1 passed, 0 failed"), "{}", text(&right));
    let wrong = cmm(&s.0, &["check", "--cases", "my.toml", "--golden", "g", "--outputs", "wrong"]);
    assert!(!wrong.status.success());
    assert!(
        text(&wrong).contains("oracle: dev 2 (row 3, col 5 of its output; global row 3, col 21) got 100 expected"),
        "{}",
        text(&wrong)
    );
    assert!(text(&wrong).contains("1 of 2048 elements off"), "{}", text(&wrong));
}

/// The README's loop, run as written: its case file, then every `cmm` command in order
/// (a copy of the goldens' outputs stands in for the user's kernel before `cmm check`).
#[test]
fn the_readme_loop_works_as_written() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap();
    let block = guide_block(&readme, "## Your shapes, your kernel, your plans", "sh");
    let case = block.split("<<'EOF'\n").nth(1).and_then(|rest| rest.split("\nEOF\n").next()).expect("a case file");
    let s = Scratch::new("readme");
    std::fs::write(s.0.join("my.toml"), format!("{case}\n")).unwrap();
    let mut ran = 0;
    for line in block.lines().filter(|l| l.starts_with("cmm ")) {
        let args: Vec<&str> = line.split('#').next().unwrap().split_whitespace().skip(1).collect();
        if args[0] == "check" {
            // The user's kernel: here, the golden outputs themselves.
            s.right_outputs("mine", 4);
        }
        let o = cmm(&s.0, &args);
        if args[0] == "golden" && !o.status.success() && text(&o).contains("cannot start the wgpu reference") {
            assert!(std::env::var_os("CI").is_none(), "CI is set but no wgpu adapter exists: {}", text(&o));
            eprintln!("SKIPPED: no wgpu adapter: {}", text(&o));
            return;
        }
        assert!(o.status.success(), "`{line}`: {}", text(&o));
        if args[0] == "check" {
            assert!(text(&o).contains("1 passed, 0 failed"), "{}", text(&o));
        }
        ran += 1;
    }
    assert_eq!(ran, 6, "the README's loop has six cmm commands");
}

/// A fused winner comes with what its prediction assumes (its waits cost nothing past the
/// data's arrival, which only one-GPU runs have tested, and there they lost); on one GPU a
/// narrow lead is called a tie.
#[test]
fn tune_says_what_a_fused_winner_assumes() {
    const FLUX: &[&str] = &[
        "--op",
        "ag_gemm",
        "-d",
        "8",
        "-m",
        "4096",
        "-n",
        "49152",
        "-k",
        "12288",
        "--input",
        "bf16",
        "--profile",
        "h800-nvlink",
    ];
    const SEED000: &[&str] = &[
        "--op",
        "ag_gemm",
        "-d",
        "4",
        "-m",
        "4096",
        "-n",
        "16384",
        "-k",
        "4096",
        "--input",
        "f16",
        "--profile",
        "h100-one-gpu",
    ];
    let s = Scratch::new("tune-caveat");
    let tune = |json: &[&str], args: &[&str]| {
        let o = cmm(&s.0, &[&["tune"], json, args].concat());
        assert!(o.status.success(), "{}", text(&o));
        o
    };
    let json =
        |args: &[&str]| -> serde_json::Value { serde_json::from_slice(&tune(&["--json"], args).stdout).unwrap() };
    let flux = json(FLUX);
    assert_eq!(flux["winner"], "fused", "{flux}");
    assert!(flux["caveat"].as_str().unwrap().contains("1.00 to 1.08 times"), "{flux}");
    // On one GPU no fused plan wins; the ring's lead over ring_bidir (the same time in the
    // model, 1 % apart on the GPU) is a tie.
    let one_gpu = json(SEED000);
    assert_ne!(one_gpu["winner"], "fused", "{one_gpu}");
    let caveat = one_gpu["caveat"].as_str().unwrap();
    assert!(caveat.starts_with("it leads by ") && caveat.ends_with("read this as a tie"), "{one_gpu}");
    let text_out = text(&tune(&[], FLUX));
    assert!(text_out.contains("\ncaveat: the fused plans have run only as virtual devices"), "{text_out}");
}

/// The 1D tuner ranks both baselines and measures overlap against the faster one, and says
/// which: on a tiny problem the direct baseline wins outright.
#[test]
fn tune_judges_overlap_against_the_faster_baseline() {
    let s = Scratch::new("tune-baselines");
    let tiny = ["tune", "--op", "ag_gemm", "-d", "4", "-m", "64", "-n", "64", "-k", "64"];
    let o = cmm(&s.0, &[&tiny[..], &["--json"]].concat());
    assert!(o.status.success(), "{}", text(&o));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(json["winner"], "baseline_direct", "{json}");
    assert_eq!(json["baseline"], "baseline_direct", "{json}");
    let ranked = json["ranked"].as_array().unwrap();
    let speedup = |name: &str| {
        let row = ranked.iter().find(|r| r["algorithm"] == name).unwrap_or_else(|| panic!("no {name}: {json}"));
        row["speedup_vs_baseline"].as_f64().unwrap()
    };
    assert_eq!(speedup("baseline_direct"), 1.0);
    assert!(speedup("baseline") < 1.0 && speedup("ring") < 1.0, "{json}");
    let o = cmm(&s.0, &tiny);
    let out = text(&o);
    assert!(out.contains("\n`vs baseline`: against baseline_direct, the faster of the two baselines"), "{out}");
    assert!(out.contains("the direct baseline wins"), "{out}");
}

/// `cmm simulate --mesh` of the plan a 2D tuner's JSON `row` names, for the GEMM `problem`
/// gives: it takes the row's time. Returns the simulation's JSON.
fn simulate_tuned_row(dir: &Path, row: &serde_json::Value, problem: &[&str]) -> serde_json::Value {
    let slices = row["slices"].to_string();
    let mut args = vec!["simulate", "--mesh", row["mesh"].as_str().unwrap(), "--json"];
    args.extend(["--algorithm", row["algorithm"].as_str().unwrap()]);
    args.extend(problem);
    if row["algorithm"] == "meshslice" {
        args.extend(["--slices", &slices]);
    }
    let o = cmm(dir, &args);
    assert!(o.status.success(), "{}", text(&o));
    let sim: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let makespan_us = sim["makespan_us"].as_f64().unwrap();
    assert!((makespan_us - row["time_us"].as_f64().unwrap()).abs() < 1e-6 * makespan_us, "{sim} against {row}");
    sim
}

/// The 2D tuner's times are cmm's own plans simulated where it replayed them, the closed
/// form's beside them, and its winner says which of the two it was ranked by.
#[test]
fn the_2d_tuner_prints_cmms_plans_simulated_beside_seed_002s_form() {
    let s = Scratch::new("tune-2d");
    let gemm = ["tune", "--chips", "16", "-m", "8192", "-n", "8192", "-k", "8192", "--input", "bf16"];
    let torus = [&gemm[..], &["--profile", "tpuv4-torus", "--top", "6"]].concat();
    let o = cmm(&s.0, &[&torus[..], &["--json"]].concat());
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = v["ranked"].as_array().unwrap();
    assert_eq!(rows.len(), 6, "{v}");
    for (i, row) in rows.iter().enumerate() {
        let simulated = row["simulated_us"].as_f64();
        assert_eq!(simulated.is_some(), i < 5, "the default replays five: {row}");
        assert_eq!(row["how"], if i < 5 { "simulated" } else { "closed form" }, "{row}");
        let time = row["time_us"].as_f64().unwrap();
        assert_eq!(time, simulated.unwrap_or(row["closed_form_us"].as_f64().unwrap()), "{row}");
    }
    // The plan `cmm simulate --mesh` simulates for the winner takes the winner's time.
    simulate_tuned_row(
        &s.0,
        &rows[0],
        &["-m", "8192", "-n", "8192", "-k", "8192", "--input", "bf16", "--profile", "tpuv4-torus"],
    );
    let out = text(&cmm(&s.0, &torus));
    assert!(
        out.contains("cmm's plan simulated)") && out.contains("\nnot replayed, by seed 002's closed form alone:"),
        "{out}"
    );
    assert!(out.contains("here the simulated plans take "), "{out}");
    let out = text(&cmm(&s.0, &[&torus[..], &["--replay", "0"]].concat()));
    assert!(out.contains("seed 002's closed form: nothing replayed)") && !out.contains("note:"), "{out}");
    // Sixteen chips on a profile of eight: refused, not priced on links it does not have.
    let o = cmm(&s.0, &[&gemm[..], &["--profile", "h100-nvlink"]].concat());
    assert!(
        !o.status.success() && text(&o).contains("profile h100-nvlink describes at most 8 devices"),
        "{}",
        text(&o)
    );
}

/// `--wire bf16` sends the LS plans' partial sums in bf16: the replayed leaders (the same
/// ones, since seed 002's form prices partial sums in the input dtype either way) get
/// faster, the winner's time is `simulate --mesh --wire bf16` of its plan, and an OS GEMM,
/// which has no partial sums, refuses a narrower wire.
#[test]
fn the_2d_tuner_replays_ls_plans_with_partial_sums_on_a_narrow_wire() {
    let s = Scratch::new("tune-2d-wire");
    let dims = ["-m", "4096", "-n", "4096", "-k", "4096", "--input", "bf16", "--profile", "tpuv4-torus"];
    let ls = [&["tune", "--chips", "16", "--dataflow", "ls", "--json"][..], &dims[..]].concat();
    let ranked = |args: &[&str]| {
        let o = cmm(&s.0, args);
        assert!(o.status.success(), "{}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v["wire"].as_str().unwrap().to_string(), v["ranked"].as_array().unwrap()[..5].to_vec())
    };
    let (f32_wire, wide) = ranked(&ls);
    let (bf16_wire, narrow) = ranked(&[&ls[..], &["--wire", "bf16"]].concat());
    assert_eq!((f32_wire.as_str(), bf16_wire.as_str()), ("f32", "bf16"));
    let time = |rows: &[serde_json::Value], row: &serde_json::Value| {
        let same = |r: &&serde_json::Value| r["family"] == row["family"] && r["mesh"] == row["mesh"];
        rows.iter().find(same).map(|r| r["simulated_us"].as_f64().unwrap())
    };
    for row in &narrow {
        let (bf16, f32) = (row["simulated_us"].as_f64().unwrap(), time(&wide, row).unwrap());
        assert!(bf16 < f32, "{row}: {bf16} µs with bf16 sums, {f32} µs with f32 ones");
    }
    let sim = simulate_tuned_row(&s.0, &narrow[0], &[&["--dataflow", "ls", "--wire", "bf16"][..], &dims[..]].concat());
    assert!(sim["plan"].as_str().unwrap().ends_with(" wire=bf16"), "{sim}");
    let os = [&["tune", "--chips", "16", "--dataflow", "os", "--wire", "bf16"][..], &dims[..]].concat();
    let o = cmm(&s.0, &os);
    assert!(!o.status.success() && text(&o).contains("only the LS and RS dataflows send partial sums"), "{}", text(&o));
}

/// docs/simulator.md shows `cmm simulate --validate`'s output "unedited": at least its
/// bench sections, which the one-GPU model changes most, must be. (The whole command takes
/// over a minute, most of it in seed 002's cross-check; each bench section is
/// `--validate-bench` of a committed report, milliseconds.)
#[test]
fn the_simulator_docs_show_the_bench_validation_unedited() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("docs/simulator.md")).unwrap();
    let shown = guide_block(&doc, "prints (this is its output, unedited):", "text");
    let reports: Vec<&str> = shown
        .lines()
        .filter_map(|l| l.split_once(".json: ").map(|(path, _)| path))
        .filter(|path| path.starts_with("docs/gpu-runs/"))
        .collect();
    assert!(reports.len() >= 2, "the validation block shows the committed benches: {reports:?}");
    for report in reports {
        let path = format!("{report}.json");
        let o = cmm(&root, &["simulate", "--validate-bench", &path]);
        assert!(o.status.success(), "{}", text(&o));
        let printed = String::from_utf8(o.stdout).unwrap();
        let start = shown.find(&format!("{path}: ")).unwrap();
        let differs = printed.lines().zip(shown[start..].lines()).enumerate().find(|(_, (now, doc))| now != doc);
        if let Some((line, (now, doc))) = differs {
            panic!(
                "docs/simulator.md's section on {path} differs at its line {}:\n doc: {doc}\n now: {now}\n\
                 run `cargo xtask simulate --validate` and paste its output there",
                line + 1
            );
        }
        assert!(shown[start..].lines().count() >= printed.lines().count(), "{path}: the doc's section is cut short");
    }
}
