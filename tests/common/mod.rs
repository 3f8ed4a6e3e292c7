//! Helpers shared by the CLI test binaries: the binary under test, a temporary directory, and a
//! run with its exit code and both output streams.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The CLI under test: the one cargo built, or `$NVFP4MOE_CLI` (the GPU bundle runs the binaries
/// on another machine, where cargo's build path does not exist).
pub fn bin() -> String {
    std::env::var("NVFP4MOE_CLI").unwrap_or_else(|_| env!("CARGO_BIN_EXE_nvfp4-moe").to_string())
}

/// A fresh temporary directory, removed on drop.
pub struct TmpDir(PathBuf);

impl TmpDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let p = std::env::temp_dir().join(format!(
            "nvfp4moe-cli-{}-{nanos}-{}-{tag}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TmpDir(p)
    }

    pub fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One finished run of the CLI.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

pub fn cli(args: &[&str]) -> Run {
    let Output { status, stdout, stderr } = Command::new(bin()).args(args).output().expect("run nvfp4-moe");
    let r = Run {
        code: status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    };
    eprintln!("$ nvfp4-moe {}\n-> exit {}\n{}{}", args.join(" "), r.code, r.stdout, r.stderr);
    r
}

pub fn assert_ok(r: &Run) {
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
}
