//! GPU benchmarks of every kvshard kernel, each next to the copy ceilings measured in the same
//! run. `cargo bench --bench gpu [-- [--quick] [--list] [SECTION...]]`; sections: resolve, pool,
//! write, pd, dcp, hicache, signal, duplex, interfere, and allgather (feature `nccl`, two GPUs)
//! (`--list` prints them and exits). Every row gives the device time of the work and what an
//! engine sees of the call: its window (entry to completion, on an idle stream) and its host
//! time per call, flagged `HOST>5%` at >= 64 pages past 5% of the transfer. Prints a table
//! and, when $OUT is set, writes it to $OUT/bench.md. Without a GPU it says it skipped and
//! exits successfully.

#[cfg(feature = "nccl")]
mod allgather;
#[cfg(feature = "nccl")]
mod cp_gather;
mod dcp;
mod harness;
mod hicache;
mod interference;
mod pd;
mod plot;
mod pool;
mod resolve;

use std::process::ExitCode;

use harness::{Ctx, Report};

type Section = fn(&mut Ctx, &mut Report) -> kvshard::Result<()>;

const SECTIONS: &[(&str, Section)] = &[
    ("resolve", resolve::run),
    ("pool", pool::copies),
    ("write", pool::write_path),
    ("pd", pd::run),
    ("dcp", dcp::run),
    ("hicache", hicache::io),
    ("signal", hicache::signalled),
    ("duplex", hicache::duplex),
    ("interfere", interference::run),
    #[cfg(feature = "nccl")]
    ("allgather", allgather::run),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.iter().any(|a| a == "--list") {
        for (name, _) in SECTIONS {
            println!("{name}");
        }
        return ExitCode::SUCCESS;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let wanted: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with("--"))
        .collect();
    // Names that are no section (a `cargo bench FILTER` meant for the criterion benches reaches
    // this binary too) are ignored, as criterion ignores filters that match nothing.
    let known = |w: &&str| SECTIONS.iter().any(|(name, _)| name == w);
    for unknown in wanted.iter().filter(|w| !known(w)) {
        println!("no gpu benchmark section {unknown} (--list prints them)");
    }
    if !wanted.is_empty() && !wanted.iter().any(known) {
        return ExitCode::SUCCESS;
    }
    let mut ctx = match Ctx::new(quick) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("SKIPPED gpu benchmarks: {e}");
            return ExitCode::SUCCESS;
        }
    };
    let info = ctx.gpu.info().clone();
    let c = ctx.ceilings;
    let mut report = Report {
        header: vec![
        format!(
            "device: {} (sm_{}{}, {} SMs, {:.0} GiB), kvshard {}",
            info.name,
            info.compute_capability.0,
            info.compute_capability.1,
            info.sm_count,
            info.total_memory as f64 / (1u64 << 30) as f64,
            env!("CARGO_PKG_VERSION")
        ),
        format!(
            "ceilings (this run): D2D {:.1} GB/s ({:.1} read+write), pinned H2D {:.1}, D2H {:.1}, H2D+D2H together {:.1} GB/s",
            c.d2d,
            2.0 * c.d2d,
            c.h2d,
            c.d2h,
            c.bidir
        ),
        ],
        ..Report::default()
    };
    for h in &report.header {
        println!("{h}");
    }
    let mut failed = false;
    for (name, section) in SECTIONS {
        if !wanted.is_empty() && !wanted.contains(name) {
            continue;
        }
        if let Err(e) = section(&mut ctx, &mut report) {
            println!("section {name} FAILED: {e}");
            failed = true;
        }
    }
    report.rebase(&ctx.ceilings);
    if let Some(out) = std::env::var_os("OUT") {
        let dir = std::path::Path::new(&out);
        let path = dir.join("bench.md");
        if let Err(e) = std::fs::write(&path, report.markdown()) {
            println!("cannot write {}: {e}", path.display());
        }
        match plot::write(&report.rows, dir) {
            Ok(charts) => charts
                .iter()
                .for_each(|c| println!("chart: {}", c.display())),
            Err(e) => println!("cannot draw the charts: {e}"),
        }
    }
    for row in &report.above_ceiling() {
        println!("ABOVE ITS SAME-RUN CEILING (a measurement bug): {row}");
        failed = true;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
