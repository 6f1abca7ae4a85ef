//! Shared by the benchmark programs: mode detection and statistics.
#![allow(dead_code)]

use std::time::Duration;

/// `cargo bench` passes `--bench`; `cargo test --all-targets` does not, and
/// then each benchmark only checks that it runs, on tiny inputs.
pub fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Scales a workload down in smoke mode.
pub fn size(full: usize, smoke: usize) -> usize {
    if full_run() { full } else { smoke }
}

/// The value at quantile `q` (0..=1) of a sorted slice.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
