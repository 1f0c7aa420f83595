//! What the `cmm` integration tests share: running the binary in a scratch directory.
#![allow(dead_code)] // Each test file uses its own part.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `cmm` with `args` in `dir`.
pub fn cmm(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cmm")).args(args).current_dir(dir).output().expect("cmm runs")
}

/// Its standard output and error together.
pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A fresh directory outside the repository, removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("cmm-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Scratch {
    /// "The user's kernel" writing the right answer: copies case `case`'s golden C of each
    /// of `devices` devices from `g/<case>` to `mine/<case>`.
    pub fn right_outputs(&self, case: &str, devices: usize) {
        let (from, to) = (self.0.join("g").join(case), self.0.join("mine").join(case));
        std::fs::create_dir_all(&to).unwrap();
        for d in 0..devices {
            let name = format!("d{d}_C.npy");
            std::fs::copy(from.join(&name), to.join(&name)).unwrap();
        }
    }
}

/// The bf16 value nearest `x` (ties to even), as an f32.
pub fn bf16_round(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(((b + 0x7fff + ((b >> 16) & 1)) >> 16) << 16)
}
